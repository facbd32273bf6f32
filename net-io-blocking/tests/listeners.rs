//! Listeners added and removed while the server runs, on every driver: the door, the drain of one
//! listener, ids, validation, descriptors and threads, and shutdown afterwards.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::child::{exit_within, is_child, rerun};
use common::echo::echo_fours;
use common::{Recorder, SOON, client, eventually, open_descriptors, round_trip};
use net_io_blocking::{
    CloseReason, ConnectionId, ControlLine, ControlState, Event, HandlerDriver, Input, Limits,
    ListenerId, ListenerSpec, NetError, ProxyMode, RefusalCause, Server, ServerBuilder, Session,
    SessionContext, SessionDriver, Step, TrustedProxies,
};

/// Set in the child process that counts descriptors and threads alone.
const CHILD_VARIABLE: &str = "NET_IO_LISTENERS_COUNTING_CHILD";

/// The four ways a server drives its connections.
#[derive(Clone, Copy, Debug)]
enum Driver {
    HandlerThreads,
    HandlerCoroutines,
    SessionThreads,
    SessionLoops,
}

const DRIVERS: [Driver; 4] = [
    Driver::HandlerThreads,
    Driver::HandlerCoroutines,
    Driver::SessionThreads,
    Driver::SessionLoops,
];

/// The session twin of `echo_fours`: a partial request leaves input unconsumed, so the session is busy.
struct Fours;

impl Session for Fours {
    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        let whole = input.bytes().len() / 4 * 4;
        if whole == 0 {
            return Step::Read;
        }
        if context.output().push(&input.bytes()[..whole]).is_err() {
            return Step::Abort;
        }
        input.consume(whole);
        Step::Write
    }
}

/// A server on 127.0.0.1:0 with a long idle timeout (so only the drain closes idle connections) and no
/// minimum rate (a loaded machine must not trip it).
fn server(driver: Driver, recorder: &Recorder, control: Option<Arc<ControlLine>>) -> Server {
    let mut builder = ServerBuilder::new()
        .listen("127.0.0.1:0")
        .workers(4)
        .limits(
            Limits::new()
                .idle_timeout(Duration::from_secs(60))
                .min_rate(None),
        )
        .events(recorder.clone());
    if let Some(control) = control {
        builder = builder.control(control);
    }
    let built = match driver {
        Driver::HandlerThreads => builder
            .handler_driver(HandlerDriver::Threads)
            .handler(echo_fours)
            .allow_all()
            .build(),
        Driver::HandlerCoroutines => builder
            .handler_driver(HandlerDriver::Coroutines { loops: 2 })
            .handler(echo_fours)
            .allow_all()
            .build(),
        Driver::SessionThreads => builder
            .session_driver(SessionDriver::Threads)
            .sessions(|_: &_| Some(Fours))
            .allow_all()
            .build(),
        Driver::SessionLoops => builder
            .session_driver(SessionDriver::EventLoop { loops: 2 })
            .sessions(|_: &_| Some(Fours))
            .allow_all()
            .build(),
    };
    built.unwrap_or_else(|error| panic!("{driver:?}: the server did not build: {error}"))
}

fn local_spec() -> ListenerSpec {
    ListenerSpec::new("127.0.0.1:0".parse().unwrap())
}

/// Adds a listener on a free port and returns its id and address.
fn add(server: &Server, spec: ListenerSpec) -> (ListenerId, SocketAddr) {
    let id = server
        .add_listener(spec)
        .unwrap_or_else(|error| panic!("adding a listener failed: {error}"));
    let address = server
        .handle()
        .listener_addr(id)
        .expect("a listener just added should be live");
    (id, address)
}

/// The connection ids the recorder saw accepted on `listener`.
fn accepted_on(recorder: &Recorder, listener: ListenerId) -> Vec<ConnectionId> {
    recorder
        .events()
        .into_iter()
        .filter_map(|event| match event {
            Event::Accepted {
                id, listener: on, ..
            } if on == listener => Some(id),
            _ => None,
        })
        .collect()
}

/// The close reasons the recorder saw for `id`.
fn closes_of(recorder: &Recorder, id: ConnectionId) -> Vec<CloseReason> {
    recorder
        .closes()
        .into_iter()
        .filter(|(closed, _)| *closed == id)
        .map(|(_, reason)| reason)
        .collect()
}

