//! The OpenAI-compatible API's sans-IO half: request decoding and validation, response and stream shapes, errors.
