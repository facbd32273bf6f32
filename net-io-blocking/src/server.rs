//! The [`Server`] owner: it holds the threads and shuts the server down when dropped.

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use net_io_core::{ListenerId, NetError, Stats};

use crate::handle::{DrainReport, ServerHandle};
use crate::listener::ListenerSpec;
use crate::shared::RuntimeControl;

/// A running server. Dropping it runs [`Server::shutdown`] with the configured `drain_timeout`.
#[must_use = "dropping the server shuts it down at once"]
pub struct Server {
    handle: ServerHandle,
    threads: Vec<JoinHandle<()>>,
    closer: Arc<dyn RuntimeControl>,
    finished: bool,
}

impl Server {
    pub(crate) fn new(
        handle: ServerHandle,
        threads: Vec<JoinHandle<()>>,
        closer: Arc<dyn RuntimeControl>,
    ) -> Self {
        Self {
            handle,
            threads,
            closer,
            finished: false,
        }
    }

    pub(crate) fn push_thread(&mut self, thread: JoinHandle<()>) {
        self.threads.push(thread);
    }

    /// A cloneable handle for other threads.
    pub fn handle(&self) -> ServerHandle {
        self.handle.clone()
    }

    /// The address of the first listener.
    pub fn local_addr(&self) -> SocketAddr {
        self.handle.local_addr()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> Stats {
        self.handle.stats()
    }

    /// Adds a listener while the server runs; see [`ServerHandle::add_listener`].
    pub fn add_listener(&self, spec: ListenerSpec) -> Result<ListenerId, NetError> {
        self.handle.add_listener(spec)
    }

    /// Removes a listener and drains its connections; see [`ServerHandle::remove_listener`].
    pub fn remove_listener(
        &self,
        id: ListenerId,
        drain_deadline: Instant,
    ) -> Result<DrainReport, NetError> {
        self.handle.remove_listener(id, drain_deadline)
    }

    /// Drains until `deadline`, stops the accept threads and workers, closes the listeners and joins every
    /// thread. Idle connections close at once with `Shutdown` (which, like every reason but the four graceful
    /// ones, resets), busy ones may finish until `deadline` and are then killed with `DrainDeadline`.
    /// Connections still in the kernel backlog are reset when the listeners close.
    pub fn shutdown(mut self, deadline: Instant) -> DrainReport {
        self.stop(deadline)
    }

    /// Sleeps until [`ServerHandle::request_stop`], then shuts down with the `drain_timeout`.
    pub fn run_until_stopped(self) -> DrainReport {
        self.handle.wait_for_stop();
        let deadline =
            crate::clock::deadline_after(Instant::now(), self.handle.core.limits.drain_timeout);
        self.shutdown(deadline)
    }

    fn stop(&mut self, deadline: Instant) -> DrainReport {
        if self.finished {
            return DrainReport {
                graceful: 0,
                killed: 0,
                elapsed: Duration::ZERO,
            };
        }
        self.finished = true;
        // Set before the drain so that its idle closes say `Shutdown`; the accept threads return at once
        // (the drain closes the door anyway) and the door cannot be opened again.
        self.handle.core.stopping.store(true, Ordering::Release);
        self.handle.core.wake_acceptors();
        let report = self.handle.drain(deadline);
        self.closer.close_queue();
        self.handle.wake_all();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
        // Taken out under the lock and joined without it: an accept thread may itself take the lock (its
        // control-line reaction opens or closes the door).
        let live = std::mem::take(&mut self.handle.core.lock_listeners().live);
        for listener in live {
            self.handle.core.retire_listener(listener);
        }
        self.handle.request_stop();
        report
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let deadline =
            crate::clock::deadline_after(Instant::now(), self.handle.core.limits.drain_timeout);
        self.stop(deadline);
    }
}

impl fmt::Debug for Server {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("Server")
            .field("handle", &self.handle)
            .field("threads", &self.threads.len())
            .finish_non_exhaustive()
    }
}
