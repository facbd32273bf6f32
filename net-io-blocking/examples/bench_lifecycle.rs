//! Lifecycle benchmark for `cargo xtask bench lifecycle`: kill, door, drain and idle costs of one net-io-blocking driver.
//!
//! ```text
//! bench_lifecycle --kind handler|handler-loop|sessions|sessions-loop|std --load kill|door|drain|shutdown|idle
//!                 [--count N] [--window-ms MS] [--pause-us US] [--control]
//! bench_lifecycle client --addr ADDR --connections N     (the child process that holds idle connections)
//! ```
//!
//! The server runs in this process, built through the public API (`ServerBuilder`), and answers every read
//! with its connection id (8 bytes, little endian), so the client learns which id to kill. A gate records
//! when the accept thread last admitted a connection. Each load prints one line
//! `result kind=K load=L key=value ...` on standard output; the xtask parses it. Every line also carries
//! `descriptor_limit`, the descriptor limit the run had once it raised its soft limit to the hard one, so
//! the report can say what limit the counts below met rather than assume one.
//!
//! - `kill`: `--count` connections (default 2,000) one after the other: connect, one round trip, then
//!   `ServerHandle::kill(id, 7)` and a blocking `read` on the client until it returns. A kill closes with
//!   `Killed(7)`, an abortive reason, so the server resets (linger 0) and the read fails with
//!   `ECONNRESET`; an end of file (0) or a timeout (2 s) is counted apart. The figure is from just before
//!   the `kill` call to the read's return: `p50_us`, `p99_us`, `max_us`; `call_p99_us` is the `kill` call
//!   alone. `--kind std` runs this load against a yardstick instead of net-io-blocking: a std thread per
//!   connection, killed the way any blocking server has to kill from another thread (`shutdown(SHUT_RD)`
//!   on a clone of the socket wakes the thread's `read` with 0; the thread then closes with linger 0).
//! - `door`: `close_door` does not close the listening socket (its documentation: "The listeners stay
//!   bound; new connections wait in the kernel backlog"), so a connect after it is never refused by the
//!   kernel; it completes and waits in the backlog. "Refused" here therefore means *no longer admitted*:
//!   a client thread connects and resets, pausing `--pause-us` (default 100; 0 connects flat out, and the
//!   line reports it as `pause_us`) after each connect, and the latency of one sample is the time from the `close_door` call to the last
//!   admission the gate saw (0 if none came after the call). `--count` samples (default 200); between
//!   samples the door is opened again and the sample waits until a new connection is admitted, which
//!   checks that the door accepts again. `late` counts admissions seen from 10 ms to 15 ms after a close
//!   (should be 0).
//! - `drain`: a child process (`client`) opens `--count` idle connections (default 10,000 for the event
//!   loops, 5,000 for worker threads: each of those holds a thread and two descriptors, so 10,000 would
//!   need about 30,000 descriptors in one process, more than many hard limits allow; the report sets this
//!   beside the run's `descriptor_limit`), one round trip each; then `drain(now + 5 s)` runs, and the child reports when every
//!   one of its connections saw its close (it closes each at once, as a client would, which ends the
//!   server's graceful linger). The child's clock starts when it reads `go` from its standard input, which
//!   the server writes just before it calls `drain`.
//! - `shutdown`: the same through `Server::shutdown(now + 5 s)`, whose idle closes carry `Shutdown`, an
//!   abortive reason (RST at once, no linger), so it shows what the graceful handshake of a drain costs;
//!   `drain_ms` is its report's elapsed time, and `call_ms` adds joining every thread.
//! - `idle`: the child opens `--count` idle connections (default 5,000), the server waits 200 ms, then
//!   sums the CPU time (`/proc/self/task/*/schedstat`, nanoseconds) and context switches
//!   (`/proc/self/task/*/status`) of every server thread over `--window-ms` (default 2,000), leaving out
//!   the main thread, which only sleeps and reads /proc. With `--control` the server also watches a
//!   control line (`ServerBuilder::control`); nothing polls it (a `ControlLine::set` wakes the accept
//!   threads), so with the line left alone the window should see no wake-up either.

