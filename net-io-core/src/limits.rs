//! [`Limits`]: every cap, deadline and budget of a server, stored as set and resolved to defaults at build.
//!
//! [`Limits`] remembers only what the caller set, so a listener's limits can be laid over the server's
//! with [`Limits::or`]. [`Limits::validate`] fills in the defaults below and checks the result, naming
//! the first bad field.
//!
//! | Field | Default |
//! |---|---|
//! | `max_connections` | the worker count |
//! | `max_per_listener` | `max_connections` |
//! | `max_per_source` | 16, at most `max_connections`; keyed per /32 (IPv4) and /64 (IPv6) |
//! | `backlog` / `accept_batch` | 1,024 / 16 |
//! | `handshake_timeout` / `idle_timeout` | 10 s / 5 s |
//! | `read_timeout` / `write_timeout` / `park_timeout` | 30 s each |
//! | `min_rate` | 256 B/s over 10 s, 5 s grace, checked every 1 s |
//! | `proxy_header_max` | 1,024 B (protocol maximum 65,519) |
//! | `read_buffer` / `read_buffer_max` | 16 KiB / 64 KiB |
//! | `output_budget` | 64 KiB |
//! | `buffer_budget` | 64 MiB, at least workers x 64 KiB x 2 |
//! | `completion_queue` | 1 per worker |
//! | `drain_timeout` | 30 s |
//! | `linger_timeout` / `linger_bytes` | 2 s / 64 KiB |
//! | `refusal_bytes_max` | 512 (also the hard ceiling) |
//! | `tick` | 10 ms; no deadline may be shorter |

use std::time::Duration;

use crate::addr::PrefixPolicy;

/// The largest PROXY v2 body the protocol allows.
pub const PROXY_HEADER_PROTOCOL_MAX: usize = 65_519;
/// The hard ceiling of a refusal reply, so the refusal path cannot amplify.
pub const REFUSAL_BYTES_CEILING: usize = 512;
/// The most buckets a minimum-rate window may have (`window / check`).
pub const MIN_RATE_BUCKETS_MAX: u32 = 64;

/// The minimum transfer rate rule for one direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MinRateRule {
    /// The least average rate over the window, in bytes per second.
    pub bytes_per_second: u64,
    /// The span the average is taken over.
    pub window: Duration,
    /// How long a direction may be busy before the rule applies.
    pub grace: Duration,
    /// The width of one bucket and how often the rate is checked.
    pub check: Duration,
}

impl MinRateRule {
    /// 256 B/s over 10 s, after 5 s of grace, checked every second.
    pub const DEFAULT: MinRateRule = MinRateRule {
        bytes_per_second: 256,
        window: Duration::from_secs(10),
        grace: Duration::from_secs(5),
        check: Duration::from_secs(1),
    };
}

/// Limits as the caller set them; unset fields take the defaults in the module table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    max_connections: Option<usize>,
    max_per_listener: Option<usize>,
    max_per_source: Option<usize>,
    source_prefix: Option<PrefixPolicy>,
    backlog: Option<u32>,
    accept_batch: Option<usize>,
    handshake_timeout: Option<Duration>,
    idle_timeout: Option<Duration>,
    read_timeout: Option<Duration>,
    write_timeout: Option<Duration>,
    park_timeout: Option<Duration>,
    min_rate: Option<Option<MinRateRule>>,
    proxy_header_max: Option<usize>,
    read_buffer: Option<usize>,
    read_buffer_max: Option<usize>,
    output_budget: Option<usize>,
    buffer_budget: Option<usize>,
    completion_queue: Option<usize>,
    drain_timeout: Option<Duration>,
    linger_timeout: Option<Duration>,
    linger_bytes: Option<usize>,
    refusal_bytes_max: Option<usize>,
    tick: Option<Duration>,
    wipe_buffers: Option<bool>,
}

