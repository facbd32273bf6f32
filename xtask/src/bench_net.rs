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

use std::collections::HashMap;
use std::env;
use std::fmt::Write as _;
use std::fs;
use std::io::{BufRead, BufReader, Write as _};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::figures::{PairedRatios, Spread, load_average, median};

const USAGE: &str = "\
usage: cargo xtask bench net [--quick] [--rounds N] [--kinds std,tokio,floor,handler,handler-loop,sessions,sessions-loop]
                             [--loads echo1,echo16,echo256,open256,idle,churn,syscalls]
                             [--duration-ms MS] [--warmup-ms MS] [--churn-ms MS] [--churn-rate N] [--open-rate N]
                             [--idle N]
                             [--client-threads N]
                             [--output PATH | --no-write] [--no-strace]

  --quick        one short round for a smoke test (does not write the report unless --output is given)
  --rounds N     rounds per kind, order rotated each round; medians are reported (default 3)
  --kinds LIST   server kinds to measure (default: all six)
  --loads LIST   loads to measure (default: all): echo1, echo16 and echo256 are the closed-loop echo at 1, 16
                 and 256 connections, open256 the open-loop echo at 256 connections, idle the idle memory,
                 churn both connect-and-close churns, syscalls the strace count; e.g. `--loads echo256
                 --rounds 9` repeats one load to show its spread
  --duration-ms  timed window of each echo load (default 2000)
  --warmup-ms    warm-up before each echo window (default 500)
  --churn-ms     length of each connect-and-close churn (default 3000)
  --churn-rate N connects per second offered by the paced churn (default 21000, 5% over the issue's target)
  --open-rate N  messages per second offered by the open-loop echo (default 50000)
  --idle N       idle connections held for the memory figure (default 5000)
  --client-threads N  echo client threads at 16 and 256 connections (default 2; 1 at one connection)
  --output PATH  where to write the markdown report (default docs/performance/netbench.md)
  --no-strace    skip the system-call count with `strace -c -f` (done by default when strace is installed)
";

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

/// The longest any child may take to print an expected line.
const LINE_TIMEOUT: Duration = Duration::from_secs(60);

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

/// A child process with its stdout lines arriving on a channel.
#[derive(Debug)]
struct Running {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    what: String,
    /// The address a server printed; empty for clients.
    address: String,
}

/// Paths of the two built examples.
#[derive(Debug)]
struct Binaries {
    server: PathBuf,
    client: PathBuf,
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

fn parse_options(arguments: &[String]) -> Result<Options> {
    let mut options = Options {
        rounds: 3,
        kinds: SERVER_KINDS.to_vec(),
        echo_connections: ECHO_CONNECTIONS.to_vec(),
        open: true,
        open_rate: 50_000,
        idle: true,
        churn: true,
        echo_duration: Duration::from_millis(2_000),
        echo_warmup: Duration::from_millis(500),
        churn_duration: Duration::from_millis(3_000),
        churn_rate: 21_000,
        idle_connections: 5_000,
        client_threads: 2,
        output: Some(PathBuf::from("docs/performance/netbench.md")),
        strace: true,
    };
    let mut quick = false;
    let mut output_given = false;
    let mut no_write = false;
    let mut no_strace = false;
    let mut iterator = arguments.iter();
    while let Some(flag) = iterator.next() {
        let mut value = || {
            iterator
                .next()
                .with_context(|| format!("{flag} needs a value\n{USAGE}"))
        };
        let mut count = |flag: &str| -> Result<u64> {
            let text = value()?;
            match text.parse::<u64>() {
                Ok(number) if number > 0 => Ok(number),
                _ => bail!("{flag} takes a positive whole number, not `{text}`"),
            }
        };
        match flag.as_str() {
            "--quick" => quick = true,
            "--rounds" => options.rounds = count("--rounds")? as usize,
            "--duration-ms" => {
                options.echo_duration = Duration::from_millis(count("--duration-ms")?)
            }
            "--warmup-ms" => options.echo_warmup = Duration::from_millis(count("--warmup-ms")?),
            "--churn-ms" => options.churn_duration = Duration::from_millis(count("--churn-ms")?),
            "--churn-rate" => options.churn_rate = count("--churn-rate")?,
            "--open-rate" => options.open_rate = count("--open-rate")?,
            "--idle" => options.idle_connections = count("--idle")? as u32,
            "--client-threads" => options.client_threads = count("--client-threads")? as u32,
            "--output" => {
                options.output = Some(PathBuf::from(value()?));
                output_given = true;
            }
            "--no-write" => no_write = true,
            "--no-strace" => no_strace = true,
            "--loads" => {
                let loads = parse_loads(value()?)?;
                options.echo_connections = ECHO_CONNECTIONS
                    .into_iter()
                    .filter(|connections| loads.contains(&Workload::Echo(*connections)))
                    .collect();
                options.open = loads.contains(&Workload::Open);
                options.idle = loads.contains(&Workload::Idle);
                options.churn = loads.contains(&Workload::Churn);
                options.strace = loads.contains(&Workload::SystemCalls);
            }
            "--kinds" => {
                let list = value()?;
                let mut kinds = Vec::new();
                for name in list.split(',') {
                    let Some(kind) = SERVER_KINDS.iter().find(|kind| kind.name == name) else {
                        bail!(
                            "unknown server kind `{name}`; the kinds are std, tokio, floor, handler, handler-loop, sessions, sessions-loop"
                        );
                    };
                    kinds.push(*kind);
                }
                options.kinds = kinds;
            }
            "--help" | "-h" => {
                print!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown flag `{other}`\n{USAGE}"),
        }
    }
    if quick {
        options.rounds = 1;
        options.echo_duration = Duration::from_millis(500);
        options.echo_warmup = Duration::from_millis(200);
        options.churn_duration = Duration::from_millis(1_000);
        options.idle_connections = options.idle_connections.min(1_000);
        if !output_given {
            options.output = None;
        }
    }
    if no_write {
        options.output = None;
    }
    if no_strace {
        options.strace = false;
    }
    Ok(options)
}

/// Reads a `--loads` list such as `echo256,churn`; an unknown name is an error naming it and the valid ones.
fn parse_loads(list: &str) -> Result<Vec<Workload>> {
    let mut loads = Vec::new();
    for name in list.split(',').map(str::trim) {
        let Some((_, load)) = WORKLOADS.iter().find(|(known, _)| *known == name) else {
            let known: Vec<&str> = WORKLOADS.iter().map(|(known, _)| *known).collect();
            bail!(
                "unknown load `{name}` in --loads; the loads are {}",
                known.join(", ")
            );
        };
        if !loads.contains(load) {
            loads.push(*load);
        }
    }
    Ok(loads)
}

/// Builds both examples once in release mode and returns their paths.
fn build_examples() -> Result<Binaries> {
    let program = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let arguments = [
        "build",
        "--release",
        "-p",
        "net-io-blocking",
        "--example",
        "bench_server",
        "--example",
        "bench_client",
    ];
    eprintln!("xtask: cargo {}", arguments.join(" "));
    let status = Command::new(program)
        .args(arguments)
        .current_dir(workspace_root())
        .status()
        .context("could not start cargo to build the benchmark examples")?;
    if !status.success() {
        bail!("building the benchmark examples failed with {status}");
    }
    let target = env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|path| {
            if path.is_absolute() {
                path
            } else {
                workspace_root().join(path)
            }
        })
        .unwrap_or_else(|| workspace_root().join("target"));
    let examples = target.join("release").join("examples");
    let binaries = Binaries {
        server: examples.join("bench_server"),
        client: examples.join("bench_client"),
    };
    for path in [&binaries.server, &binaries.client] {
        if !path.exists() {
            bail!(
                "{} is missing after the build; is CARGO_TARGET_DIR the same for xtask and cargo?",
                path.display()
            );
        }
    }
    Ok(binaries)
}

/// The workspace this run belongs to, found at run time by asking cargo from the current directory.
///
/// `crate::workspace_root` is fixed when xtask is compiled; with a target directory shared between two
/// checkouts of the same sources, cargo reuses a binary built in the other checkout, and the benchmark
/// would then build, measure and write the report there.
fn workspace_root() -> PathBuf {
    static ROOT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    ROOT.get_or_init(|| {
        let program = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        Command::new(program)
            .args(["locate-project", "--workspace", "--message-format", "plain"])
            .output()
            .ok()
            .filter(|output| output.status.success())
            .and_then(|output| {
                let manifest = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
                manifest.parent().map(PathBuf::from)
            })
            .unwrap_or_else(crate::workspace_root)
    })
    .clone()
}

/// Raises this process's soft `RLIMIT_NOFILE` (children inherit it) with `prlimit` when it is below `needed`.
fn raise_descriptor_limit(needed: u64) -> Result<()> {
    let limits = fs::read_to_string("/proc/self/limits").unwrap_or_default();
    let Some((soft, hard)) = limits
        .lines()
        .find(|line| line.starts_with("Max open files"))
        .and_then(|line| {
            let mut numbers = line
                .split_whitespace()
                .filter_map(|word| word.parse::<u64>().ok());
            Some((numbers.next()?, numbers.next()?))
        })
    else {
        return Ok(());
    };
    if soft >= needed {
        return Ok(());
    }
    let target = needed.min(hard.max(needed));
    let status = Command::new("prlimit")
        .arg("--pid")
        .arg(std::process::id().to_string())
        .arg(format!("--nofile={target}:{}", hard.max(target)))
        .status();
    match status {
        Ok(status) if status.success() => Ok(()),
        _ => bail!(
            "the descriptor limit is {soft} but the idle test needs {needed}; run `ulimit -n {needed}` first"
        ),
    }
}

/// Measures every load shape for one server kind.
fn measure_kind(
    binaries: &Binaries,
    kind: ServerKind,
    options: &Options,
    clock_ticks: f64,
) -> Result<KindRound> {
    let mut round = KindRound::default();

    if !options.echo_connections.is_empty() {
        let mut server = start_server(binaries, kind)?;
        for connections in &options.echo_connections {
            let threads = if *connections == 1 {
                1
            } else {
                options.client_threads
            };
            let result = measure_echo(
                binaries,
                &mut server,
                *connections,
                threads,
                options,
                clock_ticks,
            )
            .with_context(|| format!("echo with {connections} connections"))?;
            round.echo.push(result);
        }
        stop(server)?;
    }
    if options.open {
        let server = start_server(binaries, kind)?;
        round.open =
            Some(measure_open(binaries, &server, options, clock_ticks).context("open-loop echo")?);
        stop(server)?;
    }
    if options.idle {
        measure_idle_round(binaries, kind, options, &mut round)?;
    }
    if options.churn {
        round.churn_paced = measure_churn(
            binaries,
            kind,
            options.churn_duration,
            Some(options.churn_rate),
        )
        .context("paced churn")?;
        round.churn_saturated = measure_churn(binaries, kind, options.churn_duration, None)
            .context("saturated churn")?;
    }
    Ok(round)
}

/// Measures the idle memory of one kind into `round`, against a server whose pool can hold every connection.
fn measure_idle_round(
    binaries: &Binaries,
    kind: ServerKind,
    options: &Options,
    round: &mut KindRound,
) -> Result<()> {
    // A blocking worker holds each open connection, so the pool must hold every idle one (plus slack for
    // connections of the previous measurement that are still closing).
    let pool = (options.idle_connections + IDLE_SLACK).to_string();
    let idle_arguments: &[&str] = if kind.pooled {
        &["--workers", &pool, "--max-connections", &pool]
    } else {
        &[]
    };
    let server = start_server_with(binaries, kind, idle_arguments)?;
    let idle = measure_idle(binaries, &server, options.idle_connections)?;
    round.idle_bytes_per_connection = idle.growth_per_connection;
    round.idle_total_bytes_per_connection = idle.total_per_connection;
    round.idle_served = idle.served;
    stop(server)?;
    Ok(())
}

fn measure_echo(
    binaries: &Binaries,
    server: &mut Running,
    connections: u32,
    threads: u32,
    options: &Options,
    clock_ticks: f64,
) -> Result<EchoResult> {
    let address = server.address.clone();
    let client = spawn(
        Command::new(&binaries.client).args([
            "echo",
            "--addr",
            &address,
            "--connections",
            &connections.to_string(),
            "--threads",
            &threads.to_string(),
            "--warmup-ms",
            &options.echo_warmup.as_millis().to_string(),
            "--duration-ms",
            &options.echo_duration.as_millis().to_string(),
        ]),
        "bench_client echo",
        // The client holds its connections until this pipe closes in `finish`, so a thread-per-connection
        // server keeps its threads, and their context switch counts, past the second reading.
        true,
    )?;
    let window = timed_window(server, client, "echo ", clock_ticks)?;
    let fields = fields(&window.result);
    let round_trips = number(&fields, "round_trips")?.max(1.0);
    // The echo threads count their own switches: they end at the window's close, and a thread that ended
    // before the second reading of `/proc` takes its count out of the sum.
    let client_switches = number(&fields, "client_switches").unwrap_or(window.client_switches);
    let TimedWindow {
        server_cpu_seconds,
        client_cpu_seconds,
        server_switches: switches,
        seconds: window_seconds,
        ..
    } = window;
    Ok(EchoResult {
        connections,
        round_trips_per_second: number(&fields, "rt_per_s")?,
        p50_microseconds: number(&fields, "p50_us")?,
        p99_microseconds: number(&fields, "p99_us")?,
        server_cpu_microseconds_per_round_trip: server_cpu_seconds * 1e6 / round_trips,
        server_context_switches_per_round_trip: switches / round_trips,
        client_context_switches_per_round_trip: client_switches / round_trips,
        client_cpu_microseconds_per_round_trip: client_cpu_seconds * 1e6 / round_trips,
        cores_busy: (server_cpu_seconds + client_cpu_seconds) / window_seconds,
    })
}

/// What the machine did while a client's timed window was open.
#[derive(Debug)]
struct TimedWindow {
    /// The client's result line.
    result: String,
    server_cpu_seconds: f64,
    client_cpu_seconds: f64,
    /// Voluntary plus involuntary context switches of every server thread.
    server_switches: f64,
    /// The same over the client's threads.
    client_switches: f64,
    /// Wall time between the readings.
    seconds: f64,
}

/// Reads the server's and the client's CPU time and the server's context switches when the client says
/// `measuring` and again at `measured`, then takes the client's result line (starting with `prefix`) and
/// waits for it to end.
fn timed_window(
    server: &Running,
    client: Running,
    prefix: &str,
    clock_ticks: f64,
) -> Result<TimedWindow> {
    let server_pid = server.child.id();
    // The client stays a child until `finish` waits for it, so its /proc entry outlives its last line.
    let client_pid = client.child.id();
    expect_line(&client, |line| line == "measuring")?;
    let window_opened = Instant::now();
    let server_cpu_before = cpu_ticks(server_pid)?;
    let client_cpu_before = cpu_ticks(client_pid)?;
    let switches_before = context_switches(server_pid)?;
    let client_switches_before = context_switches(client_pid)?;
    expect_line(&client, |line| line == "measured")?;
    let server_cpu_after = cpu_ticks(server_pid)?;
    let client_cpu_after = cpu_ticks(client_pid)?;
    let switches_after = context_switches(server_pid)?;
    let client_switches_after = context_switches(client_pid)?;
    let seconds = window_opened.elapsed().as_secs_f64();
    let result = expect_line(&client, |line| line.starts_with(prefix))?;
    finish(client)?;
    Ok(TimedWindow {
        result,
        server_cpu_seconds: server_cpu_after.saturating_sub(server_cpu_before) as f64 / clock_ticks,
        client_cpu_seconds: client_cpu_after.saturating_sub(client_cpu_before) as f64 / clock_ticks,
        // A thread that exits before the second reading takes its switches out of the sum (the kernel keeps
        // an exited thread's CPU time in /proc/PID/stat, but not its switches); the echo client holds every
        // connection open until `finish`, so no server ends a connection's thread before then, and the sum
        // is kept from going below zero if one did.
        server_switches: switches_after.saturating_sub(switches_before) as f64,
        client_switches: client_switches_after.saturating_sub(client_switches_before) as f64,
        seconds,
    })
}

/// Runs the open-loop echo at [`OPEN_CONNECTIONS`] connections and `--open-rate` against `server`.
fn measure_open(
    binaries: &Binaries,
    server: &Running,
    options: &Options,
    clock_ticks: f64,
) -> Result<OpenResult> {
    let client = spawn(
        Command::new(&binaries.client).args([
            "open",
            "--addr",
            &server.address,
            "--connections",
            &OPEN_CONNECTIONS.to_string(),
            "--rate",
            &options.open_rate.to_string(),
            "--warmup-ms",
            &options.echo_warmup.as_millis().to_string(),
            "--duration-ms",
            &options.echo_duration.as_millis().to_string(),
        ]),
        "bench_client open",
        false,
    )?;
    let window = timed_window(server, client, "open ", clock_ticks)?;
    let fields = fields(&window.result);
    let sent = number(&fields, "sent")?.max(1.0);
    let TimedWindow {
        server_cpu_seconds,
        client_cpu_seconds,
        seconds: window_seconds,
        ..
    } = window;
    Ok(OpenResult {
        sent_per_second: number(&fields, "sent_per_s")?,
        p50_microseconds: number(&fields, "p50_us")?,
        p99_microseconds: number(&fields, "p99_us")?,
        p999_microseconds: number(&fields, "p999_us")?,
        max_microseconds: number(&fields, "max_us")?,
        unanswered: number(&fields, "unanswered")?,
        behind_max_microseconds: number(&fields, "behind_max_us")?,
        server_cpu_microseconds_per_message: server_cpu_seconds * 1e6 / sent,
        cores_busy: (server_cpu_seconds + client_cpu_seconds) / window_seconds,
    })
}

/// The server's memory while it holds idle connections.
#[derive(Debug, Clone, Copy)]
struct IdleMemory {
    /// RSS growth from before the connections to after them, per connection served.
    growth_per_connection: f64,
    /// The whole RSS with the connections open, per connection served (counts a pre-spawned pool too).
    total_per_connection: f64,
    /// Connections that did their round trip and stayed open.
    served: f64,
}

/// Measures the server's resident memory before and after the client opens idle connections.
fn measure_idle(binaries: &Binaries, server: &Running, connections: u32) -> Result<IdleMemory> {
    let address = server.address.clone();
    let pid = server.child.id();
    let before = resident_bytes(pid)?;
    let mut client = spawn(
        Command::new(&binaries.client).args([
            "idle",
            "--addr",
            &address,
            "--connections",
            &connections.to_string(),
        ]),
        "bench_client idle",
        true,
    )?;
    let line = expect_line(&client, |line| line.starts_with("idle "))?;
    // Let threads that are still settling after their last byte reach their idle state.
    thread::sleep(Duration::from_millis(300));
    let after = resident_bytes(pid)?;
    drop(client.stdin.take());
    finish(client)?;
    let fields = fields(&line);
    let served = number(&fields, "served")?;
    if served < 1.0 {
        bail!("the server served none of the idle connections: {line}");
    }
    Ok(IdleMemory {
        growth_per_connection: (after as f64 - before as f64) / served,
        total_per_connection: after as f64 / served,
        served,
    })
}

/// Runs one connect-and-close churn against a fresh server, paced at `rate` connects per second or unpaced.
fn measure_churn(
    binaries: &Binaries,
    kind: ServerKind,
    duration: Duration,
    rate: Option<u64>,
) -> Result<ChurnResult> {
    let server = start_server(binaries, kind)?;
    let mut arguments = vec![
        "churn".to_owned(),
        "--addr".to_owned(),
        server.address.clone(),
        "--threads".to_owned(),
        CHURN_THREADS.to_string(),
        "--duration-ms".to_owned(),
        duration.as_millis().to_string(),
    ];
    if let Some(rate) = rate {
        arguments.extend(["--rate".to_owned(), rate.to_string()]);
    }
    let overflows_before = listen_overflows();
    let client = spawn(
        Command::new(&binaries.client).args(&arguments),
        "bench_client churn",
        false,
    )?;
    let line = expect_line(&client, |line| line.starts_with("churn "))?;
    finish(client)?;
    let overflows_after = listen_overflows();
    let churn = fields(&line);
    let seconds = number(&churn, "seconds")?;
    let accepted = stop(server)?;
    Ok(ChurnResult {
        per_second: number(&churn, "per_s")?,
        stalled: number(&churn, "stalled")?,
        errors: number(&churn, "errors")?,
        p99_microseconds: number(&churn, "p99_us")?,
        slowest_milliseconds: number(&churn, "max_ms")?,
        listen_overflows: match (overflows_before, overflows_after) {
            (Some(before), Some(after)) => after.saturating_sub(before) as f64,
            _ => f64::NAN,
        },
        server_accepts_per_second: accepted.map_or(f64::NAN, |count| count as f64 / seconds),
    })
}

/// System calls the server made per round trip, counted from outside by `strace -c -f`.
#[derive(Debug, Clone, Default)]
struct SystemCalls {
    per_round_trip: f64,
    /// The most frequent calls and their count per round trip, most frequent first.
    top: Vec<(String, f64)>,
}

/// Attaches `strace -c -f` to a server after its one connection is open, runs a fixed number of round trips,
/// and divides the calls strace counted by them.
fn count_system_calls(binaries: &Binaries, kind: ServerKind) -> Result<SystemCalls> {
    // Attaching interrupts every waiting thread once (a futex restarted with EAGAIN); with 320 idle workers
    // that adds about 0.06 calls per round trip that the echo never makes, so the pool is small here.
    let arguments: &[&str] = if kind.pooled {
        &["--workers", "2"]
    } else {
        &[]
    };
    let server = start_server_with(binaries, kind, arguments)?;
    let mut client = spawn(
        Command::new(&binaries.client).args([
            "count",
            "--addr",
            &server.address,
            "--round-trips",
            &STRACE_ROUND_TRIPS.to_string(),
        ]),
        "bench_client count",
        true,
    )?;
    expect_line(&client, |line| line == "ready")?;
    let summary_path = env::temp_dir().join(format!(
        "netbench-strace-{}-{}.txt",
        std::process::id(),
        kind.name
    ));
    let mut strace = Command::new("strace")
        .args(["-c", "-f", "-p", &server.child.id().to_string(), "-o"])
        .arg(&summary_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("could not start strace")?;
    let strace_stderr = strace.stderr.take().context("strace has no stderr pipe")?;
    let (sender, attached) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(strace_stderr).lines() {
            let Ok(line) = line else { return };
            if line.contains("attached") && sender.send(()).is_err() {
                return;
            }
        }
    });
    attached
        .recv_timeout(Duration::from_secs(10))
        .context("strace did not attach to the server within 10 s")?;
    // strace announces each thread as it attaches; give it time to reach all of them.
    thread::sleep(Duration::from_millis(500));
    if let Some(stdin) = client.stdin.as_mut() {
        writeln!(stdin, "go").context("could not tell the client to start")?;
    }
    let line = expect_line(&client, |line| line.starts_with("count "))?;
    finish(client)?;
    // strace writes its summary when interrupted; `kill` targets only the strace this function started.
    let status = Command::new("kill")
        .args(["-INT", &strace.id().to_string()])
        .status()
        .context("could not run kill to stop strace")?;
    if !status.success() {
        bail!("kill -INT of strace failed with {status}");
    }
    wait_with_deadline(&mut strace, Duration::from_secs(10))?;
    stop(server)?;
    let summary = fs::read_to_string(&summary_path).with_context(|| {
        format!(
            "could not read the strace summary {}",
            summary_path.display()
        )
    })?;
    let _ = fs::remove_file(&summary_path);
    let round_trips = number(&fields(&line), "round_trips")?;
    parse_strace_summary(&summary, round_trips)
}

/// Reads the table `strace -c` writes and divides its counts by `round_trips`.
fn parse_strace_summary(summary: &str, round_trips: f64) -> Result<SystemCalls> {
    let mut total = 0.0;
    let mut rows = Vec::new();
    for row in summary.lines() {
        let words: Vec<&str> = row.split_whitespace().collect();
        // Rows are: % time, seconds, usecs/call, calls, [errors,] name.
        let (Some(name), Some(calls)) = (
            words.last(),
            words.get(3).and_then(|calls| calls.parse::<f64>().ok()),
        ) else {
            continue;
        };
        if words.len() < 5 {
            continue;
        }
        if *name == "total" {
            total = calls;
        } else {
            rows.push(((*name).to_owned(), calls / round_trips));
        }
    }
    if total == 0.0 {
        bail!("the strace summary had no total line:\n{summary}");
    }
    rows.sort_by(|left, right| right.1.total_cmp(&left.1));
    // Calls made once (start-up, the last close) round to 0.00 per round trip and say nothing here.
    rows.retain(|(_, per_round_trip)| *per_round_trip >= 0.005);
    rows.truncate(4);
    Ok(SystemCalls {
        per_round_trip: total / round_trips,
        top: rows,
    })
}

/// Starts a server with its default settings.
fn start_server(binaries: &Binaries, kind: ServerKind) -> Result<Running> {
    start_server_with(binaries, kind, &[])
}

/// Starts a server with extra arguments and reads the `listening on ADDR` line it prints once bound.
fn start_server_with(binaries: &Binaries, kind: ServerKind, arguments: &[&str]) -> Result<Running> {
    let mut server = spawn(
        Command::new(&binaries.server)
            .args(["--kind", kind.name, "--addr", "127.0.0.1:0"])
            .args(arguments),
        &format!("bench_server --kind {}", kind.name),
        true,
    )?;
    let line = expect_line(&server, |line| line.starts_with("listening on "))?;
    server.address = line.trim_start_matches("listening on ").trim().to_owned();
    Ok(server)
}

/// Starts a child with its stdout read line by line on a thread; `keep_stdin` gives it a pipe to close later.
fn spawn(command: &mut Command, what: &str, keep_stdin: bool) -> Result<Running> {
    let mut child = command
        .stdin(if keep_stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("could not start {what}"))?;
    let stdout = child
        .stdout
        .take()
        .context("the child has no stdout pipe")?;
    let stdin = child.stdin.take();
    let (sender, lines) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if sender.send(line).is_err() {
                return;
            }
        }
    });
    Ok(Running {
        child,
        stdin,
        lines,
        what: what.to_owned(),
        address: String::new(),
    })
}

