//! What the echo examples share: their flags, the server settings taken from them, and the run until a
//! termination signal with the report printed after the drain.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use net_io_blocking::{Limits, Server, ServerBuilder};
use net_io_sys::termination::TerminationSignals;

/// How long the drain after a termination signal waits for open connections before it kills them.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// `--addr`, `--workers`, `--max-connections`.
#[derive(Debug)]
pub struct Flags {
    pub address: SocketAddr,
    pub workers: usize,
    pub max_connections: Option<usize>,
}

impl Flags {
    /// Reads the flags (without the program name); `--help` prints them and exits.
    pub fn parse(mut arguments: impl Iterator<Item = String>) -> Result<Flags, String> {
        let mut flags = Flags {
            address: "127.0.0.1:7000"
                .parse()
                .map_err(|_| "bad default address")?,
            workers: 128,
            max_connections: None,
        };
        while let Some(flag) = arguments.next() {
            let mut value = |name: &str| {
                arguments
                    .next()
                    .ok_or_else(|| format!("{name} needs a value"))
            };
            match flag.as_str() {
                "--addr" => {
                    let text = value("--addr")?;
                    flags.address = text
                        .parse()
                        .map_err(|_| format!("--addr {text} is not an IP address and port"))?;
                }
                "--workers" => {
                    let text = value("--workers")?;
                    flags.workers = text
                        .parse()
                        .map_err(|_| format!("--workers {text} is not a number"))?;
                }
                "--max-connections" => {
                    let text = value("--max-connections")?;
                    flags.max_connections = Some(
                        text.parse()
                            .map_err(|_| format!("--max-connections {text} is not a number"))?,
                    );
                }
                "--help" | "-h" => {
                    println!(
                        "flags: --addr IP:PORT (default 127.0.0.1:7000, port 0 picks one) --workers N --max-connections N"
                    );
                    std::process::exit(0);
                }
                other => return Err(format!("unknown flag {other}; try --help")),
            }
        }
        Ok(flags)
    }

    /// A server builder listening on `--addr` with `--workers` and `--max-connections` applied; the
    /// caller adds the workload and the gate.
    pub fn server_builder(&self) -> ServerBuilder {
        let mut limits = Limits::new();
        if let Some(max) = self.max_connections {
            limits = limits.max_connections(max);
        }
        ServerBuilder::new()
            .listen(self.address)
            .workers(self.workers)
            .limits(limits)
    }
}

/// Prints `listening on ADDR`, serves until SIGINT or SIGTERM reaches `signals`, drains for at most
/// `DRAIN_TIMEOUT` and prints the drain report and the server's counters.
pub fn serve_until_signalled(server: Server, signals: TerminationSignals) {
    println!("listening on {}", server.local_addr());
    let stopper = server.handle();
    std::thread::spawn(move || {
        if signals.wait().is_ok() {
            stopper.request_stop();
        }
    });
    let handle = server.handle();
    handle.wait_for_stop();
    let report = server.shutdown(Instant::now() + DRAIN_TIMEOUT);
    let stats = handle.stats();
    println!(
        "drained: {} graceful, {} killed in {:?}",
        report.graceful, report.killed, report.elapsed
    );
    println!(
        "stats: accepted {} refused {} closed {} bytes in {} out {}",
        stats.accepted, stats.refused, stats.closed, stats.bytes_in, stats.bytes_out
    );
}
