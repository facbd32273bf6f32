//! Echo server for `cargo xtask bench net`: one process serving 64-byte echo with a chosen stack until stdin closes.
//!
//! ```text
//! bench_server --kind std|tokio|floor|handler|handler-loop|sessions|sessions-loop [--addr 127.0.0.1:0] [--workers N] [--max-connections N]
//! ```
//!
//! It prints `listening on ADDR` once bound, serves until its standard input reaches end of file (the
//! benchmark closes it) or SIGTERM ends the process, then prints `served connections=N` and exits.
//!
//! The kinds:
//! - `std`: a thread per connection (default stack), `TCP_NODELAY`, a 4 KiB buffer on the stack; what a
//!   user writes with the standard library alone.
//! - `tokio`: a multi-thread runtime with 2 workers, a task per connection, `TCP_NODELAY`, a 4 KiB buffer
//!   in the task.
//! - `floor`: the least an epoll echo can do, as a yardstick rather than a peer: one loop thread per core,
//!   each with its own level-triggered epoll, a connection per slot, one `read` and one `write` per round
//!   trip and nothing else (no deadlines, limits, kills, gate, events or statistics). The accept thread hands
//!   connections round robin through a channel and an eventfd. A reply the socket cannot take at once closes
//!   the connection (counted and printed at exit), since 64-byte echoes never fill a send buffer.
//! - `handler` and `sessions`: net-io-blocking with a blocking handler (4 KiB buffer on the worker's stack)
//!   and with a sans-IO session, `--workers` workers (default 320, so 256 connections fit beside the ones
//!   still closing from the previous load) and `--max-connections` (default: the workers). Limits that
//!   would end the benchmark's own connections are widened: all of them come from 127.0.0.1, so the
//!   per-source cap is the global cap, and the idle timeout is 10 minutes because std and tokio have none.
//!   The read buffer is 4 KiB, like the std and tokio servers' buffer; everything else is the default.
//! - `sessions-loop`: the same session on the event-loop driver, one loop thread per core; the connection
//!   cap defaults to 8,192 there, since no worker holds a connection.
//! - `handler-loop`: the same blocking handler on `HandlerDriver::Coroutines` (a coroutine per connection
//!   over one loop thread per core, the default 256 KiB of stack address space each); the connection cap
//!   defaults to 8,192 as for `sessions-loop`.

use std::io::{self, BufRead, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use net_io_sys::epoll::{Epoll, Events, Interest};
use net_io_sys::eventfd::EventFd;

use net_io_blocking::{
    ConnectionInfo, HandlerDriver, Input, Limits, NetError, Server, ServerBuilder, Session,
    SessionContext, SessionDriver, Step, TcpConnection,
};

/// Size of the per-connection receive buffer of every kind (the net-io-blocking read buffer too).
const BUFFER_SIZE: usize = 4096;

/// The server stack to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Std,
    Tokio,
    Floor,
    Handler,
    HandlerLoop,
    Sessions,
    SessionsLoop,
}

/// The connection cap of the event-loop kind when `--max-connections` is not given.
const LOOP_MAX_CONNECTIONS: usize = 8192;

/// Workers of the net-io-blocking kinds when `--workers` is not given.
const DEFAULT_WORKERS: usize = 320;

/// Command-line options.
#[derive(Debug)]
struct Options {
    kind: Kind,
    address: SocketAddr,
    workers: Option<usize>,
    max_connections: Option<usize>,
}

