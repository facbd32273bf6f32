//! The compute core: loads a layer range of a GGUF model and runs prefill and decode on lanes.
