//! Property test: the bytes an Output hands to vectored writes are exactly the pushes it accepted, in order.

use std::io::IoSlice;

use bytes::Bytes;
use net_io_core::output::{IO_SLICES_MAX, Output};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Action {
    Push(Vec<u8>),
    PushPartial(Vec<u8>),
    PushStatic(usize),
    PushOwned(Vec<u8>),
    /// A write that the kernel takes only this many bytes of.
    Write(usize),
}

static STATIC_TEXT: [u8; 64] = *b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-_";

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..300).prop_map(Action::Push),
        prop::collection::vec(any::<u8>(), 0..300).prop_map(Action::PushPartial),
        (0usize..64).prop_map(Action::PushStatic),
        prop::collection::vec(any::<u8>(), 0..300).prop_map(Action::PushOwned),
        (0usize..700).prop_map(Action::Write),
    ]
}

fn write(output: &mut Output, limit: usize, wire: &mut Vec<u8>) {
    let mut slices = [IoSlice::new(&[]); IO_SLICES_MAX];
    let filled = output.fill_io_slices(&mut slices);
    let mut taken = 0;
    for slice in &slices[..filled] {
        let part = &slice[..slice.len().min(limit - taken)];
        wire.extend_from_slice(part);
        taken += part.len();
        if taken == limit {
            break;
        }
    }
    output.advance(taken);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn the_written_stream_equals_the_accepted_pushes(
        budget in 1usize..1024,
        actions in prop::collection::vec(action(), 0..80),
    ) {
        let mut output = Output::new(budget);
        let mut accepted = Vec::new();
        let mut wire = Vec::new();
        for action in actions {
            match action {
                Action::Push(bytes) => {
                    if output.push(&bytes).is_ok() {
                        accepted.extend_from_slice(&bytes);
                    }
                }
                Action::PushPartial(bytes) => {
                    let count = output.push_partial(&bytes);
                    accepted.extend_from_slice(&bytes[..count]);
                }
                Action::PushStatic(length) => {
                    if output.push_static(&STATIC_TEXT[..length]).is_ok() {
                        accepted.extend_from_slice(&STATIC_TEXT[..length]);
                    }
                }
                Action::PushOwned(bytes) => {
                    if output.push_owned(Bytes::from(bytes.clone())).is_ok() {
                        accepted.extend_from_slice(&bytes);
                    }
                }
                Action::Write(limit) => write(&mut output, limit, &mut wire),
            }
            prop_assert!(output.budget() - output.room() <= budget, "the budget was exceeded");
            prop_assert_eq!(output.pending(), accepted.len() - wire.len(), "pending bytes do not add up");
        }
        while !output.is_empty() {
            write(&mut output, 97, &mut wire);
        }
        prop_assert_eq!(wire, accepted);
    }
}