/// Waits until the connection the `count`th accept on `listener` made is held by a worker or loop.
fn wait_accepted(recorder: &Recorder, listener: ListenerId, count: usize) -> ConnectionId {
    assert!(
        eventually(SOON, || accepted_on(recorder, listener).len() >= count),
        "listener {listener:?} did not accept connection number {count}"
    );
    accepted_on(recorder, listener)[count - 1]
}

fn assert_refused(address: SocketAddr, driver: Driver) {
    match TcpStream::connect_timeout(&address, Duration::from_secs(2)) {
        Err(error) => assert_eq!(
            error.kind(),
            ErrorKind::ConnectionRefused,
            "{driver:?}: a connect to the removed listener {address} failed, but not as refused"
        ),
        Ok(_) => panic!("{driver:?}: a connect to the removed listener {address} succeeded"),
    }
}

#[test]
fn an_added_listener_serves_after_open_door_and_not_before() {
    for driver in DRIVERS {
        let recorder = Recorder::default();
        let server = server(driver, &recorder, None);
        assert!(
            server.handle().is_door_open(),
            "the build should open the door"
        );
        let (id, address) = add(&server, local_spec());
        assert_ne!(
            id,
            ListenerId(0),
            "{driver:?}: the new listener reused the first id"
        );
        let mut early = client(address);
        early.write_all(b"ping").unwrap();
        early
            .set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let mut reply = [0_u8; 4];
        let before = early.read(&mut reply);
        assert!(
            matches!(&before, Err(error) if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)),
            "{driver:?}: the added listener answered before open_door: {before:?}"
        );
        assert!(
            accepted_on(&recorder, id).is_empty(),
            "{driver:?}: the added listener accepted before open_door"
        );
        server.handle().open_door();
        early.set_read_timeout(Some(SOON)).unwrap();
        early
            .read_exact(&mut reply)
            .unwrap_or_else(|error| panic!("{driver:?}: no reply after open_door: {error}"));
        assert_eq!(
            &reply, b"ping",
            "{driver:?}: wrong echo on the added listener"
        );
        let mut first = client(server.local_addr());
        assert_eq!(
            round_trip(&mut first, b"abcd"),
            b"abcd",
            "{driver:?}: the first listener stopped serving"
        );
        assert!(
            recorder.events().iter().any(|event| matches!(
                event,
                Event::ListenerOpened { listener, local, .. } if *listener == id && *local == address
            )),
            "{driver:?}: no ListenerOpened event for the added listener"
        );
    }
}

#[test]
fn removing_a_listener_refuses_its_port_closes_its_idle_connections_and_leaves_the_other_alone() {
    for driver in DRIVERS {
        let recorder = Recorder::default();
        let server = server(driver, &recorder, None);
        let (id, address) = add(&server, local_spec());
        server.handle().open_door();
        let mut other = client(server.local_addr());
        assert_eq!(round_trip(&mut other, b"keep"), b"keep");
        let other_id = wait_accepted(&recorder, ListenerId(0), 1);
        let mut idle = client(address);
        assert_eq!(round_trip(&mut idle, b"idle"), b"idle");
        let idle_id = wait_accepted(&recorder, id, 1);

        let report = server
            .remove_listener(id, Instant::now() + Duration::from_secs(10))
            .unwrap_or_else(|error| panic!("{driver:?}: removing failed: {error}"));
        assert_eq!(
            (report.graceful, report.killed),
            (1, 0),
            "{driver:?}: the idle connection should close at once, without a kill"
        );
        assert!(
            report.elapsed < Duration::from_secs(5),
            "{driver:?}: removing with only an idle connection took {:?}",
            report.elapsed
        );
        assert_eq!(
            closes_of(&recorder, idle_id),
            vec![CloseReason::Drained],
            "{driver:?}: the idle connection should close once, as drained"
        );
        assert!(
            common::is_closed_by_server(&mut idle),
            "{driver:?}: the idle connection is still open for the client"
        );
        assert_refused(address, driver);
        assert_eq!(
            round_trip(&mut other, b"more"),
            b"more",
            "{driver:?}: the other listener's connection was disturbed"
        );
        assert!(
            closes_of(&recorder, other_id).is_empty(),
            "{driver:?}: the other listener's connection was closed"
        );
        let mut fresh = client(server.local_addr());
        assert_eq!(
            round_trip(&mut fresh, b"new!"),
            b"new!",
            "{driver:?}: the other listener stopped accepting"
        );
        assert!(
            !server.handle().is_draining(),
            "{driver:?}: removing one listener put the whole server in a drain"
        );
        assert!(
            recorder.events().iter().any(
                |event| matches!(event, Event::ListenerClosed { listener } if *listener == id)
            ),
            "{driver:?}: no ListenerClosed event for the removed listener"
        );
        assert_eq!(
            server.handle().listener_ids(),
            vec![ListenerId(0)],
            "{driver:?}: the removed listener is still listed"
        );
    }
}