use std::collections::HashMap;
use std::fs;
use std::io::{self, BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use net_io_blocking::{
    Admission, ConnectionId, ConnectionInfo, ControlLine, Gate, HandlerDriver, Input, Lane, Limits,
    NetError, Refusal, Server, ServerBuilder, Session, SessionContext, SessionDriver, Step,
    TcpConnection,
};
use net_io_sys::epoll::{Epoll, Events, Interest};

/// The kill code the benchmark uses; any code below the driver's own is abortive.
const KILL_CODE: u16 = 7;

/// How long the client waits for any single reply or close before it counts a timeout.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(2);

/// The drain deadline from the moment `drain` is called.
const DRAIN_DEADLINE: Duration = Duration::from_secs(5);

/// The door load's default pause between connects (`--pause-us`): arrivals every 150 to 250 µs resolve a
/// 1 ms target, and a client thread that never paused would keep a whole core of a small machine from the
/// accept thread.
const ARRIVAL_PAUSE: Duration = Duration::from_micros(100);

/// How long the idle load lets the server settle after the last connection opened.
const IDLE_SETTLE: Duration = Duration::from_millis(200);

/// The driver to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Handler,
    HandlerLoop,
    Sessions,
    SessionsLoop,
    /// The yardstick for `kill`: a std thread per connection, killed the way any blocking server must be.
    Std,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Handler => "handler",
            Kind::HandlerLoop => "handler-loop",
            Kind::Sessions => "sessions",
            Kind::SessionsLoop => "sessions-loop",
            Kind::Std => "std",
        }
    }

    /// Whether each connection holds a worker thread.
    fn threaded(self) -> bool {
        matches!(self, Kind::Handler | Kind::Sessions)
    }
}

/// The lifecycle step to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Load {
    Kill,
    Door,
    Drain,
    /// The drain of `Server::shutdown`, whose idle closes are abortive.
    Shutdown,
    Idle,
}

impl Load {
    fn name(self) -> &'static str {
        match self {
            Load::Kill => "kill",
            Load::Door => "door",
            Load::Drain => "drain",
            Load::Shutdown => "shutdown",
            Load::Idle => "idle",
        }
    }
}

/// Options of a server run.
#[derive(Debug)]
struct Options {
    kind: Kind,
    load: Load,
    count: Option<usize>,
    window: Duration,
    /// The door load's pause between connects; zero connects flat out.
    pause: Duration,
    /// Whether the server watches a control line (`ServerBuilder::control`).
    control: bool,
}

/// Options of the child that holds connections.
#[derive(Debug)]
struct ClientOptions {
    address: SocketAddr,
    connections: usize,
}

/// What the timing gate shares with the benchmark: admissions and the time of the last one.
#[derive(Debug)]
struct Admissions {
    base: Instant,
    count: AtomicU64,
    last_nanoseconds: AtomicU64,
}

impl Admissions {
    fn since_base(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

/// Admits everything into lane 0 and notes when, on the accept thread.
#[derive(Debug)]
struct TimingGate(Arc<Admissions>);

impl Gate for TimingGate {
    type Ticket = ();

    fn admit(&self, _info: &ConnectionInfo) -> Result<Admission<()>, Refusal> {
        let now = self.0.since_base();
        self.0.last_nanoseconds.fetch_max(now, Ordering::AcqRel);
        self.0.count.fetch_add(1, Ordering::AcqRel);
        Ok(Admission {
            ticket: (),
            lane: Lane::DEFAULT,
        })
    }
}

/// The session: answers each batch of input with its connection id.
#[derive(Debug)]
struct IdSession {
    reply: [u8; 8],
}

impl Session for IdSession {
    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        input.consume_all();
        // The output budget is far above 8 bytes and the client sends one byte per round trip.
        let _ = context.output().push(&self.reply);
        Step::Write
    }
}

fn main() -> ExitCode {
    let arguments: Vec<String> = std::env::args().skip(1).collect();
    let result = if arguments.first().map(String::as_str) == Some("client") {
        parse_client_options(&arguments[1..])
            .and_then(|options| run_client(&options).map_err(|error| format!("client: {error}")))
    } else {
        parse_options(&arguments).and_then(|options| {
            run(&options).map_err(|error| format!("{}: {error}", options.load.name()))
        })
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("bench_lifecycle: {message}");
            eprintln!(
                "usage: bench_lifecycle --kind handler|handler-loop|sessions|sessions-loop|std --load kill|door|drain|shutdown|idle [--count N] [--window-ms MS] [--pause-us US] [--control]\n       bench_lifecycle client --addr ADDR --connections N"
            );
            ExitCode::FAILURE
        }
    }
}

