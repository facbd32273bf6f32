//! Error text: every `RuntimeError` says what happened and what to do, pinned by an insta snapshot.

use task_runtime::RuntimeError;

#[test]
fn every_error_message_is_pinned() {
    let errors = [
        RuntimeError::CheckError(Some(24)),
        RuntimeError::CheckError(None),
        RuntimeError::AddressLock,
        RuntimeError::AlreadyInit,
        RuntimeError::NotInitialised,
        RuntimeError::AlreadyTaken,
        RuntimeError::Finished,
        RuntimeError::Cancelled,
        RuntimeError::NoSuchTask,
        RuntimeError::TaskFailed,
        RuntimeError::NotReady,
        RuntimeError::StillInUse,
        RuntimeError::BadPath,
        RuntimeError::BadArgument,
        RuntimeError::BadVariable,
        RuntimeError::BadDirectory,
        RuntimeError::TimedOut,
        RuntimeError::BadAddress,
        RuntimeError::Closed,
        RuntimeError::TooLong,
        RuntimeError::BadSignal,
    ];
    let text: String = errors
        .iter()
        .map(|error| format!("{error:?}: {error}\n"))
        .collect();
    insta::assert_snapshot!(text);
}

#[test]
fn io_errors_map_to_the_cause_a_caller_can_act_on() {
    use std::io::{Error, ErrorKind};
    assert_eq!(
        RuntimeError::from(Error::from(ErrorKind::AddrInUse)),
        RuntimeError::AddressLock
    );
    assert_eq!(
        RuntimeError::from(Error::from(ErrorKind::NotFound)),
        RuntimeError::BadPath
    );
    assert_eq!(
        RuntimeError::from(Error::from(ErrorKind::ConnectionRefused)),
        RuntimeError::BadAddress
    );
    assert_eq!(
        RuntimeError::from(Error::from(ErrorKind::BrokenPipe)),
        RuntimeError::Closed
    );
    assert_eq!(
        RuntimeError::from(Error::from_raw_os_error(libc::EMFILE)),
        RuntimeError::CheckError(Some(libc::EMFILE))
    );
}
