//! An echo server with a sans-IO session: `cargo run -p net-io-blocking --example echo_sessions -- --addr 127.0.0.1:7000`.

use std::time::{Duration, Instant};

use net_io_blocking::{
    ConnectionInfo, Input, Limits, ServerBuilder, Session, SessionContext, Step,
};
use net_io_sys::termination::TerminationSignals;

#[path = "common/flags.rs"]
mod flags;

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
    let flags = flags::Flags::parse(std::env::args().skip(1))?;
    let signals = TerminationSignals::block()?;
    let mut limits = Limits::new();
    if let Some(max) = flags.max_connections {
        limits = limits.max_connections(max);
    }
    let server = ServerBuilder::new()
        .listen(flags.address)
        .workers(flags.workers)
        .limits(limits)
        .sessions(|_info: &ConnectionInfo| Some(Echo))
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
