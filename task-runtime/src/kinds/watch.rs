//! `File::watch`: parks on inotify events for a path; a stat snapshot catches changes between runs.

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use net_io_sys::inotify::{Inotify, WatchDescriptor};

use crate::error::RuntimeError;
use crate::pool::global_pool;
use crate::task::{Source, Step, Task, Wait, Waker, sealed};

/// Backstop poll for a missed event or a change inotify cannot see (a parent directory renamed).
const WATCH_POLL: Duration = Duration::from_millis(200);

const WATCH_MASK: u32 = libc::IN_MODIFY
    | libc::IN_ATTRIB
    | libc::IN_CLOSE_WRITE
    | libc::IN_MOVE_SELF
    | libc::IN_DELETE_SELF
    | libc::IN_CREATE
    | libc::IN_DELETE
    | libc::IN_MOVED_TO
    | libc::IN_MOVED_FROM;

/// What changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Change {
    /// Contents were written (or the size changed).
    Written,
    /// Permissions, owner, times or link count changed.
    Attributes,
    /// The path was renamed away.
    Renamed,
    /// The path was removed.
    Removed,
    /// An entry was created, removed or moved inside a watched directory.
    Entries,
}

#[derive(Default)]
struct Entry {
    users: usize,
    stamp: u64,
    last: Option<Change>,
    waiters: Vec<Waker>,
}

/// One inotify instance per runtime; watch descriptors are shared and reference-counted.
pub(crate) struct WatchRegistry {
    inotify: Inotify,
    entries: Mutex<HashMap<WatchDescriptor, Entry>>,
    buffer: Mutex<Vec<u8>>,
}

impl WatchRegistry {
    pub(crate) fn new() -> std::io::Result<Self> {
        Ok(WatchRegistry {
            inotify: Inotify::new()?,
            entries: Mutex::new(HashMap::new()),
            buffer: Mutex::new(Vec::new()),
        })
    }

    pub(crate) fn descriptor(&self) -> BorrowedFd<'_> {
        self.inotify.as_fd()
    }

    fn add(&self, path: &Path) -> std::io::Result<WatchDescriptor> {
        let watch = self.inotify.add_watch(path, WATCH_MASK)?;
        self.entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(watch)
            .or_default()
            .users += 1;
        Ok(watch)
    }

    fn remove(&self, watch: WatchDescriptor) {
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        let Some(entry) = entries.get_mut(&watch) else {
            return;
        };
        entry.users = entry.users.saturating_sub(1);
        if entry.users == 0 {
            entries.remove(&watch);
            let _ = self.inotify.remove_watch(watch);
        }
    }

    fn stamp(&self, watch: WatchDescriptor) -> (u64, Option<Change>) {
        self.entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&watch)
            .map_or((0, None), |entry| (entry.stamp, entry.last))
    }

    /// Reads inotify events and wakes the waiters of every touched watch; an overflow wakes all.
    pub(crate) fn deliver(&self) {
        let events = {
            let mut buffer = self.buffer.lock().unwrap_or_else(|p| p.into_inner());
            self.inotify.read_events(&mut buffer).unwrap_or_default()
        };
        let mut waiters = Vec::new();
        {
            let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
            for event in events {
                let change = classify(event.mask);
                if event.mask & libc::IN_Q_OVERFLOW != 0 {
                    for entry in entries.values_mut() {
                        entry.stamp += 1;
                        waiters.append(&mut entry.waiters);
                    }
                    continue;
                }
                if let Some(entry) = entries.get_mut(&event.watch) {
                    entry.stamp += 1;
                    if change.is_some() {
                        entry.last = change;
                    }
                    waiters.append(&mut entry.waiters);
                }
            }
        }
        waiters.iter().for_each(|waker| {
            waker.wake();
        });
    }

    pub(crate) fn abandon(&self) {
        let waiters: Vec<Waker> = self
            .entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values_mut()
            .flat_map(|entry| entry.waiters.drain(..))
            .collect();
        waiters.iter().for_each(|waker| {
            waker.wake();
        });
    }
}

