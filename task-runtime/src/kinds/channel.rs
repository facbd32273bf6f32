//! `Channel`: unbounded and bounded queues whose receive (and bounded send) park without a thread.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use crate::error::RuntimeError;
use crate::task::{Source, Step, Task, Wait, Waker, sealed};

const RECEIVE: u8 = 0;
const SEND: u8 = 1;

struct State<T> {
    queue: VecDeque<T>,
    capacity: Option<usize>,
    closed: bool,
    senders: usize,
    receive_waiters: VecDeque<Waker>,
    send_waiters: VecDeque<Waker>,
}

struct Inner<T> {
    state: Mutex<State<T>>,
}

impl<T> Inner<T> {
    fn lock(&self) -> std::sync::MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Wakes waiters from the front until one was really still waiting (stale wakers are skipped).
fn wake_one(waiters: &mut VecDeque<Waker>) -> Vec<Waker> {
    waiters.drain(..).collect()
}

impl<T: Send> Source for Inner<T> {
    fn register(&self, direction: u8, waker: Waker) -> bool {
        let mut state = self.lock();
        match direction {
            RECEIVE => {
                if !state.queue.is_empty() || state.closed {
                    return false;
                }
                state.receive_waiters.push_back(waker);
            }
            _ => {
                let full = state
                    .capacity
                    .is_some_and(|capacity| state.queue.len() >= capacity);
                if !full || state.closed {
                    return false;
                }
                state.send_waiters.push_back(waker);
            }
        }
        true
    }
}

/// Channel constructors.
#[derive(Debug)]
pub struct Channel;

impl Channel {
    /// An unbounded channel: sends never wait.
    pub fn unbounded<T: Send + 'static>() -> (Sender<T>, Receiver<T>) {
        let inner = Arc::new(Inner {
            state: Mutex::new(State {
                queue: VecDeque::new(),
                capacity: None,
                closed: false,
                senders: 1,
                receive_waiters: VecDeque::new(),
                send_waiters: VecDeque::new(),
            }),
        });
        (
            Sender {
                inner: Arc::clone(&inner),
            },
            Receiver { inner },
        )
    }

    /// A bounded channel holding at most `capacity` values (at least 1); a send to a full channel
    /// parks as a task.
    pub fn bounded<T: Send + 'static>(capacity: usize) -> (Sender<T>, Receiver<T>) {
        let (sender, receiver) = Channel::unbounded();
        sender.inner.lock().capacity = Some(capacity.max(1));
        (sender, receiver)
    }
}

/// The sending side; clones share the channel. The channel closes when the last sender drops.
pub struct Sender<T> {
    inner: Arc<Inner<T>>,
}

/// The receiving side; clones share the channel.
pub struct Receiver<T> {
    inner: Arc<Inner<T>>,
}

impl<T> std::fmt::Debug for Sender<T> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_struct("Sender").finish_non_exhaustive()
    }
}

impl<T> std::fmt::Debug for Receiver<T> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_struct("Receiver").finish_non_exhaustive()
    }
}

impl<T: Send + 'static> Sender<T> {
    /// Queues `value` now; a full bounded channel refuses with `NotReady` and gives the value back.
    pub fn try_send(&self, value: T) -> Result<(), (RuntimeError, T)> {
        let waiters = {
            let mut state = self.inner.lock();
            if state.closed {
                return Err((RuntimeError::Closed, value));
            }
            if state
                .capacity
                .is_some_and(|capacity| state.queue.len() >= capacity)
            {
                return Err((RuntimeError::NotReady, value));
            }
            state.queue.push_back(value);
            wake_one(&mut state.receive_waiters)
        };
        waiters.iter().for_each(|waker| {
            waker.wake();
        });
        Ok(())
    }

    /// Queues `value` on an unbounded channel (on a full bounded one this is `NotReady`; use
    /// [`send_task`](Sender::send_task) to wait for room).
    pub fn send(&self, value: T) -> Result<(), RuntimeError> {
        self.try_send(value).map_err(|(error, _)| error)
    }

    /// A task that sends `value`, parking while a bounded channel is full.
    pub fn send_task(&self, value: T) -> ChannelSend<T> {
        ChannelSend {
            inner: Arc::clone(&self.inner),
            value: Some(value),
        }
    }

    /// Closes the channel: receivers drain what is queued, then read `Closed`.
    pub fn close(&self) {
        close(&self.inner);
    }
}

