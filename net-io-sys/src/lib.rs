//! OS calls for the workspace: sockets, polling, kernel event primitives and rlimits, each behind a safe type.
