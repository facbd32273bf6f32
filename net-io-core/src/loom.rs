//! The `crate::loom` shim: std atomics normally, loom's under `--cfg loom` so models can explore interleavings.

#[cfg(not(loom))]
pub(crate) mod sync {
    pub(crate) use std::sync::Arc;

    pub(crate) mod atomic {
        pub(crate) use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
    }
}

#[cfg(loom)]
pub(crate) mod sync {
    pub(crate) use loom::sync::Arc;

    pub(crate) mod atomic {
        pub(crate) use loom::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
    }
}
