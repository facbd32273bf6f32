//! Load generator for `cargo xtask bench net`: closed- and open-loop echo, idle connections and connect-and-close churn.
//!
//! ```text
//! bench_client echo  --addr ADDR --connections C [--threads T] [--warmup-ms 500] [--duration-ms 2000] [--size 64]
//! bench_client open  --addr ADDR --connections C --rate MESSAGES_PER_SECOND [--threads T] [--warmup-ms 500] [--duration-ms 2000] [--size 64]
//! bench_client idle  --addr ADDR --connections 5000
//! bench_client churn --addr ADDR [--threads 4] [--duration-ms 2000] [--rate CONNECTS_PER_SECOND]
//! bench_client count --addr ADDR [--round-trips 10000] [--size 64]
//! ```
//!
//! Every mode prints `key=value` lines that the benchmark parses:
//!
//! - `echo`: opens C connections with `TCP_NODELAY` (one round trip each, so every one is served before the
//!   load starts) and splits them over T client threads (default: 1 for one connection, else 2, the core
//!   count of the benchmark machine). Each thread runs a closed loop in lock-step rounds over its own
//!   connections with blocking sockets: it writes one message on each, then reads each echo in the same
//!   order. A round trip's latency runs from its write to the end of its read, so one message is in flight
//!   per connection at all times. Only round trips that start after the warm-up and end before the
//!   deadline count. It prints `measuring` when the timed window opens, `measured` when it closes, then
//!   `echo connections=.. round_trips=.. seconds=.. rt_per_s=.. p50_us=.. p99_us=.. client_switches=..` (the echo
//!   threads' own context switches over their rounds in the window), and holds the
//!   connections open until its standard input closes (at once when it is not a pipe): a server with a
//!   thread per connection then keeps those threads, and their context switch counts, until the benchmark
//!   has read them.
//! - `open`: the same echo as an open loop, free of coordinated omission: messages leave on a fixed schedule
//!   of R per second whatever the replies do, so a slow reply cannot hold back the messages behind it, and
//!   each latency runs from the message's *scheduled* time (a late sender counts against the figure too) to
//!   the end of its echo. The C connections are split over T pairs of threads (default 1): a writer sends
//!   its share of the schedule round robin over its connections with blocking writes, several messages may
//!   be in flight on one connection; a reader waits on an epoll over the same connections and reads with
//!   `MSG_DONTWAIT`, matching every `--size` bytes to the oldest scheduled time of that connection. Messages
//!   scheduled in the timed window count; replies still missing 1 s after the window are reported as
//!   unanswered. It prints `open connections=.. threads=.. rate=.. sent=.. seconds=.. sent_per_s=..
//!   answered=.. unanswered=.. p50_us=.. p99_us=.. p999_us=.. max_us=.. behind_max_us=..`, where
//!   `behind_max_us` is how late the writers fell behind their schedule at worst (the client's own share of
//!   the latency when the machine is full).
//! - `idle`: opens C connections one after the other, each with one 8-byte round trip, prints
//!   `idle opened=.. served=.. failed=..`, then holds them until its standard input closes.
//! - `churn`: T threads connect and close; every close is an RST (`SO_LINGER` 0) so that neither side keeps
//!   the socket in TIME_WAIT and the port range cannot run out. A connect that takes over 500 ms (a dropped
//!   SYN waiting for its 1 s retransmit) counts as stalled. Without `--rate` the threads connect as fast as
//!   they can (saturation). On loopback a connect completes in the kernel without the server's help, so an
//!   unpaced client is an open-loop load limited only by its own CPU: whenever it out-runs the accept loop
//!   the accept queue fills, the kernel drops the next SYN and that thread waits a second. With `--rate R`
//!   the threads share a fixed schedule of R connects per second (open loop, each thread starting its k-th
//!   connect at its own slot), which asks whether a server sustains R without a stall. A thread that falls
//!   more than 5 ms behind its schedule skips the missed slots instead of bursting, so a stall lowers the
//!   achieved rate rather than causing the next overflow. It prints `churn connects=.. seconds=.. per_s=..
//!   offered_per_s=.. stalled=.. errors=.. p50_us=.. p99_us=.. max_ms=..`, where `seconds` runs until the last
//!   connect ended and `offered_per_s` is 0 when unpaced.
//! - `count`: opens one connection, does one round trip, prints `ready`, waits for a line on standard input,
//!   then does exactly N round trips and prints `count round_trips=.. seconds=..`. The benchmark attaches a
//!   system-call counter (`strace -c -f`) to the server between `ready` and its go line.

