//! Where packed weights live: regions of 2 MiB huge pages, cut into one owned mapping per matrix.
//!
//! A decode step reads every weight once, so a stage crosses every page of its weights on every step. On 4 KiB
//! pages that is a TLB miss per 4 KiB (SmolLM2: about 23,000 per step, each a two-level walk in a virtual
//! machine); on huge pages 512 times fewer. One matrix is often smaller than a huge page (SmolLM2's are about
//! 0.5 MiB), so matrices are placed one after another in a shared region advised onto huge pages, and each
//! gets its part of it as a mapping of its own (freed with its matrix). Where mapping fails, the bytes go on
//! the heap: slower, never wrong.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, Weak};

use net_io_sys::memory::{HUGE_PAGE, HugePages, Mapping, page_size};

/// The size of each shared region: large enough that a region holds many matrices (each region change leaves
/// part of a huge page unused), small enough that the untouched tail of the last one costs little address space.
const REGION: usize = 16 * HUGE_PAGE;

/// The current region: the part not yet handed out, and the trailer of the part handed out last.
static REGION_STATE: Mutex<Region> = Mutex::new(Region {
    unused: None,
    last_trailer: Weak::new(),
});

struct Region {
    unused: Option<Mapping>,
    last_trailer: Weak<Trailer>,
}

/// The rest of the huge page a region's last part ends in, given to that part when the next region starts,
/// so that it is unmapped with the part. (Unmapped before the part, it would split the huge page under the part;
/// kept forever, it would stay resident once the part is gone.)
type Trailer = Mutex<Option<Mapping>>;

/// A matrix's bytes: its own part of a huge-page region, or heap memory if mapping failed.
#[derive(Debug)]
pub(crate) struct WeightBytes {
    storage: Storage,
    length: usize,
    /// See [`Trailer`]: held only to be dropped (unmapped) with these bytes.
    _trailer: Arc<Trailer>,
}

#[derive(Debug)]
enum Storage {
    Mapped(Mapping),
    Heap(Box<[u8]>),
}

impl WeightBytes {
    /// `length` zeroed bytes, on huge pages where the system allows.
    pub(crate) fn zeroed(length: usize) -> Self {
        let trailer = Arc::new(Mutex::new(None));
        let storage = match cut_from_region(length, &trailer) {
            Some(mapping) => Storage::Mapped(mapping),
            None => Storage::Heap(vec![0u8; length].into_boxed_slice()),
        };
        Self {
            storage,
            length,
            _trailer: trailer,
        }
    }

    /// Whether these bytes sit in a mapping (not on the heap): a test's view.
    #[cfg(test)]
    pub(crate) fn is_mapped(&self) -> bool {
        matches!(&self.storage, Storage::Mapped(_))
    }

    /// Whether these bytes sit in a region advised onto huge pages: a test's view.
    #[cfg(test)]
    pub(crate) fn on_huge_pages(&self) -> bool {
        matches!(&self.storage, Storage::Mapped(mapping) if mapping.huge_pages() == HugePages::Advised)
    }
}

/// Cuts `length` bytes off the current region (starting a new one when they do not fit), or `None` when the
/// system refuses the mapping. `trailer` is the new part's: it gets the rest of its last huge page if the next
/// region starts right after it.
fn cut_from_region(length: usize, trailer: &Arc<Trailer>) -> Option<Mapping> {
    if length == 0 {
        return None;
    }
    let rounded_length = length.checked_next_multiple_of(page_size())?;
    let mut region = REGION_STATE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    // A region keeps at least one page after a split, so a part fits only if it leaves some.
    if region
        .unused
        .as_ref()
        .is_none_or(|unused| unused.len() <= rounded_length)
    {
        if let Some(mut old) = region.unused.take() {
            // The old region's unused part starts inside the huge page its last part ends in: unmapping the
            // rest of that page would split it into 4 KiB pages under the part. That rest goes with the part
            // (unmapped when it is); the whole huge pages after it are unmapped now.
            let into_page = old.as_ptr() as usize % HUGE_PAGE;
            let rest_of_page = if into_page == 0 {
                None
            } else {
                match old.split_to(HUGE_PAGE - into_page) {
                    Ok(rest) => Some(rest),
                    // All of it lies inside that huge page.
                    Err(_) => Some(old),
                }
            };
            if let (Some(rest), Some(last)) = (rest_of_page, region.last_trailer.upgrade()) {
                *last.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(rest);
            }
            // A rest whose part is gone already is unmapped here (its huge page was split when the part went).
        }
        let size = REGION.max(rounded_length.checked_add(HUGE_PAGE)?);
        region.unused = Mapping::anonymous(size, HugePages::Advised).ok();
    }
    let part = region.unused.as_mut()?.split_to(length).ok()?;
    region.last_trailer = Arc::downgrade(trailer);
    Some(part)
}

