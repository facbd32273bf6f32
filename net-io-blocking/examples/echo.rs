//! An echo server with a blocking handler: `cargo run -p net-io-blocking --example echo -- --addr 127.0.0.1:7000`.

use std::time::{Duration, Instant};

use net_io_blocking::{Limits, NetError, ServerBuilder, TcpConnection};
use net_io_sys::termination::TerminationSignals;

#[path = "common/flags.rs"]
mod flags;

fn echo(connection: &mut TcpConnection<'_>) -> Result<(), NetError> {
    let mut buffer = [0u8; 4096];
    loop {
        let count = connection.read(&mut buffer)?;
        if count == 0 {
            return Ok(());
        }
        connection.write_all(&buffer[..count])?;
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let flags = flags::Flags::parse(std::env::args().skip(1))?;
    // Blocked before any thread starts, so every thread inherits the mask and the signal waits for us.
    let signals = TerminationSignals::block()?;
    let mut limits = Limits::new();
    if let Some(max) = flags.max_connections {
        limits = limits.max_connections(max);
    }
    let server = ServerBuilder::new()
        .listen(flags.address)
        .workers(flags.workers)
        .limits(limits)
        .handler(echo)
        .allow_all()
        .build()?;
    println!("listening on {}", server.local_addr());
    let stopper = server.handle();
    std::thread::spawn(move || {
        if signals.wait().is_ok() {
            stopper.request_stop();
        }
    });
    let handle = server.handle();
    handle.wait_for_stop();
    let report = server.shutdown(Instant::now() + Duration::from_secs(5));
    let stats = handle.stats();
    flags::print_report(&report);
    println!(
        "stats: accepted {} refused {} closed {} bytes in {} out {}",
        stats.accepted, stats.refused, stats.closed, stats.bytes_in, stats.bytes_out
    );
    Ok(())
}
