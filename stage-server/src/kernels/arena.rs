//! Where packed weights live: regions of 2 MiB huge pages, cut into one owned mapping per matrix.
//!
//! A decode step reads every weight once, so a stage crosses every page of its weights on every step. On 4 KiB
//! pages that is a TLB miss per 4 KiB (SmolLM2: about 23,000 per step, each a two-level walk in a virtual
//! machine); on huge pages 512 times fewer. One matrix is often smaller than a huge page (SmolLM2's are about
//! 0.5 MiB), so matrices are placed one after another in a shared region advised onto huge pages, and each
//! gets its part of it as a mapping of its own (freed with its matrix). Where mapping fails, the bytes go on
//! the heap: slower, never wrong.

use std::ops::{Deref, DerefMut};
use std::sync::Mutex;

use net_io_sys::memory::{HUGE_PAGE, Mapping, page_size};

/// The size of each shared region: large enough that few matrices straddle two, small enough that the
/// untouched tail of the last one costs little address space.
const REGION: usize = 16 * HUGE_PAGE;

/// The part of the current region not yet handed out.
static REST: Mutex<Option<Mapping>> = Mutex::new(None);

/// A matrix's bytes: its own part of a huge-page region, or heap memory if mapping failed.
#[derive(Debug)]
pub(crate) struct WeightBytes {
    storage: Storage,
    length: usize,
}

#[derive(Debug)]
enum Storage {
    Mapped(Mapping),
    Heap(Box<[u8]>),
}

impl WeightBytes {
    /// `length` zeroed bytes, on huge pages where the system allows.
    pub(crate) fn zeroed(length: usize) -> Self {
        let storage = match take(length) {
            Some(mapping) => Storage::Mapped(mapping),
            None => Storage::Heap(vec![0u8; length].into_boxed_slice()),
        };
        Self { storage, length }
    }

    /// Whether these bytes sit in a region advised onto huge pages (a test's view).
    #[cfg(test)]
    pub(crate) fn on_huge_pages(&self) -> bool {
        matches!(&self.storage, Storage::Mapped(mapping)
            if mapping.huge_pages() == net_io_sys::memory::HugePages::Advised)
    }
}

/// Cuts `length` bytes off the current region (starting a new one when they do not fit), or `None` when the
/// system refuses the mapping.
fn take(length: usize) -> Option<Mapping> {
    if length == 0 {
        return None;
    }
    let pages = length.checked_next_multiple_of(page_size())?;
    let mut rest = REST.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    // A region keeps at least one page after a split, so a part fits only if it leaves some.
    if rest.as_ref().is_none_or(|region| region.len() <= pages) {
        // The old region's tail is unmapped here; the matrices cut from it keep their own parts.
        let size = REGION.max(pages.checked_add(HUGE_PAGE)?);
        *rest = Mapping::anonymous(size, true).ok();
    }
    rest.as_mut()?.split_to(length).ok()
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
                .all(|&b| b == 0)
        );
        first.fill(1);
        second.fill(2);
        third.fill(3);
        let copy = second.clone();
        drop(second);
        assert!(first.iter().all(|&b| b == 1));
        assert!(copy.iter().all(|&b| b == 2));
        assert_eq!(&third[..], &[3]);
        // A region larger than REGION is made for a matrix that needs one.
        let large = WeightBytes::zeroed(REGION + 5);
        assert_eq!(large.len(), REGION + 5);
        // A kernel built with transparent huge pages accepts the advice (this one lists the setting).
        if std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists() {
            assert!(first.on_huge_pages() && large.on_huge_pages());
        }
    }
}
