//! `Step::Park` and the completion ring: work offloaded to another thread wakes the parked session, which
//! answers with the result; bytes the peer sends while parked wait in the kernel.

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use common::{Recorder, SOON, client};
use net_io_blocking::{CloseReason, ConnectionInfo, Input, Limits, Session, SessionContext, Step};

/// Parses a number per line, hands the squaring to another thread, parks, and answers on wake.
struct Offloader {
    waiting: bool,
}

impl Session for Offloader {
    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        let bytes = input.bytes();
        let Some(end) = bytes.iter().position(|&byte| byte == b'\n') else {
            return Step::Read;
        };
        let Some(number) = std::str::from_utf8(&bytes[..end])
            .ok()
            .and_then(|text| text.trim().parse::<u64>().ok())
        else {
            return Step::Abort;
        };
        input.consume(end + 1);
        let Some(completer) = context.completer() else {
            return Step::Abort;
        };
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            let _ = completer.post(1, number * number);
        });
        self.waiting = true;
        Step::Park {
            until: context.now() + Duration::from_secs(5),
        }
    }

    fn on_wake(&mut self, token: u64, value: u64, context: &mut SessionContext<'_>) -> Step {
        if token != 1 || !self.waiting {
            return Step::Abort;
        }
        self.waiting = false;
        let line = format!("{value}\n");
        if context.output().push(line.as_bytes()).is_err() {
            return Step::Abort;
        }
        Step::Write
    }
}

#[test]
fn a_parked_session_is_woken_by_its_completer_and_answers_with_the_result() {
    let recorder = Recorder::default();
    let server = common::test_builder(2, Limits::new(), &recorder)
        .sessions(|_info: &ConnectionInfo| Some(Offloader { waiting: false }))
        .allow_all()
        .build()
        .unwrap();
    let mut stream = client(server.local_addr());
    // The second line arrives while the session is parked on the first and must wait in the kernel.
    stream.write_all(b"12\n").unwrap();
    std::thread::sleep(Duration::from_millis(5));
    stream.write_all(b"7\n").unwrap();
    let mut received = Vec::new();
    let mut byte = [0u8; 1];
    while received.iter().filter(|&&byte| byte == b'\n').count() < 2 {
        assert_eq!(
            stream.read(&mut byte).unwrap(),
            1,
            "the server closed early"
        );
        received.push(byte[0]);
    }
    assert_eq!(received, b"144\n49\n");
    drop(stream);
    assert_eq!(recorder.single_close(SOON), CloseReason::PeerClosed);
    assert_eq!(server.stats().stale_completions, 0);
}
