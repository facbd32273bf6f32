//! `Step::Listen`: a session waiting for input is also woken by a completion, so one connection can relay what
//! another hands it (the full-duplex links of a pipeline) without parking and without a thread.

mod common;

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Recorder, SOON, client, eventually, read_line, test_builder};
use net_io_blocking::{
    CloseReason, Completer, ConnectionInfo, Input, Limits, Session, SessionContext, Step,
};

/// Lines another thread (or connection) hands a listening session to send, and the completer that wakes it.
#[derive(Default)]
struct Mailbox {
    lines: Mutex<VecDeque<String>>,
}

/// The far end of a relay: its mailbox, and its completer once it opened.
type Far = Arc<Mutex<Option<(Arc<Mailbox>, Option<Completer>)>>>;

/// A session that echoes its own input and also sends whatever its mailbox holds when woken.
struct Relay {
    mailbox: Arc<Mailbox>,
    /// Where the session's completer goes once the connection opens.
    completers: Sender<Completer>,
    /// The mailbox of the other connection, that this one's input is forwarded to (if any).
    forward: Option<Far>,
    closes: Sender<CloseReason>,
}

impl Session for Relay {
    fn on_open(&mut self, context: &mut SessionContext<'_>) -> Step {
        context.set_idle_timeout(Duration::from_secs(30));
        let completer = context
            .completer()
            .expect("both session drivers offer a completer");
        let _ = self.completers.send(completer);
        Step::Listen
    }

    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        let bytes = input.bytes().to_vec();
        input.consume_all();
        match &self.forward {
            Some(target) => {
                let target = target.lock().unwrap();
                let (mailbox, completer) = target.as_ref().expect("the far end is open");
                let completer = completer
                    .as_ref()
                    .expect("the far end's completer is known");
                mailbox
                    .lines
                    .lock()
                    .unwrap()
                    .push_back(String::from_utf8_lossy(&bytes).into_owned());
                completer.post(1, 0).expect("the far end's ring has room");
                Step::Listen
            }
            None => {
                context.output().push(&bytes).unwrap();
                Step::Write
            }
        }
    }

    fn on_wake(&mut self, token: u64, value: u64, context: &mut SessionContext<'_>) -> Step {
        let mut lines = self.mailbox.lines.lock().unwrap();
        if lines.is_empty() {
            let text = format!("woken {token} {value}\n");
            context.output().push(text.as_bytes()).unwrap();
        }
        while let Some(line) = lines.pop_front() {
            context.output().push(line.as_bytes()).unwrap();
        }
        Step::Write
    }

    fn on_writable(&mut self, _context: &mut SessionContext<'_>) -> Step {
        Step::Listen
    }

    fn on_close(&mut self, _info: &ConnectionInfo, reason: CloseReason) {
        let _ = self.closes.send(reason);
    }
}

#[test]
fn a_listening_session_answers_its_input_and_a_post_in_either_order() {
    let recorder = Recorder::default();
    let (completers, completer_receiver) = channel();
    let (closes, _close_receiver) = channel();
    let completers = Mutex::new(completers);
    let server = test_builder(4, Limits::new(), &recorder)
        .sessions(move |_: &ConnectionInfo| {
            Some(Relay {
                mailbox: Arc::new(Mailbox::default()),
                completers: completers.lock().unwrap().clone(),
                forward: None,
                closes: closes.clone(),
            })
        })
        .allow_all()
        .build()
        .unwrap();
    let mut stream = client(server.local_addr());
    let completer = completer_receiver
        .recv_timeout(SOON)
        .expect("the session should open");
    // Nothing to read yet: only the post can end this wait.
    completer.post(7, 42).unwrap();
    assert_eq!(
        read_line(&mut stream),
        "woken 7 42",
        "a post should wake a session that listens for input"
    );
    stream.write_all(b"ping\n").unwrap();
    assert_eq!(
        read_line(&mut stream),
        "ping",
        "after a wake the session should still read"
    );
    for round in 0..50u64 {
        completer.post(8, round).unwrap();
        assert_eq!(read_line(&mut stream), format!("woken 8 {round}"));
        stream
            .write_all(format!("line {round}\n").as_bytes())
            .unwrap();
        assert_eq!(read_line(&mut stream), format!("line {round}"));
    }
}