#[test]
fn a_busy_connection_of_a_removed_listener_finishes_its_exchange_then_closes_as_drained() {
    for driver in DRIVERS {
        let recorder = Recorder::default();
        let server = server(driver, &recorder, None);
        let (id, address) = add(&server, local_spec());
        server.handle().open_door();
        let mut busy = client(address);
        assert_eq!(round_trip(&mut busy, b"busy"), b"busy");
        let busy_id = wait_accepted(&recorder, id, 1);
        // Half a request: mid-exchange.
        busy.write_all(b"ha").unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let handle = server.handle();
        let removal = std::thread::spawn(move || {
            handle.remove_listener(id, Instant::now() + Duration::from_secs(10))
        });
        std::thread::sleep(Duration::from_millis(200));
        assert!(
            closes_of(&recorder, busy_id).is_empty(),
            "{driver:?}: the busy connection was closed before finishing its exchange"
        );
        busy.write_all(b"lf").unwrap();
        let mut reply = [0_u8; 4];
        busy.read_exact(&mut reply).unwrap_or_else(|error| {
            panic!("{driver:?}: the busy connection did not get its reply: {error}")
        });
        assert_eq!(&reply, b"half", "{driver:?}: wrong reply while draining");
        let report = removal
            .join()
            .unwrap()
            .unwrap_or_else(|error| panic!("{driver:?}: removing failed: {error}"));
        assert_eq!(
            (report.graceful, report.killed),
            (1, 0),
            "{driver:?}: the finished connection should not need a kill"
        );
        assert_eq!(
            closes_of(&recorder, busy_id),
            vec![CloseReason::Drained],
            "{driver:?}: the finished connection should close once, as drained"
        );
    }
}

#[test]
fn a_connection_still_busy_at_the_removal_deadline_is_killed_and_the_other_listener_is_untouched() {
    for driver in DRIVERS {
        let recorder = Recorder::default();
        let server = server(driver, &recorder, None);
        let (id, address) = add(&server, local_spec());
        server.handle().open_door();
        let mut other = client(server.local_addr());
        other.write_all(b"ha").unwrap();
        let other_id = wait_accepted(&recorder, ListenerId(0), 1);
        let mut busy = client(address);
        busy.write_all(b"ha").unwrap();
        let busy_id = wait_accepted(&recorder, id, 1);
        std::thread::sleep(Duration::from_millis(100));
        let report = server
            .remove_listener(id, Instant::now() + Duration::from_millis(300))
            .unwrap();
        assert_eq!(
            report.killed, 1,
            "{driver:?}: the busy connection should be killed at the deadline"
        );
        assert!(
            eventually(SOON, || !closes_of(&recorder, busy_id).is_empty()),
            "{driver:?}: the busy connection never closed"
        );
        assert_eq!(
            closes_of(&recorder, busy_id),
            vec![CloseReason::DrainDeadline],
            "{driver:?}: wrong close for the connection busy at the deadline"
        );
        assert!(
            closes_of(&recorder, other_id).is_empty(),
            "{driver:?}: the other listener's busy connection was killed too"
        );
        other.write_all(b"lf").unwrap();
        let mut reply = [0_u8; 4];
        other
            .read_exact(&mut reply)
            .unwrap_or_else(|error| panic!("{driver:?}: the other connection broke: {error}"));
        assert_eq!(&reply, b"half");
    }
}