/// Limits with every default filled in. Plain public fields; produced by [`Limits::validate`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ResolvedLimits {
    /// Server-wide cap on open connections.
    pub max_connections: usize,
    /// Cap on open connections per listener.
    pub max_per_listener: usize,
    /// Cap on open connections per source prefix, per listener.
    pub max_per_source: usize,
    /// How wide a source prefix is.
    pub source_prefix: PrefixPolicy,
    /// The listen backlog (the driver also caps it at `somaxconn`).
    pub backlog: u32,
    /// The most connections accepted per wake of an accept thread.
    pub accept_batch: usize,
    /// Deadline for the handshake (PROXY header, admission).
    pub handshake_timeout: Duration,
    /// Deadline for the first byte of a request.
    pub idle_timeout: Duration,
    /// Deadline for progress while a request is being received.
    pub read_timeout: Duration,
    /// Deadline for progress while output is pending.
    pub write_timeout: Duration,
    /// Deadline for a parked session to be woken.
    pub park_timeout: Duration,
    /// The minimum transfer rate, or `None` when switched off.
    pub min_rate: Option<MinRateRule>,
    /// The largest PROXY v2 body accepted.
    pub proxy_header_max: usize,
    /// The initial read buffer size.
    pub read_buffer: usize,
    /// The size the read buffer may grow to.
    pub read_buffer_max: usize,
    /// Bytes of queued output per connection (static slices do not count).
    pub output_budget: usize,
    /// Bytes of pooled buffers for the whole server.
    pub buffer_budget: usize,
    /// Capacity of each worker's completion ring.
    pub completion_queue: usize,
    /// How long a drain waits before killing busy connections.
    pub drain_timeout: Duration,
    /// How long a graceful close reads and discards after FIN.
    pub linger_timeout: Duration,
    /// How many bytes a graceful close reads and discards at most.
    pub linger_bytes: usize,
    /// The most bytes of a refusal reply.
    pub refusal_bytes_max: usize,
    /// The timer granularity; no deadline may be shorter.
    pub tick: Duration,
    /// Whether buffers are zeroed when released.
    pub wipe_buffers: bool,
}

/// Why a configuration was rejected. Each variant names the field and the limit it broke.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A field that must be positive was zero.
    #[error("{field} is zero; it must be at least 1")]
    Zero {
        /// The field's name.
        field: &'static str,
    },
    /// A field exceeded its maximum.
    #[error("{field} is {value}, above its maximum of {max}; lower it")]
    TooLarge {
        /// The field's name.
        field: &'static str,
        /// The value given.
        value: u64,
        /// The largest allowed value.
        max: u64,
    },
    /// A field was below its minimum.
    #[error("{field} is {value}, below its minimum of {min}; raise it")]
    TooSmall {
        /// The field's name.
        field: &'static str,
        /// The value given.
        value: u64,
        /// The smallest allowed value.
        min: u64,
    },
    /// A per-listener or per-source cap was above the global cap.
    #[error(
        "{field} is {value}, above max_connections of {global}; lower it or raise max_connections"
    )]
    AboveGlobal {
        /// The field's name.
        field: &'static str,
        /// The value given.
        value: usize,
        /// The global cap.
        global: usize,
    },
    /// A deadline was shorter than the tick.
    #[error(
        "{field} is {value:?}, shorter than the tick of {tick:?}; lengthen it or shorten the tick"
    )]
    BelowTick {
        /// The field's name.
        field: &'static str,
        /// The value given.
        value: Duration,
        /// The tick.
        tick: Duration,
    },
    /// The minimum-rate window was shorter than its check interval.
    #[error(
        "min_rate window {window:?} is shorter than its check interval {check:?}; widen the window"
    )]
    WindowBelowCheck {
        /// The window given.
        window: Duration,
        /// The check interval given.
        check: Duration,
    },
    /// The buffer budget cannot give every worker two large buffers.
    #[error(
        "buffer_budget is {have} bytes, below the {need} bytes that give every worker two 64 KiB buffers; raise it"
    )]
    BudgetBelowWorkers {
        /// The budget given.
        have: usize,
        /// The least budget for this worker count.
        need: usize,
    },
    /// The descriptor limit is too low for the connection cap.
    #[error(
        "RLIMIT_NOFILE is {have} but max_connections plus 2 per worker plus 32 needs {need}; raise the limit (ulimit -n) or lower max_connections"
    )]
    DescriptorLimit {
        /// The current soft limit.
        have: u64,
        /// What this configuration needs.
        need: u64,
    },
}