fn parse_options(arguments: &[String]) -> Result<Options, String> {
    let mut kind = None;
    let mut load = None;
    let mut count = None;
    let mut window = Duration::from_secs(2);
    let mut pause = ARRIVAL_PAUSE;
    let mut control = false;
    let mut iterator = arguments.iter();
    while let Some(flag) = iterator.next() {
        if flag == "--control" {
            control = true;
            continue;
        }
        let value = iterator
            .next()
            .ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--kind" => {
                kind = Some(match value.as_str() {
                    "handler" => Kind::Handler,
                    "handler-loop" => Kind::HandlerLoop,
                    "sessions" => Kind::Sessions,
                    "sessions-loop" => Kind::SessionsLoop,
                    "std" => Kind::Std,
                    other => return Err(format!("unknown kind `{other}`")),
                })
            }
            "--load" => {
                load = Some(match value.as_str() {
                    "kill" => Load::Kill,
                    "door" => Load::Door,
                    "drain" => Load::Drain,
                    "shutdown" => Load::Shutdown,
                    "idle" => Load::Idle,
                    other => return Err(format!("unknown load `{other}`")),
                })
            }
            "--count" => count = Some(parse_count(value, "--count")?),
            "--window-ms" => {
                window = Duration::from_millis(parse_count(value, "--window-ms")? as u64)
            }
            "--pause-us" => {
                pause = Duration::from_micros(
                    value
                        .parse()
                        .map_err(|_| format!("--pause-us takes a whole number, not `{value}`"))?,
                )
            }
            other => return Err(format!("unknown flag `{other}`")),
        }
    }
    let kind = kind.ok_or("--kind is required")?;
    let load = load.ok_or("--load is required")?;
    if kind == Kind::Std && load != Load::Kill {
        return Err("the std kind is a yardstick for the kill load only".to_owned());
    }
    Ok(Options {
        kind,
        load,
        count,
        window,
        pause,
        control,
    })
}

fn parse_client_options(arguments: &[String]) -> Result<ClientOptions, String> {
    let mut address = None;
    let mut connections = None;
    let mut iterator = arguments.iter();
    while let Some(flag) = iterator.next() {
        let value = iterator
            .next()
            .ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--addr" => {
                address = Some(
                    value
                        .parse()
                        .map_err(|_| format!("`{value}` is not an address like 127.0.0.1:7000"))?,
                )
            }
            "--connections" => connections = Some(parse_count(value, "--connections")?),
            other => return Err(format!("unknown flag `{other}`")),
        }
    }
    Ok(ClientOptions {
        address: address.ok_or("--addr is required")?,
        connections: connections.ok_or("--connections is required")?,
    })
}

fn parse_count(text: &str, flag: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(count) if count > 0 => Ok(count),
        _ => Err(format!(
            "{flag} takes a positive whole number, not `{text}`"
        )),
    }
}

/// Runs one load against a fresh server and prints its result line.
fn run(options: &Options) -> io::Result<()> {
    let descriptor_limit = raise_descriptor_limit()?;
    let connections = options.count.unwrap_or(match options.load {
        Load::Kill => 2_000,
        Load::Door => 200,
        Load::Drain | Load::Shutdown if options.kind.threaded() => 5_000,
        Load::Drain | Load::Shutdown => 10_000,
        Load::Idle => 5_000,
    });
    // Connections held at once: one at a time for kill and door (plus those still closing), all of them
    // for drain and idle.
    let held = match options.load {
        Load::Kill | Load::Door => 64,
        Load::Drain | Load::Shutdown | Load::Idle => connections + 64,
    };
    if options.kind == Kind::Std {
        let (address, streams) = start_std_server()?;
        let line = measure_kill(address, connections, |id| kill_std(&streams, id))?;
        println!("result kind=std load=kill {line} descriptor_limit={descriptor_limit}");
        return Ok(());
    }
    let admissions = Arc::new(Admissions {
        base: Instant::now(),
        count: AtomicU64::new(0),
        last_nanoseconds: AtomicU64::new(0),
    });
    let server = build_server(options, held, Arc::clone(&admissions))?;
    let handle = server.handle();
    let line = match options.load {
        Load::Kill => measure_kill(server.local_addr(), connections, |id| {
            ConnectionId::new(id).is_some_and(|id| handle.kill(id, KILL_CODE))
        })?,
        Load::Door => measure_door(&server, &admissions, connections, options.pause)?,
        Load::Idle => measure_idle(&server, connections, options.window)?,
        Load::Drain | Load::Shutdown => {
            let line = measure_drain(server, connections, options.load)?;
            print_result(options, &line, descriptor_limit);
            return Ok(());
        }
    };
    print_result(options, &line, descriptor_limit);
    let _ = server.shutdown(Instant::now() + Duration::from_secs(2));
    Ok(())
}