#[test]
fn listener_ids_are_never_reused_and_removing_twice_or_an_unknown_id_is_an_error() {
    let recorder = Recorder::default();
    let server = server(Driver::HandlerThreads, &recorder, None);
    let mut seen = vec![ListenerId(0)];
    for _ in 0..5 {
        let (id, _) = add(&server, local_spec());
        assert!(
            !seen.contains(&id),
            "listener id {id:?} was handed out twice"
        );
        seen.push(id);
        server
            .remove_listener(id, Instant::now() + Duration::from_secs(1))
            .expect("removing a live listener");
        let again = server
            .remove_listener(id, Instant::now() + Duration::from_secs(1))
            .expect_err("removing a listener twice should fail");
        assert!(
            again.to_string().contains("not live"),
            "the error does not say the listener is gone: {again}"
        );
    }
    let unknown = server
        .remove_listener(ListenerId(9_999), Instant::now())
        .expect_err("removing an unknown id should fail");
    assert!(
        matches!(
            unknown,
            NetError::UnknownListener {
                listener: ListenerId(9_999)
            }
        ),
        "an unknown id should be UnknownListener naming it: {unknown:?}"
    );
    insta::assert_snapshot!("remove_unknown_listener", unknown.to_string());
    assert_eq!(server.handle().listener_ids(), vec![ListenerId(0)]);
}

#[test]
fn an_added_listener_is_validated_like_a_builder_listener() {
    let recorder = Recorder::default();
    let server = server(Driver::SessionLoops, &recorder, None);
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = taken.local_addr().unwrap();
    let in_use = server
        .add_listener(ListenerSpec::new(address))
        .expect_err("binding a taken port should fail");
    assert!(
        matches!(in_use, NetError::AddressInUse { address: named } if named == address),
        "the error should name the address in use: {in_use:?}"
    );
    assert!(
        in_use.to_string().contains(&address.to_string()),
        "the message does not name {address}: {in_use}"
    );
    let global = server.handle().limits().max_connections;
    let above = server
        .add_listener(local_spec().limits(Limits::new().max_per_listener(global + 1)))
        .expect_err("a per-listener cap above the global one should fail");
    assert!(
        above.to_string().contains("max_per_listener"),
        "the error does not name the field: {above}"
    );
    let untrusted = server
        .add_listener(local_spec().proxy(ProxyMode::Any, TrustedProxies::new()))
        .expect_err("a PROXY listener with no trusted proxies should fail");
    assert!(
        untrusted.to_string().contains("trusted_proxies"),
        "the error does not name the field: {untrusted}"
    );
    assert_eq!(
        server.handle().listener_ids(),
        vec![ListenerId(0)],
        "a failed add left a listener behind"
    );
}

#[test]
fn an_added_listener_keeps_its_own_cap_and_proxy_mode() {
    for driver in DRIVERS {
        let recorder = Recorder::default();
        let server = server(driver, &recorder, None);
        let (capped, capped_address) = add(
            &server,
            local_spec().limits(Limits::new().max_per_listener(1)),
        );
        let trusted = TrustedProxies::parse(&["127.0.0.0/8"]).unwrap();
        let (proxied, proxied_address) = add(&server, local_spec().proxy(ProxyMode::V1, trusted));
        server.handle().open_door();

        let mut held = client(capped_address);
        assert_eq!(round_trip(&mut held, b"one!"), b"one!");
        let mut second = common::UnwantedClient::connect(capped_address);
        assert!(
            second.is_closed_by_server(),
            "{driver:?}: a second connection passed the added listener's cap of 1"
        );
        assert!(
            eventually(SOON, || server
                .stats()
                .refused_by(RefusalCause::ListenerCap)
                >= 1),
            "{driver:?}: the refusal was not counted as the listener cap"
        );
        let mut other = client(server.local_addr());
        assert_eq!(
            round_trip(&mut other, b"free"),
            b"free",
            "{driver:?}: the cap of the added listener limited the first one"
        );

        let mut behind_proxy = client(proxied_address);
        behind_proxy
            .write_all(b"PROXY TCP4 192.0.2.7 192.0.2.1 4000 80\r\n")
            .unwrap();
        assert_eq!(
            round_trip(&mut behind_proxy, b"real"),
            b"real",
            "{driver:?}: no echo behind the PROXY header"
        );
        let id = wait_accepted(&recorder, proxied, 1);
        assert!(
            recorder.events().iter().any(|event| matches!(
                event,
                Event::ProxyResolved { id: resolved, real_peer }
                    if *resolved == id && real_peer.ip().to_string() == "192.0.2.7"
            )),
            "{driver:?}: the added PROXY listener did not resolve the real client"
        );
        let _ = capped;
    }
}

