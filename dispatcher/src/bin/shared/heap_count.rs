//! The counting global allocator of the byte-measuring bins (`core_costs`,
//! `node_bytes`): the system allocator, observed. It keeps the heap bytes
//! in use and the live allocations per size class, so a figure is the
//! bytes requested (malloc's own overhead is not counted).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

/// Counts the heap bytes in use.
struct Counting;

static IN_USE: AtomicIsize = AtomicIsize::new(0);

/// Live allocations by size class: class `k` holds sizes in
/// `(2^(k-1), 2^k]` (class 0: size 0 or 1). What a connection holds is
/// told apart by its sizes (an 8 KiB codec buffer, a 16 KiB write buffer).
const CLASSES: usize = 40;
static LIVE: [AtomicIsize; CLASSES] = [const { AtomicIsize::new(0) }; CLASSES];
static LIVE_BYTES: [AtomicIsize; CLASSES] = [const { AtomicIsize::new(0) }; CLASSES];

fn class_of(size: usize) -> usize {
    (usize::BITS - size.saturating_sub(1).leading_zeros()).min(CLASSES as u32 - 1) as usize
}

fn count(size: usize, sign: isize) {
    IN_USE.fetch_add(sign * size as isize, Ordering::Relaxed);
    let k = class_of(size);
    LIVE[k].fetch_add(sign, Ordering::Relaxed);
    LIVE_BYTES[k].fetch_add(sign * size as isize, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to the system allocator unchanged; the
// counters only observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size(), 1);
        // SAFETY: as the caller's contract for `System`.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(layout.size(), -1);
        // SAFETY: as the caller's contract for `System`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size(), 1);
        // SAFETY: as the caller's contract for `System`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(layout.size(), -1);
        count(new_size, 1);
        // SAFETY: as the caller's contract for `System`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Heap bytes in use now.
pub fn in_use() -> isize {
    IN_USE.load(Ordering::Relaxed)
}

/// The live allocations per size class (count, bytes).
#[allow(dead_code)] // `node_bytes` reads the total only.
pub fn live_classes() -> Vec<(isize, isize)> {
    LIVE.iter()
        .zip(&LIVE_BYTES)
        .map(|(n, b)| (n.load(Ordering::Relaxed), b.load(Ordering::Relaxed)))
        .collect()
}
