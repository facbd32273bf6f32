//! A pipeline-parallel LLM stage server: runs a layer range of a GGUF model and forwards activations.