use std::io::{self, BufRead, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use socket2::SockRef;

/// A connect slower than this waited for a SYN retransmit.
const STALL_THRESHOLD: Duration = Duration::from_millis(500);

/// No single read or connect may hang the benchmark longer than this.
const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// What to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Echo,
    Open,
    Idle,
    Churn,
    Count,
}

/// Command-line options.
#[derive(Debug)]
struct Options {
    mode: Mode,
    address: SocketAddr,
    connections: usize,
    threads: Option<usize>,
    warmup: Duration,
    duration: Duration,
    size: usize,
    round_trips: usize,
    /// Connects per second offered by the churn (`None`: as fast as possible), or messages per second
    /// offered by the open-loop echo (required there).
    rate: Option<u64>,
}

/// What one echo thread measured.
#[derive(Debug, Default)]
struct EchoTally {
    /// Latency of each counted round trip, in nanoseconds.
    samples: Vec<u64>,
    /// The thread's connections, handed back so they stay open after the window.
    connections: Vec<TcpStream>,
    /// The thread's own context switches over its rounds in the window: how often it slept waiting for an
    /// echo, or was preempted. Counted by the thread itself, since it ends before anyone outside could read
    /// its `/proc` entry a second time.
    switches: u64,
}

fn main() -> ExitCode {
    let options = match parse_options(std::env::args().skip(1)) {
        Ok(options) => options,
        Err(message) => {
            eprintln!("bench_client: {message}");
            eprintln!(
                "usage: bench_client echo|open|idle|churn|count --addr ADDR [--connections C] [--threads T] [--warmup-ms MS] [--duration-ms MS] [--size BYTES] [--round-trips N] [--rate PER_SECOND]"
            );
            return ExitCode::from(2);
        }
    };
    let result = match options.mode {
        Mode::Echo => run_echo(&options),
        Mode::Open => run_open(&options),
        Mode::Idle => run_idle(&options),
        Mode::Churn => run_churn(&options),
        Mode::Count => run_count(&options),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("bench_client: {error}");
            ExitCode::FAILURE
        }
    }
}

fn parse_options(mut arguments: impl Iterator<Item = String>) -> Result<Options, String> {
    let mode = match arguments.next().as_deref() {
        Some("echo") => Mode::Echo,
        Some("open") => Mode::Open,
        Some("idle") => Mode::Idle,
        Some("churn") => Mode::Churn,
        Some("count") => Mode::Count,
        Some(other) => return Err(format!("unknown mode `{other}`")),
        None => return Err("a mode is required: echo, open, idle, churn or count".to_owned()),
    };
    let mut options = Options {
        mode,
        address: "127.0.0.1:7000"
            .parse()
            .map_err(|_| "bad default address")?,
        connections: 1,
        threads: None,
        warmup: Duration::from_millis(500),
        duration: Duration::from_millis(2000),
        size: 64,
        round_trips: 10_000,
        rate: None,
    };
    while let Some(flag) = arguments.next() {
        let text = arguments
            .next()
            .ok_or_else(|| format!("{flag} needs a value"))?;
        let count = || match text.parse::<usize>() {
            Ok(count) if count > 0 => Ok(count),
            _ => Err(format!(
                "{flag} takes a positive whole number, not `{text}`"
            )),
        };
        match flag.as_str() {
            "--addr" => {
                options.address = text
                    .parse()
                    .map_err(|_| format!("`{text}` is not an address like 127.0.0.1:7000"))?
            }
            "--connections" => options.connections = count()?,
            "--threads" => options.threads = Some(count()?),
            "--warmup-ms" => options.warmup = Duration::from_millis(count()? as u64),
            "--duration-ms" => options.duration = Duration::from_millis(count()? as u64),
            "--size" => options.size = count()?,
            "--round-trips" => options.round_trips = count()?,
            "--rate" => options.rate = Some(count()? as u64),
            other => return Err(format!("unknown flag `{other}`")),
        }
    }
    Ok(options)
}