/// Waits for the first stdout line that `wanted` accepts, skipping others.
fn expect_line(running: &Running, wanted: impl Fn(&str) -> bool) -> Result<String> {
    let deadline = Instant::now() + LINE_TIMEOUT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match running.lines.recv_timeout(left) {
            Ok(line) if wanted(&line) => return Ok(line),
            Ok(_) => continue,
            Err(RecvTimeoutError::Timeout) => {
                bail!(
                    "{} printed no expected line within {LINE_TIMEOUT:?}",
                    running.what
                )
            }
            Err(RecvTimeoutError::Disconnected) => {
                bail!("{} ended before printing the expected line", running.what)
            }
        }
    }
}

/// Waits for a client to exit on its own and checks it succeeded.
fn finish(mut running: Running) -> Result<()> {
    drop(running.stdin.take());
    let status = wait_with_deadline(&mut running.child, LINE_TIMEOUT)?;
    if !status.success() {
        bail!("{} failed with {status}", running.what);
    }
    Ok(())
}

/// Asks a server to stop by closing its stdin (killing it, by its own pid, if it has not exited in 10 s) and
/// returns the count from its `served connections=N` line.
fn stop(mut running: Running) -> Result<Option<u64>> {
    drop(running.stdin.take());
    let status = wait_with_deadline(&mut running.child, Duration::from_secs(10))?;
    if !status.success() {
        bail!("{} exited with {status} when asked to stop", running.what);
    }
    let served = running
        .lines
        .try_iter()
        .chain(running.lines.recv_timeout(Duration::from_secs(1)))
        .find_map(|line| {
            line.strip_prefix("served connections=")
                .and_then(|count| count.trim().parse().ok())
        });
    Ok(served)
}

