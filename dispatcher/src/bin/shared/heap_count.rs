//! The counting global allocator of the byte-measuring bins (`core_costs`,
//! `node_bytes`): the system allocator (glibc's malloc), or with
//! `MEASURE_ALLOC=mimalloc` in the environment mimalloc tuned as the
//! release dispatcher tunes it (`src/bin/dispatcher.rs`), observed. It
//! keeps the heap bytes in use and the live allocations per size class,
//! so a figure is the bytes requested (the allocator's own overhead is not
//! counted; it shows in RSS).
//!
//! The allocator is chosen at the first allocation (before `main`, read
//! with `getenv`, which allocates nothing) and never changes, so every
//! block is freed by the allocator that gave it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, AtomicU8, Ordering};

use mimalloc::MiMalloc;

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

/// The allocator chosen: 0 not yet, [`SYSTEM`] or [`MIMALLOC`].
static CHOSEN: AtomicU8 = AtomicU8::new(0);
const SYSTEM: u8 = 1;
const MIMALLOC: u8 = 2;

unsafe extern "C" {
    fn getenv(name: *const std::ffi::c_char) -> *const std::ffi::c_char;
}

/// The allocator of this process, chosen at the first call.
fn chosen() -> u8 {
    match CHOSEN.load(Ordering::Acquire) {
        0 => {
            // SAFETY: getenv reads the environment (a C string constant
            // passed); it allocates nothing. The first allocation happens
            // on the main thread before any other thread exists.
            let v = unsafe { getenv(c"MEASURE_ALLOC".as_ptr()) };
            // SAFETY: a non-null getenv result is a C string.
            let mimalloc = !v.is_null() && unsafe { std::ffi::CStr::from_ptr(v) } == c"mimalloc";
            let k = if mimalloc {
                // As the dispatcher's `tune_allocator`: commit as used,
                // purge freed pages after 10 ms (options 4 and 15).
                // SAFETY: mi_option_set stores an integer in mimalloc's
                // option table, before its first allocation.
                unsafe {
                    libmimalloc_sys::mi_option_set(4, 0);
                    libmimalloc_sys::mi_option_set(15, 10);
                }
                MIMALLOC
            } else {
                SYSTEM
            };
            CHOSEN.store(k, Ordering::Release);
            k
        }
        k => k,
    }
}

/// Whether this process allocates with mimalloc (`MEASURE_ALLOC`).
#[allow(dead_code)] // `node_bytes` reads the total only.
pub fn is_mimalloc() -> bool {
    chosen() == MIMALLOC
}

// SAFETY: every call is forwarded unchanged to the allocator chosen at the
// first call, which never changes, so a block is freed where it came
// from; the counters only observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size(), 1);
        // SAFETY: as the caller's contract for the allocator.
        unsafe {
            if chosen() == MIMALLOC {
                MiMalloc.alloc(layout)
            } else {
                System.alloc(layout)
            }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(layout.size(), -1);
        // SAFETY: as the caller's contract for the allocator.
        unsafe {
            if chosen() == MIMALLOC {
                MiMalloc.dealloc(ptr, layout)
            } else {
                System.dealloc(ptr, layout)
            }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size(), 1);
        // SAFETY: as the caller's contract for the allocator.
        unsafe {
            if chosen() == MIMALLOC {
                MiMalloc.alloc_zeroed(layout)
            } else {
                System.alloc_zeroed(layout)
            }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(layout.size(), -1);
        count(new_size, 1);
        // SAFETY: as the caller's contract for the allocator.
        unsafe {
            if chosen() == MIMALLOC {
                MiMalloc.realloc(ptr, layout, new_size)
            } else {
                System.realloc(ptr, layout, new_size)
            }
        }
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
