//! `--metrics ADDR`: a tiny HTTP/1.1 listener on its own net-io-blocking event loop that answers
//! `GET /metrics` with the process metrics as Prometheus text (and 404 to anything else), then closes.

use std::net::SocketAddr;

use net_io_blocking::{
    Input, Limits, NetError, Server, ServerBuilder, Session, SessionContext, SessionDriver, Step,
};

/// Request head bytes read at most.
const HEAD_MAX: usize = 8 << 10;

/// A running metrics listener; dropping it stops it.
#[derive(Debug)]
pub struct MetricsListener {
    server: Server,
}

impl MetricsListener {
    /// Listens on `address`; its connections count as server `metrics` in the net metrics.
    pub fn start(address: SocketAddr) -> Result<MetricsListener, NetError> {
        let limits = Limits::new()
            .idle_timeout(std::time::Duration::from_secs(10))
            .read_timeout(std::time::Duration::from_secs(10));
        let server = ServerBuilder::new()
            .listen(address)
            .session_driver(SessionDriver::EventLoop { loops: 1 })
            .limits(limits)
            .sessions(|_: &net_io_blocking::ConnectionInfo| Some(ScrapeSession::default()))
            .allow_all()
            .build()?;
        super::registry::register_server("metrics", server.handle());
        Ok(MetricsListener { server })
    }

    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }
}

/// One scrape: read the head, answer, close.
#[derive(Debug, Default)]
struct ScrapeSession {
    head: Vec<u8>,
    answered: bool,
}

impl Session for ScrapeSession {
    fn on_data(&mut self, input: &mut Input<'_>, context: &mut SessionContext<'_>) -> Step {
        if self.answered {
            input.consume_all();
            return Step::Close;
        }
        self.head.extend_from_slice(input.bytes());
        input.consume_all();
        let Some(end) = self
            .head
            .windows(4)
            .position(|window| window == b"\r\n\r\n")
        else {
            return if self.head.len() > HEAD_MAX {
                Step::Abort
            } else {
                Step::Read
            };
        };
        let line = String::from_utf8_lossy(&self.head[..end]);
        let mut words = line.split_whitespace();
        let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
        let (status, body) = if method == "GET" && (path == "/metrics" || path == "/") {
            ("200 OK", super::registry::render_process())
        } else {
            (
                "404 Not Found",
                "only GET /metrics is served here\n".to_owned(),
            )
        };
        let response = format!(
            "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        self.answered = true;
        if context.output().push(response.as_bytes()).is_err() {
            return Step::Abort;
        }
        Step::Write
    }

    fn on_writable(&mut self, _context: &mut SessionContext<'_>) -> Step {
        Step::Close
    }
}