/// `TcpExtListenOverflows` from `/proc/net/netstat`: SYNs dropped because an accept queue was full.
fn listen_overflows() -> Option<u64> {
    let text = fs::read_to_string("/proc/net/netstat").ok()?;
    let mut lines = text.lines().filter(|line| line.starts_with("TcpExt:"));
    let names = lines.next()?;
    let values = lines.next()?;
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find(|(name, _)| *name == "ListenOverflows")
        .and_then(|(_, value)| value.parse().ok())
}

fn wait_with_deadline(child: &mut Child, timeout: Duration) -> Result<std::process::ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let status = child.wait()?;
            bail!(
                "process {} did not exit within {timeout:?}; killed it ({status})",
                child.id()
            );
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// User plus system CPU time of a process, in clock ticks, from `/proc/PID/stat` (fields 14 and 15).
fn cpu_ticks(pid: u32) -> Result<u64> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("could not read /proc/{pid}/stat"))?;
    // The command name (field 2) may hold spaces; count fields after its closing parenthesis.
    let rest = text
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .context("unexpected /proc/PID/stat format")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let user: u64 = fields
        .get(11)
        .and_then(|field| field.parse().ok())
        .context("no utime")?;
    let system: u64 = fields
        .get(12)
        .and_then(|field| field.parse().ok())
        .context("no stime")?;
    Ok(user + system)
}

/// Context switches, voluntary plus involuntary, summed over every thread of a process from
/// `/proc/PID/task/*/status`; a thread that exits between the listing and its read is left out.
fn context_switches(pid: u32) -> Result<u64> {
    let tasks = fs::read_dir(format!("/proc/{pid}/task"))
        .with_context(|| format!("could not list /proc/{pid}/task"))?;
    let mut total = 0;
    for task in tasks {
        let Ok(task) = task else { continue };
        let Ok(status) = fs::read_to_string(task.path().join("status")) else {
            continue;
        };
        total += context_switches_in(&status).with_context(|| {
            format!(
                "no context switch counts in {}",
                task.path().join("status").display()
            )
        })?;
    }
    Ok(total)
}

