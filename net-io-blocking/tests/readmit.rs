//! `Gate::readmit` after a trusted PROXY header, on every driver: a gate that refuses the real client, one that
//! swaps its ticket, one that panics, the order of gate calls and events, and no readmit for a `LOCAL` header.

mod common;

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use common::echo::who_am_i;
use common::gates::admit_on_the_default_lane;
use common::{Recorder, SOON, client, read_line, read_to_close, round_trip};
use net_io_blocking::{
    Admission, CloseReason, ConnectionInfo, Event, Gate, HandlerDriver, Input, Lane, LimitKind,
    Limits, ListenerSpec, ProxyMode, Refusal, RefusalCause, Server, ServerBuilder, Session,
    SessionContext, SessionDriver, Step, TrustedProxies,
};
use net_io_core::gate::GATE_PANIC_CODE;
use net_io_core::proxy::{encode_v1, encode_v2};

/// The code the test gate refuses a blocked real client with.
const BLOCKED_CODE: u16 = 7;
/// A real client the test gate refuses.
const BLOCKED: &str = "203.0.113.66:5000";
/// A real client the test gate lets through.
const WELCOME: &str = "198.51.100.9:6000";

/// The four ways a connection can be served; readmit must behave the same on each.
#[derive(Clone, Copy, Debug)]
enum Driver {
    ThreadedHandler,
    CoroutineHandler,
    ThreadedSessions,
    EventLoopSessions,
}

const DRIVERS: [Driver; 4] = [
    Driver::ThreadedHandler,
    Driver::CoroutineHandler,
    Driver::ThreadedSessions,
    Driver::EventLoopSessions,
];

/// What the test gate does in `readmit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Readmit {
    /// Refuse `BLOCKED` with a reset, keep everyone else.
    RefuseBlocked,
    /// Refuse `BLOCKED` with a reply, keep everyone else.
    ReplyToBlocked,
    /// Replace the ticket with one naming the real client.
    Swap,
    /// Panic.
    Panic,
}

/// A gate that logs every call; its ticket is a string naming where it was made.
#[derive(Clone)]
struct LoggingGate {
    readmit: Readmit,
    log: Arc<Mutex<Vec<String>>>,
}

impl LoggingGate {
    fn new(readmit: Readmit) -> LoggingGate {
        LoggingGate {
            readmit,
            log: Arc::default(),
        }
    }

    fn record(&self, line: String) {
        self.log
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(line);
    }

    fn log(&self) -> Vec<String> {
        self.log
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    fn closed_lines(&self) -> Vec<String> {
        self.log()
            .into_iter()
            .filter(|line| line.starts_with("closed"))
            .collect()
    }
}

impl Gate for LoggingGate {
    type Ticket = String;

    fn admit(&self, info: &ConnectionInfo) -> Result<Admission<String>, Refusal> {
        self.record(format!("admit {}", info.client_addr().ip()));
        Ok(Admission {
            ticket: format!("admitted {}", info.client_addr().ip()),
            lane: Lane::DEFAULT,
        })
    }

    fn readmit(&self, ticket: &mut String, info: &ConnectionInfo) -> Result<(), Refusal> {
        self.record(format!("readmit {}", info.client_addr().ip()));
        let blocked = info.client_addr().ip() == BLOCKED.parse::<SocketAddr>().unwrap().ip();
        match self.readmit {
            Readmit::RefuseBlocked if blocked => Err(Refusal::Reset { code: BLOCKED_CODE }),
            Readmit::ReplyToBlocked if blocked => Err(Refusal::Reply {
                code: BLOCKED_CODE,
                bytes: b"banned\n",
            }),
            Readmit::Swap => {
                *ticket = format!("readmitted {}", info.client_addr().ip());
                Ok(())
            }
            Readmit::Panic => panic!("a gate bug in readmit"),
            _ => Ok(()),
        }
    }

    fn closed(&self, ticket: String, _info: &ConnectionInfo, reason: CloseReason) {
        self.record(format!("closed {ticket} {}", reason.as_str()));
    }
}

/// A gate that only implements `admit`, to prove the default `readmit` keeps the connection.
struct AdmitOnly;

impl Gate for AdmitOnly {
    type Ticket = ();

    fn admit(&self, _info: &ConnectionInfo) -> Result<Admission<()>, Refusal> {
        admit_on_the_default_lane()
    }
}

/// The session version of `who_am_i`.
struct WhoAmI;

impl Session for WhoAmI {
    fn on_open(&mut self, context: &mut SessionContext<'_>) -> Step {
        let line = format!("{}\n", context.info().client_addr());
        if context.output().push(line.as_bytes()).is_err() {
            return Step::Abort;
        }
        Step::Write
    }

    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        let taken = context.output().push_partial(input.bytes());
        input.consume(taken);
        Step::Write
    }
}

