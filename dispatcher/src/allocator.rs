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

/// mimalloc's `mi_option_allow_large_os_pages` (index 6 in both
/// generations).
pub const MI_OPTION_ALLOW_LARGE_OS_PAGES: mi::mi_option_t = 6;

/// The environment variable that backs the heap with transparent huge
/// pages: `1`, `true`, `yes` or `on` ([`options`]).
pub const HUGE_PAGES_ENV: &str = "DISPATCH_HUGE_PAGES";

/// [`HUGE_PAGES_ENV`] as `getenv` takes it.
const HUGE_PAGES_ENV_C: &std::ffi::CStr = c"DISPATCH_HUGE_PAGES";

/// How long freed pages stay committed before they are purged, ms.
pub const PURGE_DELAY_MS: std::ffi::c_long = 1000;

/// The options the dispatcher runs mimalloc with, as `(option, value)`.
///
/// By default: commit arena memory as it is used rather than up front,
/// and give freed pages back 1 s after they were freed (the version's
/// default). With eager commit the dispatcher started at 64 MiB of RSS
/// instead of 52 and held about 2 KB more per pending job, for no
/// throughput (measured in docs/BENCHMARKS.md, "The allocator"). A delay
/// of 10 ms, chosen when nothing else gave memory back, made the busy
/// dispatcher return pages it needed again at once: 1.28 page faults per
/// job under `loadgen`'s 50,000 jobs/s against 0.52-0.59 with 1 s, each a
/// fault and a zeroed page; purging at once (0) cost 5-10% of the
/// throughput. Since the idle threads collect and purge themselves
/// (`collect_when_idle`, the dispatcher binary's upkeep thread), the
/// longer delay holds no more memory at rest: the same bytes per pending
/// job and per relayed node (docs/BENCHMARKS.md, "Session 24 (lead)").
///
/// With `huge_pages` ([`HUGE_PAGES_ENV`]): arenas committed up front and
/// advised for transparent huge pages (`MADV_HUGEPAGE`, which a kernel
/// whose THP mode is `madvise` needs; mimalloc's large OS pages imply
/// eager commit). A dispatcher of 100,000 nodes touches its job table,
/// its nodes and the engine's per-node state at random on every
/// placement and finish, a working set of hundreds of MB that 4 KiB
/// pages spread over more TLB entries than the CPU has: the placement
/// bench placed 23% more jobs per second at 100,000 nodes in the median
/// of eight alternated pairs (-17% to +69%), 10% more at 10,000 (-7% to
/// +32%; docs/BENCHMARKS.md, "Session 36 (lead)"). It costs memory (eager
/// commit in 2 MiB pages: an idle dispatcher 58.6 MB of RSS instead of
/// 51.6, and eager commit held ~2 KB more per pending job when it was
/// measured), so it is for large clusters, off by default.
pub fn options(huge_pages: bool) -> [(mi::mi_option_t, std::ffi::c_long); 3] {
    [
        (MI_OPTION_ARENA_EAGER_COMMIT, huge_pages.into()),
        (MI_OPTION_ALLOW_LARGE_OS_PAGES, huge_pages.into()),
        (MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS),
    ]
}

/// What [`HUGE_PAGES_ENV`]'s value says: `Some(true)` for `1`, `true`,
/// `yes`, `on`; `Some(false)` for `0`, `false`, `no`, `off` and the empty
/// value; `None` for anything else, which the dispatcher refuses at
/// start ([`check_huge_pages_env`]) and the allocator reads as off.
pub fn huge_pages_value(v: &[u8]) -> Option<bool> {
    match v {
        b"1" | b"true" | b"yes" | b"on" => Some(true),
        b"" | b"0" | b"false" | b"no" | b"off" => Some(false),
        _ => None,
    }
}

/// The binary's check, once it may allocate and report: an unknown
/// [`HUGE_PAGES_ENV`] value is an error naming the variable (`tune`,
/// before `main`, could only read it as off).
pub fn check_huge_pages_env() -> Result<(), String> {
    match std::env::var_os(HUGE_PAGES_ENV) {
        Some(v) if huge_pages_value(v.as_encoded_bytes()).is_none() => Err(format!(
            "{HUGE_PAGES_ENV}={v:?}: want 1, true, yes or on (huge pages), or 0, false, no, off"
        )),
        _ => Ok(()),
    }
}

/// [`HUGE_PAGES_ENV`] from the process environment, read without
/// allocating: this runs before the allocator's first arena exists.
fn huge_pages_from_env() -> bool {
    unsafe extern "C" {
        fn getenv(name: *const std::ffi::c_char) -> *const std::ffi::c_char;
    }
    // SAFETY: `getenv` reads the environment with a NUL-terminated name;
    // the result, when not null, is a NUL-terminated string that stays
    // valid while nothing sets the variable (nothing does before `main`).
    unsafe {
        let p = getenv(HUGE_PAGES_ENV_C.as_ptr());
        !p.is_null() && huge_pages_value(std::ffi::CStr::from_ptr(p).to_bytes()) == Some(true)
    }
}

/// Set mimalloc's options ([`options`], huge pages as
/// [`HUGE_PAGES_ENV`] says).
///
/// Call it before the first allocation reserves mimalloc's first arena,
/// which happens before `main`: from a `.init_array` entry of the
/// binary (after mimalloc's own constructor, priority 101, and before
/// the Rust runtime starts), as the `dispatcher` binary and the
/// placement bench do, so that the bench measures the allocator as the
/// dispatcher runs it.
pub extern "C" fn tune() {
    for (option, value) in options(huge_pages_from_env()) {
        // SAFETY: mi_option_set only stores an integer in mimalloc's
        // option table; the indexes are its options (see the constants).
        unsafe { mi::mi_option_set(option, value) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default commits lazily with no huge pages; huge pages commit
    /// eagerly and allow large OS pages; the purge delay is the same.
    #[test]
    fn huge_pages_switch_eager_commit_and_large_pages_together() {
        let get = |o: &[(mi::mi_option_t, std::ffi::c_long)], k| {
            o.iter().find(|(x, _)| *x == k).map(|(_, v)| *v)
        };
        let off = options(false);
        let on = options(true);
        assert_eq!(get(&off, MI_OPTION_ARENA_EAGER_COMMIT), Some(0));
        assert_eq!(get(&off, MI_OPTION_ALLOW_LARGE_OS_PAGES), Some(0));
        assert_eq!(get(&on, MI_OPTION_ARENA_EAGER_COMMIT), Some(1));
        assert_eq!(get(&on, MI_OPTION_ALLOW_LARGE_OS_PAGES), Some(1));
        assert_eq!(get(&off, MI_OPTION_PURGE_DELAY), Some(PURGE_DELAY_MS));
        assert_eq!(get(&on, MI_OPTION_PURGE_DELAY), Some(PURGE_DELAY_MS));
    }

    #[test]
    fn the_huge_pages_variable_takes_the_usual_values_and_refuses_others() {
        for v in ["1", "true", "yes", "on"] {
            assert_eq!(huge_pages_value(v.as_bytes()), Some(true), "{v}");
        }
        for v in ["", "0", "false", "no", "off"] {
            assert_eq!(huge_pages_value(v.as_bytes()), Some(false), "{v}");
        }
        for v in ["2", "TRUE", "y", " 1"] {
            assert_eq!(huge_pages_value(v.as_bytes()), None, "{v}");
        }
        assert_eq!(HUGE_PAGES_ENV_C.to_str(), Ok(HUGE_PAGES_ENV));
    }

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
