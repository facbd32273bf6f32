//! Sans-IO building blocks for bounded TCP servers: errors, limits, buffers, sessions, gates, events, stats and the PROXY parser.
//!
//! Nothing here touches a socket. Policy and protocol code takes bytes and times as arguments and returns
//! decisions; the driver (`net-io-blocking`) does the IO. That keeps this crate testable with property
//! tests, loom and Miri.
//!
//! ```text
//!   net-io-sys (syscalls) ◀── net-io-blocking (driver) ──▶ net-io-core (this crate: types and decisions)
//! ```
//!
//! A session answers input with a [`Step`]; the driver does the reading and writing:
//!
//! ```
//! use net_io_core::{Input, Session, SessionContext, Step};
//!
//! /// Echoes every complete line back.
//! struct LineEcho;
//!
//! impl Session for LineEcho {
//!     fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
//!         let Some(end) = input.bytes().iter().position(|&byte| byte == b'\n') else {
//!             return Step::Read; // wait for the rest of the line
//!         };
//!         if context.output().push(&input.bytes()[..=end]).is_err() {
//!             return Step::Write; // output budget full: flush first, the line stays unconsumed
//!         }
//!         input.consume(end + 1);
//!         Step::Write
//!     }
//! }
//! ```
//!
//! The PROXY parser is fed everything received so far:
//!
//! ```
//! use net_io_core::{ProxyMode, ProxyParser, ProxyStatus};
//!
//! let parser = ProxyParser::new(ProxyMode::Any, 1024);
//! let received = b"PROXY TCP4 192.0.2.1 198.51.100.2 56324 443\r\nGET / HTTP/1.1\r\n";
//! assert_eq!(parser.parse(&received[..20]), Ok(ProxyStatus::NeedMore));
//! let Ok(ProxyStatus::Done { header, consumed }) = parser.parse(received) else {
//!     panic!("a valid header");
//! };
//! assert_eq!(header.source, Some("192.0.2.1:56324".parse().unwrap()));
//! assert_eq!(&received[consumed..], b"GET / HTTP/1.1\r\n");
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]
// The README example runs as a doctest, so the crate's front page cannot drift from its API.
#![cfg_attr(doctest, doc = include_str!("../README.md"))]

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
pub mod linger;
mod loom;
pub mod machine;
pub mod output;
pub mod proxy;
pub mod rate;
pub mod session;
pub mod stats;
pub mod transfer;

pub use addr::{Cidr, CidrError, PrefixKey, PrefixPolicy, TrustedProxies, normalize};
pub use buffer::{BudgetExhausted, Buffer, BufferPool, SizeClass, WorkerBuffers};
pub use caps::{Cap, SourceCaps};
pub use clock::{Clock, ManualClock, SystemClock, deadline_after};
pub use close::{CloseReason, Direction, LimitKind, OsErrorClass, RefusalCause, TimeoutKind};
pub use completion::{
    Completer, Completion, CompletionReceiver, CompletionRing, PostError, Posted,
};
pub use control::{ControlLine, ControlState, ControlWaker, ControlWatch};
pub use error::{ErrorClass, NetError};
pub use event::{CoalescedKind, Coalescer, Event, EventSink, NoopSink, handler_stack_hint};
pub use gate::{
    Admission, AllowAll, Gate, Lane, Refusal, Verdict, WriteFacts, admit_or_refuse, check_or_deny,
    close_ticket, readmit_or_refuse,
};
pub use id::{ConnectionId, IdAllocator, IdBlock, ListenerId, WorkerId};
pub use info::{ConnectionInfo, Origin};
pub use input::{Input, ReadBuffer};
pub use limits::{ConfigError, Limits, MinRateRule, ResolvedLimits};
pub use linger::{LingerRead, Lingered};
pub use machine::{HalfClose, HookEnvironment, SessionMachine, WriteShut, phase_wait};
pub use output::{Output, OutputFull};
pub use proxy::{
    ProxyCommand, ProxyError, ProxyHeader, ProxyMode, ProxyParser, ProxyStatus, ProxyTransport,
    ProxyVersion,
};
pub use rate::{MinRate, RateVerdict};
pub use session::{
    LoadSource, Phase, Pressure, Session, SessionContext, SessionFactory, SessionRequests, Step,
};
pub use stats::{Counters, ServerCounters, Stats, WorkerCounters};
pub use transfer::TransferRates;
