//! A pipeline-parallel LLM stage server: runs a layer range of a GGUF model and forwards activations.

pub mod chat;
pub mod gguf_check;
pub mod kernels;
pub mod model;
pub mod tokenizer;
