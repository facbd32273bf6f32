//! A pipeline-parallel LLM stage server: runs a layer range of a GGUF model and forwards activations.

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod chat;
pub mod gguf_check;
pub mod kernels;
pub mod model;
pub mod tokenizer;
