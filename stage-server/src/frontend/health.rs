//! Whether the chain behind stage 0 answers: a task-runtime task probes it every [`PROBE_GAP`] (a hello
//! through every stage), every [`DOWN_PROBE_GAP`] while it is down, `/health` reports it, and lanes whose link
//! broke reconnect only once it is back.
//!
//! A lane's link that fails is dropped; the lane opens a new one for its next request, so a stage process
//! that restarted is picked up without restarting stage 0. While the probe says the chain is down, requests
//! fail at once with 503 (and a `Retry-After`) instead of each waiting out a connect timeout.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use task_runtime::{Compute, Runtime, TaskHandle};

use crate::driver::{self, ChainOptions};
use crate::telemetry::names;
use crate::wire::Hello;

/// The gap between two probes of the chain.
pub(crate) const PROBE_GAP: Duration = Duration::from_secs(2);
/// The gap between two probes while the chain is down: requests fail at once meanwhile, so a stage that is
/// back should be seen soon (a probe of a stage that is not back costs a refused connect).
const DOWN_PROBE_GAP: Duration = Duration::from_millis(250);
/// How long one probe may take to connect and hear every stage's hello.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// The chain's last known state.
#[derive(Debug, Default)]
pub(crate) struct ChainHealth {
    /// `None` while the chain answers; the reason it did not, otherwise.
    down: Mutex<Option<String>>,
    /// How many times the chain went down: a lane's link opened before the latest outage leads to a stage
    /// process that has since died (and maybe restarted), so the lane opens a new one before using it.
    outages: AtomicU64,
}

impl ChainHealth {
    /// Why the chain is down, if the last probe or link failure said so.
    pub(crate) fn down_reason(&self) -> Option<String> {
        self.down
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// Records that the chain answered.
    pub(crate) fn mark_up(&self) {
        let mut down = self
            .down
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(reason) = down.take() {
            tracing::info!(reason, "{}", names::EVENT_CHAIN_UP);
        }
    }

    /// Records that the chain did not answer, and why.
    pub(crate) fn mark_down(&self, reason: String) {
        let mut down = self
            .down
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if down.is_none() {
            tracing::warn!(reason, "{}", names::EVENT_CHAIN_DOWN);
            self.outages.fetch_add(1, Ordering::AcqRel);
        }
        *down = Some(reason);
    }

    /// How many times the chain has gone down so far.
    pub(crate) fn outages(&self) -> u64 {
        self.outages.load(Ordering::Acquire)
    }
}

/// Starts the repeating probe of the chain at `next` (cancel the handle to stop it).
pub(crate) fn start_probe(
    health: Arc<ChainHealth>,
    ours: Hello,
    next: SocketAddr,
    mut options: ChainOptions,
) -> TaskHandle<()> {
    // The hello's answer gets twice the connect deadline: the whole probe stays within PROBE_TIMEOUT.
    options.connect_timeout = PROBE_TIMEOUT / 2;
    options.reply_timeout = PROBE_TIMEOUT;
    let mut last: Option<Instant> = None;
    Runtime::task(Compute::compute(move |()| {
        // The task wakes every DOWN_PROBE_GAP; while the chain answers it probes only every PROBE_GAP.
        if health.down_reason().is_none() && last.is_some_and(|last| last.elapsed() < PROBE_GAP) {
            return;
        }
        last = Some(Instant::now());
        match driver::probe(&ours, next, options.clone()) {
            Ok(_) => health.mark_up(),
            Err(error) => health.mark_down(format!("stage 1 at {next}: {error}")),
        }
    }))
    .repeat()
    .every(DOWN_PROBE_GAP)
    .spawn()
}
