//! [`Coroutine`]: a stackful coroutine (from `corosensei`) that may move between threads until it first runs,
//! then stays on the thread that ran it, with a small per-thread pool of stacks.
//!
//! A coroutine runs a closure on its own stack and can suspend anywhere inside it ([`Yielder::suspend`]),
//! handing a value to whoever called [`Coroutine::resume`]; the next `resume` continues from there. The event
//! loops use this to run a blocking handler without a thread: the handler's `read` suspends until the loop
//! has input for it.
//!
//! # Threads
//!
//! `corosensei::Coroutine` is `!Send` because its stack may hold `!Send` values (an `Rc`, a reference to a
//! thread-local) once it has run. This wrapper is `Send` and keeps that sound by pinning a coroutine to the
//! thread that first resumes it:
//!
//! - before the first `resume` the stack holds only the closure, which must be `Send`, so the coroutine can
//!   move anywhere;
//! - a `resume` on any other thread than the first one is refused with [`ResumeError::ForeignThread`];
//! - dropping a started, unfinished coroutine on a foreign thread leaks its stack instead of unwinding it
//!   there (running its destructors would touch the foreign data on another thread).
//!
//! One hazard the pin does not cover: a suspended coroutine may hold a borrow of one of its thread's
//! thread-locals (it suspended inside `LocalKey::with`). Do not keep a started coroutine in a thread-local
//! itself: when the thread exits, the order in which thread-locals are destroyed is unspecified, and
//! unwinding the coroutine after the borrowed one is gone would run its destructors against freed data.
//! Keep it in a value that the thread's own code drops before the thread ends (as the event loops do: a
//! loop's connections, and their coroutines, are dropped when its function returns).
//!
//! # Stacks
//!
//! Each stack is `mmap`ed with a `PROT_NONE` guard page below it. **Overflowing a coroutine's stack hits the
//! guard page and kills the process with `SIGSEGV`**, as a thread's stack overflow aborts it: choose the
//! stack size for the deepest call chain the coroutine runs (the size is virtual memory; only the pages
//! touched become resident). Finished coroutines give their stack to a pool of the thread that dropped them
//! (at most [`STACK_POOL_MAX`] stacks per thread; stacks beyond that are unmapped), so connection churn does
//! not `mmap` and `munmap` per connection. A pooled stack keeps at most its top [`POOLED_RESIDENT_MAX`]
//! bytes resident: the pages below are given back (and read as zeros when next touched), so the pool holds
//! at most `STACK_POOL_MAX * POOLED_RESIDENT_MAX` (2 MiB) resident per thread, whatever its coroutines did.
//! The top pages keep what the last coroutine left there; safe code cannot read it (a new coroutine's
//! frames write before they read).
//!
//! # Dropping
//!
//! Dropping a suspended coroutine on its own thread unwinds its stack, so its destructors run: the
//! `suspend` it is waiting in panics with a private payload that `corosensei` catches at the coroutine's
//! root. Code that runs in those destructors sees [`std::thread::panicking`] return `true`, and must not
//! suspend again (if it does, the unwind starts over from that point). The unwind is a panic, so in a build
//! with `panic = "abort"` dropping a suspended coroutine aborts the process: there, run a coroutine to its end
//! before dropping it (net-io-blocking's handler driver does: a closed connection's handler is resumed with
//! the close and returns).

use std::cell::RefCell;
use std::fmt;
use std::io;
use std::thread::ThreadId;

use corosensei::stack::{DefaultStack, Stack};

pub use corosensei::{CoroutineResult, Yielder};

/// Stack size when none is chosen: 64 KiB of address space, of which an idle handler touches a few pages.
pub const DEFAULT_STACK_SIZE: usize = 64 * 1024;
/// The most finished stacks one thread keeps for reuse (per stack size together).
pub const STACK_POOL_MAX: usize = 128;
/// The most bytes at the top of a pooled stack that stay resident: the pages below are given back (and
/// zeroed) as the stack enters the pool, so a pool that once served deep coroutines does not keep their
/// pages, nor their data. The top is where every coroutine runs, so reuse touches no new page.
pub const POOLED_RESIDENT_MAX: usize = 16 * 1024;

