//! Admission before any read: the global cap, the per-source cap and the Busy rule of the hand-over queue.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::echo::{Echo, echo_server, echo_server_on};
use common::{Recorder, SOON, UnwantedClient, client, eventually, round_trip};
use net_io_blocking::{
    CoalescedKind, ConnectionInfo, Event, Limits, RefusalCause, ServerBuilder, SessionDriver,
};

fn refusals(recorder: &Recorder) -> Vec<RefusalCause> {
    recorder
        .events()
        .into_iter()
        .filter_map(|event| match event {
            Event::Refused { cause, .. } => Some(cause),
            _ => None,
        })
        .collect()
}

#[test]
fn with_one_worker_the_second_connection_is_busy_and_the_third_is_served_after_the_first_closes() {
    let recorder = Recorder::default();
    // The Busy rule belongs to the worker pool; event loops have no worker to be busy.
    let server = echo_server_on(
        SessionDriver::Threads,
        1,
        Limits::new().max_connections(4).max_per_source(4),
        &recorder,
    );
    let mut first = client(server.local_addr());
    assert_eq!(round_trip(&mut first, b"one"), b"one");
    let mut second = UnwantedClient::connect(server.local_addr());
    assert!(
        second.is_closed_by_server(),
        "the second connection should be reset while the only worker is busy"
    );
    assert_eq!(refusals(&recorder), vec![RefusalCause::Busy]);
    drop(first);
    assert!(
        eventually(SOON, || recorder.closes().len() == 1),
        "the first connection should close"
    );
    let mut third = client(server.local_addr());
    assert_eq!(
        round_trip(&mut third, b"three"),
        b"three",
        "the third connection should be served once the worker is free"
    );
    assert_eq!(server.stats().refused_by(RefusalCause::Busy), 1);
}

#[test]
fn the_global_cap_refuses_before_reading_and_frees_its_slot_at_close() {
    let recorder = Recorder::default();
    let server = echo_server(
        4,
        Limits::new().max_connections(2).max_per_source(2),
        &recorder,
    );
    let mut first = client(server.local_addr());
    let mut second = client(server.local_addr());
    assert_eq!(round_trip(&mut first, b"a"), b"a");
    assert_eq!(round_trip(&mut second, b"b"), b"b");
    let mut third = UnwantedClient::connect(server.local_addr());
    third.send(b"never read");
    assert!(
        third.is_closed_by_server(),
        "the third connection passed the global cap"
    );
    assert_eq!(refusals(&recorder), vec![RefusalCause::GlobalCap]);
    assert_eq!(server.handle().open_connections(), 2);
    drop(first);
    assert!(eventually(SOON, || server.handle().open_connections() == 1));
    let mut fourth = client(server.local_addr());
    assert_eq!(
        round_trip(&mut fourth, b"d"),
        b"d",
        "a freed slot should admit again"
    );
}

#[test]
fn the_per_source_cap_refuses_a_third_connection_from_one_address() {
    let recorder = Recorder::default();
    let server = echo_server(
        4,
        Limits::new().max_connections(4).max_per_source(2),
        &recorder,
    );
    let mut first = client(server.local_addr());
    let mut second = client(server.local_addr());
    assert_eq!(round_trip(&mut first, b"a"), b"a");
    assert_eq!(round_trip(&mut second, b"b"), b"b");
    let mut third = UnwantedClient::connect(server.local_addr());
    assert!(
        third.is_closed_by_server(),
        "the per-source cap let a third connection in"
    );
    assert_eq!(refusals(&recorder), vec![RefusalCause::SourceCap]);
    let stats = server.stats();
    assert_eq!(stats.refused_by(RefusalCause::SourceCap), 1);
    assert_eq!(stats.accepted, 3);
    drop((first, second));
    assert!(eventually(SOON, || server.stats().closed == 2));
}

