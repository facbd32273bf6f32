//! A sans-IO line-echo session driven the way a driver drives it: receive into a ReadBuffer, lend an Input,
//! apply what was consumed, flush the Output. No sockets; the "wire" is a byte vector.

use std::io::IoSlice;
use std::time::Instant;

use net_io_core::buffer::{BufferPool, SizeClass};
use net_io_core::id::{ConnectionId, ListenerId};
use net_io_core::info::ConnectionInfo;
use net_io_core::input::{Input, ReadBuffer};
use net_io_core::output::{IO_SLICES_MAX, Output};
use net_io_core::session::{Phase, Session, SessionContext, SessionRequests, Step};

/// Echoes each complete line; closes on "quit".
struct LineEcho;

impl Session for LineEcho {
    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        let mut wrote = false;
        while let Some(end) = input.bytes().iter().position(|&byte| byte == b'\n') {
            let line = &input.bytes()[..=end];
            if line == b"quit\n" {
                input.consume(end + 1);
                return Step::Close;
            }
            if context.output().push(line).is_err() {
                // Budget full: flush first; the unconsumed line stays in the input.
                return Step::Write;
            }
            input.consume(end + 1);
            wrote = true;
        }
        if !input.is_empty() {
            context.set_phase(Phase::Receiving);
        }
        if wrote { Step::Write } else { Step::Read }
    }
}

/// Runs the session over `segments` as they would arrive from recv, returning what went out and the last step.
fn drive(segments: &[&[u8]], output_budget: usize) -> (Vec<u8>, Step, Vec<SessionRequests>) {
    let pool = BufferPool::new(1 << 20, true);
    let mut buffers = pool.worker();
    let mut read = ReadBuffer::new(buffers.acquire(SizeClass::Small).unwrap());
    let mut output = Output::new(output_budget);
    let info = ConnectionInfo::new(
        ConnectionId::new(1).unwrap(),
        ListenerId(0),
        "127.0.0.1:7000".parse().unwrap(),
        "127.0.0.1:50000".parse().unwrap(),
        Instant::now(),
    );
    let mut session = LineEcho;
    let mut wire = Vec::new();
    let mut requests_seen = Vec::new();
    let mut step = Step::Read;
    for segment in segments {
        let spare = read.spare_mut();
        spare[..segment.len()].copy_from_slice(segment);
        read.commit(segment.len());
        loop {
            let mut requests = SessionRequests::default();
            let consumed = {
                let mut input = read.input();
                let mut context =
                    SessionContext::new(&info, &mut output, &mut requests, Instant::now());
                step = session.on_data(&mut input, &mut context);
                input.consumed()
            };
            read.consume(consumed);
            requests_seen.push(requests);
            // Flush everything, one byte-limited "syscall" at a time.
            while !output.is_empty() {
                let mut slices = [IoSlice::new(&[]); IO_SLICES_MAX];
                let filled = output.fill_io_slices(&mut slices);
                let mut taken = 0;
                for slice in &slices[..filled] {
                    let part = &slice[..slice.len().min(7 - taken)];
                    wire.extend_from_slice(part);
                    taken += part.len();
                }
                output.advance(taken);
            }
            // After a flush, a session that stopped for room gets its remaining complete lines.
            if step != Step::Write || !read.unread().contains(&b'\n') {
                break;
            }
        }
        if step == Step::Close {
            break;
        }
    }
    buffers.release(read.into_buffer());
    (wire, step, requests_seen)
}

#[test]
fn every_split_point_of_two_requests_gives_the_same_echo() {
    let stream: &[u8] = b"hello\nworld\nquit\n";
    let (whole, step, _) = drive(&[stream], 1024);
    assert_eq!(whole, b"hello\nworld\n");
    assert_eq!(step, Step::Close);
    for split in 0..=stream.len() {
        let (wire, step, _) = drive(&[&stream[..split], &stream[split..]], 1024);
        assert_eq!(wire, whole, "splitting at byte {split} changed the echo");
        assert_eq!(step, Step::Close, "splitting at byte {split} lost the quit");
    }
}

#[test]
fn a_tiny_output_budget_still_delivers_every_line_in_order() {
    let stream: &[u8] = b"aaaaaaaa\nbbbbbbbb\ncccccccc\nquit\n";
    let (wire, step, _) = drive(&[stream], 9);
    assert_eq!(wire, b"aaaaaaaa\nbbbbbbbb\ncccccccc\n");
    assert_eq!(step, Step::Close);
}

#[test]
fn a_partial_line_asks_for_the_receiving_phase() {
    let (_, step, requests) = drive(&[b"partial"], 1024);
    assert_eq!(step, Step::Read);
    assert_eq!(requests.last().unwrap().phase, Some(Phase::Receiving));
}