/// `voluntary_ctxt_switches` plus `nonvoluntary_ctxt_switches` from the text of one `/proc/.../status`.
fn context_switches_in(status: &str) -> Option<u64> {
    let count = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|value| value.trim().parse::<u64>().ok())
    };
    Some(count("voluntary_ctxt_switches")? + count("nonvoluntary_ctxt_switches")?)
}

/// Resident set size of a process in bytes, from `VmRSS` in `/proc/PID/status`.
fn resident_bytes(pid: u32) -> Result<u64> {
    let text = fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("could not read /proc/{pid}/status"))?;
    let kilobytes: u64 = text
        .lines()
        .find(|line| line.starts_with("VmRSS:"))
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|field| field.parse().ok())
        .context("no VmRSS line in /proc/PID/status")?;
    Ok(kilobytes * 1024)
}

fn clock_ticks_per_second() -> f64 {
    command_output("getconf", &["CLK_TCK"])
        .and_then(|text| text.trim().parse().ok())
        .unwrap_or(100.0)
}

/// The 1-minute load average from `/proc/loadavg`.
fn one_minute_load() -> Option<f64> {
    fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The load averages of one run: before, after, and the 1-minute figure at each measurement.
#[derive(Debug, Clone, Default)]
struct Load {
    before: String,
    after: String,
    samples: Vec<f64>,
}

impl Load {
    /// A sentence saying how loaded the machine was, from the samples, against its core count.
    fn describe(&self, cores: usize) -> String {
        if self.samples.is_empty() {
            return "The load average could not be read during the run.".to_owned();
        }
        let lowest = self.samples.iter().copied().fold(f64::INFINITY, f64::min);
        let highest = self
            .samples
            .iter()
            .copied()
            .fold(f64::NEG_INFINITY, f64::max);
        let middle = median(&self.samples);
        // The load average counts the benchmark's own threads: two client threads plus the server's busy
        // threads, and for a moment the thousands of idle-connection workers being stopped. On a machine doing
        // nothing else a quiet run here read a median of 3.8 and a highest of 5.1 on 2 cores, so only figures
        // above three per core point to other work.
        let competing = 3.0 * cores as f64;
        let verdict = if middle > competing {
            "other work was competing for the cores during most measurements, so absolute figures are low \
             and noisy; compare the ratios, which come from the same run"
        } else if highest > competing {
            "other work competed for the cores during some measurements; compare the ratios and the \
             per-round figures"
        } else {
            "no more than the benchmark's own client and server threads (the figure counts them)"
        };
        format!(
            "1-minute load average at the start of each of the {} measurements: lowest {lowest:.2}, median \
             {middle:.2}, highest {highest:.2} on {cores} logical cores: {verdict}.",
            self.samples.len()
        )
    }
}

fn command_output(program: &str, arguments: &[&str]) -> Option<String> {
    let output = Command::new(program)
        .args(arguments)
        .current_dir(workspace_root())
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// Splits `word key=value key=value` into a map.
fn fields(line: &str) -> HashMap<String, String> {
    line.split_whitespace()
        .filter_map(|word| word.split_once('='))
        .map(|(key, value)| (key.to_owned(), value.to_owned()))
        .collect()
}

fn number(fields: &HashMap<String, String>, key: &str) -> Result<f64> {
    fields
        .get(key)
        .and_then(|value| value.parse().ok())
        .with_context(|| format!("the client printed no number for `{key}`"))
}

fn summarise(round: &KindRound, options: &Options) -> String {
    let mut parts = Vec::new();
    for echo in &round.echo {
        parts.push(format!(
            "{}c {:.0} rt/s p50 {:.1} p99 {:.1} us, per rt server {:.1} us {:.2} cs client {:.1} us {:.2} cs, {:.2} cores",
            echo.connections,
            echo.round_trips_per_second,
            echo.p50_microseconds,
            echo.p99_microseconds,
            echo.server_cpu_microseconds_per_round_trip,
            echo.server_context_switches_per_round_trip,
            echo.client_cpu_microseconds_per_round_trip,
            echo.client_context_switches_per_round_trip,
            echo.cores_busy,
        ));
    }
    if let Some(open) = &round.open {
        parts.push(format!(
            "open {:.0}/s p50 {:.1} p99 {:.1} p99.9 {:.1} us, unanswered {}, behind {:.0} us, server {:.1} us/msg",
            open.sent_per_second,
            open.p50_microseconds,
            open.p99_microseconds,
            open.p999_microseconds,
            open.unanswered,
            open.behind_max_microseconds,
            open.server_cpu_microseconds_per_message,
        ));
    }
    if options.idle {
        parts.push(format!(
            "idle {:.1} KiB/conn ({:.1} whole)",
            round.idle_bytes_per_connection / 1024.0,
            round.idle_total_bytes_per_connection / 1024.0,
        ));
    }
    if options.churn {
        parts.push(format!(
            "paced churn {:.0}/s (server {:.0}/s) stalled {} overflows {} p99 {:.0} us; saturated churn \
             {:.0}/s (server {:.0}/s) stalled {} overflows {}",
            round.churn_paced.per_second,
            round.churn_paced.server_accepts_per_second,
            round.churn_paced.stalled,
            round.churn_paced.listen_overflows,
            round.churn_paced.p99_microseconds,
            round.churn_saturated.per_second,
            round.churn_saturated.server_accepts_per_second,
            round.churn_saturated.stalled,
            round.churn_saturated.listen_overflows,
        ));
    }
    parts.join("; ")
}

/// Medians over the rounds of one kind.
#[derive(Debug, Clone, Default)]
struct KindMedians {
    echo: Vec<EchoResult>,
    open: Option<OpenResult>,
    idle_kib_per_connection: f64,
    idle_total_kib_per_connection: f64,
    idle_served: f64,
    churn_paced: ChurnResult,
    churn_saturated: ChurnResult,
}

impl KindMedians {
    /// The medians of the echo load at `connections`, if it was measured.
    fn echo_at(&self, connections: u32) -> Option<&EchoResult> {
        self.echo
            .iter()
            .find(|echo| echo.connections == connections)
    }
}

fn medians(rounds: &[KindRound]) -> KindMedians {
    let of =
        |pick: &dyn Fn(&KindRound) -> f64| median(&rounds.iter().map(pick).collect::<Vec<_>>());
    // Every round measures the same echo loads in the same order, so the first round's list indexes them all.
    let loads = rounds.first().map_or(0, |round| round.echo.len());
    let echo = (0..loads)
        .map(|load| EchoResult {
            connections: rounds[0].echo[load].connections,
            round_trips_per_second: of(&|round| round.echo[load].round_trips_per_second),
            p50_microseconds: of(&|round| round.echo[load].p50_microseconds),
            p99_microseconds: of(&|round| round.echo[load].p99_microseconds),
            server_cpu_microseconds_per_round_trip: of(&|round| {
                round.echo[load].server_cpu_microseconds_per_round_trip
            }),
            server_context_switches_per_round_trip: of(&|round| {
                round.echo[load].server_context_switches_per_round_trip
            }),
            client_context_switches_per_round_trip: of(&|round| {
                round.echo[load].client_context_switches_per_round_trip
            }),
            client_cpu_microseconds_per_round_trip: of(&|round| {
                round.echo[load].client_cpu_microseconds_per_round_trip
            }),
            cores_busy: of(&|round| round.echo[load].cores_busy),
        })
        .collect();
    let open = rounds
        .iter()
        .all(|round| round.open.is_some())
        .then(|| {
            let of_open = |pick: fn(&OpenResult) -> f64| {
                of(&|round| round.open.as_ref().map_or(f64::NAN, pick))
            };
            OpenResult {
                sent_per_second: of_open(|open| open.sent_per_second),
                p50_microseconds: of_open(|open| open.p50_microseconds),
                p99_microseconds: of_open(|open| open.p99_microseconds),
                p999_microseconds: of_open(|open| open.p999_microseconds),
                max_microseconds: of_open(|open| open.max_microseconds),
                unanswered: of_open(|open| open.unanswered),
                behind_max_microseconds: of_open(|open| open.behind_max_microseconds),
                server_cpu_microseconds_per_message: of_open(|open| {
                    open.server_cpu_microseconds_per_message
                }),
                cores_busy: of_open(|open| open.cores_busy),
            }
        })
        .filter(|_| !rounds.is_empty());
    KindMedians {
        echo,
        open,
        idle_kib_per_connection: of(&|round| round.idle_bytes_per_connection) / 1024.0,
        idle_total_kib_per_connection: of(&|round| round.idle_total_bytes_per_connection) / 1024.0,
        idle_served: of(&|round| round.idle_served),
        churn_paced: churn_medians(rounds, |round| &round.churn_paced),
        churn_saturated: churn_medians(rounds, |round| &round.churn_saturated),
    }
}

/// Round trips per second of one kind's echo load at `connections`, round by round.
fn echo_rates(rounds: &[KindRound], connections: u32) -> Vec<f64> {
    echo_series(rounds, connections, |echo| echo.round_trips_per_second)
}

/// One figure of one kind's echo load at `connections`, round by round (NaN where a round lacks it).
fn echo_series(rounds: &[KindRound], connections: u32, figure: fn(&EchoResult) -> f64) -> Vec<f64> {
    rounds
        .iter()
        .map(|round| {
            round
                .echo
                .iter()
                .find(|echo| echo.connections == connections)
                .map_or(f64::NAN, figure)
        })
        .collect()
}

/// Client plus server CPU per round trip: what one round trip cost the machine.
fn cpu_per_round_trip(echo: &EchoResult) -> f64 {
    echo.server_cpu_microseconds_per_round_trip + echo.client_cpu_microseconds_per_round_trip
}

/// Picks one of the two churns out of a kind's medians.
type ChurnPick = fn(&KindMedians) -> &ChurnResult;

/// Field-by-field medians of one churn over the rounds.
fn churn_medians(rounds: &[KindRound], pick: fn(&KindRound) -> &ChurnResult) -> ChurnResult {
    let of = |field: fn(&ChurnResult) -> f64| {
        median(
            &rounds
                .iter()
                .map(|round| field(pick(round)))
                .collect::<Vec<_>>(),
        )
    };
    ChurnResult {
        per_second: of(|churn| churn.per_second),
        stalled: of(|churn| churn.stalled),
        errors: of(|churn| churn.errors),
        p99_microseconds: of(|churn| churn.p99_microseconds),
        slowest_milliseconds: of(|churn| churn.slowest_milliseconds),
        listen_overflows: of(|churn| churn.listen_overflows),
        server_accepts_per_second: of(|churn| churn.server_accepts_per_second),
    }
}

fn ratio(value: f64, base: Option<f64>) -> String {
    match base {
        Some(base) if base > 0.0 && value.is_finite() => format!("{:.2}x", value / base),
        _ => "-".to_owned(),
    }
}

/// The open-loop echo table: latency at a fixed offered rate, medians over the rounds, with p99 against tokio's.
fn render_open(out: &mut String, options: &Options, summary: &[(ServerKind, KindMedians)]) {
    let tokio_p99 = summary
        .iter()
        .find(|(kind, _)| kind.name == "tokio")
        .and_then(|(_, medians)| medians.open.as_ref())
        .map(|open| open.p99_microseconds);
    let _ = writeln!(
        out,
        "\n## Echo, 64 B, open loop: {} messages/s over {OPEN_CONNECTIONS} connections\n",
        options.open_rate
    );
    let _ = writeln!(
        out,
        "| Server | Sent/s | p50 (us) | p99 (us) | p99.9 (us) | Max (us) | Unanswered | Client behind schedule, max (us) | \
         Server CPU per message (us) | Cores busy, client + server | p99 vs tokio |"
    );
    let _ = writeln!(
        out,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for (kind, medians) in summary {
        let Some(open) = &medians.open else {
            continue;
        };
        let _ = writeln!(
            out,
            "| {} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.0} | {:.2} | {:.2} | {} |",
            kind.label,
            open.sent_per_second,
            open.p50_microseconds,
            open.p99_microseconds,
            open.p999_microseconds,
            open.max_microseconds,
            open.unanswered,
            open.behind_max_microseconds,
            open.server_cpu_microseconds_per_message,
            open.cores_busy,
            ratio(open.p99_microseconds, tokio_p99),
        );
    }
    let _ = writeln!(
        out,
        "\nThe closed-loop latency above is what a client that waits for each echo sees; it hides how long a \
         message would have waited had it been sent on time (coordinated omission). Here messages leave on a \
         fixed schedule whatever the replies do, and each latency runs from the message's scheduled time, so a \
         stall shows in every message scheduled during it. Lower is better; a p99 ratio under 1.00x beats \
         tokio. The client's own lateness (column \"behind\") is part of the figure: on two shared cores a \
         server that keeps the CPU longer delays the client's writer too."
    );
}

/// The echo table: medians of every kind at every measured connection count, with the ratios of medians.
fn render_echo(out: &mut String, options: &Options, summary: &[(ServerKind, KindMedians)]) {
    let peer = |name: &str, connections: u32| {
        summary
            .iter()
            .find(|(kind, _)| kind.name == name)
            .and_then(|(_, medians)| medians.echo_at(connections))
    };
    let _ = writeln!(out, "## Echo, 64 B, closed loop\n");
    let _ = writeln!(
        out,
        "| Server | Connections | Round trips/s | p50 (us) | p99 (us) | Server CPU per round trip (us) | \
         Server context switches per round trip | Client CPU per round trip (us) | Client context switches per \
         round trip | Cores busy, client + server | rt/s vs std | rt/s vs tokio | p50 vs std |"
    );
    let _ = writeln!(
        out,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for connections in &options.echo_connections {
        let std_echo = peer("std", *connections);
        let tokio_echo = peer("tokio", *connections);
        for (kind, medians) in summary {
            let Some(echo) = medians.echo_at(*connections) else {
                continue;
            };
            let _ = writeln!(
                out,
                "| {} | {connections} | {:.0} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {} | {} | {} |",
                kind.label,
                echo.round_trips_per_second,
                echo.p50_microseconds,
                echo.p99_microseconds,
                echo.server_cpu_microseconds_per_round_trip,
                echo.server_context_switches_per_round_trip,
                echo.client_cpu_microseconds_per_round_trip,
                echo.client_context_switches_per_round_trip,
                echo.cores_busy,
                ratio(
                    echo.round_trips_per_second,
                    std_echo.map(|echo| echo.round_trips_per_second)
                ),
                ratio(
                    echo.round_trips_per_second,
                    tokio_echo.map(|echo| echo.round_trips_per_second)
                ),
                ratio(
                    echo.p50_microseconds,
                    std_echo.map(|echo| echo.p50_microseconds)
                ),
            );
        }
    }
    let cores = thread::available_parallelism().map_or(2, |count| count.get());
    let _ = writeln!(
        out,
        "\nHow to read the added columns: the CPU columns are user plus system time over the timed window from \
         `/proc/PID/stat` (the client's too, since it runs on the same {cores} cores), divided by the round \
         trips in the window; context switches are `voluntary_ctxt_switches` plus `nonvoluntary_ctxt_switches` \
         summed over the server's threads (`/proc/PID/task/*/status`), read at the same moments. Cores busy is \
         client plus server CPU time over the window's wall time. Near {cores}, the two filled the machine: \
         throughput is then bounded by the CPU, every microsecond the client spends per round trip is one the \
         server cannot show, and a server goes faster only by costing less CPU per round trip, so server CPU \
         and context switches per round trip are the steadier comparison. Well below {cores}, either client \
         and server waited on each other (one connection: each wakes the other once per round trip, about one \
         context switch each) or other work took the rest (see the load average above). A server that blocks a \
         thread once per round trip shows about one context switch per round trip and pays for each in CPU. \
         The client's context switches count how often its threads slept (a lock-step client sleeps when the \
         echo it reads next has not come) or were preempted: each sleep costs a wake-up that a server's `send` \
         pays for, and that may take the server's core (see `floor.md`)."
    );
}

/// Round trips/s of every kind against tokio's in the same round, with the median, lowest and highest ratio.
fn render_ratios_against_tokio(out: &mut String, options: &Options, results: &[Vec<KindRound>]) {
    let Some(tokio_index) = options.kinds.iter().position(|kind| kind.name == "tokio") else {
        return;
    };
    let tokio_rounds = &results[tokio_index];
    let _ = writeln!(out, "\n## Round trips/s against tokio, round by round\n");
    let _ = writeln!(
        out,
        "Each round measures every kind once (order rotated by one each round), so a kind's round pairs with \
         tokio's round of the same number. The headline ratio, in the echo table's `rt/s vs tokio` column and \
         in the targets below, stays the **ratio of medians** (a kind's median round trips/s over tokio's), as \
         in every earlier run, so that figures stay comparable across runs. The per-round ratios beside it show \
         how firm that headline is: their lowest and highest give the range a single round could have reported, \
         and their median cancels a slow phase of the machine that hit both sides of a round, if the phase \
         lasted longer than the time between the two measurements (the column \"apart\"; every load a run \
         selects lengthens it, so `--loads echo256` pairs them closest). A kind's own spread (highest minus \
         lowest round trips/s, as a share of its median) shows how much the machine moved under it. When the \
         range of ratios straddles a target, one run of this length cannot settle it.\n\n\
         Why a ratio is what it is: round trips/s equal the cores client and server kept busy divided by the \
         CPU one round trip cost them both, so each round's ratio is the product of two ratios, whose medians \
         over the rounds close the table. **From cores busy** is how much more of the machine the pair used \
         than tokio's pair: above 1 where tokio's workers and the client waited on each other, or where other \
         work took the cores while tokio was measured; and under competing load, a server with more runnable \
         threads wins a larger share of the cores from the scheduler, which shows here and not as efficiency. **From CPU per round trip** is how much less client \
         plus server CPU a round trip cost than with tokio (tokio's cost over this kind's): the server's own \
         efficiency, plus what its way of replying saved or cost the client. The second is the steadier one \
         on a shared machine.\n"
    );
    let _ = writeln!(
        out,
        "| Server | Connections | Round trips/s per round | Own spread | Apart from tokio's, at most (s) | \
         vs tokio per round | Median of ratios | Lowest | Highest | Ratio of medians (headline) | \
         From cores busy | From CPU per round trip |"
    );
    let _ = writeln!(
        out,
        "|---|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"
    );
    let times = |value: f64| {
        if value.is_finite() {
            format!("{value:.2}x")
        } else {
            "-".to_owned()
        }
    };
    for connections in &options.echo_connections {
        let tokio_rates = echo_rates(tokio_rounds, *connections);
        for (kind, rounds) in options.kinds.iter().zip(results) {
            let rates = echo_rates(rounds, *connections);
            let own = Spread::of(&rates);
            let listed = rates
                .iter()
                .map(|rate| format!("{rate:.0}"))
                .collect::<Vec<_>>()
                .join(", ");
            if kind.name == "tokio" {
                let _ = writeln!(
                    out,
                    "| {} | {connections} | {listed} | {:.0}% | - | - | - | - | - | - | - | - |",
                    kind.label,
                    own.range_of_median() * 100.0
                );
                continue;
            }
            let paired = PairedRatios::new(&rates, &tokio_rates);
            let per_round = paired
                .per_round
                .iter()
                .map(|ratio| times(*ratio))
                .collect::<Vec<_>>()
                .join(", ");
            let apart = rounds
                .iter()
                .zip(tokio_rounds)
                .map(|(ours, tokio)| ours.started.abs_diff(tokio.started).as_secs_f64())
                .fold(0.0, f64::max);
            // Round trips/s = cores busy / CPU per round trip, so each round's ratio is the product of these two
            // ratios (up to the few milliseconds between the client's window and the xtask's readings).
            let from_cores = PairedRatios::new(
                &echo_series(rounds, *connections, |echo| echo.cores_busy),
                &echo_series(tokio_rounds, *connections, |echo| echo.cores_busy),
            );
            let from_cost = PairedRatios::new(
                &echo_series(tokio_rounds, *connections, cpu_per_round_trip),
                &echo_series(rounds, *connections, cpu_per_round_trip),
            );
            let _ = writeln!(
                out,
                "| {} | {connections} | {listed} | {:.0}% | {apart:.0} | {per_round} | {} | {} | {} | {} | {} | {} |",
                kind.label,
                own.range_of_median() * 100.0,
                times(paired.median),
                times(paired.lowest),
                times(paired.highest),
                times(median(&rates) / median(&tokio_rates)),
                times(from_cores.median),
                times(from_cost.median),
            );
        }
    }
}

fn render_report(
    options: &Options,
    results: &[Vec<KindRound>],
    system_calls: &[(ServerKind, SystemCalls)],
    elapsed: Duration,
    load: &Load,
    arguments: &[String],
) -> String {
    let summary: Vec<(ServerKind, KindMedians)> = options
        .kinds
        .iter()
        .zip(results)
        .map(|(kind, rounds)| (*kind, medians(rounds)))
        .collect();
    let find = |name: &str| {
        summary
            .iter()
            .find(|(kind, _)| kind.name == name)
            .map(|(_, m)| m)
    };
    let std_medians = find("std");
    let tokio_medians = find("tokio");

    let mut out = String::new();
    let _ = writeln!(
        out,
        "# net-io-blocking beside std and tokio: echo, idle memory, churn\n"
    );
    let _ = writeln!(
        out,
        "Produced by `cargo xtask bench net{}{}`; every figure is the median of {} round{}, and every ratio compares \
         stacks measured in this same run on this same machine.\n",
        if arguments.is_empty() { "" } else { " " },
        arguments.join(" "),
        options.rounds,
        if options.rounds == 1 { "" } else { "s" },
    );
    let _ = writeln!(out, "## Machine\n");
    let cpu_model = command_output("lscpu", &[])
        .and_then(|text| {
            text.lines()
                .find(|line| line.starts_with("Model name:"))
                .map(|line| line.trim_start_matches("Model name:").trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned());
    let cores = thread::available_parallelism().map_or(0, |count| count.get());
    let kernel = command_output("uname", &["-r"]).unwrap_or_else(|| "unknown".to_owned());
    let commit = command_output("git", &["rev-parse", "--short", "HEAD"])
        .unwrap_or_else(|| "unknown".to_owned());
    let dirty = command_output("git", &["status", "--porcelain", "--untracked-files=no"])
        .is_some_and(|text| !text.is_empty());
    let _ = writeln!(out, "- CPU: {cpu_model}, {cores} logical cores");
    let _ = writeln!(out, "- Kernel: {kernel}");
    let _ = writeln!(
        out,
        "- Commit: {commit}{}",
        if dirty {
            " (with uncommitted changes)"
        } else {
            ""
        }
    );
    let _ = writeln!(
        out,
        "- Load average (1, 5, 15 min) before: {}; after: {} (the figure after can jump \
         with the benchmark's own momentary wake-ups, such as 5,000 workers stopping at once). Run took {:.0} s.",
        load.before,
        load.after,
        elapsed.as_secs_f64()
    );
    let _ = writeln!(out, "- {}\n", load.describe(cores));

    if !options.echo_connections.is_empty() {
        render_echo(&mut out, options, &summary);
        render_ratios_against_tokio(&mut out, options, results);
    }
    if options.open {
        render_open(&mut out, options, &summary);
    }

    if options.idle {
        let _ = writeln!(out, "\n## Idle memory\n");
        let _ = writeln!(
            out,
            "| Server | RSS growth per idle connection (KiB) | Whole RSS / idle connections (KiB) | Idle connections served |"
        );
        let _ = writeln!(out, "|---|---:|---:|---:|");
        for (kind, medians) in &summary {
            let _ = writeln!(
                out,
                "| {} | {:.1} | {:.1} | {:.0} of {} |",
                kind.label,
                medians.idle_kib_per_connection,
                medians.idle_total_kib_per_connection,
                medians.idle_served,
                options.idle_connections,
            );
        }
    }

    if options.churn {
        let _ = writeln!(out, "\n## Connect-and-close churn\n");
        let churns: [(&str, ChurnPick); 2] = [
            ("Paced at the offered rate", |medians| &medians.churn_paced),
            ("Saturated (unpaced)", |medians| &medians.churn_saturated),
        ];
        let _ = writeln!(
            out,
            "| Server | Churn | Connects/s | Server accepts/s | Stalled connects (> 500 ms) | Listen overflows | Connect errors | p99 connect (us) | Slowest connect (ms) | vs std | vs tokio |"
        );
        let _ = writeln!(
            out,
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        for (name, pick) in churns {
            let name = if name.starts_with("Paced") {
                format!("paced, {} offered/s", options.churn_rate)
            } else {
                name.to_lowercase()
            };
            for (kind, medians) in &summary {
                let churn = pick(medians);
                let _ = writeln!(
                    out,
                    "| {} | {name} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} | {} | {} |",
                    kind.label,
                    churn.per_second,
                    churn.server_accepts_per_second,
                    churn.stalled,
                    churn.listen_overflows,
                    churn.errors,
                    churn.p99_microseconds,
                    churn.slowest_milliseconds,
                    ratio(churn.per_second, std_medians.map(|m| pick(m).per_second)),
                    ratio(churn.per_second, tokio_medians.map(|m| pick(m).per_second)),
                );
            }
        }
    }

    if !system_calls.is_empty() {
        let _ = writeln!(
            out,
            "\n## System calls per round trip, counted from outside\n\n\
             `strace -c -f` attached to the server (all its threads) after the client's one connection was open, \
             over {STRACE_ROUND_TRIPS} round trips of 64 B, with 2 workers for the net-io-blocking kinds (attaching \
             interrupts every idle worker's wait once, which a large pool would add to the count); the client's \
             own calls are not counted. strace slows \
             every call, which can change how often an event loop finds nothing ready, so read this as a count, \
             not a speed.\n"
        );
        let _ = writeln!(
            out,
            "| Server | Calls per round trip | Most frequent (per round trip) |"
        );
        let _ = writeln!(out, "|---|---:|---|");
        for (kind, counted) in system_calls {
            let top = counted
                .top
                .iter()
                .map(|(name, count)| format!("{name} {count:.2}"))
                .collect::<Vec<_>>()
                .join(", ");
            let _ = writeln!(
                out,
                "| {} | {:.2} | {top} |",
                kind.label, counted.per_round_trip
            );
        }
    }

    let rounds_of = |name: &str| {
        options
            .kinds
            .iter()
            .position(|kind| kind.name == name)
            .map(|index| results[index].as_slice())
    };
    let tokio_rounds = rounds_of("tokio");
    if options.has_round_loads() {
        let _ = writeln!(out, "\n## Targets of issue 2, checked against this run\n");
        let mut any_target = false;
        for name in ["handler", "handler-loop", "sessions", "sessions-loop"] {
            let (Some(ours), Some(ours_rounds)) = (find(name), rounds_of(name)) else {
                continue;
            };
            any_target = true;
            let label = SERVER_KINDS
                .iter()
                .find(|kind| kind.name == name)
                .map_or(name, |kind| kind.label);
            let _ = writeln!(out, "{label}:\n");
            let peers = Peers {
                std: std_medians,
                tokio: tokio_medians,
                tokio_rounds,
            };
            for line in target_lines(ours, ours_rounds, &peers, options) {
                let _ = writeln!(out, "- {line}");
            }
            let _ = writeln!(out);
        }
        if !any_target {
            let _ = writeln!(out, "No net-io-blocking kind was measured in this run.\n");
        }
        for line in floor_lines(&find, tokio_medians) {
            let _ = writeln!(out, "{line}");
        }
    } else {
        let _ = writeln!(out);
    }

    let _ = writeln!(out, "## Method\n");
    let threads = options.client_threads;
    let _ = writeln!(
        out,
        "- Servers (`net-io-blocking/examples/bench_server.rs`), each its own process bound to 127.0.0.1 port 0: \
         **std**, a thread per connection (default stack) with `TCP_NODELAY` and a 4 KiB buffer; **tokio**, a \
         multi-thread runtime with 2 workers and a task per connection with a 4 KiB buffer; **floor**, a yardstick \
         rather than a peer: one loop thread per core with its own level-triggered epoll, one `read` and one \
         `write` per round trip and nothing else (no deadlines, limits, kills, gate, events or statistics), so \
         it shows what the kernel's path alone allows here; **handler** and \
         **sessions**, net-io-blocking with a blocking handler (4 KiB buffer on the worker stack) and with a \
         sans-IO session echoing what they read, 320 workers (so 256 connections fit beside those still closing), \
         a 4 KiB read buffer, the per-source cap raised to the global cap (every client is 127.0.0.1) and a \
         10-minute idle timeout (std and tokio have none); every other limit is the default (backlog 1,024). \
         **handler-loop** runs the same handler on a coroutine per connection over one event-loop thread per \
         core (`HandlerDriver::Coroutines`, 256 KiB of stack address space each) and **sessions-loop** the same \
         session on the event-loop driver; both cap connections at 8,192 by default. \
         A fresh server process is started for the echo loads, for the idle figure and for the churn.\n\
         - Echo client (`bench_client echo`): closed loop, one 64 B message in flight per connection. It opens \
         the connections (one round trip each, so all are served), then splits them over 1, {threads} and {threads} client threads for \
         1, 16 and 256 connections; each thread writes one message on each of its connections, then reads each \
         echo in order, with blocking sockets. A round trip's latency runs from its write to the end of its \
         read; all round trips inside the window are sampled. Warm-up {} ms, timed window {} ms. Closed-loop p99 \
         understates the latency an open-loop load would see (coordinated omission). How to read the latency \
         at 16 and 256 connections: in a lock-step round a message also waits for the client to write and read \
         the others of its thread, so p50 there is mostly the client's round time; and by Little's law a closed \
         loop with N messages in flight has a mean latency of N divided by its throughput, so with 256 \
         connections a p99 under 2 ms needs well over 128,000 round trips/s, which client and server sharing \
         two cores cannot reach here. `--client-threads` changes the split (256 gives one thread per \
         connection).\n\
         - Open-loop echo (`bench_client open`, load `open256`, a fresh server): 256 connections, one writer \
         thread sending 64 B messages round robin on a fixed schedule of `--open-rate` per second (several may be \
         in flight on one connection) and one reader thread taking the echoes through epoll; a latency runs from \
         the message's scheduled time to the end of its echo, for every message scheduled in the timed window \
         (same warm-up and window as the closed loop); echoes missing 1 s after the writer's last message are \
         unanswered. Server CPU per message is read as for the closed loop.\n\
         - Server CPU per round trip: utime + stime of the server from `/proc/PID/stat` at the start and end of \
         the timed window (10 ms ticks, so at low rates it is coarse), divided by the round trips in the window. \
         Client CPU per round trip is read the same way from the client's `/proc/PID/stat`, and server context \
         switches per round trip from the voluntary and involuntary counts of every server thread in \
         `/proc/PID/task/*/status`, at the same two moments. Cores busy is the client's and the server's CPU \
         time together over the wall time between the two readings.\n\
         - Idle memory: the server's `VmRSS` from `/proc/PID/status` before and 300 ms after the client opened \
         {} connections one after the other (each doing one 8 B round trip, then staying open), divided by the \
         connections it served; and the whole RSS with them open divided by the same count, which also \
         charges the pre-spawned worker pool of the net-io-blocking kinds (started with {} + {IDLE_SLACK} \
         workers for this measurement, since a blocking worker holds each open connection) and the base \
         process of every kind.\n\
         - Churn (`bench_client churn`): {CHURN_THREADS} client threads connect and close for {} ms; every close \
         is an RST (`SO_LINGER` 0) so no TIME_WAIT piles up on either side. Each kind runs it twice, each time \
         against a fresh server. **Paced**: the threads share a fixed schedule of {} connects/s (open loop; a \
         thread more than 5 ms behind skips the missed slots instead of bursting), which asks whether the \
         server sustains that rate. **Saturated**: every thread connects as fast as it can. On loopback a \
         connect completes in the kernel without the server, so the saturated client offers whatever its own \
         CPU share allows, and any server it out-runs for long enough fills its accept queue: the kernel then \
         drops a SYN (`TcpExtListenOverflows`) and that client thread waits for the 1 s SYN retransmit. With \
         {CHURN_THREADS} threads a server the client out-runs therefore shows about {CHURN_THREADS} stalls per \
         second however fast it is, and its rate mostly measures those waits: read it as overload behaviour, \
         and the paced figure as the capacity check (see docs/performance/netbench-churn.md). Connects per second run \
         over the whole time until the last connect ended; a connect over 500 ms counts as stalled; p99 is of \
         the successful connects' own durations. Server accepts/s is the count the server reports at exit over \
         the same time; listen overflows is the growth of `TcpExtListenOverflows` in `/proc/net/netstat` \
         during the churn (machine-wide, so another helper's server could add to it). std and tokio listen \
         with their default backlog (128 from `TcpListener::bind`), net-io-blocking with 1,024.\n\
         - Client and server share the same two cores, so from 16 connections on the client takes a large share \
         of the CPU and the throughput figures are partly client-bound; the client CPU and cores busy columns \
         show how much in each measurement.\n\
         - Each round runs every kind once, with the order rotated by one each round; the medians over rounds \
         are reported, and the throughput against tokio also round by round (a kind's round over tokio's round \
         of the same number). `--loads` selects the loads (for example `--loads echo256 --rounds 9` for the \
         spread of one figure). Raw per-round figures follow; per round trip, `server` is the server's CPU \
         and context switches (`cs`), `client` the client's CPU, and `cores` the cores the two kept busy.",
        options.echo_warmup.as_millis(),
        options.echo_duration.as_millis(),
        options.idle_connections,
        options.idle_connections,
        options.churn_duration.as_millis(),
        options.churn_rate,
    );

    let _ = writeln!(out, "\n## Per-round figures\n");
    let _ = writeln!(out, "```text");
    for (kind, rounds) in options.kinds.iter().zip(results) {
        for (index, round) in rounds.iter().enumerate() {
            let _ = writeln!(
                out,
                "{:8} round {}: {}",
                kind.name,
                index + 1,
                summarise(round, options)
            );
        }
    }
    let _ = writeln!(out, "```");
    out
}

/// What the targets compare a net-io-blocking kind against.
#[derive(Debug, Clone, Copy)]
struct Peers<'a> {
    std: Option<&'a KindMedians>,
    tokio: Option<&'a KindMedians>,
    /// Tokio's rounds, to pair with ours round by round.
    tokio_rounds: Option<&'a [KindRound]>,
}

/// What the bare epoll echo (`floor`) reached, if this run measured it: its throughput against tokio's is
/// the most any epoll server with one `recv` and one `send` per round trip could show here, and each
/// net-io-blocking kind's share of it is what its driver costs.
fn floor_lines<'a>(
    find: &dyn Fn(&str) -> Option<&'a KindMedians>,
    tokio: Option<&KindMedians>,
) -> Vec<String> {
    let Some(floor) = find("floor") else {
        return Vec::new();
    };
    let mut lines = vec!["## Against the floor\n".to_owned()];
    for connections in [1, 16, 256] {
        let Some(floor_echo) = floor.echo_at(connections) else {
            continue;
        };
        let floor_rate = floor_echo.round_trips_per_second;
        let mut parts = vec![format!("{floor_rate:.0} rt/s for the floor")];
        if let Some(tokio_echo) = tokio.and_then(|tokio| tokio.echo_at(connections)) {
            parts.push(format!(
                "{:.2}x tokio's",
                floor_rate / tokio_echo.round_trips_per_second
            ));
        }
        for name in ["handler", "handler-loop", "sessions", "sessions-loop"] {
            if let Some(echo) = find(name).and_then(|ours| ours.echo_at(connections)) {
                parts.push(format!(
                    "{name} {:.0}% of it",
                    echo.round_trips_per_second / floor_rate * 100.0
                ));
            }
        }
        let noun = if connections == 1 {
            "connection"
        } else {
            "connections"
        };
        lines.push(format!("- {connections} {noun}: {}", parts.join(", ")));
    }
    lines.push(String::new());
    lines
}

/// The issue's targets that this run measured, each with the measured figure and whether this run met it.
///
/// The throughput targets are judged on the ratio of medians, as in every earlier run; the per-round ratios
/// follow in brackets so that a verdict resting on one lucky or unlucky round shows as such.
fn target_lines(
    ours: &KindMedians,
    ours_rounds: &[KindRound],
    peers: &Peers<'_>,
    options: &Options,
) -> Vec<String> {
    let verdict = |met: bool| if met { "met" } else { "missed" };
    let mut lines = Vec::new();
    if let (Some(ours_echo), Some(std_echo)) =
        (ours.echo_at(1), peers.std.and_then(|std| std.echo_at(1)))
    {
        let ours_p50 = ours_echo.p50_microseconds;
        let std_p50 = std_echo.p50_microseconds;
        lines.push(format!(
            "1 connection, p50 within 5% of std's: {ours_p50:.1} us vs {std_p50:.1} us ({:+.1}%): {}",
            (ours_p50 / std_p50 - 1.0) * 100.0,
            verdict(ours_p50 <= std_p50 * 1.05)
        ));
    }
    if let (Some(tokio), Some(tokio_rounds)) = (peers.tokio, peers.tokio_rounds) {
        for connections in [16, 256] {
            let (Some(ours_echo), Some(tokio_echo)) =
                (ours.echo_at(connections), tokio.echo_at(connections))
            else {
                continue;
            };
            let headline = ours_echo.round_trips_per_second / tokio_echo.round_trips_per_second;
            let paired = PairedRatios::new(
                &echo_rates(ours_rounds, connections),
                &echo_rates(tokio_rounds, connections),
            );
            let rounds_met = paired
                .per_round
                .iter()
                .filter(|ratio| **ratio >= 1.2)
                .count();
            lines.push(format!(
                "{connections} connections, at least 1.2x tokio's round trips/s: {headline:.2}x (ratio of \
                 medians; per round median {:.2}x, lowest {:.2}x, highest {:.2}x, at least 1.2x in {rounds_met} \
                 of {} rounds): {}",
                paired.median,
                paired.lowest,
                paired.highest,
                paired.per_round.len(),
                verdict(headline >= 1.2)
            ));
        }
    }
    if let Some(echo) = ours.echo_at(256) {
        let p99 = echo.p99_microseconds;
        lines.push(format!(
            "256 connections, p99 under 2 ms: {:.2} ms: {}",
            p99 / 1_000.0,
            verdict(p99 < 2_000.0)
        ));
    }
    if options.churn {
        let paced = ours.churn_paced;
        lines.push(format!(
            "churn at least {CHURN_TARGET:.0} connects/s with no stalled connect, offered {}/s on a \
             schedule: {:.0}/s, {:.0} stalled: {}",
            options.churn_rate,
            paced.per_second,
            paced.stalled,
            verdict(paced.per_second >= CHURN_TARGET && paced.stalled == 0.0)
        ));
    }
    if options.idle {
        // A blocking worker holds each idle connection, and the pool was spawned before the "before" reading,
        // so only the whole-process figure charges the connections for their threads.
        lines.push(format!(
            "idle memory at most 16 KiB per connection, counting the whole process with the workers that hold \
             the connections: {:.1} KiB ({:.1} KiB of growth after the pool was up): {}",
            ours.idle_total_kib_per_connection,
            ours.idle_kib_per_connection,
            verdict(ours.idle_total_kib_per_connection <= 16.0)
        ));
    }
    lines.push(
        "2 system calls and 0 allocations per round trip: checked by the `syscalls` and `allocations` tests of \
         net-io-blocking, not here"
            .to_owned(),
    );
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_result_lines_split_into_numbers() {
        let parsed = fields("echo connections=16 rt_per_s=1234 p50_us=9.5");
        assert_eq!(
            number(&parsed, "rt_per_s").unwrap(),
            1234.0,
            "rt_per_s was not parsed"
        );
        assert_eq!(
            number(&parsed, "p50_us").unwrap(),
            9.5,
            "p50_us was not parsed"
        );
        assert!(
            number(&parsed, "p99_us").is_err(),
            "a missing key must be an error"
        );
    }

    #[test]
    fn an_strace_summary_divides_into_calls_per_round_trip() {
        let summary = "\
% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 55.00    0.010000           2      5001           recvfrom
 45.00    0.008000           1      5000           sendto
  0.00    0.000000           0         3         1 futex
------ ----------- ----------- --------- --------- ----------------
100.00    0.018000           1     10004         1 total
";
        let counted = parse_strace_summary(summary, 5_000.0).unwrap();
        assert!(
            (counted.per_round_trip - 2.0008).abs() < 1e-9,
            "total calls per round trip came out as {}",
            counted.per_round_trip
        );
        let names: Vec<&str> = counted.top.iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(
            names,
            ["recvfrom", "sendto"],
            "the once-only futex should be dropped and the rest sorted by count"
        );
        assert!(
            parse_strace_summary("no table here", 1.0).is_err(),
            "a summary without a total line must be an error"
        );
    }

    #[test]
    fn the_load_sentence_reports_the_measured_spread_and_what_it_means() {
        let busy = Load {
            samples: vec![7.5, 8.25, 3.0],
            ..Load::default()
        };
        let text = busy.describe(2);
        assert!(
            text.contains("lowest 3.00, median 7.50, highest 8.25 on 2 logical cores"),
            "the sentence lost the measured figures: {text}"
        );
        assert!(
            text.contains("during most measurements"),
            "a median load of 7.5 on 2 cores should be called competing work: {text}"
        );
        let quiet = Load {
            samples: vec![0.5, 1.25],
            ..Load::default()
        };
        assert!(
            quiet
                .describe(2)
                .contains("no more than the benchmark's own"),
            "a load under the core count should be called quiet: {}",
            quiet.describe(2)
        );
        assert!(
            Load::default().describe(2).contains("could not be read"),
            "no samples must not be reported as a quiet machine"
        );
    }

    #[test]
    fn the_loads_list_selects_what_a_run_measures() {
        let arguments: Vec<String> = ["--loads", "echo256,churn", "--no-write"]
            .iter()
            .map(|word| (*word).to_owned())
            .collect();
        let options = parse_options(&arguments).unwrap();
        assert_eq!(
            options.echo_connections,
            [256],
            "only the 256-connection echo was asked for"
        );
        assert!(
            options.churn && !options.idle && !options.strace,
            "churn was asked for, idle and syscalls were not: {options:?}"
        );
        let everything = parse_options(&[]).unwrap();
        assert!(
            everything.echo_connections == ECHO_CONNECTIONS
                && everything.idle
                && everything.churn
                && everything.strace,
            "without --loads every load should run: {everything:?}"
        );
        let strace_only = parse_options(&["--loads".to_owned(), "syscalls".to_owned()]).unwrap();
        assert!(
            !strace_only.has_round_loads() && strace_only.strace,
            "syscalls alone needs no rounds: {strace_only:?}"
        );
        let vetoed = parse_options(&[
            "--loads".to_owned(),
            "syscalls".to_owned(),
            "--no-strace".to_owned(),
        ])
        .unwrap();
        assert!(
            !vetoed.strace,
            "--no-strace must win over --loads syscalls whatever the order"
        );
    }

    #[test]
    fn an_unknown_load_is_named_with_the_valid_ones() {
        let error = parse_loads("echo256,echo64").unwrap_err().to_string();
        assert_eq!(
            error,
            "unknown load `echo64` in --loads; the loads are echo1, echo16, echo256, open256, idle, churn, syscalls",
            "the error should name the bad load and list the good ones"
        );
        assert_eq!(
            parse_loads("idle,idle,echo1").unwrap(),
            [Workload::Idle, Workload::Echo(1)],
            "a repeated load is measured once"
        );
    }

    #[test]
    fn context_switches_are_the_sum_of_the_voluntary_and_involuntary_counts() {
        let status = "\
Name:\tbench_server
State:\tS (sleeping)
Threads:\t3
voluntary_ctxt_switches:\t1500
nonvoluntary_ctxt_switches:\t42
";
        assert_eq!(
            context_switches_in(status),
            Some(1542),
            "1500 voluntary and 42 involuntary switches make 1542"
        );
        assert_eq!(
            context_switches_in("Name:\tx\nvoluntary_ctxt_switches:\t7\n"),
            None,
            "a status without the involuntary count must not read as a number"
        );
        assert_eq!(
            context_switches_in("voluntary_ctxt_switches:\tmany\nnonvoluntary_ctxt_switches:\t1\n"),
            None,
            "a count that is not a number must not read as zero"
        );
    }

    #[test]
    fn this_process_context_switches_count_every_thread() {
        // Each sleep blocks the thread, a voluntary switch the kernel counts on that thread's own status. Other
        // test threads may start and end meanwhile, so the process-wide sum is only compared with this one
        // thread's own count, read while it is still alive: the sum over all threads can never be smaller.
        let (own, whole) = thread::spawn(|| {
            for _ in 0..20 {
                thread::sleep(Duration::from_millis(1));
            }
            let own = fs::read_to_string("/proc/thread-self/status")
                .ok()
                .and_then(|status| context_switches_in(&status));
            let whole = context_switches(std::process::id());
            (own, whole)
        })
        .join()
        .expect("the sleeping thread panicked");
        let own = own.expect("could not read this thread's own context switches");
        let whole = whole.expect("could not read this process's context switches");
        assert!(
            own >= 20,
            "20 sleeps should count at least 20 switches on the sleeping thread, read {own}"
        );
        assert!(
            whole >= own,
            "the sum over the threads ({whole}) is below one thread's own count ({own}): a thread was missed"
        );
    }

    /// One kind's rounds with the given round trips/s at 256 connections, begun `offset` seconds into
    /// rounds that start every 30 s.
    fn rounds_at_256(rates: &[f64], offset: u64) -> Vec<KindRound> {
        rates
            .iter()
            .enumerate()
            .map(|(round, rate)| KindRound {
                started: Duration::from_secs(round as u64 * 30 + offset),
                echo: vec![EchoResult {
                    connections: 256,
                    round_trips_per_second: *rate,
                    p50_microseconds: 1_000.0,
                    p99_microseconds: 1_900.0,
                    server_cpu_microseconds_per_round_trip: 6.0,
                    server_context_switches_per_round_trip: 0.25,
                    client_context_switches_per_round_trip: 0.5,
                    client_cpu_microseconds_per_round_trip: 8.0,
                    cores_busy: 1.9,
                }],
                ..KindRound::default()
            })
            .collect()
    }

    #[test]
    fn the_report_shows_each_rounds_ratio_against_tokio_beside_the_ratio_of_medians() {
        let arguments: Vec<String> = [
            "--loads",
            "echo256",
            "--kinds",
            "tokio,sessions-loop",
            "--no-write",
        ]
        .iter()
        .map(|word| (*word).to_owned())
        .collect();
        let options = parse_options(&arguments).unwrap();
        // Tokio's fast second round pairs with ours: per round 1.20x, 1.05x, 1.13x (median 1.13x), while
        // the ratio of medians is 120,000 over 100,000, 1.20x.
        let mut results = vec![
            rounds_at_256(&[100_000.0, 200_000.0, 80_000.0], 0),
            rounds_at_256(&[120_000.0, 210_000.0, 90_000.0], 12),
        ];
        // Tokio's pair kept half the cores busy (a factor of 2 from cores busy), and a round trip cost our
        // server 3 us instead of 6 (11 us against 14 with the client's 8: a factor of 14 / 11 = 1.27).
        for round in &mut results[0] {
            round.echo[0].cores_busy = 0.95;
        }
        for round in &mut results[1] {
            round.echo[0].server_cpu_microseconds_per_round_trip = 3.0;
        }
        let report = render_report(
            &options,
            &results,
            &[],
            Duration::from_secs(1),
            &Load::default(),
            &arguments,
        );
        assert!(
            report.contains(
                "| net-io-blocking sessions, event loop | 256 | 120000, 210000, 90000 | 100% | 12 | 1.20x, \
                 1.05x, 1.12x | 1.12x | 1.05x | 1.20x | 1.20x | 2.00x | 1.27x |"
            ),
            "the ratio table lost the per-round ratios, their statistics or the two factors:\n{report}"
        );
        assert!(
            report
                .contains("| tokio multi-thread, 2 workers | 256 | 100000, 200000, 80000 | 120% |"),
            "tokio's own spread should be listed:\n{report}"
        );
        assert!(
            report.contains(
                "256 connections, at least 1.2x tokio's round trips/s: 1.20x (ratio of medians; per round \
                 median 1.12x, lowest 1.05x, highest 1.20x, at least 1.2x in 1 of 3 rounds): met"
            ),
            "the target line should keep the ratio of medians as its verdict and show the rounds:\n{report}"
        );
        assert!(
            report.contains("| 0.25 | 8.00 | 0.50 | 1.90 |"),
            "the echo table lost the context switch, client CPU, client context switch or cores busy column:\n{report}"
        );
        assert!(
            !report.contains("## Idle memory") && !report.contains("## Connect-and-close churn"),
            "loads that were not selected must not be reported:\n{report}"
        );
        assert!(
            !report.contains("churn at least") && !report.contains("idle memory at most"),
            "targets of loads that were not measured must not be judged:\n{report}"
        );
    }

    #[test]
    fn this_process_cpu_time_and_memory_are_readable_from_proc() {
        let pid = std::process::id();
        assert!(
            resident_bytes(pid).unwrap() > 0,
            "VmRSS of this process read as zero"
        );
        cpu_ticks(pid).expect("could not read this process's CPU time");
    }
}