/// A stackful coroutine that is `Send` until it first runs and pinned to that thread afterwards.
///
/// `Input` is what each [`resume`](Coroutine::resume) passes in, `Yield` what each suspend passes out and
/// `Return` what the closure returns. A panic inside the closure finishes the coroutine and continues in the
/// caller of `resume`.
pub struct Coroutine<Input, Yield, Return> {
    inner: Option<corosensei::Coroutine<Input, Yield, Return, DefaultStack>>,
    /// The thread of the first `resume`; `None` until then.
    home: Option<ThreadId>,
    stack_size: usize,
}

/// Why [`Coroutine::resume`] did not run the coroutine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ResumeError {
    /// The coroutine first ran on another thread; it can only be resumed there.
    ForeignThread,
    /// The coroutine finished (returned or panicked) already.
    Finished,
}

thread_local! {
    /// This thread's id, read without the reference count that `thread::current()` costs.
    static THREAD: ThreadId = std::thread::current().id();
    /// Finished stacks kept for reuse, with the size each was made for.
    static POOL: RefCell<Vec<(usize, DefaultStack)>> = const { RefCell::new(Vec::new()) };
}

impl<Input, Yield, Return> Coroutine<Input, Yield, Return> {
    /// Makes a coroutine that will run `body` on a stack of at least `stack_size` bytes (taken from this
    /// thread's pool when one of that size is there, else mapped), without running it yet.
    ///
    /// `body` gets the [`Yielder`] to suspend with and the input of the first `resume`.
    pub fn new<F>(stack_size: usize, body: F) -> io::Result<Self>
    where
        F: FnOnce(&Yielder<Input, Yield>, Input) -> Return + Send + 'static,
        Input: 'static,
        Yield: 'static,
        Return: 'static,
    {
        let stack = match take_pooled(stack_size) {
            Some(stack) => stack,
            None => {
                crate::shim::enter("coroutine_stack")?;
                DefaultStack::new(stack_size)?
            }
        };
        Ok(Self {
            inner: Some(corosensei::Coroutine::with_stack(stack, body)),
            home: None,
            stack_size,
        })
    }

    /// Runs the coroutine until it suspends (`Yield`) or finishes (`Return`).
    ///
    /// The first call pins the coroutine to this thread. A panic in the coroutine continues here, and the
    /// coroutine is finished afterwards.
    pub fn resume(&mut self, input: Input) -> Result<CoroutineResult<Yield, Return>, ResumeError> {
        let here = current_thread();
        match self.home {
            Some(home) if Some(home) != here => return Err(ResumeError::ForeignThread),
            Some(_) => {}
            None => self.home = Some(here.ok_or(ResumeError::ForeignThread)?),
        }
        let Some(inner) = self.inner.as_mut() else {
            return Err(ResumeError::Finished);
        };
        if inner.done() {
            return Err(ResumeError::Finished);
        }
        Ok(inner.resume(input))
    }

    /// Whether the coroutine returned or panicked (it cannot be resumed any more).
    pub fn is_finished(&self) -> bool {
        self.inner.as_ref().is_none_or(|inner| inner.done())
    }

    /// Whether the coroutine has run at all.
    pub fn is_started(&self) -> bool {
        self.home.is_some()
    }
}

impl<Input, Yield, Return> Drop for Coroutine<Input, Yield, Return> {
    fn drop(&mut self) {
        let Some(mut inner) = self.inner.take() else {
            return;
        };
        let suspended = self.home.is_some() && !inner.done();
        if suspended && self.home != current_thread() {
            // Unwinding would run destructors of this coroutine's (possibly `!Send`) data on a thread it
            // does not belong to. Leaking the stack is the sound choice; the memory stays mapped.
            std::mem::forget(inner);
            return;
        }
        // On our own thread (or never started, when only the `Send` closure is on the stack): unwind, so the
        // destructors run, then keep the stack.
        inner.force_unwind();
        if inner.done() {
            give_back(self.stack_size, inner.into_stack());
        }
    }
}

impl<Input, Yield, Return> fmt::Debug for Coroutine<Input, Yield, Return> {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("Coroutine")
            .field("stack_size", &self.stack_size)
            .field("started", &self.is_started())
            .field("finished", &self.is_finished())
            .finish()
    }
}

// SAFETY: the only part of a `corosensei::Coroutine` that is not `Send` is the data on its stack. Before the
// first `resume` that is the closure alone, which `new` requires to be `Send`. From the first `resume` on,
// the stack is only ever touched on that thread: `resume` refuses any other thread (`ForeignThread`), and
// `drop` on another thread leaks the stack without running anything on it. Moving the wrapper itself moves
// only the stack's address and bookkeeping, never the data the stack holds.
unsafe impl<Input, Yield, Return> Send for Coroutine<Input, Yield, Return> {}

