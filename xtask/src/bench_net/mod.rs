//! `cargo xtask bench net`: side-by-side echo, idle-memory and churn benchmarks of the net-io stack and its peers.
//!
//! The benchmark builds the `bench_server` and `bench_client` examples of `net-io-blocking` once in release
//! mode, then measures every server kind in the same run, as separate processes on this machine:
//!
//! ```text
//!   xtask ──spawn──> bench_server --kind K   (prints `listening on ADDR`, stops when stdin closes)
//!     │                    ▲  /proc/PID/stat (CPU), /proc/PID/status (VmRSS), /proc/PID/task/*/status (switches)
//!     └──spawn──> bench_client echo|idle|churn --addr ADDR   (prints key=value result lines)
//!                          ▲  /proc/PID/stat (the client's CPU over the echo window)
//! ```
//!
//! Each round runs every kind once, in an order rotated by one each round, and the report gives the median
//! of the rounds with ratios against std and tokio taken from the same run, and each round's throughput
//! ratio against tokio with their median and range. Beside the client's figures, the xtask reads the
//! server's and the client's CPU time and the server threads' context switches from /proc at the start and
//! end of each echo window. `--loads` picks the loads, so that one can be repeated over many rounds. Every
//! measurement starts a fresh server process so that one load shape cannot leave memory or threads behind
//! for the next.
//!
//! The parts: `options` reads the command line, `processes` builds the examples and starts and stops
//! them, `measure` runs each load against a fresh server, `procfs` reads CPU time, memory, context
//! switches and the load average from /proc, `summary` takes the medians over the rounds, and `report`
//! writes the markdown.

mod measure;
mod options;
mod processes;
mod procfs;
mod report;
mod summary;

use std::fs;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use self::measure::{count_system_calls, measure_kind};
use self::options::parse_options;
use self::processes::{build_examples, command_output, raise_descriptor_limit, workspace_root};
use self::procfs::{Load, clock_ticks_per_second, one_minute_load};
use self::report::render_report;
use self::summary::summarise;
use crate::figures::load_average;

/// Connections of the open-loop echo load.
const OPEN_CONNECTIONS: u32 = 256;

/// Connection counts of the closed-loop echo loads.
const ECHO_CONNECTIONS: [u32; 3] = [1, 16, 256];

/// Client threads doing connect-and-close.
const CHURN_THREADS: u32 = 4;

/// The issue's churn target: connects per second sustained with no stalled connect.
const CHURN_TARGET: f64 = 20_000.0;

/// Workers beyond the idle connections for the pooled kinds.
const IDLE_SLACK: u32 = 64;

/// Round trips counted under strace; start-up calls are outside the counted span.
const STRACE_ROUND_TRIPS: u32 = 5_000;

/// A server stack the benchmark can start.
#[derive(Debug, Clone, Copy)]
struct ServerKind {
    /// The `--kind` value of `bench_server`.
    name: &'static str,
    /// How the report names it.
    label: &'static str,
    /// Whether the server has a fixed worker pool that must be sized for the idle connections.
    pooled: bool,
}

const SERVER_KINDS: [ServerKind; 7] = [
    ServerKind {
        name: "std",
        label: "std, thread per connection",
        pooled: false,
    },
    ServerKind {
        name: "tokio",
        label: "tokio multi-thread, 2 workers",
        pooled: false,
    },
    // A yardstick, not a peer: the kernel's cost of an epoll echo with no driver around it.
    ServerKind {
        name: "floor",
        label: "bare epoll echo (floor), 2 loops",
        pooled: false,
    },
    ServerKind {
        name: "handler",
        label: "net-io-blocking handler",
        pooled: true,
    },
    // Not a worker pool either: each handler runs on a coroutine over the event loops; its connection cap is
    // sized like the pooled kinds'.
    ServerKind {
        name: "handler-loop",
        label: "net-io-blocking handler, coroutines on event loops",
        pooled: true,
    },
    ServerKind {
        name: "sessions",
        label: "net-io-blocking sessions",
        pooled: true,
    },
    // Not a worker pool, but its connection cap is sized the same way (from --workers by default).
    ServerKind {
        name: "sessions-loop",
        label: "net-io-blocking sessions, event loop",
        pooled: true,
    },
];

