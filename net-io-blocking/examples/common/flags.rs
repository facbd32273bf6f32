//! Command-line flags and the final report shared by the echo examples.

use std::net::SocketAddr;

use net_io_blocking::DrainReport;

/// `--addr`, `--workers`, `--max-connections`.
#[derive(Debug)]
pub struct Flags {
    pub address: SocketAddr,
    pub workers: usize,
    pub max_connections: Option<usize>,
}

impl Flags {
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
}

pub fn print_report(report: &DrainReport) {
    println!(
        "drained: {} graceful, {} killed in {:?}",
        report.graceful, report.killed, report.elapsed
    );
}