fn print_result(options: &Options, line: &str, descriptor_limit: u64) {
    println!(
        "result kind={} load={} {line} descriptor_limit={descriptor_limit}",
        options.kind.name(),
        options.load.name()
    );
}

/// Raises the soft descriptor limit to the hard one (drain and idle hold thousands of sockets) and returns
/// the limit this process now has.
fn raise_descriptor_limit() -> io::Result<u64> {
    let mut limit = net_io_sys::rlimit::descriptor_limit()?;
    if limit.soft < limit.hard {
        limit.soft = limit.hard;
        net_io_sys::rlimit::set_descriptor_limit(limit)?;
    }
    Ok(limit.soft)
}

/// Builds the server of `kind` for `held` connections at once, with the door open.
fn build_server(options: &Options, held: usize, admissions: Arc<Admissions>) -> io::Result<Server> {
    let kind = options.kind;
    // Every connection comes from 127.0.0.1, so the per-source cap is the global one; the idle timeout is
    // long so that no connection of the benchmark ends on its own.
    let limits = Limits::new()
        .max_connections(held)
        .max_per_source(held)
        .backlog(4096)
        .idle_timeout(Duration::from_secs(600))
        .read_buffer(4096);
    let mut builder = ServerBuilder::new().listen("127.0.0.1:0").limits(limits);
    if options.control {
        builder = builder.control(Arc::new(ControlLine::new()));
    }
    if kind.threaded() {
        builder = builder.workers(held);
    }
    let gate = TimingGate(admissions);
    let server = match kind {
        Kind::Handler => builder.handler(id_handler).gate(gate).build(),
        Kind::HandlerLoop => builder
            .handler_driver(HandlerDriver::coroutines())
            .handler(id_handler)
            .gate(gate)
            .build(),
        Kind::Std => {
            return Err(io::Error::other(
                "the std yardstick is not a net-io-blocking server",
            ));
        }
        Kind::Sessions | Kind::SessionsLoop => {
            let driver = if kind == Kind::SessionsLoop {
                SessionDriver::event_loop()
            } else {
                SessionDriver::Threads
            };
            builder
                .session_driver(driver)
                .sessions(|info: &ConnectionInfo| {
                    Some(IdSession {
                        reply: info.id.get().to_le_bytes(),
                    })
                })
                .gate(gate)
                .build()
        }
    };
    server.map_err(io::Error::other)
}

/// The handler: answers each read with the connection id until the peer closes.
fn id_handler(connection: &mut TcpConnection<'_>) -> Result<(), NetError> {
    let reply = connection.id().get().to_le_bytes();
    let mut buffer = [0u8; 64];
    loop {
        if connection.read(&mut buffer)? == 0 {
            return Ok(());
        }
        connection.write_all(&reply)?;
    }
}

/// Connects and does one round trip; returns the stream and the server's id for it.
fn connect_served(address: SocketAddr) -> io::Result<(TcpStream, u64)> {
    let mut stream = TcpStream::connect(address)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(CLIENT_TIMEOUT))?;
    stream.write_all(&[1])?;
    let mut reply = [0u8; 8];
    stream.read_exact(&mut reply)?;
    Ok((stream, u64::from_le_bytes(reply)))
}

/// The streams of the std yardstick's connections, by id, for its kill.
type StdStreams = Arc<Mutex<HashMap<u64, TcpStream>>>;