/// One load `--loads` can select.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Workload {
    /// The closed-loop echo at this many connections.
    Echo(u32),
    /// The open-loop echo at [`OPEN_CONNECTIONS`] connections.
    Open,
    /// Resident memory with idle connections open.
    Idle,
    /// The paced and the saturated connect-and-close churn.
    Churn,
    /// System calls per round trip under strace.
    SystemCalls,
}

/// Every load with its `--loads` name, in the order a run measures them.
const WORKLOADS: [(&str, Workload); 7] = [
    ("echo1", Workload::Echo(1)),
    ("echo16", Workload::Echo(16)),
    ("echo256", Workload::Echo(256)),
    ("open256", Workload::Open),
    ("idle", Workload::Idle),
    ("churn", Workload::Churn),
    ("syscalls", Workload::SystemCalls),
];

/// Options of one benchmark run.
#[derive(Debug, Clone)]
struct Options {
    rounds: usize,
    kinds: Vec<ServerKind>,
    /// Connection counts of the echo loads to measure, in the order of `ECHO_CONNECTIONS`.
    echo_connections: Vec<u32>,
    /// Whether to measure the open-loop echo.
    open: bool,
    /// Messages per second the open-loop echo offers.
    open_rate: u64,
    /// Whether to measure the idle memory.
    idle: bool,
    /// Whether to measure the two churns.
    churn: bool,
    echo_duration: Duration,
    echo_warmup: Duration,
    churn_duration: Duration,
    /// Connects per second offered by the paced churn.
    churn_rate: u64,
    idle_connections: u32,
    /// Client threads for the 16- and 256-connection loads.
    client_threads: u32,
    output: Option<PathBuf>,
    /// Count system calls per round trip with `strace -c -f` when it is installed (the `syscalls` load,
    /// unless `--no-strace`).
    strace: bool,
}

impl Options {
    /// Whether any load measured round by round (echo, idle, churn) was selected.
    fn has_round_loads(&self) -> bool {
        !self.echo_connections.is_empty() || self.open || self.idle || self.churn
    }
}

/// One echo load's result for one kind in one round.
#[derive(Debug, Clone, Copy, Default)]
struct EchoResult {
    connections: u32,
    round_trips_per_second: f64,
    p50_microseconds: f64,
    p99_microseconds: f64,
    server_cpu_microseconds_per_round_trip: f64,
    /// Voluntary plus involuntary context switches of every server thread over the window, per round trip.
    server_context_switches_per_round_trip: f64,
    /// The same count over the client's threads: a lock-step client that finds its echo missing sleeps,
    /// and the reply that wakes it may preempt the server.
    client_context_switches_per_round_trip: f64,
    /// The client's user plus system CPU over the window, per round trip.
    client_cpu_microseconds_per_round_trip: f64,
    /// Client and server CPU time together over the window's wall time: how many cores the two kept busy.
    cores_busy: f64,
}

/// One open-loop echo's result for one kind in one round.
#[derive(Debug, Clone, Copy, Default)]
struct OpenResult {
    /// Messages per second the client sent in the window (the offered rate, unless the client fell behind).
    sent_per_second: f64,
    p50_microseconds: f64,
    p99_microseconds: f64,
    p999_microseconds: f64,
    max_microseconds: f64,
    /// Messages of the window whose echo never came.
    unanswered: f64,
    /// How far the client's writers fell behind their schedule at worst.
    behind_max_microseconds: f64,
    server_cpu_microseconds_per_message: f64,
    /// Client and server CPU time together over the window's wall time.
    cores_busy: f64,
}

