//! `Signal`: parks until a signal arrives; the counting handler rings an eventfd the manager watches.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use net_io_sys::signal::SignalWatch;

use crate::error::RuntimeError;
use crate::pool::global_pool;
use crate::task::{Source, Step, Task, Wait, Waker, sealed};

/// Backstop poll for a missed wake.
const SIGNAL_POLL: Duration = Duration::from_millis(50);

#[derive(Default)]
struct Entry {
    pending: u64,
    waiters: Vec<Waker>,
}

/// Per-signal delivery counts and parked waiters, fed by the manager when the signal eventfd rings.
#[derive(Default)]
pub(crate) struct SignalRegistry {
    entries: Mutex<HashMap<i32, Entry>>,
}

impl SignalRegistry {
    /// Moves the handler's counts into the entries and wakes waiters.
    pub(crate) fn deliver(&self) {
        let _ = net_io_sys::signal::drain_wake();
        let waiters: Vec<Waker> = {
            let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
            let mut waiters = Vec::new();
            for (signal, entry) in entries.iter_mut() {
                let count = net_io_sys::signal::take_count(*signal);
                if count > 0 {
                    entry.pending += count;
                    waiters.append(&mut entry.waiters);
                }
            }
            waiters
        };
        waiters.iter().for_each(|waker| {
            waker.wake();
        });
    }

    fn take(&self, signal: i32) -> u64 {
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        let entry = entries.entry(signal).or_default();
        // Counts the manager has not moved yet still belong to this signal.
        entry.pending += net_io_sys::signal::take_count(signal);
        std::mem::take(&mut entry.pending)
    }

    pub(crate) fn abandon(&self) {
        let waiters: Vec<Waker> = {
            let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
            entries
                .values_mut()
                .flat_map(|entry| entry.waiters.drain(..))
                .collect()
        };
        waiters.iter().for_each(|waker| {
            waker.wake();
        });
    }
}

struct SignalSource {
    signal: i32,
}

impl Source for SignalSource {
    fn register(&self, _direction: u8, waker: Waker) -> bool {
        let Some(pool) = global_pool() else {
            return false;
        };
        let mut entries = pool
            .reactor
            .signals
            .entries
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let entry = entries.entry(self.signal).or_default();
        entry.pending += net_io_sys::signal::take_count(self.signal);
        if entry.pending > 0 {
            return false;
        }
        entry.waiters.push(waker);
        true
    }
}

/// Signal constructors.
#[derive(Debug)]
pub struct Signal;

impl Signal {
    /// A task that waits for `signal` and returns how many deliveries arrived since its last report.
    /// Watching takes the signal over (its default action no longer happens) until the task is dropped.
    /// `SIGKILL`, `SIGSTOP` and reserved numbers read `BadSignal`.
    pub fn wait(signal: i32) -> SignalWait {
        let watch = SignalWatch::install(signal).map_err(|_| RuntimeError::BadSignal);
        SignalWait {
            source: Arc::new(SignalSource { signal }),
            watch: watch.map(Arc::new),
        }
    }
}

/// The task [`Signal::wait`] builds.
pub struct SignalWait {
    source: Arc<SignalSource>,
    watch: Result<Arc<SignalWatch>, RuntimeError>,
}

impl std::fmt::Debug for SignalWait {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("SignalWait")
            .field("signal", &self.source.signal)
            .finish()
    }
}

impl Clone for SignalWait {
    fn clone(&self) -> Self {
        SignalWait {
            source: Arc::clone(&self.source),
            watch: self.watch.clone(),
        }
    }
}

impl sealed::Sealed for SignalWait {}

impl Task for SignalWait {
    type Input = ();
    type Output = u64;

    fn start(&mut self, _input: ()) {}

    fn step(&mut self) -> Step<u64> {
        if let Err(error) = &self.watch {
            return Step::Done(Err(error.clone()));
        }
        let count = match global_pool() {
            Some(pool) => pool.reactor.signals.take(self.source.signal),
            None => net_io_sys::signal::take_count(self.source.signal),
        };
        if count > 0 {
            return Step::Done(Ok(count));
        }
        Step::Park(Wait::on(
            self.source.clone(),
            0,
            Some(Instant::now() + SIGNAL_POLL),
        ))
    }
}
