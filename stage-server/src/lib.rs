//! A pipeline-parallel LLM stage server: runs a layer range of a GGUF model and forwards activations.

#![deny(unsafe_code)]
#![warn(missing_docs)]
// The README example runs as a doctest, so the crate's front page cannot drift from its API.
#![cfg_attr(doctest, doc = include_str!("../README.md"))]

pub mod api;
pub mod client;
pub mod driver;
pub mod frontend;
pub mod fuzzing;
pub mod http;
pub mod kernels;
pub mod launch;
pub mod model;
pub mod serve;
pub mod telemetry;
pub mod tokenizer;
pub mod wire;
