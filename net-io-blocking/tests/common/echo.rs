//! The echoing session and handlers the tests serve, and the plain echo servers the counting tests (of
//! allocations, system calls, descriptors) measure: one copy each, so every test echoes the same way.

use net_io_blocking::{
    ConnectionInfo, HandlerDriver, Input, Limits, NetError, Server, ServerBuilder, Session,
    SessionContext, SessionDriver, Step, TcpConnection,
};

use super::Recorder;

/// Which driver a plain echo server runs on, and how many threads it has.
#[derive(Clone, Copy, Debug)]
pub enum EchoDriver {
    /// The [`echo`] handler on `workers` worker threads.
    Handler {
        /// Worker threads.
        workers: usize,
    },
    /// The [`echo`] handler on coroutines over `loops` event loops.
    Coroutines {
        /// Event-loop threads.
        loops: usize,
    },
    /// [`Echo`] sessions on `workers` worker threads.
    Sessions {
        /// Worker threads.
        workers: usize,
    },
    /// [`Echo`] sessions on `loops` event loops.
    EventLoop {
        /// Event-loop threads.
        loops: usize,
    },
}

/// A session that echoes whatever arrives, as much as the output budget takes each time.
#[derive(Debug)]
pub struct Echo;

impl Session for Echo {
    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        let taken = context.output().push_partial(input.bytes());
        input.consume(taken);
        Step::Write
    }
}

/// A handler that echoes each read until the peer closes, from a buffer on its own stack (so the echo path
/// allocates nothing, which the allocation count relies on).
pub fn echo(connection: &mut TcpConnection<'_>) -> Result<(), NetError> {
    let mut buffer = [0_u8; 4096];
    loop {
        let read = connection.read(&mut buffer)?;
        if read == 0 {
            return Ok(());
        }
        connection.write_all(&buffer[..read])?;
    }
}

/// A handler that reads whole 4-byte messages and echoes each once it is complete, until the peer closes.
pub fn echo_fours(connection: &mut TcpConnection<'_>) -> Result<(), NetError> {
    let mut buffer = [0u8; 4];
    loop {
        let mut got = 0;
        while got < 4 {
            let count = connection.read(&mut buffer[got..])?;
            if count == 0 {
                return Ok(());
            }
            got += count;
        }
        connection.write_all(&buffer)?;
    }
}

/// A handler that answers the client address it sees (one line), then echoes until the peer closes.
pub fn who_am_i(connection: &mut TcpConnection<'_>) -> Result<(), NetError> {
    let line = format!("{}\n", connection.peer_addr());
    connection.write_all(line.as_bytes())?;
    echo(connection)
}

/// A plain echo server on 127.0.0.1: the builder's defaults but for the driver, no event sink, allows all.
/// The counting tests use it so that what they count is the echo path and nothing the test added.
pub fn plain_echo_server(driver: EchoDriver) -> Server {
    let builder = ServerBuilder::new().listen("127.0.0.1:0");
    let (built, what) = match driver {
        EchoDriver::Handler { workers } => (
            builder.workers(workers).handler(echo).allow_all().build(),
            "handler",
        ),
        EchoDriver::Coroutines { loops } => (
            builder
                .handler_driver(HandlerDriver::Coroutines { loops })
                .handler(echo)
                .allow_all()
                .build(),
            "coroutine handler",
        ),
        EchoDriver::Sessions { workers } => (
            builder
                .workers(workers)
                .session_driver(SessionDriver::Threads)
                .sessions(|_: &ConnectionInfo| Some(Echo))
                .allow_all()
                .build(),
            "sessions",
        ),
        EchoDriver::EventLoop { loops } => (
            builder
                .session_driver(SessionDriver::EventLoop { loops })
                .sessions(|_: &ConnectionInfo| Some(Echo))
                .allow_all()
                .build(),
            "event-loop",
        ),
    };
    built.unwrap_or_else(|error| panic!("the {what} echo server did not start: {error}"))
}

/// An [`Echo`] sessions server for the tests that watch its events: [`super::test_builder`]'s settings,
/// allows all.
pub fn echo_server(workers: usize, limits: Limits, recorder: &Recorder) -> Server {
    echo_server_on(super::session_driver(), workers, limits, recorder)
}

/// [`echo_server`] on the session driver `driver`.
pub fn echo_server_on(
    driver: SessionDriver,
    workers: usize,
    limits: Limits,
    recorder: &Recorder,
) -> Server {
    super::test_builder(workers, limits, recorder)
        .session_driver(driver)
        .sessions(|_info: &ConnectionInfo| Some(Echo))
        .allow_all()
        .build()
        .expect("the test server should start")
}