/// Starts the std yardstick: an accept thread and a thread per connection that answers each read with the
/// connection's id and, when its read sees an end (the kill shut the read side), closes with an RST.
fn start_std_server() -> io::Result<(SocketAddr, StdStreams)> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let address = listener.local_addr()?;
    let streams: StdStreams = Arc::default();
    let shared = Arc::clone(&streams);
    thread::spawn(move || {
        let mut next_id = 0u64;
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            next_id += 1;
            let id = next_id;
            let Ok(clone) = stream.try_clone() else {
                continue;
            };
            lock(&shared).insert(id, clone);
            let shared = Arc::clone(&shared);
            thread::spawn(move || {
                let mut buffer = [0u8; 64];
                while matches!(stream.read(&mut buffer), Ok(read) if read > 0) {
                    if stream.write_all(&id.to_le_bytes()).is_err() {
                        break;
                    }
                }
                // Abortive, like net-io-blocking's close for a kill.
                let _ = socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO));
                lock(&shared).remove(&id);
            });
        }
    });
    Ok((address, streams))
}

/// The std yardstick's kill: shut the read side, which wakes the connection's thread from its `read`.
fn kill_std(streams: &StdStreams, id: u64) -> bool {
    lock(streams)
        .get(&id)
        .is_some_and(|stream| stream.shutdown(Shutdown::Read).is_ok())
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The kill load (see the module documentation); `kill` ends the connection with the server's id.
fn measure_kill(
    address: SocketAddr,
    connections: usize,
    kill: impl Fn(u64) -> bool,
) -> io::Result<String> {
    let mut latencies = Vec::with_capacity(connections);
    let mut calls = Vec::with_capacity(connections);
    let (mut resets, mut ends, mut timeouts, mut others, mut refused_kills) = (0, 0, 0, 0, 0);
    for _ in 0..connections {
        let (mut stream, id) = connect_served(address)?;
        let started = Instant::now();
        let killed = kill(id);
        let called = started.elapsed();
        let mut byte = [0u8; 1];
        let outcome = stream.read(&mut byte);
        let elapsed = started.elapsed();
        if !killed {
            refused_kills += 1;
        }
        match outcome {
            Err(error) if error.kind() == ErrorKind::ConnectionReset => resets += 1,
            Ok(0) => ends += 1,
            Err(error) if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                timeouts += 1;
                continue;
            }
            _ => {
                others += 1;
                continue;
            }
        }
        latencies.push(micros(elapsed));
        calls.push(micros(called));
    }
    let spread = Percentiles::of(&mut latencies);
    let call = Percentiles::of(&mut calls);
    Ok(format!(
        "n={} p50_us={:.1} p99_us={:.1} max_us={:.1} call_p99_us={:.1} reset={resets} eof={ends} \
         timeout={timeouts} other={others} kill_false={refused_kills}",
        latencies.len(),
        spread.p50,
        spread.p99,
        spread.max,
        call.p99
    ))
}

