//! The echoing session and handlers the tests serve: one copy each, so every test echoes the same way.

use net_io_blocking::{Input, NetError, Session, SessionContext, Step, TcpConnection};

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