#[test]
fn a_closed_door_accepts_nothing_and_opening_it_serves_the_waiting_connection() {
    let recorder = Recorder::default();
    let server = ServerBuilder::new()
        .session_driver(common::session_driver())
        .listen("127.0.0.1:0")
        .workers(2)
        .events(recorder.clone())
        .open_door_at_build(false)
        .sessions(|_info: &ConnectionInfo| Some(Echo))
        .allow_all()
        .build()
        .unwrap();
    let handle = server.handle();
    assert!(!handle.is_door_open());
    let mut waiting = client(server.local_addr());
    waiting.write_all(b"early").unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        server.stats().accepted,
        0,
        "a closed door accepted a connection"
    );
    handle.open_door();
    handle.open_door();
    let mut reply = [0u8; 5];
    std::io::Read::read_exact(&mut waiting, &mut reply).unwrap();
    assert_eq!(
        &reply, b"early",
        "the backlog connection should be served after the door opens"
    );
}

/// Puts the first connection in lane 5 and every later one in lane 0.
struct LaneByOrder {
    admitted: std::sync::atomic::AtomicUsize,
}

impl net_io_blocking::Gate for LaneByOrder {
    type Ticket = ();

    fn admit(
        &self,
        _info: &ConnectionInfo,
    ) -> Result<net_io_core::Admission<()>, net_io_core::Refusal> {
        let order = self
            .admitted
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(net_io_core::Admission {
            ticket: (),
            lane: net_io_core::Lane(if order == 0 { 5 } else { 0 }),
        })
    }
}

#[test]
fn shedding_closes_idle_connections_in_shed_lanes_and_spares_lower_lanes() {
    let recorder = Recorder::default();
    let control = std::sync::Arc::new(net_io_blocking::ControlLine::new());
    let server = common::test_builder(4, Limits::new(), &recorder)
        .control(std::sync::Arc::clone(&control))
        .sessions(|_info: &ConnectionInfo| Some(Echo))
        .gate(LaneByOrder {
            admitted: std::sync::atomic::AtomicUsize::new(0),
        })
        .build()
        .unwrap();
    let mut high = client(server.local_addr());
    assert_eq!(round_trip(&mut high, b"h"), b"h");
    let mut low = client(server.local_addr());
    assert_eq!(round_trip(&mut low, b"l"), b"l");
    control.set(net_io_blocking::ControlState::Shed {
        lane: net_io_core::Lane(5),
    });
    let closes = recorder.wait_for_closes(1, SOON);
    assert_eq!(closes[0].1, net_io_blocking::CloseReason::Shed);
    assert!(
        common::is_closed_by_server(&mut high),
        "the lane-5 connection stayed open"
    );
    assert_eq!(
        round_trip(&mut low, b"still"),
        b"still",
        "the lane-0 connection was shed"
    );
    assert_eq!(recorder.closes().len(), 1);
}

#[test]
fn an_ipv6_loopback_listener_serves_and_reports_its_address() {
    let recorder = Recorder::default();
    let server = ServerBuilder::new()
        .session_driver(common::session_driver())
        .listen("[::1]:0")
        .workers(1)
        .limits(Limits::new().min_rate(None))
        .events(recorder.clone())
        .sessions(|_info: &ConnectionInfo| Some(Echo))
        .allow_all()
        .build()
        .expect("an IPv6 loopback listener should start");
    assert!(server.local_addr().is_ipv6());
    let mut stream = client(server.local_addr());
    assert_eq!(round_trip(&mut stream, b"six"), b"six");
}

/// Connects `count` times to `address`, dropping each connection at once. The server is expected to refuse
/// each with an RST, which may reach the client before its `connect` returns.
fn flood(address: std::net::SocketAddr, count: u64) -> Duration {
    let started = Instant::now();
    for attempt in 0..count {
        match TcpStream::connect(address) {
            Ok(refused) => drop(refused),
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => {}
            Err(error) => panic!("connect {attempt} of the flood failed: {error}"),
        }
    }
    started.elapsed()
}