fn close<T>(inner: &Inner<T>) {
    let waiters: Vec<Waker> = {
        let mut state = inner.lock();
        state.closed = true;
        let mut waiters: Vec<Waker> = state.receive_waiters.drain(..).collect();
        waiters.extend(state.send_waiters.drain(..));
        waiters
    };
    waiters.iter().for_each(|waker| {
        waker.wake();
    });
}

impl<T> Clone for Sender<T> {
    fn clone(&self) -> Self {
        self.inner.lock().senders += 1;
        Sender {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        let last = {
            let mut state = self.inner.lock();
            state.senders -= 1;
            state.senders == 0
        };
        if last {
            close(&self.inner);
        }
    }
}

impl<T: Send + 'static> Receiver<T> {
    /// A task that receives one value, parking while the channel is empty; `Closed` once closed and drained.
    pub fn receive(&self) -> ChannelReceive<T> {
        ChannelReceive {
            inner: Arc::clone(&self.inner),
        }
    }

    /// Takes a value now: `NotReady` when empty, `Closed` when closed and drained.
    pub fn try_receive(&self) -> Result<T, RuntimeError> {
        receive_now(&self.inner).unwrap_or(Err(RuntimeError::NotReady))
    }

    /// Values queued.
    pub fn len(&self) -> usize {
        self.inner.lock().queue.len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Closes the channel.
    pub fn close(&self) {
        close(&self.inner);
    }
}

impl<T> Clone for Receiver<T> {
    fn clone(&self) -> Self {
        Receiver {
            inner: Arc::clone(&self.inner),
        }
    }
}

/// `Some(result)` when a receive can finish now.
fn receive_now<T>(inner: &Inner<T>) -> Option<Result<T, RuntimeError>> {
    let (value, waiters) = {
        let mut state = inner.lock();
        match state.queue.pop_front() {
            Some(value) => {
                let waiters = wake_one(&mut state.send_waiters);
                (Ok(value), waiters)
            }
            None if state.closed => (Err(RuntimeError::Closed), Vec::new()),
            None => return None,
        }
    };
    waiters.iter().for_each(|waker| {
        waker.wake();
    });
    Some(value)
}

/// A receive task (see [`Receiver::receive`]).
pub struct ChannelReceive<T> {
    inner: Arc<Inner<T>>,
}

impl<T> std::fmt::Debug for ChannelReceive<T> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("ChannelReceive")
            .finish_non_exhaustive()
    }
}

impl<T> Clone for ChannelReceive<T> {
    fn clone(&self) -> Self {
        ChannelReceive {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<T> sealed::Sealed for ChannelReceive<T> {}

impl<T: Send + 'static> Task for ChannelReceive<T> {
    type Input = ();
    type Output = T;

    fn start(&mut self, _input: ()) {}

    fn step(&mut self) -> Step<T> {
        match receive_now(&self.inner) {
            Some(result) => Step::Done(result),
            None => Step::Park(Wait::on(self.inner.clone(), RECEIVE, None)),
        }
    }
}

/// A send task for bounded channels (see [`Sender::send_task`]).
pub struct ChannelSend<T> {
    inner: Arc<Inner<T>>,
    value: Option<T>,
}

impl<T> std::fmt::Debug for ChannelSend<T> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("ChannelSend")
            .finish_non_exhaustive()
    }
}

impl<T> sealed::Sealed for ChannelSend<T> {}

impl<T: Send + 'static> Task for ChannelSend<T> {
    type Input = ();
    type Output = ();

    fn start(&mut self, _input: ()) {}

    fn step(&mut self) -> Step<()> {
        let Some(value) = self.value.take() else {
            return Step::Done(Err(RuntimeError::Finished));
        };
        let sender = Sender {
            inner: Arc::clone(&self.inner),
        };
        sender.inner.lock().senders += 1;
        let result = sender.try_send(value);
        match result {
            Ok(()) => Step::Done(Ok(())),
            Err((RuntimeError::NotReady, value)) => {
                self.value = Some(value);
                Step::Park(Wait::on(self.inner.clone(), SEND, None))
            }
            Err((error, _)) => Step::Done(Err(error)),
        }
    }
}