fn classify(mask: u32) -> Option<Change> {
    if mask & libc::IN_DELETE_SELF != 0 {
        Some(Change::Removed)
    } else if mask & libc::IN_MOVE_SELF != 0 {
        Some(Change::Renamed)
    } else if mask & (libc::IN_MODIFY | libc::IN_CLOSE_WRITE) != 0 {
        Some(Change::Written)
    } else if mask & libc::IN_ATTRIB != 0 {
        Some(Change::Attributes)
    } else if mask & (libc::IN_CREATE | libc::IN_DELETE | libc::IN_MOVED_TO | libc::IN_MOVED_FROM)
        != 0
    {
        Some(Change::Entries)
    } else {
        None
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Snapshot {
    exists: bool,
    length: u64,
    modified: Option<SystemTime>,
    inode: u64,
    mode: u32,
    links: u64,
}

fn snapshot(path: &Path) -> Snapshot {
    use std::os::unix::fs::MetadataExt;
    match std::fs::metadata(path) {
        Ok(metadata) => Snapshot {
            exists: true,
            length: metadata.len(),
            modified: metadata.modified().ok(),
            inode: metadata.ino(),
            mode: metadata.mode(),
            links: metadata.nlink(),
        },
        Err(_) => Snapshot {
            exists: false,
            length: 0,
            modified: None,
            inode: 0,
            mode: 0,
            links: 0,
        },
    }
}

struct WatchSource {
    watch: Mutex<Option<WatchDescriptor>>,
}

impl Source for WatchSource {
    fn register(&self, _direction: u8, waker: Waker) -> bool {
        let Some(watch) = *self.watch.lock().unwrap_or_else(|p| p.into_inner()) else {
            return true;
        };
        let Some(pool) = global_pool() else {
            return true;
        };
        let mut entries = pool
            .reactor
            .watches
            .entries
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(entry) = entries.get_mut(&watch) {
            entry.waiters.push(waker);
        }
        true
    }
}

/// A file-change wait (see [`File::watch`](crate::File::watch)). Its output is the change seen.
pub struct FileWatch {
    path: PathBuf,
    source: Arc<WatchSource>,
    stamp: u64,
    seen: Option<Snapshot>,
}

impl std::fmt::Debug for FileWatch {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("FileWatch")
            .field("path", &self.path)
            .finish()
    }
}

impl FileWatch {
    pub(crate) fn new(path: PathBuf) -> Self {
        FileWatch {
            path,
            source: Arc::new(WatchSource {
                watch: Mutex::new(None),
            }),
            stamp: 0,
            seen: None,
        }
    }
}

impl Drop for FileWatch {
    fn drop(&mut self) {
        if let Some(watch) = self
            .source
            .watch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            && let Some(pool) = global_pool()
        {
            pool.reactor.watches.remove(watch);
        }
    }
}

impl sealed::Sealed for FileWatch {}

impl Task for FileWatch {
    type Input = ();
    type Output = Change;

    fn start(&mut self, _input: ()) {}

    fn step(&mut self) -> Step<Change> {
        let Some(pool) = global_pool() else {
            return Step::Done(Err(RuntimeError::NotInitialised));
        };
        let registry = &pool.reactor.watches;
        let mut watch_slot = self.source.watch.lock().unwrap_or_else(|p| p.into_inner());
        if watch_slot.is_none() {
            match registry.add(&self.path) {
                Ok(watch) => {
                    *watch_slot = Some(watch);
                    self.stamp = registry.stamp(watch).0;
                    self.seen = Some(snapshot(&self.path));
                }
                Err(error) => return Step::Done(Err(error.into())),
            }
        }
        let Some(watch) = *watch_slot else {
            return Step::Done(Err(RuntimeError::BadPath));
        };
        drop(watch_slot);
        let (stamp, last) = registry.stamp(watch);
        let now = snapshot(&self.path);
        let stat_changed = self.seen.is_some_and(|seen| seen != now);
        if stamp != self.stamp || stat_changed {
            self.stamp = stamp;
            let previous = self.seen.replace(now);
            let change = match (previous, now.exists) {
                (_, false) => Change::Removed,
                (Some(previous), true) if previous.length != now.length => Change::Written,
                (Some(previous), true) if previous.modified != now.modified => Change::Written,
                (Some(previous), true)
                    if previous.mode != now.mode || previous.links != now.links =>
                {
                    Change::Attributes
                }
                _ => last.unwrap_or(Change::Written),
            };
            return Step::Done(Ok(change));
        }
        Step::Park(Wait::on(
            self.source.clone(),
            0,
            Some(Instant::now() + WATCH_POLL),
        ))
    }
}