/// The refusals the sink saw one by one, and those it was told of in `Coalesced` counts.
fn reported_refusals(recorder: &Recorder) -> (u64, u64) {
    let events = recorder.events();
    let passed = events
        .iter()
        .filter(|event| matches!(event, Event::Refused { .. }))
        .count() as u64;
    let folded = events
        .iter()
        .filter_map(|event| match event {
            Event::Coalesced {
                kind: CoalescedKind::Refused,
                count,
            } => Some(*count),
            _ => None,
        })
        .sum();
    (passed, folded)
}

/// Waits until every one of `flood` refusals was reported, one by one or folded (nothing connects or closes
/// meanwhile: the count folded in the flood's last second must still come once that second is over), and
/// checks that the sink was spared most of them.
fn assert_every_refusal_reported_and_most_folded(recorder: &Recorder, flood: u64, took: Duration) {
    assert!(
        eventually(SOON, || {
            let (passed, folded) = reported_refusals(recorder);
            passed + folded == flood
        }),
        "every refusal of the flood ({flood} in {took:?}) should be reported, one by one or in a Coalesced \
         count, after the flood stopped; reported (one by one, folded): {:?}",
        reported_refusals(recorder)
    );
    let (passed, folded) = reported_refusals(recorder);
    assert!(
        folded > 0 && passed < flood,
        "a flood of {flood} refusals in {took:?} should pass at most 1,000 a second to the sink and fold the \
         rest, but {passed} passed and {folded} were folded"
    );
}

#[test]
fn a_flood_of_refusals_folds_past_a_thousand_a_second_and_its_count_arrives_after_the_flood_stops()
{
    const FLOOD: u64 = 3_000;
    let recorder = Recorder::default();
    let server = echo_server(
        2,
        Limits::new().max_connections(1).max_per_source(1),
        &recorder,
    );
    let mut holder = client(server.local_addr());
    assert_eq!(round_trip(&mut holder, b"hold"), b"hold");
    let took = flood(server.local_addr(), FLOOD);
    assert!(
        eventually(SOON, || server.stats().refused_by(RefusalCause::GlobalCap)
            == FLOOD),
        "every connection of the flood should be refused at the global cap, but {} were",
        server.stats().refused_by(RefusalCause::GlobalCap)
    );
    assert_every_refusal_reported_and_most_folded(&recorder, FLOOD, took);
    assert_eq!(
        round_trip(&mut holder, b"still"),
        b"still",
        "the connection admitted before the flood should still be served"
    );
}

#[test]
fn a_flood_of_refusals_after_admission_is_folded_and_reported_after_it_stops_on_both_session_drivers()
 {
    const FLOOD: u64 = 3_000;
    for driver in [
        SessionDriver::Threads,
        SessionDriver::EventLoop { loops: 2 },
    ] {
        let recorder = Recorder::default();
        // Admitted at accept, then declined by the factory: a refusal the serving thread reports. Caps as
        // large as the flood: connections admitted and not yet declined count against them, and with the
        // defaults (16 per source, 16 on 16 workers) a serving thread that a loaded machine held back left
        // most of the flood refused at a cap on the accept thread, never reaching the factory.
        let caps = Limits::new()
            .max_connections(FLOOD as usize)
            .max_per_source(FLOOD as usize);
        let server = common::test_builder(16, caps, &recorder)
            .session_driver(driver)
            .sessions(|_info: &ConnectionInfo| None::<Echo>)
            .allow_all()
            .build()
            .expect("the test server should start");
        let took = flood(server.local_addr(), FLOOD);
        // With worker threads some are refused as Busy at accept when every worker is taken; most reach
        // a worker (or a loop) and are refused after admission.
        assert!(
            eventually(SOON, || server.stats().refused == FLOOD),
            "{driver:?}: every connection of the flood should be refused, but {} were",
            server.stats().refused
        );
        let after_admission = server.stats().refused_by(RefusalCause::Session);
        assert!(
            after_admission > 1_000,
            "{driver:?}: more than 1,000 of the flood should reach the factory, so that the serving threads' \
             refusals fold too, but {after_admission} did"
        );
        assert_every_refusal_reported_and_most_folded(&recorder, FLOOD, took);
    }
}
