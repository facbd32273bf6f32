//! `cargo xtask bench net`: side-by-side echo, idle-memory and churn benchmarks of the net-io stack and its peers.
//!
//! The benchmark builds the `bench_server` and `bench_client` examples of `net-io-blocking` once in release
//! mode, then measures every server kind in the same run, as separate processes on this machine:
//!
//! ```text
//!   xtask ──spawn──> bench_server --kind K   (prints `listening on ADDR`, stops when stdin closes)
//!     │                    ▲  /proc/PID/stat (CPU), /proc/PID/status (VmRSS)
//!     └──spawn──> bench_client echo|idle|churn --addr ADDR   (prints key=value result lines)
//! ```
//!
//! Each round runs every kind once, in an order rotated by one each round, and the report gives the median
//! of the rounds with ratios against std and tokio taken from the same run. Every measurement starts a fresh
//! server process so that one load shape cannot leave memory or threads behind for the next.

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

use crate::figures::{load_average, median};

const USAGE: &str = "\
usage: cargo xtask bench net [--quick] [--rounds N] [--kinds std,tokio,handler,handler-loop,sessions,sessions-loop]
                             [--duration-ms MS] [--warmup-ms MS] [--churn-ms MS] [--churn-rate N]
                             [--idle N]
                             [--client-threads N]
                             [--output PATH | --no-write] [--no-strace]

  --quick        one short round for a smoke test (does not write the report unless --output is given)
  --rounds N     rounds per kind, order rotated each round; medians are reported (default 3)
  --kinds LIST   server kinds to measure (default: all six)
  --duration-ms  timed window of each echo load (default 2000)
  --warmup-ms    warm-up before each echo window (default 500)
  --churn-ms     length of each connect-and-close churn (default 3000)
  --churn-rate N connects per second offered by the paced churn (default 21000, 5% over the issue's target)
  --idle N       idle connections held for the memory figure (default 5000)
  --client-threads N  echo client threads at 16 and 256 connections (default 2; 1 at one connection)
  --output PATH  where to write the markdown report (default docs/performance/netbench.md)
  --no-strace    skip the system-call count with `strace -c -f` (done by default when strace is installed)
";

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

const SERVER_KINDS: [ServerKind; 6] = [
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

/// Options of one benchmark run.
#[derive(Debug, Clone)]
struct Options {
    rounds: usize,
    kinds: Vec<ServerKind>,
    echo_duration: Duration,
    echo_warmup: Duration,
    churn_duration: Duration,
    /// Connects per second offered by the paced churn.
    churn_rate: u64,
    idle_connections: u32,
    /// Client threads for the 16- and 256-connection loads.
    client_threads: u32,
    output: Option<PathBuf>,
    /// Count system calls per round trip with `strace -c -f` when it is installed.
    strace: bool,
}

/// One echo load's result for one kind in one round.
#[derive(Debug, Clone, Copy, Default)]
struct EchoResult {
    round_trips_per_second: f64,
    p50_microseconds: f64,
    p99_microseconds: f64,
    server_cpu_microseconds_per_round_trip: f64,
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
    echo: Vec<EchoResult>,
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
    for round in 0..options.rounds {
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
            let measured = measure_kind(&binaries, kind, &options, clock_ticks)
                .with_context(|| format!("measuring {} in round {}", kind.name, round + 1))?;
            eprintln!("xtask:   {}", summarise(&measured));
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
            "--idle" => options.idle_connections = count("--idle")? as u32,
            "--client-threads" => options.client_threads = count("--client-threads")? as u32,
            "--output" => {
                options.output = Some(PathBuf::from(value()?));
                output_given = true;
            }
            "--no-write" => no_write = true,
            "--no-strace" => options.strace = false,
            "--kinds" => {
                let list = value()?;
                let mut kinds = Vec::new();
                for name in list.split(',') {
                    let Some(kind) = SERVER_KINDS.iter().find(|kind| kind.name == name) else {
                        bail!(
                            "unknown server kind `{name}`; the kinds are std, tokio, handler, handler-loop, sessions, sessions-loop"
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
    Ok(options)
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

    let mut server = start_server(binaries, kind)?;
    for connections in &ECHO_CONNECTIONS {
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

    round.churn_paced = measure_churn(
        binaries,
        kind,
        options.churn_duration,
        Some(options.churn_rate),
    )
    .context("paced churn")?;
    round.churn_saturated =
        measure_churn(binaries, kind, options.churn_duration, None).context("saturated churn")?;
    Ok(round)
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
        false,
    )?;
    let pid = server.child.id();
    expect_line(&client, |line| line == "measuring")?;
    let cpu_before = cpu_ticks(pid)?;
    expect_line(&client, |line| line == "measured")?;
    let cpu_after = cpu_ticks(pid)?;
    let result = expect_line(&client, |line| line.starts_with("echo "))?;
    finish(client)?;
    let fields = fields(&result);
    let round_trips = number(&fields, "round_trips")?;
    let cpu_seconds = (cpu_after - cpu_before) as f64 / clock_ticks;
    Ok(EchoResult {
        round_trips_per_second: number(&fields, "rt_per_s")?,
        p50_microseconds: number(&fields, "p50_us")?,
        p99_microseconds: number(&fields, "p99_us")?,
        server_cpu_microseconds_per_round_trip: cpu_seconds * 1e6 / round_trips.max(1.0),
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

fn summarise(round: &KindRound) -> String {
    let mut text = String::new();
    for (connections, echo) in ECHO_CONNECTIONS.iter().zip(&round.echo) {
        let _ = write!(
            text,
            "{connections}c {:.0} rt/s p50 {:.1} p99 {:.1} us; ",
            echo.round_trips_per_second, echo.p50_microseconds, echo.p99_microseconds
        );
    }
    let _ = write!(
        text,
        "idle {:.1} KiB/conn ({:.1} whole); paced churn {:.0}/s (server {:.0}/s) stalled {} overflows {} \
         p99 {:.0} us; saturated churn {:.0}/s (server {:.0}/s) stalled {} overflows {}",
        round.idle_bytes_per_connection / 1024.0,
        round.idle_total_bytes_per_connection / 1024.0,
        round.churn_paced.per_second,
        round.churn_paced.server_accepts_per_second,
        round.churn_paced.stalled,
        round.churn_paced.listen_overflows,
        round.churn_paced.p99_microseconds,
        round.churn_saturated.per_second,
        round.churn_saturated.server_accepts_per_second,
        round.churn_saturated.stalled,
        round.churn_saturated.listen_overflows,
    );
    text
}

/// The median of some values (the mean of the middle two for an even count).
/// Medians over the rounds of one kind.
#[derive(Debug, Clone, Default)]
struct KindMedians {
    echo: Vec<EchoResult>,
    idle_kib_per_connection: f64,
    idle_total_kib_per_connection: f64,
    idle_served: f64,
    churn_paced: ChurnResult,
    churn_saturated: ChurnResult,
}

fn medians(rounds: &[KindRound]) -> KindMedians {
    let of =
        |pick: &dyn Fn(&KindRound) -> f64| median(&rounds.iter().map(pick).collect::<Vec<_>>());
    let echo = (0..ECHO_CONNECTIONS.len())
        .map(|load| EchoResult {
            round_trips_per_second: of(&|round| round.echo[load].round_trips_per_second),
            p50_microseconds: of(&|round| round.echo[load].p50_microseconds),
            p99_microseconds: of(&|round| round.echo[load].p99_microseconds),
            server_cpu_microseconds_per_round_trip: of(&|round| {
                round.echo[load].server_cpu_microseconds_per_round_trip
            }),
        })
        .collect();
    KindMedians {
        echo,
        idle_kib_per_connection: of(&|round| round.idle_bytes_per_connection) / 1024.0,
        idle_total_kib_per_connection: of(&|round| round.idle_total_bytes_per_connection) / 1024.0,
        idle_served: of(&|round| round.idle_served),
        churn_paced: churn_medians(rounds, |round| &round.churn_paced),
        churn_saturated: churn_medians(rounds, |round| &round.churn_saturated),
    }
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

    let _ = writeln!(out, "## Echo, 64 B, closed loop\n");
    let _ = writeln!(
        out,
        "| Server | Connections | Round trips/s | p50 (us) | p99 (us) | Server CPU per round trip (us) | rt/s vs std | rt/s vs tokio | p50 vs std |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (load, connections) in ECHO_CONNECTIONS.iter().enumerate() {
        for (kind, medians) in &summary {
            let echo = medians.echo[load];
            let _ = writeln!(
                out,
                "| {} | {connections} | {:.0} | {:.1} | {:.1} | {:.2} | {} | {} | {} |",
                kind.label,
                echo.round_trips_per_second,
                echo.p50_microseconds,
                echo.p99_microseconds,
                echo.server_cpu_microseconds_per_round_trip,
                ratio(
                    echo.round_trips_per_second,
                    std_medians.map(|m| m.echo[load].round_trips_per_second)
                ),
                ratio(
                    echo.round_trips_per_second,
                    tokio_medians.map(|m| m.echo[load].round_trips_per_second)
                ),
                ratio(
                    echo.p50_microseconds,
                    std_medians.map(|m| m.echo[load].p50_microseconds)
                ),
            );
        }
    }

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

    let _ = writeln!(out, "\n## Targets of issue 2, checked against this run\n");
    let mut any_target = false;
    for name in ["handler", "handler-loop", "sessions", "sessions-loop"] {
        let Some(ours) = find(name) else { continue };
        any_target = true;
        let label = SERVER_KINDS
            .iter()
            .find(|kind| kind.name == name)
            .map_or(name, |kind| kind.label);
        let _ = writeln!(out, "{label}:\n");
        for line in target_lines(ours, std_medians, tokio_medians, options.churn_rate) {
            let _ = writeln!(out, "- {line}");
        }
        let _ = writeln!(out);
    }
    if !any_target {
        let _ = writeln!(out, "No net-io-blocking kind was measured in this run.\n");
    }

    let _ = writeln!(out, "## Method\n");
    let threads = options.client_threads;
    let _ = writeln!(
        out,
        "- Servers (`net-io-blocking/examples/bench_server.rs`), each its own process bound to 127.0.0.1 port 0: \
         **std**, a thread per connection (default stack) with `TCP_NODELAY` and a 4 KiB buffer; **tokio**, a \
         multi-thread runtime with 2 workers and a task per connection with a 4 KiB buffer; **handler** and \
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
         - Server CPU per round trip: utime + stime of the server from `/proc/PID/stat` at the start and end of \
         the timed window (10 ms ticks, so at low rates it is coarse), divided by the round trips in the window.\n\
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
         of the CPU and the throughput figures are partly client-bound.\n\
         - Each round runs every kind once, with the order rotated by one each round; the medians over rounds \
         are reported. Raw per-round figures follow.",
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
                summarise(round)
            );
        }
    }
    let _ = writeln!(out, "```");
    out
}

/// The issue's targets, each with the measured figure and whether this run met it.
fn target_lines(
    ours: &KindMedians,
    std_medians: Option<&KindMedians>,
    tokio_medians: Option<&KindMedians>,
    churn_rate: u64,
) -> Vec<String> {
    let verdict = |met: bool| if met { "met" } else { "missed" };
    let mut lines = Vec::new();
    if let Some(std_medians) = std_medians {
        let ours_p50 = ours.echo[0].p50_microseconds;
        let std_p50 = std_medians.echo[0].p50_microseconds;
        lines.push(format!(
            "1 connection, p50 within 5% of std's: {ours_p50:.1} us vs {std_p50:.1} us ({:+.1}%): {}",
            (ours_p50 / std_p50 - 1.0) * 100.0,
            verdict(ours_p50 <= std_p50 * 1.05)
        ));
    }
    if let Some(tokio_medians) = tokio_medians {
        for load in [1, 2] {
            let ours_rate = ours.echo[load].round_trips_per_second;
            let tokio_rate = tokio_medians.echo[load].round_trips_per_second;
            lines.push(format!(
                "{} connections, at least 1.2x tokio's round trips/s: {:.2}x: {}",
                ECHO_CONNECTIONS[load],
                ours_rate / tokio_rate,
                verdict(ours_rate >= tokio_rate * 1.2)
            ));
        }
    }
    let p99 = ours.echo[2].p99_microseconds;
    lines.push(format!(
        "256 connections, p99 under 2 ms: {:.2} ms: {}",
        p99 / 1_000.0,
        verdict(p99 < 2_000.0)
    ));
    let paced = ours.churn_paced;
    lines.push(format!(
        "churn at least {CHURN_TARGET:.0} connects/s with no stalled connect, offered {churn_rate}/s on a \
         schedule: {:.0}/s, {:.0} stalled: {}",
        paced.per_second,
        paced.stalled,
        verdict(paced.per_second >= CHURN_TARGET && paced.stalled == 0.0)
    ));
    // A blocking worker holds each idle connection, and the pool was spawned before the "before" reading,
    // so only the whole-process figure charges the connections for their threads.
    lines.push(format!(
        "idle memory at most 16 KiB per connection, counting the whole process with the workers that hold \
         the connections: {:.1} KiB ({:.1} KiB of growth after the pool was up): {}",
        ours.idle_total_kib_per_connection,
        ours.idle_kib_per_connection,
        verdict(ours.idle_total_kib_per_connection <= 16.0)
    ));
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
    fn this_process_cpu_time_and_memory_are_readable_from_proc() {
        let pid = std::process::id();
        assert!(
            resident_bytes(pid).unwrap() > 0,
            "VmRSS of this process read as zero"
        );
        cpu_ticks(pid).expect("could not read this process's CPU time");
    }
}
