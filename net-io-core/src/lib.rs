//! Sans-IO building blocks for bounded TCP servers: errors, limits, buffers, sessions, gates, events, stats and the PROXY parser.
//!
//! Nothing here touches a socket. Policy and protocol code takes bytes and times as arguments and returns
//! decisions; the driver (`net-io-blocking`) does the IO. That keeps this crate testable with property
//! tests, loom and Miri.
//!
//! ```text
//!   net-io-sys (syscalls) ◀── net-io-blocking (driver) ──▶ net-io-core (this crate: types and decisions)
//! ```

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod addr;
pub mod buffer;
pub mod caps;
pub mod checksum;
pub mod clock;
pub mod close;
pub mod completion;
pub mod control;
pub mod error;
pub mod event;
pub mod gate;
pub mod id;
pub mod info;
pub mod input;
pub mod limits;
mod loom;
pub mod output;
pub mod proxy;
pub mod rate;
pub mod session;
pub mod stats;

pub use addr::{Cidr, CidrError, PrefixKey, PrefixPolicy, TrustedProxies, normalize};
pub use buffer::{BudgetExhausted, Buffer, BufferPool, SizeClass, WorkerBuffers};
pub use caps::{Cap, SourceCaps};
pub use clock::{Clock, ManualClock, SystemClock};
pub use close::{CloseReason, Direction, LimitKind, OsErrorClass, RefusalCause, TimeoutKind};
pub use completion::{
    Completer, Completion, CompletionReceiver, CompletionRing, PostError, Posted,
};
pub use control::{ControlLine, ControlState, ControlWatch};
pub use error::{ErrorClass, NetError};
pub use event::{CoalescedKind, Coalescer, Event, EventSink, NoopSink};
pub use gate::{
    Admission, AllowAll, Gate, Lane, Refusal, Verdict, WriteFacts, admit_or_refuse, check_or_deny,
    close_ticket,
};
pub use id::{ConnectionId, IdAllocator, IdBlock, ListenerId, WorkerId};
pub use info::ConnectionInfo;
pub use input::{Input, ReadBuffer};
pub use limits::{ConfigError, Limits, MinRateRule, ResolvedLimits};
pub use output::{Output, OutputFull};
pub use proxy::{
    ProxyCommand, ProxyError, ProxyHeader, ProxyMode, ProxyParser, ProxyStatus, ProxyTransport,
    ProxyVersion,
};
pub use rate::{MinRate, RateVerdict};
pub use session::{Phase, Session, SessionContext, SessionFactory, SessionRequests, Step};
pub use stats::{Counters, ServerCounters, Stats, WorkerCounters};
