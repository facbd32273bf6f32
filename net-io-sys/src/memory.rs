//! Anonymous memory mappings, optionally advised onto 2 MiB transparent huge pages, that split into owned parts.
//!
//! Why: a buffer read end to end on every step (a model's weights) costs one TLB miss per 4 KiB page it
//! crosses; in a virtual machine each miss walks two page tables. Backed by 2 MiB pages the same buffer
//! crosses 512 times fewer pages. `malloc` gives no control over that (large allocations are not 2 MiB
//! aligned, and the system's `transparent_hugepage` setting is commonly `madvise`), so the memory is mapped
//! here, aligned and advised (`MADV_HUGEPAGE`) before anything touches it.
//!
//! A [`Mapping`] owns its pages. [`Mapping::split_to`] cuts its front off as another owned mapping, so many
//! small buffers can share the huge pages of one region while each is freed on its own (`munmap(2)` unmaps
//! any page-aligned part of a mapping).

use std::io;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use crate::{cvt, shim};

/// The size of a transparent huge page on x86-64 (a PMD: 512 pages of 4 KiB), and the alignment a huge-page
/// mapping gets. Other page sizes (arm64 with 64 KiB pages has 512 MiB huge pages) get the alignment but not
/// huge pages.
pub const HUGE_PAGE: usize = 2 << 20;

/// The base page size of the system.
pub fn page_size() -> usize {
    // SAFETY: sysconf(3) takes no pointers; _SC_PAGESIZE is always supported and positive on Linux.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).unwrap_or(4096).max(1)
}

/// Huge pages for a mapping: asked for when mapping, and whether the advice was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HugePages {
    /// Advised with `MADV_HUGEPAGE` (or, when mapping, to be): the kernel backs the region's aligned 2 MiB parts
    /// with huge pages when it can (it may not, when memory is fragmented or THP is `never`).
    Advised,
    /// Base pages only: not asked for, or the advice was refused (a kernel without THP).
    No,
}

/// An anonymous, private, read-write mapping of zeroed memory, unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    start: NonNull<u8>,
    length: usize,
    huge_pages: HugePages,
}

