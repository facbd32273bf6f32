//! A kill racing a graceful close is never lost, on every driver: sessions on event loops and on worker
//! threads, handlers on worker threads and on coroutines.
//!
//! The close is graceful with input left unread, so it lingers; a kill that lands anywhere from before the
//! close was decided to well into the linger either wins (the close is `Killed`) or cuts the linger short
//! (the close keeps its reason and ends with an RST at once). Lost would mean it did neither, and the linger
//! ran its full course.

mod common;

use std::io::Write;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::sessions::{CloseWhenFull, READ_BEFORE_CLOSE};
use common::{Recorder, SOON, client, eventually, test_builder};
use net_io_blocking::{
    CloseReason, ConnectionInfo, DEFAULT_WORKERS, HandlerDriver, Limits, NetError, Server,
    SessionDriver, TcpConnection,
};

/// One race at a time: each holds a loop or a worker busy and times its closes.
static TURN: Mutex<()> = Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Reads exactly `READ_BEFORE_CLOSE` bytes, then returns (a graceful close with input left unread).
fn read_then_return(connection: &mut TcpConnection<'_>) -> Result<(), NetError> {
    let mut buffer = vec![0u8; READ_BEFORE_CLOSE];
    let mut filled = 0;
    while filled < READ_BEFORE_CLOSE {
        let count = connection.read(&mut buffer[filled..])?;
        if count == 0 {
            return Ok(());
        }
        filled += count;
    }
    Ok(())
}

fn limits(linger: Duration) -> Limits {
    Limits::new()
        .min_rate(None)
        .read_buffer(READ_BEFORE_CLOSE)
        .linger_timeout(linger)
}

fn session_server(driver: SessionDriver, linger: Duration, recorder: &Recorder) -> Server {
    test_builder(DEFAULT_WORKERS, limits(linger), recorder)
        .session_driver(driver)
        .sessions(|_: &ConnectionInfo| Some(CloseWhenFull))
        .allow_all()
        .build()
        .expect("the session server should start")
}

fn handler_server(driver: HandlerDriver, linger: Duration, recorder: &Recorder) -> Server {
    test_builder(DEFAULT_WORKERS, limits(linger), recorder)
        .handler_driver(driver)
        .handler(read_then_return)
        .allow_all()
        .build()
        .expect("the handler server should start")
}

/// Takes the turn and races [`ATTEMPTS`] kills against graceful closes (lingering up to [`LINGER`]) on the
/// server `start` makes with the recorder it is given.
fn race_on(start: impl FnOnce(&Recorder) -> Server) {
    let _turn = turn();
    let recorder = Recorder::default();
    let server = start(&recorder);
    race(server, &recorder, LINGER, ATTEMPTS);
}

/// Races `attempts` kills against graceful closes on `server` and checks that none is lost.
fn race(server: Server, recorder: &Recorder, linger: Duration, attempts: u64) {
    let handle = server.handle();
    let (mut won, mut cut) = (0u64, 0u64);
    for attempt in 0..attempts {
        let mut stream = client(server.local_addr());
        assert!(
            eventually(SOON, || recorder.admitted().len() as u64 == attempt + 1),
            "attempt {attempt}: the connection was not admitted"
        );
        let id = *recorder.admitted().last().expect("an admitted id");
        // A kill finds only a connection a worker or a loop holds (one still queued is not killable yet).
        assert!(
            eventually(SOON, || handle.connections().contains(&id)),
            "attempt {attempt}: no worker or loop took the connection"
        );
        // More than the server reads: its graceful close finds input left and lingers on it. The kill
        // lands anywhere from before the close was decided to well into the linger.
        stream
            .write_all(&vec![b'x'; READ_BEFORE_CLOSE + 1000])
            .unwrap();
        let delay = Duration::from_micros(attempt % 200);
        let start = Instant::now();
        while start.elapsed() < delay {
            std::hint::spin_loop();
        }
        let killed_at = Instant::now();
        let kill_won = handle.kill(id, 9);
        assert!(
            eventually(SOON, || recorder.closes().len() as u64 == attempt + 1),
            "attempt {attempt}: the connection did not close"
        );
        let closed_after = killed_at.elapsed();
        let (closed_id, reason) = *recorder.closes().last().expect("a close");
        assert_eq!(
            closed_id, id,
            "attempt {attempt}: another connection closed"
        );
        if kill_won {
            won += 1;
            assert_eq!(
                reason,
                CloseReason::Killed(9),
                "attempt {attempt}: a won kill"
            );
        } else {
            cut += 1;
            assert_eq!(
                reason,
                CloseReason::SessionClosed,
                "attempt {attempt}: a kill that lost to the close keeps the close's reason"
            );
        }
        // Lost would mean: the kill neither won nor cut the linger, which then ran its full course.
        assert!(
            closed_after < linger / 2,
            "attempt {attempt} (kill {delay:?} after the write): the close came {closed_after:?} after a kill \
             that returned {kill_won}: the kill was lost and the {linger:?} linger ran out"
        );
        drop(stream);
    }
    println!("{attempts} kills racing a graceful close: {won} won, {cut} cut the close short");
    drop(server);
}

const ATTEMPTS: u64 = 600;
const LINGER: Duration = Duration::from_secs(3);

#[test]
fn a_kill_racing_a_graceful_close_is_never_lost_on_an_event_loop() {
    race_on(|recorder| session_server(SessionDriver::EventLoop { loops: 1 }, LINGER, recorder));
}

#[test]
fn a_kill_racing_a_graceful_close_is_never_lost_on_session_worker_threads() {
    race_on(|recorder| session_server(SessionDriver::Threads, LINGER, recorder));
}

#[test]
fn a_kill_racing_a_graceful_close_is_never_lost_on_handler_worker_threads() {
    race_on(|recorder| handler_server(HandlerDriver::Threads, LINGER, recorder));
}

#[test]
fn a_kill_racing_a_graceful_close_is_never_lost_on_handler_coroutines() {
    race_on(|recorder| handler_server(HandlerDriver::Coroutines { loops: 1 }, LINGER, recorder));
}
