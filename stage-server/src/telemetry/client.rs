//! The OTLP exporters' HTTP client: one blocking HTTP/1.1 POST per export over a std `TcpStream`, run on the
//! exporter's own thread (the batch processor's or the periodic reader's), so no async runtime exists.
//!
//! Why std's `TcpStream` and not `net_io_blocking::connect`: the collector is usually named by host
//! (`otel-collector:4318`), which needs the resolver `ToSocketAddrs` has; and a shutdown must be able to cut
//! an export that a black-hole collector holds open, which `try_clone` plus `shutdown(Both)` from the
//! shutting-down thread does without any cooperation from the exporting thread. Every read and write runs
//! under the client's timeout; plain `http://` only (a collector behind TLS needs a local sidecar).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use opentelemetry_http::{HttpClient, HttpError, Request, Response};

use super::processor::EXPORT_COUNTERS;

/// Response bytes read at most (a collector answers with a small protobuf or an error text).
const RESPONSE_MAX: usize = 1 << 20;

/// What the client and whoever shuts it down share.
#[derive(Debug, Default)]
struct Shared {
    /// Set once at shutdown: exports in flight are cut and later ones fail at once.
    aborted: AtomicBool,
    /// The connections of exports in flight (clones), so an abort can shut them.
    in_flight: Mutex<Vec<TcpStream>>,
}

/// A blocking HTTP/1.1 client for the OTLP/HTTP exporters.
#[derive(Clone, Debug)]
pub struct BlockingClient {
    shared: Arc<Shared>,
    timeout: Duration,
}

/// Cuts a [`BlockingClient`]'s exports from another thread.
#[derive(Clone, Debug)]
pub struct AbortHandle {
    shared: Arc<Shared>,
}

impl BlockingClient {
    /// A client whose connect, each write and each read wait at most `timeout`, and a whole exchange at most
    /// twice that.
    pub fn new(timeout: Duration) -> BlockingClient {
        BlockingClient {
            shared: Arc::new(Shared::default()),
            timeout,
        }
    }

    /// The handle that cuts this client's exports.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle {
            shared: Arc::clone(&self.shared),
        }
    }

    /// Sends `request` and reads the whole response (the connection closes after it); a failure or a status
    /// other than 2xx counts in the export errors.
    pub fn exchange(&self, request: &Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let result = self.exchange_once(request);
        if !result
            .as_ref()
            .is_ok_and(|response| response.status().is_success())
        {
            EXPORT_COUNTERS.errors.fetch_add(1, Ordering::Relaxed);
        }
        result
    }

    fn exchange_once(&self, request: &Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        if self.shared.aborted.load(Ordering::Acquire) {
            return Err("the telemetry exporter is shut down".into());
        }
        let uri = request.uri();
        if uri.scheme_str().is_some_and(|scheme| scheme != "http") {
            return Err(format!(
                "{uri}: only http:// collectors are supported (put a TLS sidecar next to the stage)"
            )
            .into());
        }
        let host = uri.host().ok_or_else(|| format!("{uri} names no host"))?;
        let port = uri.port_u16().unwrap_or(80);
        let address = (host, port)
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| format!("{host} resolves to no address"))?;
        let mut stream = TcpStream::connect_timeout(&address, self.timeout)?;
        stream.set_read_timeout(Some(self.timeout))?;
        stream.set_write_timeout(Some(self.timeout))?;
        let _ = stream.set_nodelay(true);
        let registered = stream.try_clone()?;
        {
            let mut in_flight = self.lock();
            if self.shared.aborted.load(Ordering::Acquire) {
                return Err("the telemetry exporter is shut down".into());
            }
            in_flight.push(registered);
        }
        let result = self.send_and_read(&mut stream, request, host, port);
        self.lock().retain(|other| {
            other.peer_addr().ok() != stream.peer_addr().ok()
                || other.local_addr().ok() != stream.local_addr().ok()
        });
        result
    }

    fn send_and_read(
        &self,
        stream: &mut TcpStream,
        request: &Request<Bytes>,
        host: &str,
        port: u16,
    ) -> Result<Response<Bytes>, HttpError> {
        let deadline = Instant::now() + self.timeout * 2;
        let path = request
            .uri()
            .path_and_query()
            .map_or("/", |path| path.as_str());
        let mut head = format!(
            "{} {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\nContent-Length: {}\r\n",
            request.method(),
            request.body().len()
        );
        for (name, value) in request.headers() {
            if name == http::header::CONTENT_LENGTH || name == http::header::CONNECTION {
                continue;
            }
            if let Ok(value) = value.to_str() {
                head.push_str(name.as_str());
                head.push_str(": ");
                head.push_str(value);
                head.push_str("\r\n");
            }
        }
        head.push_str("\r\n");
        stream.write_all(head.as_bytes())?;
        stream.write_all(request.body())?;
        let mut response = Vec::new();
        let mut buffer = [0u8; 8192];
        let body_start = loop {
            if Instant::now() >= deadline {
                return Err("the collector did not answer in time".into());
            }
            let count = stream.read(&mut buffer)?;
            if count == 0 {
                return Err("the collector closed the connection before answering".into());
            }
            response.extend_from_slice(&buffer[..count]);
            if let Some(end) = find(&response, b"\r\n\r\n") {
                break end + 4;
            }
            if response.len() > RESPONSE_MAX {
                return Err("the collector's response head is too long".into());
            }
        };
        let head = std::str::from_utf8(&response[..body_start])?;
        let status: u16 = head
            .split_whitespace()
            .nth(1)
            .and_then(|status| status.parse().ok())
            .ok_or("the collector's response has no status")?;
        let length = head.lines().find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.trim()
                .eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse::<usize>().ok())
                .flatten()
        });
        let wanted = length.map_or(RESPONSE_MAX, |length| length.min(RESPONSE_MAX));
        while response.len() - body_start < wanted && Instant::now() < deadline {
            match stream.read(&mut buffer) {
                Ok(0) => break,
                Ok(count) => response.extend_from_slice(&buffer[..count]),
                Err(error) if length.is_none() => {
                    let _ = error;
                    break;
                }
                Err(error) => return Err(error.into()),
            }
        }
        let end = (body_start + wanted).min(response.len());
        let body = Bytes::copy_from_slice(&response[body_start..end]);
        Ok(Response::builder().status(status).body(body)?)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<TcpStream>> {
        self.shared
            .in_flight
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl AbortHandle {
    /// Cuts every export in flight and fails every later one at once.
    pub fn abort(&self) {
        self.shared.aborted.store(true, Ordering::Release);
        let in_flight = std::mem::take(
            &mut *self
                .shared
                .in_flight
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        );
        for stream in in_flight {
            // Wakes a read blocked on a collector that never answers (shutdown(2) on a clone of its socket).
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

#[async_trait::async_trait]
impl HttpClient for BlockingClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        // The exporters call this from their own threads under `futures_executor::block_on`: blocking here
        // blocks only that thread.
        self.exchange(&request)
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
}