/// Prints one line and flushes, because the benchmark acts on each line as it arrives.
fn say(line: &str) {
    let mut stdout = io::stdout().lock();
    let _ = writeln!(stdout, "{line}");
    let _ = stdout.flush();
}

/// Connects with `TCP_NODELAY` and the I/O timeouts, then does one round trip so the server has taken it.
fn open_served(address: SocketAddr, size: usize) -> io::Result<TcpStream> {
    let mut stream = TcpStream::connect_timeout(&address, IO_TIMEOUT)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let message = vec![b'x'; size];
    let mut echo = vec![0u8; size];
    stream.write_all(&message)?;
    stream.read_exact(&mut echo)?;
    if echo != message {
        return Err(io::Error::other("the echo differs from what was sent"));
    }
    Ok(stream)
}

/// Opens `--connections` connections with [`open_served`], each served once, one after the other.
fn open_all_served(options: &Options) -> io::Result<Vec<TcpStream>> {
    (0..options.connections)
        .map(|_| open_served(options.address, options.size))
        .collect()
}

fn run_echo(options: &Options) -> io::Result<()> {
    let connections = open_all_served(options)?;
    let thread_count = options
        .threads
        .unwrap_or(if options.connections == 1 { 1 } else { 2 })
        .min(options.connections);
    let mut groups: Vec<Vec<TcpStream>> = (0..thread_count).map(|_| Vec::new()).collect();
    for (index, connection) in connections.into_iter().enumerate() {
        groups[index % thread_count].push(connection);
    }
    let start = Instant::now();
    let window_opens = start + options.warmup;
    let window_closes = window_opens + options.duration;
    let size = options.size;
    let handles: Vec<_> = groups
        .into_iter()
        .map(|group| thread::spawn(move || echo_loop(group, size, window_opens, window_closes)))
        .collect();
    sleep_until(window_opens);
    say("measuring");
    sleep_until(window_closes);
    say("measured");
    let mut samples = Vec::new();
    let mut held = Vec::with_capacity(options.connections);
    let mut switches = 0;
    for handle in handles {
        let tally = handle
            .join()
            .map_err(|_| io::Error::other("an echo thread panicked"))??;
        samples.extend(tally.samples);
        held.extend(tally.connections);
        switches += tally.switches;
    }
    if samples.is_empty() {
        return Err(io::Error::other(
            "no round trip completed inside the window",
        ));
    }
    samples.sort_unstable();
    let seconds = options.duration.as_secs_f64();
    say(&format!(
        "echo connections={} threads={} round_trips={} seconds={:.3} rt_per_s={:.0} p50_us={:.1} p99_us={:.1} \
         client_switches={switches}",
        options.connections,
        thread_count,
        samples.len(),
        seconds,
        samples.len() as f64 / seconds,
        percentile(&samples, 0.50) as f64 / 1_000.0,
        percentile(&samples, 0.99) as f64 / 1_000.0,
    ));
    wait_for_end_of_input();
    drop(held);
    Ok(())
}

/// Reads standard input until it ends: the benchmark closes it when it is done with a measurement.
fn wait_for_end_of_input() {
    let stdin = io::stdin();
    let mut line = String::new();
    let mut locked = stdin.lock();
    while matches!(locked.read_line(&mut line), Ok(read) if read > 0) {
        line.clear();
    }
}

