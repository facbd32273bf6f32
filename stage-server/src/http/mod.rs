//! Sans-IO HTTP/1.1 for stage 0's API: request parsing (heads, bodies, limits) and response framing.
