//! One measurement per load: the closed- and open-loop echo, idle memory, churn and the strace count, each against a fresh server.

use std::env;
use std::fs;
use std::io::{BufRead, BufReader, Write as _};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::processes::{
    Binaries, Running, expect_line, fields, finish, number, spawn, start_server, start_server_with,
    stop, wait_with_deadline,
};
use super::procfs::{context_switches, cpu_ticks, listen_overflows, resident_bytes};
use super::{
    CHURN_THREADS, ChurnResult, EchoResult, IDLE_SLACK, KindRound, OPEN_CONNECTIONS, OpenResult,
    Options, STRACE_ROUND_TRIPS, ServerKind,
};

/// Measures every load shape for one server kind.
pub(super) fn measure_kind(
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
pub(super) fn measure_idle_round(
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

pub(super) fn measure_echo(
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
pub(super) struct TimedWindow {
    /// The client's result line.
    pub(super) result: String,
    pub(super) server_cpu_seconds: f64,
    pub(super) client_cpu_seconds: f64,
    /// Voluntary plus involuntary context switches of every server thread.
    pub(super) server_switches: f64,
    /// The same over the client's threads.
    pub(super) client_switches: f64,
    /// Wall time between the readings.
    pub(super) seconds: f64,
}

/// Reads the server's and the client's CPU time and the server's context switches when the client says
/// `measuring` and again at `measured`, then takes the client's result line (starting with `prefix`) and
/// waits for it to end.
pub(super) fn timed_window(
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
pub(super) fn measure_open(
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
pub(super) struct IdleMemory {
    /// RSS growth from before the connections to after them, per connection served.
    pub(super) growth_per_connection: f64,
    /// The whole RSS with the connections open, per connection served (counts a pre-spawned pool too).
    pub(super) total_per_connection: f64,
    /// Connections that did their round trip and stayed open.
    pub(super) served: f64,
}

/// Measures the server's resident memory before and after the client opens idle connections.
pub(super) fn measure_idle(
    binaries: &Binaries,
    server: &Running,
    connections: u32,
) -> Result<IdleMemory> {
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
pub(super) fn measure_churn(
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
pub(super) struct SystemCalls {
    pub(super) per_round_trip: f64,
    /// The most frequent calls and their count per round trip, most frequent first.
    pub(super) top: Vec<(String, f64)>,
}

/// Attaches `strace -c -f` to a server after its one connection is open, runs a fixed number of round trips,
/// and divides the calls strace counted by them.
pub(super) fn count_system_calls(binaries: &Binaries, kind: ServerKind) -> Result<SystemCalls> {
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
pub(super) fn parse_strace_summary(summary: &str, round_trips: f64) -> Result<SystemCalls> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