macro_rules! setters {
    ($($(#[$doc:meta])* $field:ident: $type:ty;)*) => {
        $(
            $(#[$doc])*
            pub fn $field(mut self, value: $type) -> Limits {
                self.$field = Some(value);
                self
            }
        )*
    };
}

impl Limits {
    /// Limits with nothing set: every field takes its default.
    pub fn new() -> Limits {
        Limits::default()
    }

    setters! {
        /// Sets the server-wide cap on open connections.
        max_connections: usize;
        /// Sets the cap on open connections per listener.
        max_per_listener: usize;
        /// Sets the cap on open connections per source prefix, per listener.
        max_per_source: usize;
        /// Sets how wide a source prefix is.
        source_prefix: PrefixPolicy;
        /// Sets the listen backlog.
        backlog: u32;
        /// Sets the most connections accepted per wake.
        accept_batch: usize;
        /// Sets the handshake deadline.
        handshake_timeout: Duration;
        /// Sets the idle deadline.
        idle_timeout: Duration;
        /// Sets the read deadline.
        read_timeout: Duration;
        /// Sets the write deadline.
        write_timeout: Duration;
        /// Sets the park deadline.
        park_timeout: Duration;
        /// Sets the minimum transfer rate, or switches it off with `None`.
        min_rate: Option<MinRateRule>;
        /// Sets the largest PROXY v2 body accepted.
        proxy_header_max: usize;
        /// Sets the initial read buffer size (4, 16 or 64 KiB; other sizes round up to a class).
        read_buffer: usize;
        /// Sets the size the read buffer may grow to.
        read_buffer_max: usize;
        /// Sets the output budget per connection.
        output_budget: usize;
        /// Sets the pooled buffer budget for the whole server.
        buffer_budget: usize;
        /// Sets each worker's completion ring capacity.
        completion_queue: usize;
        /// Sets the drain deadline.
        drain_timeout: Duration;
        /// Sets how long a graceful close lingers.
        linger_timeout: Duration;
        /// Sets how much a graceful close reads and discards.
        linger_bytes: usize;
        /// Sets the most bytes of a refusal reply (at most 512).
        refusal_bytes_max: usize;
        /// Sets the timer tick.
        tick: Duration;
        /// Sets whether buffers are zeroed on release.
        wipe_buffers: bool;
    }

    /// These limits with every unset field taken from `fallback` (a listener's limits over the server's).
    pub fn or(self, fallback: Limits) -> Limits {
        Limits {
            max_connections: self.max_connections.or(fallback.max_connections),
            max_per_listener: self.max_per_listener.or(fallback.max_per_listener),
            max_per_source: self.max_per_source.or(fallback.max_per_source),
            source_prefix: self.source_prefix.or(fallback.source_prefix),
            backlog: self.backlog.or(fallback.backlog),
            accept_batch: self.accept_batch.or(fallback.accept_batch),
            handshake_timeout: self.handshake_timeout.or(fallback.handshake_timeout),
            idle_timeout: self.idle_timeout.or(fallback.idle_timeout),
            read_timeout: self.read_timeout.or(fallback.read_timeout),
            write_timeout: self.write_timeout.or(fallback.write_timeout),
            park_timeout: self.park_timeout.or(fallback.park_timeout),
            min_rate: self.min_rate.or(fallback.min_rate),
            proxy_header_max: self.proxy_header_max.or(fallback.proxy_header_max),
            read_buffer: self.read_buffer.or(fallback.read_buffer),
            read_buffer_max: self.read_buffer_max.or(fallback.read_buffer_max),
            output_budget: self.output_budget.or(fallback.output_budget),
            buffer_budget: self.buffer_budget.or(fallback.buffer_budget),
            completion_queue: self.completion_queue.or(fallback.completion_queue),
            drain_timeout: self.drain_timeout.or(fallback.drain_timeout),
            linger_timeout: self.linger_timeout.or(fallback.linger_timeout),
            linger_bytes: self.linger_bytes.or(fallback.linger_bytes),
            refusal_bytes_max: self.refusal_bytes_max.or(fallback.refusal_bytes_max),
            tick: self.tick.or(fallback.tick),
            wipe_buffers: self.wipe_buffers.or(fallback.wipe_buffers),
        }
    }

    /// Fills in the defaults for a server with `workers` workers, without checking anything.
    pub fn resolve(&self, workers: usize) -> ResolvedLimits {
        let max_connections = self.max_connections.unwrap_or(workers.max(1));
        let large = 64 * 1024;
        ResolvedLimits {
            max_connections,
            max_per_listener: self.max_per_listener.unwrap_or(max_connections),
            max_per_source: self.max_per_source.unwrap_or(16.min(max_connections)),
            source_prefix: self.source_prefix.unwrap_or_default(),
            backlog: self.backlog.unwrap_or(1024),
            accept_batch: self.accept_batch.unwrap_or(16),
            handshake_timeout: self.handshake_timeout.unwrap_or(Duration::from_secs(10)),
            idle_timeout: self.idle_timeout.unwrap_or(Duration::from_secs(5)),
            read_timeout: self.read_timeout.unwrap_or(Duration::from_secs(30)),
            write_timeout: self.write_timeout.unwrap_or(Duration::from_secs(30)),
            park_timeout: self.park_timeout.unwrap_or(Duration::from_secs(30)),
            min_rate: self.min_rate.unwrap_or(Some(MinRateRule::DEFAULT)),
            proxy_header_max: self.proxy_header_max.unwrap_or(1024),
            read_buffer: self.read_buffer.unwrap_or(16 * 1024),
            read_buffer_max: self.read_buffer_max.unwrap_or(large),
            output_budget: self.output_budget.unwrap_or(large),
            buffer_budget: self
                .buffer_budget
                .unwrap_or((64 << 20).max(workers * large * 2)),
            completion_queue: self.completion_queue.unwrap_or(1),
            drain_timeout: self.drain_timeout.unwrap_or(Duration::from_secs(30)),
            linger_timeout: self.linger_timeout.unwrap_or(Duration::from_secs(2)),
            linger_bytes: self.linger_bytes.unwrap_or(large),
            refusal_bytes_max: self.refusal_bytes_max.unwrap_or(REFUSAL_BYTES_CEILING),
            tick: self.tick.unwrap_or(Duration::from_millis(10)),
            wipe_buffers: self.wipe_buffers.unwrap_or(true),
        }
    }

    /// Resolves the defaults and checks the result for `workers` workers and a descriptor limit
    /// (`RLIMIT_NOFILE` soft limit). Returns the first problem, naming the field and the limit.
    pub fn validate(
        &self,
        workers: usize,
        descriptor_limit: u64,
    ) -> Result<ResolvedLimits, ConfigError> {
        let resolved = self.resolve(workers);
        resolved.check(workers, descriptor_limit)?;
        Ok(resolved)
    }
}

impl ResolvedLimits {
    /// Checks resolved limits for `workers` workers and a descriptor limit; see [`Limits::validate`].
    pub fn check(&self, workers: usize, descriptor_limit: u64) -> Result<(), ConfigError> {
        if workers == 0 {
            return Err(ConfigError::Zero { field: "workers" });
        }
        let counts: [(&'static str, usize); 12] = [
            ("max_connections", self.max_connections),
            ("max_per_listener", self.max_per_listener),
            ("max_per_source", self.max_per_source),
            ("backlog", self.backlog as usize),
            ("accept_batch", self.accept_batch),
            ("proxy_header_max", self.proxy_header_max),
            ("read_buffer", self.read_buffer),
            ("read_buffer_max", self.read_buffer_max),
            ("output_budget", self.output_budget),
            ("buffer_budget", self.buffer_budget),
            ("completion_queue", self.completion_queue),
            ("refusal_bytes_max", self.refusal_bytes_max),
        ];
        for (field, value) in counts {
            if value == 0 {
                return Err(ConfigError::Zero { field });
            }
        }
        let maxima: [(&'static str, usize, usize); 6] = [
            (
                "proxy_header_max",
                self.proxy_header_max,
                PROXY_HEADER_PROTOCOL_MAX,
            ),
            (
                "refusal_bytes_max",
                self.refusal_bytes_max,
                REFUSAL_BYTES_CEILING,
            ),
            ("read_buffer", self.read_buffer, 64 * 1024),
            ("read_buffer_max", self.read_buffer_max, 64 * 1024),
            ("completion_queue", self.completion_queue, 1 << 16),
            ("accept_batch", self.accept_batch, 1024),
        ];
        for (field, value, max) in maxima {
            if value > max {
                return Err(ConfigError::TooLarge {
                    field,
                    value: value as u64,
                    max: max as u64,
                });
            }
        }
        if self.read_buffer_max < self.read_buffer {
            return Err(ConfigError::TooSmall {
                field: "read_buffer_max",
                value: self.read_buffer_max as u64,
                min: self.read_buffer as u64,
            });
        }
        if self.source_prefix.v4 > 32 {
            return Err(ConfigError::TooLarge {
                field: "source_prefix.v4",
                value: u64::from(self.source_prefix.v4),
                max: 32,
            });
        }
        if self.source_prefix.v6 > 128 {
            return Err(ConfigError::TooLarge {
                field: "source_prefix.v6",
                value: u64::from(self.source_prefix.v6),
                max: 128,
            });
        }
        for (field, value) in [
            ("max_per_listener", self.max_per_listener),
            ("max_per_source", self.max_per_source),
        ] {
            if value > self.max_connections {
                return Err(ConfigError::AboveGlobal {
                    field,
                    value,
                    global: self.max_connections,
                });
            }
        }
        if self.tick.is_zero() {
            return Err(ConfigError::Zero { field: "tick" });
        }
        let mut deadlines = vec![
            ("handshake_timeout", self.handshake_timeout),
            ("idle_timeout", self.idle_timeout),
            ("read_timeout", self.read_timeout),
            ("write_timeout", self.write_timeout),
            ("park_timeout", self.park_timeout),
            ("drain_timeout", self.drain_timeout),
        ];
        if let Some(rule) = self.min_rate {
            deadlines.push(("min_rate.check", rule.check));
            deadlines.push(("min_rate.window", rule.window));
        }
        for (field, value) in deadlines {
            if value < self.tick {
                return Err(ConfigError::BelowTick {
                    field,
                    value,
                    tick: self.tick,
                });
            }
        }
        if let Some(rule) = self.min_rate {
            if rule.bytes_per_second == 0 {
                return Err(ConfigError::Zero {
                    field: "min_rate.bytes_per_second",
                });
            }
            if rule.window < rule.check {
                return Err(ConfigError::WindowBelowCheck {
                    window: rule.window,
                    check: rule.check,
                });
            }
            let buckets = rule.window.as_nanos().div_ceil(rule.check.as_nanos());
            if buckets > u128::from(MIN_RATE_BUCKETS_MAX) {
                return Err(ConfigError::TooLarge {
                    field: "min_rate.window / min_rate.check",
                    value: u64::try_from(buckets).unwrap_or(u64::MAX),
                    max: u64::from(MIN_RATE_BUCKETS_MAX),
                });
            }
        }
        let need = workers.saturating_mul(64 * 1024 * 2);
        if self.buffer_budget < need {
            return Err(ConfigError::BudgetBelowWorkers {
                have: self.buffer_budget,
                need,
            });
        }
        let need = (self.max_connections as u64)
            .saturating_add(2 * workers as u64)
            .saturating_add(32);
        if need > descriptor_limit {
            return Err(ConfigError::DescriptorLimit {
                have: descriptor_limit,
                need,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_the_table_for_128_workers() {
        let resolved = Limits::new()
            .validate(128, 4096)
            .expect("defaults are valid");
        assert_eq!(resolved.max_connections, 128);
        assert_eq!(resolved.max_per_listener, 128);
        assert_eq!(resolved.max_per_source, 16);
        assert_eq!(resolved.backlog, 1024);
        assert_eq!(resolved.accept_batch, 16);
        assert_eq!(resolved.idle_timeout, Duration::from_secs(5));
        assert_eq!(resolved.min_rate, Some(MinRateRule::DEFAULT));
        assert_eq!(resolved.buffer_budget, 64 << 20);
        assert_eq!(resolved.tick, Duration::from_millis(10));
    }

    #[test]
    fn a_listener_override_wins_and_the_rest_falls_back() {
        let server = Limits::new()
            .idle_timeout(Duration::from_secs(9))
            .backlog(64);
        let listener = Limits::new().backlog(128);
        let merged = listener.or(server).resolve(4);
        assert_eq!(merged.backlog, 128);
        assert_eq!(merged.idle_timeout, Duration::from_secs(9));
    }

    #[test]
    fn validation_names_the_bad_field() {
        let cases = [
            (
                Limits::new().accept_batch(0),
                ConfigError::Zero {
                    field: "accept_batch",
                },
            ),
            (
                Limits::new().max_connections(10).max_per_listener(11),
                ConfigError::AboveGlobal {
                    field: "max_per_listener",
                    value: 11,
                    global: 10,
                },
            ),
            (
                Limits::new().idle_timeout(Duration::from_millis(5)),
                ConfigError::BelowTick {
                    field: "idle_timeout",
                    value: Duration::from_millis(5),
                    tick: Duration::from_millis(10),
                },
            ),
            (
                Limits::new().proxy_header_max(70_000),
                ConfigError::TooLarge {
                    field: "proxy_header_max",
                    value: 70_000,
                    max: 65_519,
                },
            ),
        ];
        for (limits, expected) in cases {
            assert_eq!(limits.validate(4, 100_000), Err(expected));
        }
    }

    #[test]
    fn the_descriptor_budget_counts_two_per_worker_and_32_spare() {
        let limits = Limits::new().max_connections(1000);
        assert_eq!(
            limits.validate(8, 1000),
            Err(ConfigError::DescriptorLimit {
                have: 1000,
                need: 1048
            })
        );
        assert!(
            limits.validate(8, 1048).is_ok(),
            "exactly enough descriptors is fine"
        );
    }

    #[test]
    fn a_window_shorter_than_its_check_is_rejected() {
        let rule = MinRateRule {
            window: Duration::from_millis(100),
            check: Duration::from_millis(200),
            ..MinRateRule::DEFAULT
        };
        assert!(matches!(
            Limits::new().min_rate(Some(rule)).validate(1, 1000),
            Err(ConfigError::WindowBelowCheck { .. })
        ));
    }

    #[test]
    fn the_buffer_budget_must_cover_two_large_buffers_per_worker() {
        assert_eq!(
            Limits::new().buffer_budget(1 << 20).validate(16, 100_000),
            Err(ConfigError::BudgetBelowWorkers {
                have: 1 << 20,
                need: 2 << 20
            })
        );
    }
}
