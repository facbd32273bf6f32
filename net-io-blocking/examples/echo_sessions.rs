//! An echo server with a sans-IO session: `cargo run -p net-io-blocking --example echo_sessions -- --addr 127.0.0.1:7000`.

use net_io_blocking::{ConnectionInfo, Input, Session, SessionContext, Step};
use net_io_sys::termination::TerminationSignals;

#[path = "common/mod.rs"]
mod common;

/// Echoes whatever arrives, as much as the output budget takes per round.
struct Echo;

impl Session for Echo {
    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        let taken = context.output().push_partial(input.bytes());
        input.consume(taken);
        Step::Write
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let flags = common::Flags::parse(std::env::args().skip(1))?;
    // Blocked before any thread starts, so every thread inherits the mask and the signal waits for us.
    let signals = TerminationSignals::block()?;
    let server = flags
        .server_builder()
        .sessions(|_info: &ConnectionInfo| Some(Echo))
        .allow_all()
        .build()?;
    common::serve_until_signalled(server, signals);
    Ok(())
}