#[test]
fn a_listening_session_is_still_closed_at_its_idle_deadline() {
    let recorder = Recorder::default();
    let (completers, _completer_receiver) = channel();
    let (closes, close_receiver) = channel();
    let completers = Mutex::new(completers);
    let server = test_builder(4, Limits::new(), &recorder)
        .sessions(move |_: &ConnectionInfo| {
            Some(Idle {
                completers: completers.lock().unwrap().clone(),
                closes: closes.clone(),
            })
        })
        .allow_all()
        .build()
        .unwrap();
    let _stream = client(server.local_addr());
    let started = Instant::now();
    let reason = close_receiver
        .recv_timeout(SOON)
        .expect("the idle deadline should close a listening session");
    assert_eq!(reason, CloseReason::Idle);
    assert!(
        started.elapsed() >= Duration::from_millis(250),
        "the idle deadline fired early, after {:?}",
        started.elapsed()
    );
}

/// Listens with a short idle timeout and never gets a post.
struct Idle {
    completers: Sender<Completer>,
    closes: Sender<CloseReason>,
}

impl Session for Idle {
    fn on_open(&mut self, context: &mut SessionContext<'_>) -> Step {
        context.set_idle_timeout(Duration::from_millis(300));
        let _ = self.completers.send(context.completer().unwrap());
        Step::Listen
    }

    fn on_data(&mut self, input: &mut Input<'_>, _context: &mut SessionContext<'_>) -> Step {
        input.consume_all();
        Step::Listen
    }

    fn on_close(&mut self, _info: &ConnectionInfo, reason: CloseReason) {
        let _ = self.closes.send(reason);
    }
}

#[test]
fn one_connection_relays_its_input_to_another_through_posts() {
    let recorder = Recorder::default();
    let (completers, completer_receiver) = channel();
    let (closes, _close_receiver) = channel();
    // The first connection to open is the far end; the second forwards its input there.
    let far: Far = Arc::default();
    let opened = Arc::new(Mutex::new(0usize));
    let completers = Mutex::new(completers);
    let factory_far = Arc::clone(&far);
    let server = test_builder(4, Limits::new(), &recorder)
        .sessions(move |_: &ConnectionInfo| {
            let mut count = opened.lock().unwrap();
            *count += 1;
            let mailbox = Arc::new(Mailbox::default());
            let forward = if *count == 1 {
                // The far end's mailbox is published once its completer is known (below).
                factory_far
                    .lock()
                    .unwrap()
                    .replace((Arc::clone(&mailbox), None));
                None
            } else {
                Some(Arc::clone(&factory_far))
            };
            Some(Relay {
                mailbox,
                completers: completers.lock().unwrap().clone(),
                forward,
                closes: closes.clone(),
            })
        })
        .allow_all()
        .build()
        .unwrap();
    let mut far_stream = client(server.local_addr());
    let far_completer = completer_receiver.recv_timeout(SOON).unwrap();
    far.lock().unwrap().as_mut().unwrap().1 = Some(far_completer);
    let mut near_stream = client(server.local_addr());
    let _near_completer = completer_receiver.recv_timeout(SOON).unwrap();
    for round in 0..100 {
        near_stream
            .write_all(format!("relayed {round}\n").as_bytes())
            .unwrap();
        assert_eq!(
            read_line(&mut far_stream),
            format!("relayed {round}"),
            "what one connection reads should come out of the other"
        );
    }
    drop(near_stream);
    let mut rest = [0u8; 1];
    far_stream
        .set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    assert!(
        far_stream.read(&mut rest).is_err(),
        "the far end should have nothing left over"
    );
    assert!(eventually(SOON, || recorder.closes().len() == 1));
}