/// One client thread's closed loop: write on every connection, then read every echo in the same order.
fn echo_loop(
    mut group: Vec<TcpStream>,
    size: usize,
    window_opens: Instant,
    window_closes: Instant,
) -> io::Result<EchoTally> {
    let message = vec![b'e'; size];
    let mut echo = vec![0u8; size];
    let mut written_at = vec![window_opens; group.len()];
    let mut tally = EchoTally {
        samples: Vec::with_capacity(1 << 20),
        connections: Vec::new(),
        switches: 0,
    };
    let mut switches_at_open = None;
    loop {
        let round_start = Instant::now();
        if round_start >= window_closes {
            tally.connections = group;
            if let Some(opened) = switches_at_open {
                tally.switches = own_context_switches().saturating_sub(opened);
            }
            return Ok(tally);
        }
        if switches_at_open.is_none() && round_start >= window_opens {
            switches_at_open = Some(own_context_switches());
        }
        for (stream, at) in group.iter_mut().zip(written_at.iter_mut()) {
            *at = Instant::now();
            stream.write_all(&message)?;
        }
        for (stream, at) in group.iter_mut().zip(written_at.iter()) {
            stream.read_exact(&mut echo)?;
            let done = Instant::now();
            if *at >= window_opens && done <= window_closes {
                tally.samples.push((done - *at).as_nanos() as u64);
            }
        }
    }
}