/// The door load (see the module documentation).
fn measure_door(
    server: &Server,
    admissions: &Arc<Admissions>,
    samples: usize,
    pause: Duration,
) -> io::Result<String> {
    let handle = server.handle();
    let address = server.local_addr();
    let stop = Arc::new(AtomicBool::new(false));
    let connects = Arc::new(AtomicU64::new(0));
    let failures = Arc::new(AtomicU64::new(0));
    let arrivals = {
        let stop = Arc::clone(&stop);
        let connects = Arc::clone(&connects);
        let failures = Arc::clone(&failures);
        thread::spawn(move || {
            while !stop.load(Ordering::Acquire) {
                match TcpStream::connect(address) {
                    Ok(stream) => {
                        // An RST close keeps the client's ports out of TIME_WAIT across tens of
                        // thousands of connects.
                        let _ = socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO));
                        connects.fetch_add(1, Ordering::Relaxed);
                        if !pause.is_zero() {
                            thread::sleep(pause);
                        }
                    }
                    Err(_) => {
                        failures.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        })
    };
    let started = Instant::now();
    let mut latencies = Vec::with_capacity(samples);
    let mut calls = Vec::with_capacity(samples);
    let (mut late, mut reopen_failures) = (0u64, 0u64);
    for _ in 0..samples {
        let before = admissions.count.load(Ordering::Acquire);
        handle.open_door();
        let reopened = wait_until(Duration::from_secs(1), || {
            admissions.count.load(Ordering::Acquire) > before
        });
        if !reopened {
            reopen_failures += 1;
            continue;
        }
        thread::sleep(Duration::from_millis(2));
        let closed_at = admissions.since_base();
        let call_started = Instant::now();
        handle.close_door();
        calls.push(micros(call_started.elapsed()));
        thread::sleep(Duration::from_millis(10));
        let settled = admissions.count.load(Ordering::Acquire);
        thread::sleep(Duration::from_millis(5));
        late += admissions.count.load(Ordering::Acquire) - settled;
        let last = admissions.last_nanoseconds.load(Ordering::Acquire);
        latencies.push(last.saturating_sub(closed_at) as f64 / 1_000.0);
    }
    stop.store(true, Ordering::Release);
    handle.open_door();
    let _ = arrivals.join();
    let seconds = started.elapsed().as_secs_f64();
    let connected = connects.load(Ordering::Relaxed);
    let spread = Percentiles::of(&mut latencies);
    let call = Percentiles::of(&mut calls);
    Ok(format!(
        "n={} p50_us={:.1} p99_us={:.1} max_us={:.1} call_p99_us={:.1} late={late} reopen_failed={reopen_failures} \
         arrival_gap_us={:.1} connect_failed={} pause_us={}",
        latencies.len(),
        spread.p50,
        spread.p99,
        spread.max,
        call.p99,
        if connected == 0 {
            f64::NAN
        } else {
            seconds * 1e6 / connected as f64
        },
        failures.load(Ordering::Relaxed),
        pause.as_micros()
    ))
}

/// The drain load (see the module documentation).
/// With `Load::Shutdown`, the same through `Server::shutdown`: its idle closes carry `Shutdown`, which is
/// abortive (an RST, no linger), and the call also joins every thread.
fn measure_drain(server: Server, connections: usize, load: Load) -> io::Result<String> {
    let handle = server.handle();
    let mut client = Holder::start(server.local_addr(), connections)?;
    let ready = client.expect("ready")?;
    let opened = field(&ready, "opened").unwrap_or(0);
    wait_until(Duration::from_secs(5), || {
        handle.open_connections() >= opened
    });
    let open_before = handle.open_connections();
    client.send("go")?;
    let started = Instant::now();
    let (report, still_running) = if load == Load::Shutdown {
        (server.shutdown(started + DRAIN_DEADLINE), None)
    } else {
        (handle.drain(started + DRAIN_DEADLINE), Some(server))
    };
    let returned = started.elapsed();
    let closed = client.expect("closed")?;
    drop(client);
    if let Some(server) = still_running {
        let _ = server.shutdown(Instant::now() + Duration::from_secs(2));
    }
    Ok(format!(
        "n={opened} open={open_before} drain_ms={:.2} call_ms={:.2} graceful={} killed={} \
         client_first_ms={} client_last_ms={} eof={} reset={} unclosed={}",
        report.elapsed.as_secs_f64() * 1e3,
        returned.as_secs_f64() * 1e3,
        report.graceful,
        report.killed,
        text_field(&closed, "first_ms").unwrap_or("nan"),
        text_field(&closed, "last_ms").unwrap_or("nan"),
        field(&closed, "eof").unwrap_or(0),
        field(&closed, "reset").unwrap_or(0),
        field(&closed, "unclosed").unwrap_or(0),
    ))
}

/// The idle load (see the module documentation).
fn measure_idle(server: &Server, connections: usize, window: Duration) -> io::Result<String> {
    let handle = server.handle();
    let mut client = Holder::start(server.local_addr(), connections)?;
    let ready = client.expect("ready")?;
    let opened = field(&ready, "opened").unwrap_or(0);
    wait_until(Duration::from_secs(5), || {
        handle.open_connections() >= opened
    });
    thread::sleep(IDLE_SETTLE);
    let before = thread_usage()?;
    let started = Instant::now();
    thread::sleep(window);
    let after = thread_usage()?;
    let seconds = started.elapsed().as_secs_f64();
    let open = handle.open_connections();
    drop(client);
    let mut cpu_nanoseconds = 0u64;
    let mut switches = 0u64;
    let mut woken_threads = 0usize;
    // The CPU the server threads used since they started: shows the reading works when the window's is 0.
    let lifetime_nanoseconds: u64 = after.values().map(|usage| usage.cpu_nanoseconds).sum();
    for (thread_id, usage) in &after {
        let earlier = before.get(thread_id).copied().unwrap_or_default();
        let switched = usage.switches.saturating_sub(earlier.switches);
        cpu_nanoseconds += usage
            .cpu_nanoseconds
            .saturating_sub(earlier.cpu_nanoseconds);
        switches += switched;
        if switched > 0 {
            woken_threads += 1;
        }
    }
    Ok(format!(
        "n={opened} open={open} threads={} window_ms={:.0} cpu_us={:.1} cpu_share={:.6} switches={switches} \
         switches_per_s={:.2} woken_threads={woken_threads} lifetime_cpu_ms={:.1}",
        after.len(),
        seconds * 1e3,
        cpu_nanoseconds as f64 / 1e3,
        cpu_nanoseconds as f64 / 1e9 / seconds,
        switches as f64 / seconds,
        lifetime_nanoseconds as f64 / 1e6,
    ))
}

/// One thread's CPU time and context switches so far.
#[derive(Debug, Clone, Copy, Default)]
struct ThreadUsage {
    cpu_nanoseconds: u64,
    switches: u64,
}

/// Every thread of this process but the main one, by thread id.
fn thread_usage() -> io::Result<HashMap<u32, ThreadUsage>> {
    let main_thread = std::process::id();
    let mut usage = HashMap::new();
    for entry in fs::read_dir("/proc/self/task")? {
        let entry = entry?;
        let Some(thread_id) = entry
            .file_name()
            .to_str()
            .and_then(|name| name.parse::<u32>().ok())
        else {
            continue;
        };
        if thread_id == main_thread {
            continue;
        }
        // A thread may end between the listing and the reads; it then simply has no figures.
        let Ok(schedstat) = fs::read_to_string(entry.path().join("schedstat")) else {
            continue;
        };
        let Ok(status) = fs::read_to_string(entry.path().join("status")) else {
            continue;
        };
        let cpu_nanoseconds = schedstat
            .split_whitespace()
            .next()
            .and_then(|word| word.parse().ok())
            .unwrap_or(0);
        let switches = status
            .lines()
            .filter(|line| line.contains("ctxt_switches:"))
            .filter_map(|line| line.split_whitespace().nth(1)?.parse::<u64>().ok())
            .sum();
        usage.insert(
            thread_id,
            ThreadUsage {
                cpu_nanoseconds,
                switches,
            },
        );
    }
    Ok(usage)
}

/// The child process that holds the idle connections, and its pipes.
struct Holder {
    child: Child,
    input: Option<ChildStdin>,
    output: BufReader<ChildStdout>,
}

impl Holder {
    fn start(address: SocketAddr, connections: usize) -> io::Result<Holder> {
        let mut child = Command::new(std::env::current_exe()?)
            .args([
                "client",
                "--addr",
                &address.to_string(),
                "--connections",
                &connections.to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let input = child.stdin.take();
        let output = child
            .stdout
            .take()
            .map(BufReader::new)
            .ok_or_else(|| io::Error::other("the client child has no standard output"))?;
        Ok(Holder {
            child,
            input,
            output,
        })
    }

    /// Reads lines until one starts with `word`; an end of file is an error.
    fn expect(&mut self, word: &str) -> io::Result<String> {
        let mut line = String::new();
        loop {
            line.clear();
            if self.output.read_line(&mut line)? == 0 {
                return Err(io::Error::other(format!(
                    "the client child ended before it printed `{word}`"
                )));
            }
            if line.starts_with(word) {
                return Ok(line.trim().to_owned());
            }
        }
    }

    fn send(&mut self, line: &str) -> io::Result<()> {
        let input = self
            .input
            .as_mut()
            .ok_or_else(|| io::Error::other("the client child's input is closed"))?;
        input.write_all(format!("{line}\n").as_bytes())?;
        input.flush()
    }
}

/// Closing the child's input ends it; dropping the holder waits for that.
impl Drop for Holder {
    fn drop(&mut self) {
        drop(self.input.take());
        let _ = self.child.wait();
    }
}

/// The child: opens the connections, prints `ready opened=N failed=F`, then on `go` waits for every close
/// and prints `closed ...`; an end of file on its input ends it with the connections still open.
fn run_client(options: &ClientOptions) -> io::Result<()> {
    raise_descriptor_limit()?;
    let mut streams = Vec::with_capacity(options.connections);
    let mut failed = 0usize;
    for _ in 0..options.connections {
        match connect_served(options.address) {
            Ok((stream, _)) => streams.push(stream),
            Err(_) => failed += 1,
        }
    }
    // Registered before `ready`: ten thousand registrations take tens of milliseconds, which would
    // otherwise land inside the measured drain.
    let epoll = Epoll::new()?;
    for (index, stream) in streams.iter().enumerate() {
        stream.set_nonblocking(true)?;
        epoll.add(stream.as_fd(), index as u64, Interest::READABLE)?;
    }
    println!("ready opened={} failed={failed}", streams.len());
    io::stdout().flush()?;
    let mut line = String::new();
    if io::stdin().lock().read_line(&mut line)? == 0 || line.trim() != "go" {
        return Ok(());
    }
    let started = Instant::now();
    let mut open: Vec<Option<TcpStream>> = streams.into_iter().map(Some).collect();
    let mut left = open.len();
    let (mut ends, mut resets) = (0usize, 0usize);
    let mut first = None;
    let mut last = Duration::ZERO;
    let mut events = Events::with_capacity(1024);
    let deadline = started + DRAIN_DEADLINE + Duration::from_secs(5);
    let mut byte = [0u8; 64];
    while left > 0 && Instant::now() < deadline {
        epoll.wait(&mut events, Some(Duration::from_millis(100)))?;
        for event in events.iter() {
            let Some(slot) = open.get_mut(event.token as usize) else {
                continue;
            };
            let Some(stream) = slot.as_mut() else {
                continue;
            };
            let closed = match stream.read(&mut byte) {
                Ok(0) => {
                    ends += 1;
                    true
                }
                Ok(_) => false,
                Err(error) if error.kind() == ErrorKind::WouldBlock => false,
                Err(_) => {
                    resets += 1;
                    true
                }
            };
            if closed {
                last = started.elapsed();
                first.get_or_insert(last);
                if let Some(stream) = slot.take() {
                    let _ = epoll.delete(stream.as_fd());
                }
                left -= 1;
            }
        }
    }
    println!(
        "closed eof={ends} reset={resets} unclosed={left} first_ms={:.2} last_ms={:.2}",
        first.map_or(f64::NAN, |first| first.as_secs_f64() * 1e3),
        last.as_secs_f64() * 1e3
    );
    io::stdout().flush()?;
    // Wait for the server to say it is done, so the open sockets outlive the measurement.
    let _ = io::stdin().lock().read_line(&mut line);
    Ok(())
}

/// Polls `done` every 100 µs until it holds or `timeout` passes; returns whether it held.
fn wait_until(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if done() {
            return true;
        }
        thread::sleep(Duration::from_micros(100));
    }
    done()
}

fn micros(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e6
}

/// The median, 99th percentile and maximum of some samples (NaN for none).
#[derive(Debug, Clone, Copy)]
struct Percentiles {
    p50: f64,
    p99: f64,
    max: f64,
}

impl Percentiles {
    fn of(samples: &mut [f64]) -> Percentiles {
        if samples.is_empty() {
            return Percentiles {
                p50: f64::NAN,
                p99: f64::NAN,
                max: f64::NAN,
            };
        }
        samples.sort_by(f64::total_cmp);
        // The nearest-rank percentile: the smallest sample with at least q of them at or below it.
        let rank = |quantile: f64| {
            let index = (quantile * samples.len() as f64).ceil() as usize;
            samples[index.clamp(1, samples.len()) - 1]
        };
        Percentiles {
            p50: rank(0.50),
            p99: rank(0.99),
            max: samples[samples.len() - 1],
        }
    }
}

/// A numeric `key=value` field of a line.
fn field(line: &str, key: &str) -> Option<usize> {
    text_field(line, key)?.parse().ok()
}

/// A `key=value` field of a line, as text.
fn text_field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .filter_map(|word| word.split_once('='))
        .find(|(name, _)| *name == key)
        .map(|(_, value)| value)
}
