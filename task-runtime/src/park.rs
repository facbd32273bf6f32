//! The workers' park and notify protocol: the epoch word idle workers sleep on, the count of parked workers
//! and the one-wake-in-flight flag, kept apart from the pool so that a loom model can check it alone.
//!
//! ```text
//!   pusher                                   parking worker
//!   ──────                                   ──────────────
//!   queue the task                           ticket = prepare():  read epoch, parked += 1,
//!   notify():  fence                                              clear wake_pending, fence
//!              parked == 0? done             re-check the queues (and stop / kill flags)
//!              set wake_pending; was set?      found something: cancel(ticket)        (parked -= 1)
//!                done (a wake is in flight)    nothing:         wait(ticket, timeout) (futex on epoch)
//!              epoch += 1, futex wake 1                         parked -= 1, clear wake_pending
//!                                            a woken worker that takes a task passes the wake on
//!                                            (notify) when work is left and a worker is parked
//! ```
//!
//! Why no push is slept through (the loom model in `loom_models` checks it; see there for its bounds):
//! - A worker the pusher did not see parked ran its re-check after the pusher's fence (the two fences
//!   order the `parked` increment against the push), so the re-check sees the task.
//! - A worker the pusher saw parked cleared the flag after reading the epoch. A notify that then finds
//!   the flag clear bumps the epoch after that read, so the worker's futex wait returns at once or the
//!   wake reaches it; a notify that finds the flag set was preceded by one that set it after the clear,
//!   and so bumped after the read too. A flag left set by a wake that reached nobody (every parked
//!   worker backed out or saw the new epoch) is cleared by the next worker that parks.
//! - A worker already asleep is woken by the notify that wins the flag, or, when a wake is in flight,
//!   by its receiver, which passes the wake on after taking a task.
//!
//! Cost: a push while no worker is parked is one fence and one load; at most one wake system call is in
//! flight. The flag is cleared with swaps, not plain stores: a swap costs a few cycles more on the park
//! path, and loom checks it faithfully (it orders a plain store only partially against a racing swap and
//! then reports wake-ups lost through values no real execution can read).

#[cfg(loom)]
use loom::sync::atomic::{AtomicBool, AtomicU32, Ordering, fence};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering, fence};
use std::time::Duration;

pub(crate) use net_io_sys::futex::Wake;

/// The shared parking state of one pool's workers.
pub(crate) struct Parking {
    /// The futex word parked workers sleep on; bumped by the notify that wins `wake_pending`, and by
    /// `wake_all`.
    epoch: AtomicU32,
    /// Workers between [`Parking::prepare`] and the end of their [`Parking::cancel`] or [`Parking::wait`].
    parked: AtomicU32,
    /// A wake is on its way to a parked worker, so later notifies make no system call. Cleared by the
    /// worker leaving its wait and by every worker entering `prepare` (a wake can reach nobody).
    wake_pending: AtomicBool,
    /// Under loom the futex is modelled with a mutex and a condition variable.
    #[cfg(loom)]
    futex: model::Futex,
}

/// A worker's claim to park, holding the epoch it read; give it back through [`Parking::cancel`] or
/// [`Parking::wait`], so the parked count stays right.
#[must_use = "a ticket must be given back through cancel or wait, or the parked count stays raised"]
pub(crate) struct Ticket {
    epoch: u32,
}

impl Parking {
    /// Nobody parked, no wake in flight.
    pub(crate) fn new() -> Self {
        Parking {
            epoch: AtomicU32::new(0),
            parked: AtomicU32::new(0),
            wake_pending: AtomicBool::new(false),
            #[cfg(loom)]
            futex: model::Futex::new(),
        }
    }

    /// How many workers are parked or about to park (a hint for the chain wake; exact only under a fence).
    pub(crate) fn parked(&self) -> u32 {
        self.parked.load(Ordering::Relaxed)
    }

    /// Tells the parked workers that work was queued: call after the task is in a queue a parked worker's
    /// re-check looks at. Costs a fence and a load when nobody is parked, and no system call while a wake
    /// is already in flight.
    pub(crate) fn notify(&self) {
        // Pairs with the fence in `prepare`: either this load sees the worker counted, or the worker's
        // re-check sees our task (the store-load race of two threads that each write then read).
        fence(Ordering::SeqCst);
        if self.parked.load(Ordering::Relaxed) == 0 {
            return;
        }
        if self.wake_pending.swap(true, Ordering::AcqRel) {
            // A wake is in flight; its receiver passes it on if work is left (the chain wake).
            return;
        }
        // The bump releases our task to a worker that reads the new epoch, and makes the futex wait of a
        // worker that read the old one return at once.
        self.epoch.fetch_add(1, Ordering::AcqRel);
        self.wake_one();
    }

