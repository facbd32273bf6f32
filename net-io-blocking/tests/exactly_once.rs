//! The exactly-once close property over seeded random client behaviour: FIN, RST, partial lines, full lines,
//! connections that stay open, kills from the test thread, and a final drain.

mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use common::{Recorder, SOON, eventually};
use net_io_blocking::{
    ConnectionInfo, Input, Limits, NetError, Session, SessionContext, Step, TcpConnection,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Echoes complete lines.
struct Lines;

impl Session for Lines {
    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        let bytes = input.bytes();
        let Some(end) = bytes.iter().position(|&byte| byte == b'\n') else {
            return Step::Read;
        };
        if context.output().push(&bytes[..=end]).is_err() {
            return Step::Abort;
        }
        input.consume(end + 1);
        Step::Write
    }
}

/// Echoes complete lines from a blocking handler.
fn lines(connection: &mut TcpConnection<'_>) -> Result<(), NetError> {
    let mut line = [0u8; 64];
    let mut filled = 0;
    loop {
        let count = connection.read(&mut line[filled..])?;
        if count == 0 {
            return Ok(());
        }
        filled += count;
        if let Some(end) = line[..filled].iter().position(|&byte| byte == b'\n') {
            connection.write_all(&line[..=end])?;
            line.copy_within(end + 1..filled, 0);
            filled -= end + 1;
        } else if filled == line.len() {
            return Ok(());
        }
    }
}

fn run_round(seed: u64, rounds: usize, handler: bool) {
    let recorder = Recorder::default();
    let builder = common::test_builder(
        6,
        Limits::new()
            .max_connections(8)
            .max_per_source(8)
            .idle_timeout(Duration::from_millis(300))
            .read_timeout(Duration::from_millis(300)),
        &recorder,
    );
    let server = if handler {
        builder
            .handler_driver(common::handler_driver())
            .handler(lines)
            .allow_all()
            .build()
    } else {
        builder
            .sessions(|_info: &ConnectionInfo| Some(Lines))
            .allow_all()
            .build()
    }
    .expect("the test server should start");
    let address = server.local_addr();
    let handle = server.handle();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut kept: Vec<TcpStream> = Vec::new();
    for round in 0..rounds {
        let Ok(mut stream) = TcpStream::connect(address) else {
            continue;
        };
        stream
            .set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        match rng.random_range(0..5) {
            0 => {
                let _ = stream.shutdown(Shutdown::Write);
            }
            1 => common::reset(stream),
            2 => {
                let _ = stream.write_all(b"partial line without end");
                if rng.random_bool(0.5) {
                    common::reset(stream);
                }
            }
            3 => {
                let _ = stream.write_all(b"full line\n");
                let mut reply = [0u8; 10];
                let _ = stream.read_exact(&mut reply);
            }
            _ => {
                let _ = stream.write_all(b"stay\n");
                kept.push(stream);
                if kept.len() > 4 {
                    let index = rng.random_range(0..kept.len());
                    drop(kept.swap_remove(index));
                }
            }
        }
        if round % 3 == 2 {
            let open = handle.connections();
            if !open.is_empty() {
                let victim = open[rng.random_range(0..open.len())];
                handle.kill(victim, 1);
            }
        }
        std::thread::sleep(Duration::from_millis(rng.random_range(0..4)));
    }
    server
        .handle()
        .drain(Instant::now() + Duration::from_millis(200));
    drop(kept);
    assert!(
        eventually(SOON, || handle.open_connections() == 0),
        "seed {seed}: connections still open after the drain"
    );
    // The drivers free a connection's caps before they emit its Closed event (so a client reconnecting on
    // the event is never refused), so the open count can reach 0 a moment before the last event is recorded.
    assert!(
        eventually(SOON, || recorder.closes().len()
            >= recorder.admitted().len()),
        "seed {seed}: fewer Closed events than admitted connections after the drain"
    );
    let admitted = recorder.admitted();
    assert!(
        admitted.len() > rounds / 2,
        "seed {seed}: only {} of {rounds} connections were admitted",
        admitted.len()
    );
    let mut closes: HashMap<_, usize> = HashMap::new();
    for (id, _reason) in recorder.closes() {
        *closes.entry(id).or_default() += 1;
    }
    for id in &admitted {
        assert_eq!(
            closes.get(id).copied().unwrap_or(0),
            1,
            "seed {seed}: admitted connection {id} closed {} times",
            closes.get(id).copied().unwrap_or(0)
        );
    }
    for id in closes.keys() {
        assert!(
            admitted.contains(id),
            "seed {seed}: connection {id} closed without being admitted"
        );
    }
    let stats = handle.stats();
    assert_eq!(
        stats.closed,
        admitted.len() as u64,
        "seed {seed}: stats count {} closes for {} admitted",
        stats.closed,
        admitted.len()
    );
    assert_eq!(
        stats.open, 0,
        "seed {seed}: stats still show open connections"
    );
    drop(server);
}

#[test]
fn every_admitted_session_connection_closes_exactly_once_under_random_client_behaviour() {
    for seed in 1..=4u64 {
        run_round(seed, 60, false);
    }
}

#[test]
fn every_admitted_handler_connection_closes_exactly_once_under_random_client_behaviour() {
    for seed in 11..=14u64 {
        run_round(seed, 60, true);
    }
}
