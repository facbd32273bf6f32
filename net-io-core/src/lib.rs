//! Sans-IO building blocks for bounded TCP servers: errors, limits, buffers, sessions, gates, events, stats and the PROXY parser.