    /// Wakes every parked worker (shutdown and fault hooks). Set the flag the workers should see (stop,
    /// kill) before calling: a worker that reads the bumped epoch re-checks its flags before sleeping.
    pub(crate) fn wake_all(&self) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        self.wake_every();
    }

    /// Counts the calling worker parked and reads the epoch. The caller must re-check every cause to run
    /// (queues, stop, kill) after this and then give the ticket back with `cancel` or `wait`.
    pub(crate) fn prepare(&self) -> Ticket {
        let epoch = self.epoch.load(Ordering::Acquire);
        self.parked.fetch_add(1, Ordering::AcqRel);
        // A flag left set by a wake that reached nobody (or one that went to a worker already awake)
        // would make the next notify skip us. Cleared after the epoch read: a notify that sets it again
        // bumps the epoch after our read, so our futex wait cannot sleep through that notify.
        self.wake_pending.swap(false, Ordering::AcqRel);
        // Pairs with the fence in `notify`: see there.
        fence(Ordering::SeqCst);
        Ticket { epoch }
    }

    /// The re-check found something to do: the worker does not park after all.
    pub(crate) fn cancel(&self, ticket: Ticket) {
        let Ticket { epoch: _ } = ticket;
        self.parked.fetch_sub(1, Ordering::AcqRel);
    }

    /// Sleeps until a notify bumps the epoch past the ticket's, a wake arrives, or `timeout` passes
    /// (`None`: no timeout), then clears the wake-in-flight flag. A caller that then takes a task must
    /// `notify` again if work is left and a worker is parked (the chain wake).
    pub(crate) fn wait(&self, ticket: Ticket, timeout: Option<Duration>) -> Wake {
        let woke = self.sleep(ticket.epoch, timeout);
        self.parked.fetch_sub(1, Ordering::AcqRel);
        self.wake_pending.swap(false, Ordering::AcqRel);
        woke
    }

    #[cfg(not(loom))]
    fn sleep(&self, epoch: u32, timeout: Option<Duration>) -> Wake {
        // An error (only a fault injected by the shim) reads as a wake: the caller re-checks and parks again.
        net_io_sys::futex::wait(&self.epoch, epoch, timeout).unwrap_or(Wake::Woken)
    }

    #[cfg(not(loom))]
    fn wake_one(&self) -> usize {
        net_io_sys::futex::wake(&self.epoch, 1)
    }

    #[cfg(not(loom))]
    fn wake_every(&self) {
        net_io_sys::futex::wake_all(&self.epoch);
    }

    #[cfg(loom)]
    fn sleep(&self, epoch: u32, _timeout: Option<Duration>) -> Wake {
        // The model has no clock: a timed wait is a wait that may last forever, which is the case that
        // matters for a lost wake-up (a worker at the floor waits without a timeout).
        self.futex.wait(&self.epoch, epoch)
    }

    #[cfg(loom)]
    fn wake_one(&self) -> usize {
        self.futex.wake(1)
    }

    #[cfg(loom)]
    fn wake_every(&self) {
        self.futex.wake(usize::MAX);
    }
}

/// A futex modelled for loom: the word is compared under a mutex that the waker also takes, which gives
/// the same guarantee as `futex(2)`: a waiter either sees the waker's change of the word or is woken.
#[cfg(loom)]
mod model {
    use loom::sync::atomic::{AtomicU32, Ordering, fence};
    use loom::sync::{Condvar, Mutex};

    use super::Wake;

    /// Sleepers in arrival order: each takes the next number; a wake hands the turn to the oldest, as the
    /// kernel wakes waiters of one futex word first come, first served. A wake cannot be taken by a thread
    /// that arrives after it, which a bare count of wakes would allow.
    #[derive(Default)]
    struct Sleepers {
        /// The number the next sleeper takes.
        arrived: u64,
        /// Sleepers with a number below this have been woken.
        woken: u64,
    }

    pub(super) struct Futex {
        sleepers: Mutex<Sleepers>,
        ring: Condvar,
    }

    impl Futex {
        pub(super) fn new() -> Self {
            Futex {
                sleepers: Mutex::new(Sleepers::default()),
                ring: Condvar::new(),
            }
        }

        pub(super) fn wait(&self, word: &AtomicU32, expected: u32) -> Wake {
            let mut sleepers = self.sleepers.lock().unwrap();
            // The kernel issues a full barrier before it reads the word (futex_wait_setup's smp_mb,
            // paired with the one in futex_wake), so the read is ordered like a load after a SeqCst fence.
            fence(Ordering::SeqCst);
            if word.load(Ordering::Relaxed) != expected {
                return Wake::Changed;
            }
            let number = sleepers.arrived;
            sleepers.arrived += 1;
            while number >= sleepers.woken {
                sleepers = self.ring.wait(sleepers).unwrap();
            }
            Wake::Woken
        }