#[test]
fn the_control_line_is_still_obeyed_after_the_listener_watching_it_is_removed() {
    let recorder = Recorder::default();
    let control = Arc::new(ControlLine::new());
    let server = server(Driver::SessionLoops, &recorder, Some(Arc::clone(&control)));
    let (_, address) = add(&server, local_spec());
    server.handle().open_door();
    server
        .remove_listener(ListenerId(0), Instant::now() + Duration::from_secs(1))
        .unwrap();
    let mut served = client(address);
    assert_eq!(round_trip(&mut served, b"live"), b"live");
    control.set(ControlState::Lockdown);
    assert!(
        eventually(SOON, || recorder.events().iter().any(|event| matches!(
            event,
            Event::ControlReacted {
                state: ControlState::Lockdown
            }
        ))),
        "nobody reacted to the control line once its watcher was removed"
    );
    let mut locked_out = common::UnwantedClient::connect(address);
    assert!(
        locked_out.is_closed_by_server(),
        "a new connection was served during a lockdown"
    );
}

#[test]
fn shutdown_after_adds_and_removes_closes_every_listener_once_and_every_connection() {
    for driver in DRIVERS {
        let recorder = Recorder::default();
        let server = server(driver, &recorder, None);
        let added: Vec<_> = (0..3).map(|_| add(&server, local_spec())).collect();
        server.handle().open_door();
        server
            .remove_listener(added[1].0, Instant::now() + Duration::from_secs(1))
            .unwrap();
        let mut streams = Vec::new();
        for address in [server.local_addr(), added[0].1, added[2].1] {
            let mut stream = client(address);
            assert_eq!(round_trip(&mut stream, b"open"), b"open");
            streams.push(stream);
        }
        let handle = server.handle();
        let report = server.shutdown(Instant::now() + Duration::from_secs(5));
        assert_eq!(
            (report.graceful, report.killed),
            (3, 0),
            "{driver:?}: three idle connections should close at once"
        );
        for stream in &mut streams {
            assert!(
                common::is_closed_by_server(stream),
                "{driver:?}: a connection outlived the shutdown"
            );
        }
        for address in [added[0].1, added[1].1, added[2].1] {
            assert_refused(address, driver);
        }
        let closed: Vec<ListenerId> = recorder
            .events()
            .into_iter()
            .filter_map(|event| match event {
                Event::ListenerClosed { listener } => Some(listener),
                _ => None,
            })
            .collect();
        let mut sorted = closed.clone();
        sorted.sort_by_key(|id| id.0);
        assert_eq!(
            sorted,
            vec![ListenerId(0), added[0].0, added[1].0, added[2].0],
            "{driver:?}: every listener should be reported closed exactly once: {closed:?}"
        );
        assert!(
            handle.listener_ids().is_empty(),
            "{driver:?}: listeners are still live after the shutdown"
        );
        assert!(
            matches!(
                handle.add_listener(local_spec()),
                Err(NetError::ServerStopped | NetError::ShuttingDown)
            ),
            "{driver:?}: a listener could be added to a stopped server"
        );
    }
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("could not list /proc/self/task")
        .count()
}

