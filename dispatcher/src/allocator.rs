//! The processes' global allocator: mimalloc, asked for word-aligned
//! blocks by its plain `mi_malloc` entry points.
//!
//! The `mimalloc` crate's `GlobalAlloc` sends every allocation through
//! `mi_malloc_aligned(size, align)`, whose checks (a power of two, the
//! alignment against the size, then whether the page's next free block
//! happens to be aligned) run on every call although nearly every Rust
//! allocation asks for an alignment of 8 or less. mimalloc's blocks are
//! whole words (its size classes are multiples of 8 bytes, and a page's
//! first block is 16-byte aligned), so any block it returns is 8-byte
//! aligned: those requests go to `mi_malloc` / `mi_zalloc` / `mi_realloc`
//! directly, as the standard library's `System` allocator does with
//! `malloc` under its own minimum alignment. Larger alignments keep the
//! aligned entry points. Frees are the same call either way (`mi_free`).

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

use libmimalloc_sys as mi;

/// The alignment every mimalloc block has: a machine word.
const WORD_ALIGN: usize = std::mem::size_of::<usize>();

/// mimalloc through its plain entry points for word-aligned requests
/// (see the module's doc).
pub struct Mimalloc;

/// Whether a request of `align` can take mimalloc's plain entry points.
#[inline(always)]
fn plain(align: usize) -> bool {
    align <= WORD_ALIGN
}

// SAFETY: every block comes from mimalloc and goes back to it; a block
// from the plain entry points is word-aligned (mimalloc's size classes
// are whole words from a 16-byte aligned page start), which satisfies
// every layout routed to them (`plain`), and the others take mimalloc's
// aligned calls with the layout's alignment.
unsafe impl GlobalAlloc for Mimalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: plain FFI allocation calls with the layout's values.
        unsafe {
            if plain(layout.align()) {
                mi::mi_malloc(layout.size()).cast()
            } else {
                mi::mi_malloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as in `alloc`.
        unsafe {
            if plain(layout.align()) {
                mi::mi_zalloc(layout.size()).cast()
            } else {
                mi::mi_zalloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: `ptr` was returned by this allocator, so by mimalloc.
        unsafe { mi::mi_free(ptr.cast::<c_void>()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` was returned by this allocator with `layout`; the
        // moved block keeps the layout's alignment (as in `alloc`).
        unsafe {
            if plain(layout.align()) {
                mi::mi_realloc(ptr.cast::<c_void>(), new_size).cast()
            } else {
                mi::mi_realloc_aligned(ptr.cast::<c_void>(), new_size, layout.align()).cast()
            }
        }
    }
}

/// mimalloc's `mi_option_arena_eager_commit` (index 4 in the option enum
/// of both of its generations, v2 and v3).
pub const MI_OPTION_ARENA_EAGER_COMMIT: mi::mi_option_t = 4;

/// mimalloc's `mi_option_purge_delay` (index 15 in both generations).
pub const MI_OPTION_PURGE_DELAY: mi::mi_option_t = 15;

/// How long freed pages stay committed before they are purged, ms.
pub const PURGE_DELAY_MS: std::ffi::c_long = 1000;

/// The options the dispatcher runs mimalloc with: commit arena memory as
/// it is used rather than up front, and give freed pages back 1 s after
/// they were freed (the version's default). With eager commit the
/// dispatcher started at 64 MiB of RSS instead of 52 and held about 2 KB
/// more per pending job, for no throughput (measured in
/// docs/BENCHMARKS.md, "The allocator"). A delay of 10 ms, chosen when
/// nothing else gave memory back, made the busy dispatcher return pages
/// it needed again at once: 1.28 page faults per job under `loadgen`'s
/// 50,000 jobs/s against 0.52-0.59 with 1 s, each a fault and a zeroed
/// page; purging at once (0) cost 5-10% of the throughput. Since the idle
/// threads collect and purge themselves (`collect_when_idle`, the
/// dispatcher binary's upkeep thread), the longer delay holds no more
/// memory at rest: the same bytes per pending job and per relayed node
/// (docs/BENCHMARKS.md, "Session 24 (lead)").
///
/// Call it before the first allocation reserves mimalloc's first arena,
/// which happens before `main`: from a `.init_array` entry of the
/// binary (after mimalloc's own constructor, priority 101, and before
/// the Rust runtime starts), as the `dispatcher` binary and the
/// placement bench do, so that the bench measures the allocator as the
/// dispatcher runs it.
pub extern "C" fn tune() {
    // SAFETY: mi_option_set only stores an integer in mimalloc's option
    // table; the indexes are its options (see the constants).
    unsafe {
        mi::mi_option_set(MI_OPTION_ARENA_EAGER_COMMIT, 0);
        mi::mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every size from 1 byte to past the small size classes, at every
    /// alignment from 1 to 4 KiB, comes back aligned, writable, zeroed
    /// when asked, and keeps its bytes through a reallocation.
    #[test]
    fn blocks_have_their_layouts_alignment() {
        let a = Mimalloc;
        let mut sizes: Vec<usize> = (1..=256).collect();
        sizes.extend([1000, 1024, 4096, 10_000, 100_000, 1 << 20]);
        for align in (0..=12).map(|s| 1usize << s) {
            for &size in &sizes {
                let layout = Layout::from_size_align(size, align).unwrap();
                // SAFETY: a non-zero layout; every block is freed below with it.
                unsafe {
                    let p = a.alloc(layout);
                    assert!(!p.is_null());
                    assert_eq!(p as usize % align, 0, "size {size} align {align}");
                    std::ptr::write_bytes(p, 0xa5, size);
                    let z = a.alloc_zeroed(layout);
                    assert_eq!(z as usize % align, 0, "zeroed: size {size} align {align}");
                    assert!(std::slice::from_raw_parts(z, size).iter().all(|&b| b == 0));
                    let q = a.realloc(p, layout, size * 3);
                    assert_eq!(q as usize % align, 0, "realloc: size {size} align {align}");
                    assert!(
                        std::slice::from_raw_parts(q, size)
                            .iter()
                            .all(|&b| b == 0xa5)
                    );
                    a.dealloc(q, Layout::from_size_align(size * 3, align).unwrap());
                    a.dealloc(z, layout);
                }
            }
        }
    }
}
