//! Zero allocations per round trip in a steady echo (sessions and handlers, on every driver), counted by a process-wide counting allocator.
//!
//! This is its own test binary because the allocator counts every thread of the process: the server's
//! accept thread and worker, the harness's main thread, and the client, which therefore uses only std
//! sockets and fixed buffers.

#![deny(unsafe_code)]

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use net_io_blocking::Server;

use common::client;
use common::echo::{EchoDriver, plain_echo_server};
use counting::allocations;

/// A global allocator that counts allocations; the one place in this binary that needs `unsafe`.
#[allow(unsafe_code)]
mod counting {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Wraps the system allocator and counts every allocation and reallocation.
    struct CountingAllocator;

    /// Allocations and reallocations since the process started, on every thread.
    static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

    /// Allocations and reallocations so far, on every thread of the process.
    pub fn allocations() -> u64 {
        ALLOCATIONS.load(Ordering::SeqCst)
    }

    // SAFETY: every method forwards to `System` with the caller's arguments unchanged, so the
    // `GlobalAlloc` contract (layout, alignment, pointer origin) is exactly the system allocator's; the
    // counter is an atomic, which never allocates.
    unsafe impl GlobalAlloc for CountingAllocator {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
            // SAFETY: the caller upholds `alloc`'s contract for `layout`, passed on unchanged.
            unsafe { System.alloc(layout) }
        }

        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
            // SAFETY: as for `alloc`.
            unsafe { System.alloc_zeroed(layout) }
        }

        unsafe fn dealloc(&self, pointer: *mut u8, layout: Layout) {
            // SAFETY: `pointer` came from this allocator, that is from `System`, with `layout`.
            unsafe { System.dealloc(pointer, layout) }
        }

        unsafe fn realloc(&self, pointer: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
            // SAFETY: `pointer` came from `System` with `layout`; the caller upholds `new_size`'s contract.
            unsafe { System.realloc(pointer, layout, new_size) }
        }
    }

    #[global_allocator]
    static GLOBAL: CountingAllocator = CountingAllocator;
}

/// Size of each message: large enough that a per-message buffer would show up.
const MESSAGE: usize = 1_000;
const WARM_UP_ROUND_TRIPS: usize = 50;
const COUNTED_ROUND_TRIPS: usize = 1_000;

/// Warms up, then counts the allocations of the whole process over the steady round trips.
fn allocations_in_steady_echo(server: Server) -> u64 {
    let mut stream = client(server.local_addr());
    let message = [0x5a_u8; MESSAGE];
    let mut echo = [0_u8; MESSAGE];
    for _ in 0..WARM_UP_ROUND_TRIPS {
        stream.write_all(&message).expect("warm-up write failed");
        stream.read_exact(&mut echo).expect("warm-up read failed");
    }
    assert_eq!(echo, message, "the server echoed different bytes");

    wait_for_the_harness_to_settle();
    let before = allocations();
    for _ in 0..COUNTED_ROUND_TRIPS {
        stream.write_all(&message).expect("write failed");
        stream.read_exact(&mut echo).expect("read failed");
    }
    let after = allocations();

    // The counter must see this process's allocations, or a zero would prove nothing.
    let probe = std::hint::black_box(vec![0_u8; 64]);
    assert!(
        allocations() > after,
        "the counting allocator did not count a Vec allocation"
    );
    drop(probe);
    assert_eq!(echo, message, "the server echoed different bytes");
    drop(stream);
    let _ = server.shutdown(Instant::now() + Duration::from_secs(2));
    after - before
}

/// Waits until libtest's main thread sleeps: right after it starts a test thread it records the running
/// test in a map (an allocation), and on a loaded machine that can land inside the counted window. Its
/// thread id is the process id; `S` in `/proc/self/task/PID/stat` means it is blocked waiting for results.
fn wait_for_the_harness_to_settle() {
    let stat = format!("/proc/self/task/{0}/stat", std::process::id());
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut asleep_in_a_row = 0;
    while asleep_in_a_row < 5 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
        let state = std::fs::read_to_string(&stat).ok().and_then(|text| {
            let (_, rest) = text.rsplit_once(')')?;
            rest.split_whitespace().next().map(str::to_owned)
        });
        if state.as_deref() == Some("S") {
            asleep_in_a_row += 1;
        } else {
            asleep_in_a_row = 0;
        }
    }
}

// One test, sessions, event loop, handler, then handler on coroutines, because the count is process-wide: a second test would have libtest's
// main thread print (and allocate) while the other counts.
#[test]
fn a_steady_echo_allocates_nothing_per_round_trip_with_sessions_an_event_loop_or_a_handler_on_either_driver()
 {
    // One worker, so no worker thread is still starting (and allocating) while we count.
    let sessions = plain_echo_server(EchoDriver::Sessions { workers: 1 });
    let counted = allocations_in_steady_echo(sessions);
    assert_eq!(
        counted, 0,
        "{counted} allocations happened during {COUNTED_ROUND_TRIPS} steady sessions round trips of \
         {MESSAGE} B; the echo path must not allocate after warm-up"
    );

    let event_loop = plain_echo_server(EchoDriver::EventLoop { loops: 1 });
    let counted = allocations_in_steady_echo(event_loop);
    assert_eq!(
        counted, 0,
        "{counted} allocations happened during {COUNTED_ROUND_TRIPS} steady event-loop round trips of \
         {MESSAGE} B; the echo path must not allocate after warm-up"
    );

    let handler = plain_echo_server(EchoDriver::Handler { workers: 1 });
    let counted = allocations_in_steady_echo(handler);
    assert_eq!(
        counted, 0,
        "{counted} allocations happened during {COUNTED_ROUND_TRIPS} steady handler round trips of \
         {MESSAGE} B; the echo path must not allocate after warm-up"
    );

    let coroutines = plain_echo_server(EchoDriver::Coroutines { loops: 1 });
    let counted = allocations_in_steady_echo(coroutines);
    assert_eq!(
        counted, 0,
        "{counted} allocations happened during {COUNTED_ROUND_TRIPS} steady round trips of a handler on a \
         coroutine ({MESSAGE} B); the echo path must not allocate after warm-up"
    );
}