impl fmt::Display for ResumeError {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ResumeError::ForeignThread => formatter.write_str(
                "the coroutine first ran on another thread and can only be resumed there; resume it on \
                 the thread that started it",
            ),
            ResumeError::Finished => formatter.write_str(
                "the coroutine has finished (returned or panicked) and cannot be resumed; make a new one",
            ),
        }
    }
}

impl std::error::Error for ResumeError {}

/// Finished stacks of `stack_size` this thread keeps for reuse (for tests and diagnostics).
pub fn pooled_stacks(stack_size: usize) -> usize {
    POOL.try_with(|pool| {
        pool.borrow()
            .iter()
            .filter(|(size, _)| *size == stack_size)
            .count()
    })
    .unwrap_or(0)
}

fn current_thread() -> Option<ThreadId> {
    THREAD.try_with(|id| *id).ok()
}

fn take_pooled(stack_size: usize) -> Option<DefaultStack> {
    POOL.try_with(|pool| {
        let mut pool = pool.borrow_mut();
        let position = pool.iter().rposition(|(size, _)| *size == stack_size)?;
        Some(pool.swap_remove(position).1)
    })
    .ok()
    .flatten()
}

fn give_back(stack_size: usize, stack: DefaultStack) {
    // A thread that is exiting (its pool already gone) unmaps the stack instead.
    let _ = POOL.try_with(|pool| {
        let mut pool = pool.borrow_mut();
        if pool.len() < STACK_POOL_MAX {
            trim(&stack);
            pool.push((stack_size, stack));
        }
    });
}