impl Deref for WeightBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match &self.storage {
            Storage::Mapped(mapping) => &mapping[..self.length],
            Storage::Heap(bytes) => bytes,
        }
    }
}

impl DerefMut for WeightBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.storage {
            Storage::Mapped(mapping) => &mut mapping[..self.length],
            Storage::Heap(bytes) => bytes,
        }
    }
}

impl Clone for WeightBytes {
    fn clone(&self) -> Self {
        let mut copy = Self::zeroed(self.length);
        copy.copy_from_slice(self);
        copy
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_zeroed_disjoint_and_survive_each_other() {
        let mut first = WeightBytes::zeroed(100_000);
        let mut second = WeightBytes::zeroed(3 * HUGE_PAGE);
        let mut third = WeightBytes::zeroed(1);
        assert_eq!(
            (first.len(), second.len(), third.len()),
            (100_000, 3 * HUGE_PAGE, 1)
        );
        assert!(
            first
                .iter()
                .chain(second.iter())
                .chain(third.iter())
                .all(|&byte| byte == 0),
            "fresh parts are zeroed"
        );
        let range = |bytes: &WeightBytes| {
            let start = bytes.as_ptr() as usize;
            start..start + bytes.len()
        };
        for (one, other) in [(&first, &second), (&first, &third), (&second, &third)] {
            let (one, other) = (range(one), range(other));
            assert!(
                one.end <= other.start || other.end <= one.start,
                "parts overlap: {one:x?} and {other:x?}"
            );
        }
        first.fill(1);
        second.fill(2);
        third.fill(3);
        let copy = second.clone();
        drop(second);
        assert!(
            first.iter().all(|&byte| byte == 1),
            "a neighbour's drop changed nothing"
        );
        assert!(
            copy.iter().all(|&byte| byte == 2),
            "the clone kept the bytes"
        );
        assert_eq!(&third[..], &[3]);
        // A matrix larger than a region gets a region of its own.
        let large = WeightBytes::zeroed(REGION + 5);
        assert_eq!(large.len(), REGION + 5);
        // On a kernel built with transparent huge pages (it lists the setting), every part is mapped and advised:
        // the heap is only for a system that refuses the mapping (a low RLIMIT_AS), which would fail here.
        if transparent_huge_pages() {
            for part in [&first, &third, &large] {
                assert!(part.is_mapped(), "a part went to the heap");
                assert!(
                    part.on_huge_pages(),
                    "a region was not advised onto huge pages"
                );
            }
        }
    }

    /// Whether this kernel has transparent huge pages (it lists the setting).
    fn transparent_huge_pages() -> bool {
        std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists()
    }

    /// The end of the memory area (`/proc/self/maps`) holding `address`.
    fn area_end(address: usize) -> usize {
        let maps = std::fs::read_to_string("/proc/self/maps").expect("/proc/self/maps");
        maps.lines()
            .filter_map(|line| {
                let (from, to) = line.split_once(' ')?.0.split_once('-')?;
                Some((
                    usize::from_str_radix(from, 16).ok()?,
                    usize::from_str_radix(to, 16).ok()?,
                ))
            })
            .find(|(from, to)| (*from..*to).contains(&address))
            .map(|(_, to)| to)
            .expect("an area holds the address")
    }

    #[test]
    fn a_new_region_leaves_the_huge_page_under_the_old_ones_last_matrix_mapped() {
        // Parts of a little over a huge page: a region holds about 15, so these span several regions.
        let parts: Vec<WeightBytes> = (0..40)
            .map(|_| WeightBytes::zeroed(HUGE_PAGE + 12_345))
            .collect();
        if !transparent_huge_pages() {
            return; // no huge pages to keep whole
        }
        assert!(
            parts.iter().all(WeightBytes::is_mapped),
            "a part went to the heap"
        );
        let mut switches = 0;
        for pair in parts.windows(2) {
            let end = pair[0].as_ptr() as usize + pair[0].len();
            if pair[1].as_ptr() as usize == end.next_multiple_of(page_size()) {
                continue; // the same region (or another test's part in between)
            }
            switches += 1;
            assert!(
                area_end(end - 1) >= end.next_multiple_of(HUGE_PAGE),
                "the huge page under a region's last part was cut at {end:#x}"
            );
        }
        assert!(switches > 0, "40 parts of over 2 MiB fit in one region");
    }
}