fn server<G: Gate>(driver: Driver, gate: G, recorder: &Recorder) -> Server {
    server_with_limits(driver, gate, recorder, Limits::new())
}

fn server_with_limits<G: Gate>(
    driver: Driver,
    gate: G,
    recorder: &Recorder,
    limits: Limits,
) -> Server {
    let builder = ServerBuilder::new()
        .listener(ListenerSpec::new("127.0.0.1:0".parse().unwrap()).proxy(
            ProxyMode::Any,
            TrustedProxies::parse(&["127.0.0.1/32"]).unwrap(),
        ))
        .workers(2)
        .limits(limits.min_rate(None))
        .events(recorder.clone());
    let built = match driver {
        Driver::ThreadedHandler => builder
            .handler_driver(HandlerDriver::Threads)
            .handler(who_am_i)
            .gate(gate)
            .build(),
        Driver::CoroutineHandler => builder
            .handler_driver(HandlerDriver::Coroutines { loops: 2 })
            .handler(who_am_i)
            .gate(gate)
            .build(),
        Driver::ThreadedSessions => builder
            .session_driver(SessionDriver::Threads)
            .sessions(|_: &ConnectionInfo| Some(WhoAmI))
            .gate(gate)
            .build(),
        Driver::EventLoopSessions => builder
            .session_driver(SessionDriver::EventLoop { loops: 2 })
            .sessions(|_: &ConnectionInfo| Some(WhoAmI))
            .gate(gate)
            .build(),
    };
    built.unwrap_or_else(|error| panic!("the {driver:?} server should start: {error}"))
}

fn v1_header(real: &str, server: &Server) -> Vec<u8> {
    encode_v1(real.parse().unwrap(), server.local_addr()).into_bytes()
}

fn v2_header(real: &str, server: &Server) -> Vec<u8> {
    encode_v2(
        Some((real.parse().unwrap(), server.local_addr())),
        &[],
        true,
    )
}

fn ip(address: &str) -> IpAddr {
    address.parse::<SocketAddr>().unwrap().ip()
}

#[test]
fn a_gate_that_refuses_the_real_client_closes_it_and_lets_others_through() {
    for driver in DRIVERS {
        for header in [v1_header, v2_header] {
            let recorder = Recorder::default();
            let gate = LoggingGate::new(Readmit::RefuseBlocked);
            let server = server(driver, gate.clone(), &recorder);
            let mut welcome = client(server.local_addr());
            welcome.write_all(&header(WELCOME, &server)).unwrap();
            assert_eq!(
                read_line(&mut welcome),
                WELCOME,
                "{driver:?}: a real client the gate keeps was not served as itself"
            );
            let mut blocked = client(server.local_addr());
            let mut bytes = header(BLOCKED, &server);
            bytes.extend_from_slice(b"must never be read\n");
            blocked.write_all(&bytes).unwrap();
            assert!(
                read_to_close(&mut blocked).is_empty(),
                "{driver:?}: the refused client received bytes"
            );
            let closes = recorder.wait_for_closes(1, SOON);
            assert_eq!(
                closes.iter().map(|close| close.1).collect::<Vec<_>>(),
                vec![CloseReason::Refused(RefusalCause::Gate(BLOCKED_CODE))],
                "{driver:?}: the refused real client did not close with the gate's refusal (or others closed)"
            );
            assert_eq!(
                round_trip(&mut welcome, b"still here"),
                b"still here",
                "{driver:?}: the kept connection suffered from the refusal"
            );
            assert_eq!(
                gate.closed_lines(),
                vec![format!("closed admitted 127.0.0.1 refused_gate")],
                "{driver:?}: the refused connection's ticket did not come back exactly once"
            );
            drop(welcome);
            recorder.wait_for_closes(2, SOON);
            assert_eq!(
                gate.closed_lines().len(),
                2,
                "{driver:?}: the kept connection's ticket did not come back once: {:?}",
                gate.log()
            );
        }
    }
}