/// Gives back the pages of a finished stack below its top [`POOLED_RESIDENT_MAX`] bytes: one `madvise`,
/// cheap where no page was touched. Without it each pooled stack would keep every page its deepest
/// coroutine touched (128 stacks of a deep handler kept 28 MiB resident in a test).
fn trim(stack: &DefaultStack) {
    // SAFETY: sysconf(3) with a valid name only reads system configuration.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let Ok(page) = usize::try_from(page) else {
        return;
    };
    if page == 0 || !page.is_power_of_two() {
        return;
    }
    let top = stack.base().get();
    // `limit` includes the guard page, which stays as it is.
    let bottom = stack.limit().get() + page;
    let kept_from = top.saturating_sub(POOLED_RESIDENT_MAX) & !(page - 1);
    if kept_from <= bottom || crate::shim::enter("madvise_stack").is_err() {
        return;
    }
    // SAFETY: madvise(2) on [bottom, kept_from): page-aligned, inside the mapping `stack` owns (above its guard
    // page, below its top) and used by no coroutine (the one that ran on it finished, the stack is not in
    // use until the pool hands it out again). MADV_DONTNEED on private anonymous memory drops the pages and
    // zero-fills them on the next touch; no Rust value lives there. A failure leaves the pages resident.
    let _ = unsafe {
        libc::madvise(
            bottom as *mut libc::c_void,
            kept_from - bottom,
            libc::MADV_DONTNEED,
        )
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::panic::{AssertUnwindSafe, catch_unwind};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct CountsDrops(Arc<AtomicUsize>);

    impl Drop for CountsDrops {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn values_pass_in_and_out_across_suspends() {
        let mut coroutine = Coroutine::new(DEFAULT_STACK_SIZE, |yielder, first: u32| {
            let second = yielder.suspend(first * 10);
            let third = yielder.suspend(second * 10);
            format!("done {third}")
        })
        .unwrap();
        assert!(!coroutine.is_started(), "a new coroutine has not run");
        assert!(matches!(
            coroutine.resume(1),
            Ok(CoroutineResult::Yield(10))
        ));
        assert!(matches!(
            coroutine.resume(2),
            Ok(CoroutineResult::Yield(20))
        ));
        match coroutine.resume(3) {
            Ok(CoroutineResult::Return(text)) => assert_eq!(text, "done 3"),
            other => panic!("the third resume should return, got {other:?}"),
        }
        assert!(coroutine.is_finished(), "a returned coroutine is finished");
        assert_eq!(
            coroutine.resume(4).unwrap_err(),
            ResumeError::Finished,
            "a finished coroutine refuses to run"
        );
    }

    #[test]
    fn a_panic_in_the_coroutine_reaches_the_resumer_and_finishes_it() {
        let mut coroutine: Coroutine<(), (), ()> =
            Coroutine::new(DEFAULT_STACK_SIZE, |yielder, ()| {
                yielder.suspend(());
                panic!("handler failed");
            })
            .unwrap();
        assert!(coroutine.resume(()).is_ok());
        let caught = catch_unwind(AssertUnwindSafe(|| coroutine.resume(())));
        let payload = caught.expect_err("the panic should continue in the resumer");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"handler failed"));
        assert!(coroutine.is_finished(), "a panicked coroutine is finished");
    }

    #[test]
    fn dropping_a_suspended_coroutine_runs_its_destructors() {
        let drops = Arc::new(AtomicUsize::new(0));
        let panicking_seen = Arc::new(AtomicUsize::new(0));
        let (counter, seen) = (Arc::clone(&drops), Arc::clone(&panicking_seen));
        let mut coroutine: Coroutine<(), (), ()> =
            Coroutine::new(DEFAULT_STACK_SIZE, move |yielder, ()| {
                let _guard = CountsDrops(counter);
                struct SeesPanicking(Arc<AtomicUsize>);
                impl Drop for SeesPanicking {
                    fn drop(&mut self) {
                        if std::thread::panicking() {
                            self.0.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
                let _probe = SeesPanicking(seen);
                loop {
                    yielder.suspend(());
                }
            })
            .unwrap();
        assert!(coroutine.resume(()).is_ok());
        drop(coroutine);
        assert_eq!(
            drops.load(Ordering::SeqCst),
            1,
            "the guard on the suspended stack should be dropped"
        );
        assert_eq!(
            panicking_seen.load(Ordering::SeqCst),
            1,
            "destructors of an unwound coroutine should see thread::panicking()"
        );
    }

    #[test]
    fn a_resume_on_another_thread_is_refused_and_a_drop_there_leaks() {
        let drops = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&drops);
        let mut coroutine: Coroutine<(), (), ()> =
            Coroutine::new(DEFAULT_STACK_SIZE, move |yielder, ()| {
                let _guard = CountsDrops(counter);
                yielder.suspend(());
            })
            .unwrap();
        assert!(coroutine.resume(()).is_ok());
        let refused = std::thread::spawn(move || {
            let refused = coroutine.resume(());
            drop(coroutine);
            refused
        })
        .join()
        .unwrap();
        assert_eq!(
            refused.unwrap_err(),
            ResumeError::ForeignThread,
            "a coroutine should run only on the thread that started it"
        );
        assert_eq!(
            drops.load(Ordering::SeqCst),
            0,
            "a drop on a foreign thread should leak the stack, not run its destructors there"
        );
    }

    #[test]
    fn a_coroutine_that_never_ran_can_move_to_another_thread_and_run_there() {
        let mut coroutine: Coroutine<u8, u8, u8> =
            Coroutine::new(DEFAULT_STACK_SIZE, |yielder, first| {
                yielder.suspend(first + 1) + 1
            })
            .unwrap();
        let result = std::thread::spawn(move || {
            let first = coroutine.resume(1);
            let second = coroutine.resume(5);
            (first, second)
        })
        .join()
        .unwrap();
        assert!(matches!(result.0, Ok(CoroutineResult::Yield(2))));
        assert!(matches!(result.1, Ok(CoroutineResult::Return(6))));
    }

    #[test]
    fn finished_stacks_are_reused_and_the_pool_is_bounded() {
        // A size no other test uses, so the count is this test's alone (tests run on their own threads).
        let size = DEFAULT_STACK_SIZE + 4096;
        for _ in 0..10 {
            let mut coroutine: Coroutine<(), (), ()> =
                Coroutine::new(size, |yielder, ()| yielder.suspend(())).unwrap();
            assert!(coroutine.resume(()).is_ok());
            assert!(coroutine.resume(()).is_ok());
        }
        assert_eq!(
            pooled_stacks(size),
            1,
            "one stack should serve coroutines made one after another"
        );
        let many: Vec<_> = (0..STACK_POOL_MAX + 10)
            .map(|_| Coroutine::<(), (), ()>::new(size, |_, ()| ()).unwrap())
            .collect();
        drop(many);
        assert_eq!(
            pooled_stacks(size),
            STACK_POOL_MAX,
            "the pool should keep at most STACK_POOL_MAX stacks"
        );
    }
}
