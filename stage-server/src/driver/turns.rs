//! A lock that lanes take in turns: first come, first served, so lanes sharing one loaded stage each get a
//! forward pass in order instead of the lane that just released the lock taking it straight back.

use std::sync::{Condvar, Mutex, MutexGuard};

/// `T` behind a first-come-first-served lock.
///
/// A plain mutex lets the thread that just unlocked it win it again before a sleeping waiter wakes, so one
/// lane of several decoding on one stage could run many steps while the others wait (a second-long gap
/// between two of their tokens). Here every lock takes a ticket and waits until it is served.
#[derive(Debug, Default)]
pub struct Turns<T> {
    value: Mutex<T>,
    tickets: Mutex<Tickets>,
    served: Condvar,
}

#[derive(Debug, Default)]
struct Tickets {
    next: u64,
    serving: u64,
}

/// Access to the value for one turn; the next ticket is served when it drops.
#[derive(Debug)]
pub struct Turn<'a, T> {
    guard: Option<MutexGuard<'a, T>>,
    turns: &'a Turns<T>,
}

impl<T> Turns<T> {
    /// `value` behind the lock.
    pub fn new(value: T) -> Turns<T> {
        Turns {
            value: Mutex::new(value),
            tickets: Mutex::new(Tickets::default()),
            served: Condvar::new(),
        }
    }

    /// Waits for this caller's turn. A panic during an earlier turn does not poison it: each lane resets
    /// its own state before it uses it.
    pub fn lock(&self) -> Turn<'_, T> {
        let mut tickets = self
            .tickets
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let ticket = tickets.next;
        tickets.next += 1;
        while tickets.serving != ticket {
            tickets = self
                .served
                .wait(tickets)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        drop(tickets);
        let guard = self
            .value
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        Turn {
            guard: Some(guard),
            turns: self,
        }
    }
}

impl<T> std::ops::Deref for Turn<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        self.guard
            .as_deref()
            .expect("a turn holds its guard until it drops")
    }
}

impl<T> std::ops::DerefMut for Turn<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.guard
            .as_deref_mut()
            .expect("a turn holds its guard until it drops")
    }
}

impl<T> Drop for Turn<'_, T> {
    fn drop(&mut self) {
        drop(self.guard.take());
        let mut tickets = self
            .turns
            .tickets
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        tickets.serving += 1;
        drop(tickets);
        self.turns.served.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[test]
    fn waiting_threads_are_served_in_turn_and_none_runs_twice_while_another_waits() {
        let turns = Arc::new(Turns::new(Vec::<usize>::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let threads: Vec<_> = (0..3)
            .map(|id| {
                let (turns, stop) = (Arc::clone(&turns), Arc::clone(&stop));
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let mut order = turns.lock();
                        order.push(id);
                        // Hold the turn a little, as a forward pass does.
                        std::thread::sleep(std::time::Duration::from_micros(200));
                    }
                })
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(300));
        stop.store(true, Ordering::Relaxed);
        for thread in threads {
            thread.join().unwrap();
        }
        let order = turns.lock().clone();
        assert!(order.len() > 30, "too few turns to judge: {}", order.len());
        // Once all three wait, no thread gets two turns in a row (a plain mutex gives long runs here).
        let repeats = order
            .windows(2)
            .skip(3)
            .filter(|pair| pair[0] == pair[1])
            .count();
        assert!(
            repeats <= 2,
            "{repeats} turns went twice in a row to one thread: {order:?}"
        );
    }
}