// SAFETY: a Mapping owns its pages exclusively (no other Mapping covers them, see `split_to`); access goes
// through `&self`/`&mut self` like a `Box<[u8]>`, so moving it or sharing `&Mapping` across threads is sound.
unsafe impl Send for Mapping {}
// SAFETY: as above: `&Mapping` only gives `&[u8]`.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `length` bytes (rounded up to whole pages) of zeroed memory. With [`HugePages::Advised`], the start
    /// is aligned to [`HUGE_PAGE`] and the region advised with `MADV_HUGEPAGE` before any page is touched; a
    /// kernel that refuses the advice gives base pages ([`Mapping::huge_pages`] says which).
    ///
    /// Errors: `length` of zero (`InvalidInput`), or the `mmap(2)` error (`ENOMEM`).
    pub fn anonymous(length: usize, huge_pages: HugePages) -> io::Result<Self> {
        let huge_pages = huge_pages == HugePages::Advised;
        if length == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a mapping of zero bytes",
            ));
        }
        let page = page_size();
        let length = length.checked_next_multiple_of(page).ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, "mapping length overflows")
        })?;
        let alignment = if huge_pages {
            HUGE_PAGE.max(page)
        } else {
            page
        };
        // Over-map by the alignment so an aligned start exists inside, then give the slack back.
        let reserved = length.checked_add(alignment - page).ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, "mapping length overflows")
        })?;
        shim::enter("mmap")?;
        // SAFETY: mmap(2): a null hint, MAP_PRIVATE | MAP_ANONYMOUS and fd -1 create a new mapping that aliases
        // no existing memory; MAP_FAILED is checked before the address is used.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                reserved,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = raw as usize;
        let start = base.next_multiple_of(alignment);
        let head = start - base;
        let tail = reserved - head - length;
        // SAFETY: munmap(2): [base, start) and [start + length, base + reserved) are page-aligned parts of the
        // mapping just made, which nothing else refers to; unmapping part of a mapping leaves the rest mapped.
        // Should it fail (ENOMEM past vm.max_map_count), the slack stays mapped and unused: address space, no
        // memory, since it was never touched.
        unsafe {
            if head > 0 {
                libc::munmap(raw, head);
            }
            if tail > 0 {
                libc::munmap((start + length) as *mut libc::c_void, tail);
            }
        }
        let Some(start_pointer) = NonNull::new(start as *mut u8) else {
            // mmap(2) promises only that a failure is MAP_FAILED; a mapping at address 0 would be unusable here.
            return Err(io::Error::other("mmap returned a mapping at address 0"));
        };
        let mut advised = HugePages::No;
        if huge_pages && shim::enter("madvise").is_ok() {
            // SAFETY: madvise(2): [start, start + length) is the mapping made above, page-aligned;
            // MADV_HUGEPAGE changes how the kernel backs it, never its contents or validity.
            let result = cvt!(unsafe {
                libc::madvise(start as *mut libc::c_void, length, libc::MADV_HUGEPAGE)
            });
            if result.is_ok() {
                advised = HugePages::Advised;
            }
        }
        Ok(Self {
            start: start_pointer,
            length,
            huge_pages: advised,
        })
    }

    /// Bytes mapped (a whole number of pages).
    pub fn len(&self) -> usize {
        self.length
    }

    /// Always false: a mapping has at least one page.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Whether the region was advised onto huge pages.
    pub fn huge_pages(&self) -> HugePages {
        self.huge_pages
    }

    /// Cuts the first `length` bytes (rounded up to whole pages) off this mapping and returns them as a
    /// mapping of their own; this one keeps the rest. Each part is unmapped on its own drop.
    ///
    /// Errors (`InvalidInput`, nothing changed): `length` of zero, or not less than [`Mapping::len`] once
    /// rounded (a mapping never becomes empty).
    pub fn split_to(&mut self, length: usize) -> io::Result<Mapping> {
        let rounded = length.checked_next_multiple_of(page_size());
        match rounded {
            Some(rounded) if length > 0 && rounded < self.length => {
                let front = Mapping {
                    start: self.start,
                    length: rounded,
                    huge_pages: self.huge_pages,
                };
                // SAFETY: `rounded < self.length`, so the new start stays inside this mapping and is not null.
                self.start = unsafe { NonNull::new_unchecked(self.start.as_ptr().add(rounded)) };
                self.length -= rounded;
                Ok(front)
            }
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "cannot split {length} bytes off a mapping of {} bytes (at least one page must stay)",
                    self.length
                ),
            )),
        }
    }
}

impl Deref for Mapping {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: [start, start + length) is mapped read-write for as long as this Mapping lives, and only
        // this Mapping refers to it; anonymous memory is initialised (zero-filled, mmap(2)).
        unsafe { std::slice::from_raw_parts(self.start.as_ptr(), self.length) }
    }
}

