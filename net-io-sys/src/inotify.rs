//! An `inotify(7)` instance: watch paths and read change events, parsed into owned values.

use std::ffi::{CString, OsString};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::Path;

use crate::{cvt, shim};

/// A watch descriptor; the same inode watched twice returns the same one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WatchDescriptor(pub i32);

/// One change event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InotifyEvent {
    /// The watch it belongs to (-1 for a queue overflow).
    pub watch: WatchDescriptor,
    /// The `IN_*` bits.
    pub mask: u32,
    /// Pairs the two halves of a rename.
    pub cookie: u32,
    /// The entry name inside a watched directory, if any.
    pub name: Option<OsString>,
}

/// A non-blocking, close-on-exec inotify instance.
#[derive(Debug)]
pub struct Inotify {
    descriptor: OwnedFd,
}

/// The fixed header of a kernel event: wd, mask, cookie, len.
const HEADER: usize = 16;

impl Inotify {
    /// Creates an instance (`inotify_init1(IN_CLOEXEC | IN_NONBLOCK)`).
    pub fn new() -> io::Result<Self> {
        shim::enter("inotify_init1")?;
        // SAFETY: inotify_init1(2) takes flags only; a non-negative return is a new descriptor we own.
        let raw = cvt!(unsafe { libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK) })?;
        // SAFETY: `raw` was just returned by inotify_init1(2) and nobody else owns it.
        let descriptor = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(Self { descriptor })
    }

    /// Watches `path` for the `IN_*` events in `mask`.
    pub fn add_watch(&self, path: &Path, mask: u32) -> io::Result<WatchDescriptor> {
        let path = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        shim::enter("inotify_add_watch")?;
        // SAFETY: `path` is a live NUL-terminated string for the call (inotify_add_watch(2)).
        let watch = cvt!(unsafe {
            libc::inotify_add_watch(self.descriptor.as_raw_fd(), path.as_ptr(), mask)
        })?;
        Ok(WatchDescriptor(watch))
    }

    /// Stops a watch; the kernel then queues an `IN_IGNORED` event for it.
    pub fn remove_watch(&self, watch: WatchDescriptor) -> io::Result<()> {
        shim::enter("inotify_rm_watch")?;
        // SAFETY: inotify_rm_watch(2) takes two integers and no pointers.
        cvt!(unsafe { libc::inotify_rm_watch(self.descriptor.as_raw_fd(), watch.0) })?;
        Ok(())
    }

    /// Reads every queued event (none when the queue is empty), using `buffer` as scratch space.
    pub fn read_events(&self, buffer: &mut Vec<u8>) -> io::Result<Vec<InotifyEvent>> {
        // One event can be as large as the header plus NAME_MAX + 1 bytes.
        if buffer.len() < 4096 {
            buffer.resize(4096, 0);
        }
        let mut events = Vec::new();
        loop {
            shim::enter("inotify_read")?;
            // SAFETY: reads at most buffer.len() bytes into a live buffer we own.
            let result = unsafe {
                libc::read(
                    self.descriptor.as_raw_fd(),
                    buffer.as_mut_ptr().cast(),
                    buffer.len(),
                )
            };
            let count = match cvt!(result) {
                Ok(count) => count as usize,
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => return Ok(events),
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(error) => return Err(error),
            };
            if count == 0 {
                return Ok(events);
            }
            parse_events(&buffer[..count], &mut events);
        }
    }
}

impl AsFd for Inotify {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.descriptor.as_fd()
    }
}

/// Parses kernel event records from `bytes` with bounds checks; a truncated tail is ignored.
pub fn parse_events(bytes: &[u8], events: &mut Vec<InotifyEvent>) {
    let word = |at: usize| -> Option<[u8; 4]> { bytes.get(at..at + 4)?.try_into().ok() };
    let mut offset = 0;
    while offset + HEADER <= bytes.len() {
        let (Some(watch), Some(mask), Some(cookie), Some(length)) = (
            word(offset),
            word(offset + 4),
            word(offset + 8),
            word(offset + 12),
        ) else {
            return;
        };
        let length = u32::from_ne_bytes(length) as usize;
        let Some(name_bytes) = bytes.get(offset + HEADER..offset + HEADER + length) else {
            return;
        };
        let trimmed: Vec<u8> = name_bytes
            .iter()
            .copied()
            .take_while(|&byte| byte != 0)
            .collect();
        events.push(InotifyEvent {
            watch: WatchDescriptor(i32::from_ne_bytes(watch)),
            mask: u32::from_ne_bytes(mask),
            cookie: u32::from_ne_bytes(cookie),
            name: (!trimmed.is_empty()).then(|| OsString::from_vec(trimmed)),
        });
        offset += HEADER + length;
    }
}

#[cfg(test)]
mod tests {
    use super::{Inotify, parse_events};

    #[test]
    fn a_write_to_a_watched_file_is_reported() {
        let directory = std::env::temp_dir().join(format!("inotify-test-{}", std::process::id()));
        std::fs::create_dir_all(&directory).expect("create dir");
        let path = directory.join("watched");
        std::fs::write(&path, b"one").expect("write");
        let inotify = Inotify::new().expect("inotify");
        let watch = inotify.add_watch(&path, libc::IN_MODIFY).expect("watch");
        let mut buffer = Vec::new();
        assert!(inotify.read_events(&mut buffer).expect("read").is_empty());
        std::fs::write(&path, b"two").expect("write");
        let events = inotify.read_events(&mut buffer).expect("read");
        assert!(
            events
                .iter()
                .any(|event| event.watch == watch && event.mask & libc::IN_MODIFY != 0),
            "a modify event should arrive for the watch, got {events:?}"
        );
        inotify.remove_watch(watch).expect("remove");
        std::fs::remove_dir_all(&directory).expect("clean up");
    }

    #[test]
    fn truncated_or_random_bytes_never_panic() {
        let mut events = Vec::new();
        for length in 0..64 {
            let bytes: Vec<u8> = (0..length).map(|index| (index * 37 + 11) as u8).collect();
            parse_events(&bytes, &mut events);
        }
        let mut record = Vec::new();
        record.extend_from_slice(&3i32.to_ne_bytes());
        record.extend_from_slice(&2u32.to_ne_bytes());
        record.extend_from_slice(&0u32.to_ne_bytes());
        record.extend_from_slice(&8u32.to_ne_bytes());
        record.extend_from_slice(b"name\0\0\0\0");
        events.clear();
        parse_events(&record, &mut events);
        assert_eq!(events.len(), 1, "one whole record should parse");
        assert_eq!(
            events[0].name.as_deref(),
            Some(std::ffi::OsStr::new("name"))
        );
    }
}