        pub(super) fn wake(&self, count: usize) -> usize {
            fence(Ordering::SeqCst);
            let mut sleepers = self.sleepers.lock().unwrap();
            let asleep = sleepers.arrived - sleepers.woken;
            let woken = asleep.min(count as u64);
            sleepers.woken += woken;
            if woken > 0 {
                self.ring.notify_all();
            }
            woken as usize
        }
    }
}

#[cfg(all(test, loom))]
mod loom_models {
    //! Two workers and one or two pushers over a counted queue, with the worker loop of `pool.rs` (take
    //! a task and pass the wake on, or park and re-check). A worker that takes the last task stops the
    //! others, so an execution ends only if every task is taken; a task left queued while every worker
    //! sleeps leaves every thread blocked, which loom reports as a deadlock.
    //!
    //! Bounds: CI runs each model with one preemption (about 5 s for both). With two preemptions, run by
    //! hand with `LOOM_DEPTH=2`, both pass in about 6 minutes on the shared 2-core machine (nearly all of
    //! it the two-pusher model).
    use loom::sync::Arc;
    use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use super::Parking;

    /// The pool around the protocol, cut down to a counted queue and a stop flag.
    struct Pool {
        parking: Parking,
        queued: AtomicUsize,
        taken: AtomicUsize,
        stop: AtomicBool,
        tasks: usize,
    }

    impl Pool {
        fn push(&self) {
            self.queued.fetch_add(1, Ordering::AcqRel);
            self.parking.notify();
        }

        fn take(&self) -> bool {
            self.queued
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |queued| {
                    queued.checked_sub(1)
                })
                .is_ok()
        }

        /// The worker loop of `pool.rs`: take a task and pass the wake on, or park.
        fn work(&self) {
            loop {
                if self.stop.load(Ordering::Acquire) {
                    return;
                }
                if self.take() {
                    if self.parking.parked() > 0 && self.queued.load(Ordering::Acquire) > 0 {
                        self.parking.notify();
                    }
                    if self.taken.fetch_add(1, Ordering::AcqRel) + 1 == self.tasks {
                        self.stop.store(true, Ordering::Release);
                        self.parking.wake_all();
                        return;
                    }
                    continue;
                }
                let ticket = self.parking.prepare();
                if self.queued.load(Ordering::Acquire) > 0 || self.stop.load(Ordering::Acquire) {
                    self.parking.cancel(ticket);
                    continue;
                }
                let _ = self.parking.wait(ticket, None);
            }
        }
    }

    /// Runs two workers and one pusher per entry of `pushes` (each pushing that many tasks one by one).
    fn run(pushes: &'static [usize]) {
        let mut builder = loom::model::Builder::new();
        // Five threads with loops: CI's bound (`LOOM_MAX_PREEMPTIONS`, 4) would run for hours, so the
        // model sets its own; `LOOM_DEPTH` raises it by hand.
        builder.preemption_bound = Some(
            std::env::var("LOOM_DEPTH")
                .ok()
                .and_then(|depth| depth.parse().ok())
                .unwrap_or(1),
        );
        builder.check(move || {
            let pool = Arc::new(Pool {
                parking: Parking::new(),
                queued: AtomicUsize::new(0),
                taken: AtomicUsize::new(0),
                stop: AtomicBool::new(false),
                tasks: pushes.iter().sum(),
            });
            let workers: Vec<_> = (0..2)
                .map(|_| {
                    let pool = Arc::clone(&pool);
                    loom::thread::spawn(move || pool.work())
                })
                .collect();
            let pushers: Vec<_> = pushes
                .iter()
                .map(|&count| {
                    let pool = Arc::clone(&pool);
                    loom::thread::spawn(move || {
                        for _ in 0..count {
                            pool.push();
                        }
                    })
                })
                .collect();
            for thread in pushers.into_iter().chain(workers) {
                thread.join().unwrap();
            }
            assert_eq!(
                pool.taken.load(Ordering::Acquire),
                pool.tasks,
                "a pushed task was never taken"
            );
        });
    }

    #[test]
    fn one_pusher_of_two_tasks_never_leaves_a_task_behind_sleeping_workers() {
        run(&[2]);
    }

    #[test]
    fn two_pushers_never_leave_a_task_behind_sleeping_workers() {
        run(&[1, 1]);
    }
}
