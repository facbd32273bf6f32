//! An echo server with a blocking handler: `cargo run -p net-io-blocking --example echo -- --addr 127.0.0.1:7000`.

use net_io_blocking::{NetError, TcpConnection};
use net_io_sys::termination::TerminationSignals;

#[path = "common/mod.rs"]
mod common;

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
    let flags = common::Flags::parse(std::env::args().skip(1))?;
    // Blocked before any thread starts, so every thread inherits the mask and the signal waits for us.
    let signals = TerminationSignals::block()?;
    let server = flags.server_builder().handler(echo).allow_all().build()?;
    common::serve_until_signalled(server, signals);
    Ok(())
}