impl DerefMut for Mapping {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.start.as_ptr(), self.length) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: munmap(2): this Mapping alone owns [start, start + length), page-aligned and mapped; nothing
        // can refer to it after drop. munmap can fail with ENOMEM when unmapping the middle of a region would
        // need more areas than vm.max_map_count allows; the pages then stay mapped (a leak, not a fault).
        let result = unsafe { libc::munmap(self.start.as_ptr().cast(), self.length) };
        debug_assert_eq!(result, 0, "munmap: {}", io::Error::last_os_error());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `VmFlags` line of the `/proc/self/smaps` entry covering `address`.
    fn flags_at(address: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("/proc/self/smaps");
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ')
                && let Some((from, to)) = range.split_once('-')
                && let (Ok(from), Ok(to)) = (
                    usize::from_str_radix(from, 16),
                    usize::from_str_radix(to, 16),
                )
            {
                inside = (from..to).contains(&address);
                continue;
            }
            if inside && let Some(flags) = line.strip_prefix("VmFlags:") {
                return flags.trim().to_string();
            }
        }
        panic!("no smaps entry covers {address:#x}");
    }

    #[test]
    fn a_huge_page_mapping_is_aligned_zeroed_and_advised() {
        let mut mapping = Mapping::anonymous(3 * HUGE_PAGE + 5, HugePages::Advised).expect("map");
        assert_eq!(mapping.as_ptr() as usize % HUGE_PAGE, 0);
        assert_eq!(mapping.len() % page_size(), 0);
        assert!(mapping.len() >= 3 * HUGE_PAGE + 5);
        assert!(mapping.iter().all(|&byte| byte == 0));
        mapping[HUGE_PAGE + 1] = 7;
        assert_eq!(mapping[HUGE_PAGE + 1], 7);
        // A kernel built with transparent huge pages (it lists the setting) takes the advice whatever the
        // setting; `hg` in the area's flags says it carries MADV_HUGEPAGE.
        if std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists() {
            assert_eq!(
                mapping.huge_pages(),
                HugePages::Advised,
                "the advice was refused"
            );
            let flags = flags_at(mapping.as_ptr() as usize);
            assert!(
                flags.split_whitespace().any(|flag| flag == "hg"),
                "no `hg` in the area's flags: {flags}"
            );
        }
    }

    #[test]
    fn a_plain_mapping_is_not_advised() {
        let mapping = Mapping::anonymous(10_000, HugePages::No).expect("map");
        assert_eq!(mapping.huge_pages(), HugePages::No);
        assert_eq!(mapping.len(), 10_000usize.next_multiple_of(page_size()));
        let flags = flags_at(mapping.as_ptr() as usize);
        assert!(
            !flags.split_whitespace().any(|flag| flag == "hg"),
            "{flags}"
        );
    }

    #[test]
    fn split_parts_are_disjoint_and_each_freed_alone() {
        let page = page_size();
        let mut rest = Mapping::anonymous(8 * page, HugePages::Advised).expect("map");
        let whole = rest.as_ptr() as usize;
        let mut first = rest.split_to(1).expect("one byte rounds up to a page");
        let second = rest.split_to(2 * page).expect("two pages");
        assert_eq!(first.as_ptr() as usize, whole);
        assert_eq!(first.len(), page);
        assert_eq!(second.as_ptr() as usize, whole + page);
        assert_eq!(rest.as_ptr() as usize, whole + 3 * page);
        assert_eq!(rest.len(), 5 * page);
        first.fill(1);
        drop(second);
        // The parts either side of the freed one are still mapped and keep their bytes.
        assert!(first.iter().all(|&byte| byte == 1));
        rest.fill(2);
        assert!(rest.iter().all(|&byte| byte == 2));
    }

    #[test]
    fn bad_lengths_are_refused_and_change_nothing() {
        assert_eq!(
            Mapping::anonymous(0, HugePages::Advised)
                .unwrap_err()
                .kind(),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            Mapping::anonymous(usize::MAX - 10, HugePages::No)
                .unwrap_err()
                .kind(),
            io::ErrorKind::InvalidInput
        );
        let page = page_size();
        let mut mapping = Mapping::anonymous(2 * page, HugePages::No).expect("map");
        for length in [0, 2 * page, 2 * page - 1, 5 * page] {
            let error = mapping.split_to(length).unwrap_err();
            assert_eq!(error.kind(), io::ErrorKind::InvalidInput);
            assert_eq!(mapping.len(), 2 * page);
        }
        assert_eq!(
            Mapping::anonymous(2 * page, HugePages::No)
                .unwrap()
                .split_to(0)
                .unwrap_err()
                .to_string(),
            format!(
                "cannot split 0 bytes off a mapping of {} bytes (at least one page must stay)",
                2 * page
            )
        );
    }

    /// Under the fault-injection shim (`RUSTFLAGS="--cfg net_io_shim" cargo test -p net-io-sys --lib
    /// memory::tests::shim`): a failing mmap is an error, a refused advice gives base pages. One test, since
    /// the shim's faults are process-wide.
    #[cfg(net_io_shim)]
    #[test]
    fn shim_a_failed_map_is_an_error_and_a_refused_advice_gives_base_pages() {
        crate::shim::inject("mmap", 0, 1, libc::ENOMEM);
        let error = Mapping::anonymous(HUGE_PAGE, HugePages::Advised).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::ENOMEM));
        crate::shim::inject("madvise", 0, 1, libc::EINVAL);
        let mapping = Mapping::anonymous(HUGE_PAGE, HugePages::Advised).expect("map");
        assert_eq!(mapping.huge_pages(), HugePages::No);
        assert_eq!(mapping.len(), HUGE_PAGE);
    }
}