/// One connect-and-close churn's result for one kind in one round.
#[derive(Debug, Clone, Copy, Default)]
struct ChurnResult {
    per_second: f64,
    stalled: f64,
    errors: f64,
    p99_microseconds: f64,
    slowest_milliseconds: f64,
    /// `TcpExtListenOverflows` growth during the churn (machine-wide, so other helpers' servers count too).
    listen_overflows: f64,
    /// Connections the server reported accepting, over the churn's length.
    server_accepts_per_second: f64,
}

/// Everything measured for one kind in one round.
#[derive(Debug, Clone, Default)]
struct KindRound {
    /// When this kind's measurements of the round began, from the start of the run: the echo loads come
    /// first, so two kinds' echo figures of one round were taken about this far apart.
    started: Duration,
    echo: Vec<EchoResult>,
    /// The open-loop echo, when measured.
    open: Option<OpenResult>,
    idle_bytes_per_connection: f64,
    idle_total_bytes_per_connection: f64,
    idle_served: f64,
    /// The churn paced at `--churn-rate`.
    churn_paced: ChurnResult,
    /// The churn with every client thread connecting as fast as it can.
    churn_saturated: ChurnResult,
}

/// Runs the networking benchmarks with the given extra arguments.
pub fn run(arguments: &[String]) -> Result<()> {
    let options = parse_options(arguments)?;
    eprintln!("xtask: workspace {}", workspace_root().display());
    raise_descriptor_limit(options.idle_connections as u64 * 2 + 1_000)?;
    let binaries = build_examples()?;
    let clock_ticks = clock_ticks_per_second();
    let load_before = load_average();
    // The 1-minute load average at the start of every measurement, to report what else was running.
    let mut load_samples = Vec::new();
    let started = Instant::now();

    // results[kind index][round]
    let mut results: Vec<Vec<KindRound>> = vec![Vec::new(); options.kinds.len()];
    let rounds = if options.has_round_loads() {
        options.rounds
    } else {
        0
    };
    for round in 0..rounds {
        for offset in 0..options.kinds.len() {
            let index = (round + offset) % options.kinds.len();
            let kind = options.kinds[index];
            eprintln!(
                "xtask: round {}/{}: {}",
                round + 1,
                options.rounds,
                kind.name
            );
            load_samples.extend(one_minute_load());
            let began = started.elapsed();
            let mut measured = measure_kind(&binaries, kind, &options, clock_ticks)
                .with_context(|| format!("measuring {} in round {}", kind.name, round + 1))?;
            measured.started = began;
            eprintln!("xtask:   {}", summarise(&measured, &options));
            results[index].push(measured);
        }
    }
    let mut system_calls = Vec::new();
    if options.strace && command_output("strace", &["-V"]).is_some() {
        for kind in &options.kinds {
            eprintln!(
                "xtask: system calls per round trip under strace: {}",
                kind.name
            );
            let counted = count_system_calls(&binaries, *kind)
                .with_context(|| format!("counting system calls of {}", kind.name))?;
            eprintln!("xtask:   {:.2} per round trip", counted.per_round_trip);
            system_calls.push((*kind, counted));
        }
    }
    let load_after = load_average();
    load_samples.extend(one_minute_load());
    let report = render_report(
        &options,
        &results,
        &system_calls,
        started.elapsed(),
        &Load {
            before: load_before,
            after: load_after,
            samples: load_samples,
        },
        arguments,
    );
    println!("{report}");
    if let Some(path) = &options.output {
        let path = if path.is_absolute() {
            path.clone()
        } else {
            workspace_root().join(path)
        };
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent)
                .with_context(|| format!("could not create {}", parent.display()))?;
        }
        fs::write(&path, &report).with_context(|| format!("could not write {}", path.display()))?;
        eprintln!("xtask: wrote {}", path.display());
    }
    Ok(())
}