fn main() -> ExitCode {
    let options = match parse_options(std::env::args().skip(1)) {
        Ok(options) => options,
        Err(message) => {
            eprintln!("bench_server: {message}");
            eprintln!(
                "usage: bench_server --kind std|tokio|floor|handler|handler-loop|sessions|sessions-loop [--addr 127.0.0.1:0] [--workers N] [--max-connections N]"
            );
            return ExitCode::from(2);
        }
    };
    let served = Arc::new(AtomicU64::new(0));
    let result = match options.kind {
        Kind::Std => run_std(&options, Arc::clone(&served)),
        Kind::Tokio => run_tokio(&options, Arc::clone(&served)),
        Kind::Floor => run_floor(&options, Arc::clone(&served)),
        Kind::Handler | Kind::HandlerLoop | Kind::Sessions | Kind::SessionsLoop => {
            run_net_io(&options, &served)
        }
    };
    match result {
        Ok(()) => {
            println!("served connections={}", served.load(Ordering::Relaxed));
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("bench_server: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Parses `--kind`, `--addr`, `--workers` and `--max-connections`.
fn parse_options(mut arguments: impl Iterator<Item = String>) -> Result<Options, String> {
    let mut kind = None;
    let mut address: SocketAddr = "127.0.0.1:0".parse().map_err(|_| "bad default address")?;
    let mut workers = None;
    let mut max_connections = None;
    while let Some(flag) = arguments.next() {
        let mut value = || {
            arguments
                .next()
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        match flag.as_str() {
            "--kind" => {
                kind = Some(match value()?.as_str() {
                    "std" => Kind::Std,
                    "tokio" => Kind::Tokio,
                    "floor" => Kind::Floor,
                    "handler" => Kind::Handler,
                    "handler-loop" => Kind::HandlerLoop,
                    "sessions" => Kind::Sessions,
                    "sessions-loop" => Kind::SessionsLoop,
                    other => return Err(format!("unknown kind `{other}`")),
                })
            }
            "--addr" => {
                let text = value()?;
                address = text
                    .parse()
                    .map_err(|_| format!("`{text}` is not an address like 127.0.0.1:0"))?;
            }
            "--workers" => workers = Some(parse_count(&value()?, "--workers")?),
            "--max-connections" => {
                max_connections = Some(parse_count(&value()?, "--max-connections")?)
            }
            other => return Err(format!("unknown flag `{other}`")),
        }
    }
    let kind = kind.ok_or("--kind is required")?;
    Ok(Options {
        kind,
        address,
        workers,
        max_connections,
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

/// Announces the bound address on stdout, where the benchmark reads it.
fn announce(address: SocketAddr) {
    println!("listening on {address}");
    // The benchmark waits for this line; without a flush it would sit in the buffer.
    let _ = io::stdout().flush();
}

/// Blocks until standard input reaches end of file, which is how the benchmark asks the server to stop.
fn wait_for_stdin_to_close() {
    let stdin = io::stdin();
    let mut line = String::new();
    let mut locked = stdin.lock();
    while matches!(locked.read_line(&mut line), Ok(read) if read > 0) {
        line.clear();
    }
}

/// Thread per connection with the standard library.
fn run_std(options: &Options, served: Arc<AtomicU64>) -> io::Result<()> {
    let listener = TcpListener::bind(options.address)?;
    announce(listener.local_addr()?);
    thread::spawn(move || {
        for stream in listener.incoming() {
            // Accept errors (EMFILE, ECONNABORTED) are per connection; keep accepting.
            let Ok(stream) = stream else { continue };
            served.fetch_add(1, Ordering::Relaxed);
            // A failed spawn (thread limit) drops the connection, as a plain std server would.
            let _ = thread::Builder::new().spawn(move || echo_std(stream));
        }
    });
    wait_for_stdin_to_close();
    Ok(())
}

fn echo_std(mut stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let mut buffer = [0u8; BUFFER_SIZE];
    loop {
        match stream.read(&mut buffer) {
            Ok(0) | Err(_) => return,
            Ok(read) => {
                if stream.write_all(&buffer[..read]).is_err() {
                    return;
                }
            }
        }
    }
}

/// Task per connection on a tokio multi-thread runtime with 2 workers (or `--workers`).
fn run_tokio(options: &Options, served: Arc<AtomicU64>) -> io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(options.workers.unwrap_or(2))
        .enable_all()
        .build()?;
    let listener = runtime.block_on(tokio::net::TcpListener::bind(options.address))?;
    announce(listener.local_addr()?);
    runtime.spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            served.fetch_add(1, Ordering::Relaxed);
            tokio::spawn(async move {
                let _ = stream.set_nodelay(true);
                let mut buffer = [0u8; BUFFER_SIZE];
                loop {
                    match stream.read(&mut buffer).await {
                        Ok(0) | Err(_) => return,
                        Ok(read) => {
                            if stream.write_all(&buffer[..read]).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    wait_for_stdin_to_close();
    runtime.shutdown_background();
    Ok(())
}

/// One loop of the `floor` kind: its epoll, the eventfd the accept thread signals, and the channel that
/// carries new connections.
struct FloorLoop {
    epoll: Epoll,
    wake: EventFd,
    incoming: Mutex<Vec<TcpStream>>,
}

/// The token of a loop's eventfd; connection tokens are slot indexes, far below it.
const FLOOR_WAKE_TOKEN: u64 = u64::MAX;

/// The bare epoll echo (see the module documentation): the kernel's cost of a round trip with no driver.
fn run_floor(options: &Options, served: Arc<AtomicU64>) -> io::Result<()> {
    let loops = options
        .workers
        .unwrap_or_else(|| thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get));
    let listener = TcpListener::bind(options.address)?;
    announce(listener.local_addr()?);
    let mut shared = Vec::with_capacity(loops);
    for _ in 0..loops {
        let floor_loop = Arc::new(FloorLoop {
            epoll: Epoll::new()?,
            wake: EventFd::new()?,
            incoming: Mutex::new(Vec::new()),
        });
        floor_loop.epoll.add(
            floor_loop.wake.as_fd(),
            FLOOR_WAKE_TOKEN,
            Interest::READABLE,
        )?;
        shared.push(floor_loop);
    }
    let overflowed = Arc::new(AtomicU64::new(0));
    for floor_loop in &shared {
        let floor_loop = Arc::clone(floor_loop);
        let overflowed = Arc::clone(&overflowed);
        thread::spawn(move || floor_serve(&floor_loop, &overflowed));
    }
    thread::spawn(move || {
        let mut next = 0;
        for stream in listener.incoming() {
            let Ok(stream) = stream else {
                continue;
            };
            if stream.set_nodelay(true).is_err() || stream.set_nonblocking(true).is_err() {
                continue;
            }
            served.fetch_add(1, Ordering::Relaxed);
            let floor_loop = &shared[next % shared.len()];
            next += 1;
            floor_loop
                .incoming
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .push(stream);
            let _ = floor_loop.wake.signal();
        }
    });
    wait_for_stdin_to_close();
    let overflowed = overflowed.load(Ordering::Relaxed);
    if overflowed > 0 {
        println!(
            "floor: {overflowed} connections closed on a reply the socket could not take at once"
        );
    }
    Ok(())
}

/// A `floor` loop thread: wait, then one read and one write per ready connection.
fn floor_serve(floor_loop: &FloorLoop, overflowed: &AtomicU64) {
    let mut events = Events::with_capacity(256);
    let mut slots: Vec<Option<TcpStream>> = Vec::new();
    let mut free: Vec<usize> = Vec::new();
    let mut buffer = [0u8; BUFFER_SIZE];
    loop {
        if floor_loop.epoll.wait(&mut events, None).is_err() {
            continue;
        }
        for event in events.iter() {
            if event.token == FLOOR_WAKE_TOKEN {
                let _ = floor_loop.wake.drain();
                let streams = std::mem::take(
                    &mut *floor_loop
                        .incoming
                        .lock()
                        .unwrap_or_else(|poisoned| poisoned.into_inner()),
                );
                for stream in streams {
                    let slot = free.pop().unwrap_or_else(|| {
                        slots.push(None);
                        slots.len() - 1
                    });
                    if floor_loop
                        .epoll
                        .add(stream.as_fd(), slot as u64, Interest::READABLE)
                        .is_ok()
                    {
                        slots[slot] = Some(stream);
                    } else {
                        free.push(slot);
                    }
                }
                continue;
            }
            let slot = event.token as usize;
            let Some(stream) = slots.get_mut(slot).and_then(Option::as_mut) else {
                continue;
            };
            let keep = match stream.read(&mut buffer) {
                Ok(0) => false,
                Ok(read) => match stream.write(&buffer[..read]) {
                    Ok(written) if written == read => true,
                    Ok(_) => {
                        overflowed.fetch_add(1, Ordering::Relaxed);
                        false
                    }
                    Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                        overflowed.fetch_add(1, Ordering::Relaxed);
                        false
                    }
                    Err(_) => false,
                },
                Err(error) => error.kind() == io::ErrorKind::WouldBlock,
            };
            if !keep {
                if let Some(stream) = slots[slot].take() {
                    let _ = floor_loop.epoll.delete(stream.as_fd());
                }
                free.push(slot);
            }
        }
    }
}

/// net-io-blocking with a blocking handler or with sessions.
fn run_net_io(options: &Options, served: &AtomicU64) -> io::Result<()> {
    let workers = options.workers.unwrap_or(DEFAULT_WORKERS);
    // No worker holds an event loop's connection, so its cap is not the worker count: a churn of
    // connect-and-reset would otherwise meet it while the loops catch up with the closes.
    let max_connections = options.max_connections.unwrap_or(
        if matches!(options.kind, Kind::SessionsLoop | Kind::HandlerLoop) {
            LOOP_MAX_CONNECTIONS
        } else {
            workers
        },
    );
    let limits = Limits::new()
        .max_connections(max_connections)
        .max_per_source(max_connections)
        .idle_timeout(Duration::from_secs(600))
        .read_buffer(BUFFER_SIZE);
    let builder = ServerBuilder::new()
        .listen(options.address)
        .workers(workers)
        .limits(limits);
    let server: Server = if options.kind == Kind::Handler {
        builder.handler(echo_handler).allow_all().build()
    } else if options.kind == Kind::HandlerLoop {
        builder
            .handler_driver(HandlerDriver::coroutines())
            .handler(echo_handler)
            .allow_all()
            .build()
    } else {
        let driver = if options.kind == Kind::SessionsLoop {
            SessionDriver::event_loop()
        } else {
            SessionDriver::Threads
        };
        builder
            .session_driver(driver)
            .sessions(|_: &ConnectionInfo| Some(EchoSession))
            .allow_all()
            .build()
    }
    .map_err(io::Error::other)?;
    announce(server.local_addr());
    wait_for_stdin_to_close();
    let stats = server.stats();
    served.store(stats.accepted, Ordering::Relaxed);
    let _ = server.shutdown(Instant::now() + Duration::from_secs(2));
    // Refusals and timeouts would mean the benchmark did not measure what it meant to; show them.
    eprintln!(
        "bench_server: accepted {} refused {} closed {} timeouts {} slow peers {} descriptor pressure {}",
        stats.accepted,
        stats.refused,
        stats.closed,
        stats.timeouts,
        stats.slow_peers,
        stats.descriptor_pressure
    );
    Ok(())
}

/// The handler: echo each read until the peer closes.
fn echo_handler(connection: &mut TcpConnection<'_>) -> Result<(), NetError> {
    let mut buffer = [0u8; BUFFER_SIZE];
    loop {
        let read = connection.read(&mut buffer)?;
        if read == 0 {
            return Ok(());
        }
        connection.write_all(&buffer[..read])?;
    }
}

/// The session: echo whatever arrives, as much as the output budget takes each time.
#[derive(Debug)]
struct EchoSession;

impl Session for EchoSession {
    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        let taken = context.output().push_partial(input.bytes());
        input.consume(taken);
        Step::Write
    }
}