/// Voluntary plus involuntary context switches of the calling thread so far (0 if `/proc` cannot be read).
fn own_context_switches() -> u64 {
    std::fs::read_to_string("/proc/thread-self/status")
        .unwrap_or_default()
        .lines()
        .filter(|line| line.contains("ctxt_switches:"))
        .filter_map(|line| line.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum()
}

/// The value below which `fraction` of the sorted samples lie (nearest rank).
fn percentile(sorted: &[u64], fraction: f64) -> u64 {
    let rank = ((sorted.len() as f64 * fraction).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn sleep_until(deadline: Instant) {
    let now = Instant::now();
    if deadline > now {
        thread::sleep(deadline - now);
    }
}

/// How long the readers wait for the replies of the last messages after the window closes (or after their
/// writer sent its last one, if it was behind).
const OPEN_DRAIN: Duration = Duration::from_secs(1);

/// The scheduled times of one connection's messages still waiting for their echo, oldest first, shared by
/// the connection's writer (which adds) and reader (which takes).
type InFlight = Arc<std::sync::Mutex<std::collections::VecDeque<Instant>>>;

/// What one open-loop reader measured.
#[derive(Debug, Default)]
struct OpenTally {
    /// Latency from the scheduled time of each counted message to the end of its echo, in nanoseconds.
    samples: Vec<u64>,
    /// Messages scheduled in the window whose echo did not come.
    unanswered: u64,
}

/// What one open-loop writer did.
#[derive(Debug, Default)]
struct OpenSent {
    /// Messages scheduled in the window (and sent).
    sent: u64,
    /// How far behind its schedule the writer was at worst.
    behind: Duration,
}

fn run_open(options: &Options) -> io::Result<()> {
    let rate = options
        .rate
        .ok_or_else(|| io::Error::other("open needs --rate MESSAGES_PER_SECOND"))?;
    let connections = open_all_served(options)?;
    let pairs = options.threads.unwrap_or(1).min(options.connections);
    let mut groups: Vec<Vec<(TcpStream, InFlight)>> = (0..pairs).map(|_| Vec::new()).collect();
    for (index, connection) in connections.into_iter().enumerate() {
        groups[index % pairs].push((connection, InFlight::default()));
    }
    let start = Instant::now() + Duration::from_millis(10);
    let window_opens = start + options.warmup;
    let window_closes = window_opens + options.duration;
    // Each writer sends every `pairs / rate` seconds, the writers staggered evenly inside that interval.
    let interval = Duration::from_secs_f64(pairs as f64 / rate as f64);
    let size = options.size;
    let mut writers = Vec::with_capacity(pairs);
    let mut readers = Vec::with_capacity(pairs);
    for (pair, group) in groups.into_iter().enumerate() {
        let mut write_side = Vec::with_capacity(group.len());
        let mut read_side = Vec::with_capacity(group.len());
        for (stream, in_flight) in group {
            write_side.push((stream.try_clone()?, Arc::clone(&in_flight)));
            read_side.push((stream, in_flight));
        }
        let first = start + interval.mul_f64(pair as f64 / pairs as f64);
        let window = (window_opens, window_closes);
        let writer_done = Arc::new(std::sync::OnceLock::new());
        let done = Arc::clone(&writer_done);
        writers.push(thread::spawn(move || {
            let sent = open_writer(write_side, size, first, interval, window);
            let _ = done.set(Instant::now());
            sent
        }));
        readers.push(thread::spawn(move || {
            open_reader(read_side, size, window, &writer_done)
        }));
    }
    sleep_until(window_opens);
    say("measuring");
    sleep_until(window_closes);
    say("measured");
    let mut sent = 0;
    let mut behind = Duration::ZERO;
    for writer in writers {
        let done = writer
            .join()
            .map_err(|_| io::Error::other("an open-loop writer panicked"))??;
        sent += done.sent;
        behind = behind.max(done.behind);
    }
    let mut samples = Vec::new();
    let mut unanswered = 0;
    for reader in readers {
        let tally = reader
            .join()
            .map_err(|_| io::Error::other("an open-loop reader panicked"))??;
        samples.extend(tally.samples);
        unanswered += tally.unanswered;
    }
    if samples.is_empty() {
        return Err(io::Error::other(
            "no echo of a message scheduled inside the window arrived",
        ));
    }
    samples.sort_unstable();
    let seconds = options.duration.as_secs_f64();
    let micros = |nanoseconds: u64| nanoseconds as f64 / 1_000.0;
    say(&format!(
        "open connections={} threads={pairs} rate={rate} sent={sent} seconds={seconds:.3} sent_per_s={:.0} \
         answered={} unanswered={unanswered} p50_us={:.1} p99_us={:.1} p999_us={:.1} max_us={:.1} \
         behind_max_us={:.1}",
        options.connections,
        sent as f64 / seconds,
        samples.len(),
        micros(percentile(&samples, 0.50)),
        micros(percentile(&samples, 0.99)),
        micros(percentile(&samples, 0.999)),
        micros(*samples.last().unwrap_or(&0)),
        behind.as_secs_f64() * 1e6,
    ));
    Ok(())
}

/// One open-loop writer: sends on its connections round robin at its scheduled times, however the
/// replies go, and records each message's scheduled time for the reader.
fn open_writer(
    group: Vec<(TcpStream, InFlight)>,
    size: usize,
    first: Instant,
    interval: Duration,
    (window_opens, window_closes): (Instant, Instant),
) -> io::Result<OpenSent> {
    let message = vec![b'o'; size];
    let mut done = OpenSent::default();
    let mut next = first;
    let mut cursor = 0;
    let mut group = group;
    while next < window_closes {
        let now = Instant::now();
        if next > now {
            // Slept, never spun: a spinning writer would take a core from the server it measures. The timer's
            // slack (about 50 us) makes the writer late by that much; it then sends every message that fell
            // due, and the lateness counts in the latency and in `behind_max_us`.
            thread::sleep(next - now);
            continue;
        }
        done.behind = done.behind.max(now - next);
        let (stream, in_flight) = &mut group[cursor];
        // Recorded before the write, so the reader never sees an echo without its time.
        in_flight
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push_back(next);
        stream.write_all(&message)?;
        if next >= window_opens {
            done.sent += 1;
        }
        cursor = (cursor + 1) % group.len();
        next += interval;
    }
    Ok(done)
}

/// One open-loop reader: takes every echo as it arrives and matches it to its message's scheduled time.
fn open_reader(
    group: Vec<(TcpStream, InFlight)>,
    size: usize,
    (window_opens, window_closes): (Instant, Instant),
    writer_done: &std::sync::OnceLock<Instant>,
) -> io::Result<OpenTally> {
    use net_io_sys::epoll::{Epoll, Events, Interest};
    use std::os::fd::AsFd;

    let epoll = Epoll::new()?;
    for (index, (stream, _)) in group.iter().enumerate() {
        epoll.add(stream.as_fd(), index as u64, Interest::READABLE)?;
    }
    let mut events = Events::with_capacity(256);
    let mut buffer = vec![0u8; 64 * 1024];
    // Bytes of an echo that arrived split, per connection.
    let mut partial = vec![0usize; group.len()];
    let mut tally = OpenTally {
        samples: Vec::with_capacity(1 << 20),
        unanswered: 0,
    };
    loop {
        let now = Instant::now();
        // A writer behind its schedule still sends messages of the window after it closed: wait for it.
        let writer_finished = writer_done.get().copied();
        if writer_finished.is_some_and(|finished| now >= finished.max(window_closes) + OPEN_DRAIN) {
            break;
        }
        let waiting_in_window = |in_flight: &InFlight| {
            in_flight
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .iter()
                .any(|at| *at >= window_opens && *at < window_closes)
        };
        if writer_finished.is_some()
            && !group
                .iter()
                .any(|(_, in_flight)| waiting_in_window(in_flight))
        {
            break;
        }
        epoll.wait(&mut events, Some(Duration::from_millis(10)))?;
        for event in events.iter() {
            let index = event.token as usize;
            let (stream, in_flight) = &group[index];
            loop {
                let read = match net_io_sys::socket::recv_nonblocking(stream.as_fd(), &mut buffer) {
                    Ok(0) => {
                        return Err(io::Error::other("the server closed a connection mid-run"));
                    }
                    Ok(read) => read,
                    Err(error) if error.kind() == io::ErrorKind::WouldBlock => break,
                    Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                    Err(error) => return Err(error),
                };
                let arrived = Instant::now();
                partial[index] += read;
                let mut queue = in_flight
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                while partial[index] >= size {
                    partial[index] -= size;
                    let Some(scheduled) = queue.pop_front() else {
                        return Err(io::Error::other("an echo arrived for no message sent"));
                    };
                    if scheduled >= window_opens && scheduled < window_closes {
                        tally
                            .samples
                            .push(arrived.saturating_duration_since(scheduled).as_nanos() as u64);
                    }
                }
            }
        }
    }
    for (_, in_flight) in &group {
        tally.unanswered += in_flight
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .iter()
            .filter(|at| **at >= window_opens && **at < window_closes)
            .count() as u64;
    }
    Ok(tally)
}

fn run_idle(options: &Options) -> io::Result<()> {
    let mut held = Vec::with_capacity(options.connections);
    let mut failed = 0usize;
    let mut first_error = None;
    for _ in 0..options.connections {
        match open_served(options.address, 8) {
            Ok(stream) => held.push(stream),
            Err(error) => {
                failed += 1;
                first_error.get_or_insert(error);
            }
        }
    }
    if let Some(error) = first_error {
        eprintln!("bench_client: first failed idle connection: {error}");
    }
    say(&format!(
        "idle opened={} served={} failed={failed}",
        options.connections,
        held.len()
    ));
    wait_for_end_of_input();
    drop(held);
    Ok(())
}

fn run_count(options: &Options) -> io::Result<()> {
    let mut stream = open_served(options.address, options.size)?;
    say("ready");
    let mut line = String::new();
    io::stdin().lock().read_line(&mut line)?;
    let message = vec![b'c'; options.size];
    let mut echo = vec![0u8; options.size];
    let began = Instant::now();
    for _ in 0..options.round_trips {
        stream.write_all(&message)?;
        stream.read_exact(&mut echo)?;
    }
    say(&format!(
        "count round_trips={} seconds={:.3}",
        options.round_trips,
        began.elapsed().as_secs_f64()
    ));
    Ok(())
}

/// A paced churn thread that falls further behind its schedule than this skips slots instead of bursting.
const CHURN_SCHEDULE_SLACK: Duration = Duration::from_millis(5);

/// What one churn thread counted.
#[derive(Debug, Default)]
struct ChurnTally {
    connects: u64,
    stalled: u64,
    errors: u64,
    /// How long each successful connect took, in nanoseconds.
    samples: Vec<u64>,
    /// When the thread's last connect ended.
    finished: Option<Instant>,
    /// The first failed connect, to say what the errors were.
    first_error: Option<io::Error>,
}

fn run_churn(options: &Options) -> io::Result<()> {
    let thread_count = options.threads.unwrap_or(4);
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let deadline = start + options.duration;
    let address = options.address;
    // Each thread owns every `thread_count`-th slot of one shared schedule, so together they are evenly spaced.
    let interval = options
        .rate
        .map(|rate| Duration::from_secs_f64(thread_count as f64 / rate as f64));
    let handles: Vec<_> = (0..thread_count)
        .map(|index| {
            let stop = Arc::clone(&stop);
            let pacing = interval.map(|interval| {
                let first = start + interval.mul_f64(index as f64 / thread_count as f64);
                (first, interval)
            });
            thread::spawn(move || churn_loop(address, deadline, pacing, &stop))
        })
        .collect();
    sleep_until(deadline);
    stop.store(true, Ordering::Relaxed);
    let mut total = ChurnTally::default();
    for handle in handles {
        let tally = handle
            .join()
            .map_err(|_| io::Error::other("a churn thread panicked"))?;
        total.connects += tally.connects;
        total.stalled += tally.stalled;
        total.errors += tally.errors;
        total.samples.extend(tally.samples);
        total.finished = total.finished.max(tally.finished);
        if let Some(error) = tally.first_error
            && total.first_error.is_none()
        {
            total.first_error = Some(error);
        }
    }
    if let Some(error) = &total.first_error {
        eprintln!(
            "bench_client: {} churn connects failed; the first: {error}",
            total.errors
        );
    }
    // A connect stuck in a SYN retransmit ends after the deadline; count the whole time up to the last one.
    let ended = total.finished.map_or(deadline, |last| last.max(deadline));
    let seconds = (ended - start).as_secs_f64();
    total.samples.sort_unstable();
    let microseconds = |fraction: f64| {
        if total.samples.is_empty() {
            0.0
        } else {
            percentile(&total.samples, fraction) as f64 / 1_000.0
        }
    };
    say(&format!(
        "churn connects={} seconds={seconds:.3} per_s={:.0} offered_per_s={} stalled={} errors={} p50_us={:.1} p99_us={:.1} max_ms={:.1}",
        total.connects,
        total.connects as f64 / seconds,
        options.rate.unwrap_or(0),
        total.stalled,
        total.errors,
        microseconds(0.50),
        microseconds(0.99),
        total.samples.last().copied().unwrap_or(0) as f64 / 1_000_000.0,
    ));
    Ok(())
}

/// One churn thread: connect, close with RST, repeat until the deadline, on a schedule when `pacing` is given
/// as (first slot, interval between this thread's slots).
fn churn_loop(
    address: SocketAddr,
    deadline: Instant,
    pacing: Option<(Instant, Duration)>,
    stop: &AtomicBool,
) -> ChurnTally {
    let mut tally = ChurnTally {
        samples: Vec::with_capacity(1 << 16),
        ..ChurnTally::default()
    };
    let mut slot = pacing.map(|(first, _)| first);
    while !stop.load(Ordering::Relaxed) {
        if let (Some(next), Some((_, interval))) = (slot.as_mut(), pacing) {
            let now = Instant::now();
            if *next >= deadline {
                break;
            }
            if *next > now {
                sleep_until(*next);
            } else if now - *next > CHURN_SCHEDULE_SLACK {
                // Behind after a stall: give up the missed slots rather than burst into the accept queue.
                *next = now - CHURN_SCHEDULE_SLACK;
            }
            *next += interval;
        } else if Instant::now() >= deadline {
            break;
        }
        let began = Instant::now();
        match TcpStream::connect_timeout(&address, IO_TIMEOUT) {
            Ok(stream) => {
                let took = began.elapsed();
                tally.connects += 1;
                if took > STALL_THRESHOLD {
                    tally.stalled += 1;
                }
                tally.samples.push(took.as_nanos() as u64);
                // Close with RST: no TIME_WAIT on either side, so the port range cannot run out.
                let _ = SockRef::from(&stream).set_linger(Some(Duration::ZERO));
            }
            Err(error) => {
                tally.errors += 1;
                tally.first_error.get_or_insert(error);
            }
        }
        tally.finished = Some(Instant::now());
    }
    tally
}