/// The `Refused` events the recorder saw, as (peer, cause).
fn refused_events(recorder: &Recorder) -> Vec<(SocketAddr, RefusalCause)> {
    recorder
        .events()
        .into_iter()
        .filter_map(|event| match event {
            Event::Refused { peer, cause, .. } => Some((peer, cause)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_refused_readmit_counts_as_a_refusal_in_stats_and_events() {
    for driver in DRIVERS {
        let recorder = Recorder::default();
        let gate = LoggingGate::new(Readmit::RefuseBlocked);
        let server = server(driver, gate, &recorder);
        let before = server.stats();
        let mut blocked = client(server.local_addr());
        blocked.write_all(&v1_header(BLOCKED, &server)).unwrap();
        read_to_close(&mut blocked);
        let cause = RefusalCause::Gate(BLOCKED_CODE);
        assert_eq!(
            recorder.single_close(SOON),
            CloseReason::Refused(cause),
            "{driver:?}: the refused real client did not close with the gate's refusal"
        );
        let after = server.stats();
        assert_eq!(
            after.refused,
            before.refused + 1,
            "{driver:?}: a readmit refusal was not counted in Stats::refused"
        );
        assert_eq!(
            after.refused_by(cause),
            1,
            "{driver:?}: a readmit refusal was not counted under the gate's cause"
        );
        assert_eq!(
            after.closed, 1,
            "{driver:?}: the refused connection was admitted, so it must also count as closed once"
        );
        assert_eq!(
            after.open, 0,
            "{driver:?}: a readmit refusal counted twice against open (accepted {}, refused {}, closed {})",
            after.accepted, after.refused, after.closed
        );
        assert_eq!(
            refused_events(&recorder),
            vec![(BLOCKED.parse().unwrap(), cause)],
            "{driver:?}: a readmit refusal did not report one Refused event naming the real client"
        );
    }
}

#[test]
fn a_real_client_over_its_source_cap_counts_as_a_refusal_in_stats_and_events() {
    for driver in DRIVERS {
        let recorder = Recorder::default();
        let gate = LoggingGate::new(Readmit::RefuseBlocked);
        let limits = Limits::new().max_per_source(1);
        let server = server_with_limits(driver, gate, &recorder, limits);
        // The first connection moves its source slot from the proxy to the real client and holds it.
        let mut first = client(server.local_addr());
        first.write_all(&v1_header(WELCOME, &server)).unwrap();
        assert_eq!(read_line(&mut first), WELCOME, "{driver:?}: not served");
        let before = server.stats();
        let mut second = client(server.local_addr());
        second.write_all(&v1_header(WELCOME, &server)).unwrap();
        assert!(
            read_to_close(&mut second).is_empty(),
            "{driver:?}: the client over its source cap received bytes"
        );
        assert_eq!(
            recorder.single_close(SOON),
            CloseReason::Limit(LimitKind::PerSource),
            "{driver:?}: the second connection of the real client did not close at its source cap"
        );
        let after = server.stats();
        assert_eq!(
            after.refused,
            before.refused + 1,
            "{driver:?}: a source-cap refusal after the header was not counted in Stats::refused"
        );
        assert_eq!(
            after.refused_by(RefusalCause::SourceCap),
            1,
            "{driver:?}: a source-cap refusal after the header was not counted under SourceCap"
        );
        assert_eq!(
            after.open, 1,
            "{driver:?}: only the first connection is open (accepted {}, refused {}, closed {})",
            after.accepted, after.refused, after.closed
        );
        assert_eq!(
            refused_events(&recorder),
            vec![(WELCOME.parse().unwrap(), RefusalCause::SourceCap)],
            "{driver:?}: a source-cap refusal after the header did not report one Refused event"
        );
        assert_eq!(
            round_trip(&mut first, b"still here"),
            b"still here",
            "{driver:?}: the first connection suffered from the refusal"
        );
    }
}

#[test]
fn a_refusal_with_a_reply_sends_it_once_then_closes() {
    for driver in DRIVERS {
        let recorder = Recorder::default();
        let gate = LoggingGate::new(Readmit::ReplyToBlocked);
        let server = server(driver, gate.clone(), &recorder);
        let mut blocked = client(server.local_addr());
        blocked.write_all(&v1_header(BLOCKED, &server)).unwrap();
        assert_eq!(
            read_to_close(&mut blocked),
            b"banned\n",
            "{driver:?}: the refusal reply did not arrive alone"
        );
        assert_eq!(
            recorder.single_close(SOON),
            CloseReason::Refused(RefusalCause::Gate(BLOCKED_CODE)),
            "{driver:?}: wrong close reason for a refusal with a reply"
        );
    }
}

#[test]
fn a_gate_that_swaps_its_ticket_gets_the_new_one_back_at_close() {
    for driver in DRIVERS {
        let recorder = Recorder::default();
        let gate = LoggingGate::new(Readmit::Swap);
        let server = server(driver, gate.clone(), &recorder);
        let mut stream = client(server.local_addr());
        stream.write_all(&v2_header(WELCOME, &server)).unwrap();
        assert_eq!(read_line(&mut stream), WELCOME, "{driver:?}: not served");
        drop(stream);
        recorder.wait_for_closes(1, SOON);
        assert_eq!(
            gate.closed_lines(),
            vec![format!("closed readmitted {} peer_closed", ip(WELCOME))],
            "{driver:?}: closed did not receive the swapped ticket exactly once"
        );
    }
}

#[test]
fn a_panic_in_readmit_refuses_the_connection_and_still_returns_the_ticket() {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    for driver in DRIVERS {
        let recorder = Recorder::default();
        let gate = LoggingGate::new(Readmit::Panic);
        let server = server(driver, gate.clone(), &recorder);
        let mut stream = client(server.local_addr());
        let mut bytes = v1_header(WELCOME, &server);
        bytes.extend_from_slice(b"hello\n");
        stream.write_all(&bytes).unwrap();
        let received = read_to_close(&mut stream);
        let reason = recorder.single_close(SOON);
        let closed = gate.closed_lines();
        drop(server);
        assert!(
            received.is_empty(),
            "{driver:?}: a panicking readmit let bytes out: {received:?}"
        );
        assert_eq!(
            reason,
            CloseReason::Refused(RefusalCause::Gate(GATE_PANIC_CODE)),
            "{driver:?}: a panicking readmit did not fail closed"
        );
        assert_eq!(
            closed,
            vec!["closed admitted 127.0.0.1 refused_gate".to_string()],
            "{driver:?}: the ticket did not come back exactly once after the panic"
        );
    }
    std::panic::set_hook(hook);
}

#[test]
fn gate_calls_and_events_come_in_order_and_a_refusal_reports_no_resolution() {
    for driver in DRIVERS {
        let recorder = Recorder::default();
        let gate = LoggingGate::new(Readmit::RefuseBlocked);
        let server = server(driver, gate.clone(), &recorder);
        let mut kept = client(server.local_addr());
        kept.write_all(&v1_header(WELCOME, &server)).unwrap();
        assert_eq!(read_line(&mut kept), WELCOME, "{driver:?}: not served");
        drop(kept);
        recorder.wait_for_closes(1, SOON);
        let mut refused = client(server.local_addr());
        refused.write_all(&v2_header(BLOCKED, &server)).unwrap();
        read_to_close(&mut refused);
        recorder.wait_for_closes(2, SOON);
        assert_eq!(
            gate.log(),
            vec![
                "admit 127.0.0.1".to_string(),
                format!("readmit {}", ip(WELCOME)),
                "closed admitted 127.0.0.1 peer_closed".to_string(),
                "admit 127.0.0.1".to_string(),
                format!("readmit {}", ip(BLOCKED)),
                "closed admitted 127.0.0.1 refused_gate".to_string(),
            ],
            "{driver:?}: the gate was not asked admit, readmit, closed in order, once each"
        );
        let names: Vec<&str> = recorder
            .events()
            .iter()
            .filter_map(|event| match event {
                Event::Accepted { .. } => Some("accepted"),
                Event::Admitted { .. } => Some("admitted"),
                Event::ProxyResolved { real_peer, .. } => {
                    assert_eq!(
                        real_peer.ip(),
                        ip(WELCOME),
                        "{driver:?}: a refused client was reported resolved"
                    );
                    Some("proxy_resolved")
                }
                Event::HandshakeDone { .. } => Some("handshake_done"),
                Event::Closed { .. } => Some("closed"),
                _ => None,
            })
            .collect();
        assert_eq!(
            names,
            [
                "accepted",
                "admitted",
                "proxy_resolved",
                "handshake_done",
                "closed",
                "accepted",
                "admitted",
                "closed",
            ],
            "{driver:?}: events out of order"
        );
    }
}

#[test]
fn a_local_header_keeps_the_proxy_address_and_is_not_readmitted() {
    for driver in DRIVERS {
        let recorder = Recorder::default();
        let gate = LoggingGate::new(Readmit::RefuseBlocked);
        let server = server(driver, gate.clone(), &recorder);
        let mut stream = client(server.local_addr());
        stream.write_all(&encode_v2(None, &[], true)).unwrap();
        let seen = read_line(&mut stream);
        assert!(
            seen.starts_with("127.0.0.1:"),
            "{driver:?}: a LOCAL header changed the client address to {seen}"
        );
        drop(stream);
        recorder.wait_for_closes(1, SOON);
        assert!(
            gate.log().iter().all(|line| !line.starts_with("readmit")),
            "{driver:?}: readmit was called without a real client: {:?}",
            gate.log()
        );
    }
}

#[test]
fn a_gate_without_readmit_keeps_serving_the_real_client() {
    for driver in DRIVERS {
        let recorder = Recorder::default();
        let server = server(driver, AdmitOnly, &recorder);
        let mut stream = client(server.local_addr());
        stream.write_all(&v1_header(BLOCKED, &server)).unwrap();
        assert_eq!(
            read_line(&mut stream),
            BLOCKED,
            "{driver:?}: the default readmit did not keep the connection"
        );
        assert_eq!(round_trip(&mut stream, b"echo"), b"echo");
    }
}
