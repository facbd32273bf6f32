//! The OpenAI-compatible API's sans-IO half: request decoding and validation, response and stream shapes, errors.
//!
//! No sockets and no model calls: the HTTP layer hands a route's body bytes to a `decode_*` function, runs the
//! request, and writes the strings the response functions build. The pieces:
//!
//! ```text
//!   body bytes --decode_chat / decode_completion--> GenerationRequest --(server runs it)--+
//!                                                                                     |
//!   generated pieces --StopMatcher::push--> releasable text --chat_chunk_content ...--> SSE data lines
//!                                                         \--chat_completion / completion--> one JSON body
//!   any refusal --> ApiError (status + to_json)
//! ```
//!
//! The shapes are OpenAI's (so its SDKs parse them), with llama-server's extras where local clients expect them
//! (`top_k`, `min_p`, `repeat_penalty`, `/tokenize`, `/detokenize`).

mod error;
mod fields;
mod request;
mod response;
mod stop;

pub use error::ApiError;
pub use request::{
    DEFAULT_TEMPERATURE, Endpoint, GenerationRequest, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, Prompt,
    TokenizeRequest, decode_chat, decode_completion, decode_detokenize, decode_tokenize,
};
pub use response::{
    FinishReason, Reply, TokenLogprob, TopLogprob, Usage, chat_chunk_content, chat_chunk_finish,
    chat_chunk_role, chat_completion, completion, completion_chunk, detokenize_response,
    models_list, new_id, tokenize_response, usage_chunk,
};
pub use stop::{StopMatcher, StopRelease};