/// The child's part: adds, serves on and removes a listener 200 times on each driver, and checks that the
/// process holds as many descriptors and threads as before.
fn count_in_child() {
    for driver in DRIVERS {
        let recorder = Recorder::default();
        let server = server(driver, &recorder, None);
        // One round first, so lazily made things (the id blocks, thread-locals, the loops' slabs) exist.
        let (id, address) = add(&server, local_spec());
        server.handle().open_door();
        let mut stream = client(address);
        assert_eq!(round_trip(&mut stream, b"warm"), b"warm");
        server
            .remove_listener(id, Instant::now() + Duration::from_secs(5))
            .unwrap();
        drop(stream);
        let descriptors = open_descriptors();
        let tasks = threads();
        for round in 0..200 {
            let (id, address) = add(&server, local_spec());
            server.handle().open_door();
            let mut stream = client(address);
            assert_eq!(round_trip(&mut stream, b"loop"), b"loop", "round {round}");
            let report = server
                .remove_listener(id, Instant::now() + Duration::from_secs(5))
                .unwrap();
            assert_eq!(
                report.killed, 0,
                "{driver:?} round {round}: a kill was needed"
            );
            assert!(common::is_closed_by_server(&mut stream));
        }
        // The client sockets are closed by now; the server's side closed before each removal returned.
        let settled = eventually(SOON, || {
            open_descriptors() <= descriptors && threads() <= tasks
        });
        assert!(
            settled,
            "{driver:?}: 200 adds and removes left descriptors {} -> {} and threads {} -> {}",
            descriptors,
            open_descriptors(),
            tasks,
            threads()
        );
        let _ = server.shutdown(Instant::now() + Duration::from_secs(5));
    }
}

#[test]
fn adding_and_removing_a_listener_200_times_leaves_no_descriptor_or_thread_behind() {
    if is_child(CHILD_VARIABLE) {
        count_in_child();
        return;
    }
    let mut child = rerun(
        "adding_and_removing_a_listener_200_times_leaves_no_descriptor_or_thread_behind",
        CHILD_VARIABLE,
    )
    .spawn()
    .expect("could not start the counting child");
    let status = exit_within(&mut child, Duration::from_secs(300))
        .expect("the counting child did not finish within 5 minutes");
    assert!(
        status.success(),
        "the counting child failed with {status} (its output is above)"
    );
}

/// Removes listener `target` from inside the event sink, on that listener's own accept thread.
#[derive(Clone)]
struct RemovingSink {
    handle: Arc<std::sync::OnceLock<net_io_blocking::ServerHandle>>,
    target: Arc<std::sync::OnceLock<ListenerId>>,
    outcome: Arc<std::sync::Mutex<Option<Result<u64, String>>>>,
}

impl net_io_blocking::EventSink for RemovingSink {
    fn emit(&self, event: Event) {
        let Event::Accepted { listener, .. } = event else {
            return;
        };
        let (Some(handle), Some(target)) = (self.handle.get(), self.target.get()) else {
            return;
        };
        if listener != *target {
            return;
        }
        let result = handle
            .remove_listener(listener, Instant::now())
            .map(|report| report.graceful + report.killed)
            .map_err(|error| error.to_string());
        self.outcome.lock().unwrap().get_or_insert(result);
    }
}

#[test]
fn a_listener_removed_from_its_own_accept_thread_closes_without_a_deadlock() {
    let sink = RemovingSink {
        handle: Arc::default(),
        target: Arc::default(),
        outcome: Arc::default(),
    };
    let server = ServerBuilder::new()
        .listen("127.0.0.1:0")
        .workers(2)
        .events(sink.clone())
        .handler(echo_fours)
        .allow_all()
        .build()
        .unwrap();
    let _ = sink.handle.set(server.handle());
    let (id, address) = add(&server, local_spec());
    let _ = sink.target.set(id);
    server.handle().open_door();
    // The accept of this connection removes the listener and closes the connection, and that reset can
    // reach the client before its connect returns: only the accept matters here, so a reset connect is fine.
    let _first = common::UnwantedClient::connect(address);
    assert!(
        eventually(SOON, || sink.outcome.lock().unwrap().is_some()),
        "the removal from the accept thread did not return"
    );
    let outcome = sink.outcome.lock().unwrap().clone().unwrap();
    assert!(outcome.is_ok(), "the removal failed: {outcome:?}");
    assert!(
        eventually(SOON, || TcpStream::connect(address).is_err()),
        "the listener removed from its own thread kept its port open"
    );
    let mut other = client(server.local_addr());
    assert_eq!(round_trip(&mut other, b"four"), b"four");
    let report = server.shutdown(Instant::now() + Duration::from_secs(5));
    assert_eq!(report.killed, 0, "the shutdown needed a kill: {report:?}");
}
