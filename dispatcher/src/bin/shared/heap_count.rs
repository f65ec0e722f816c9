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

use dispatcher::allocator::Mimalloc as MiMalloc;

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

/// With `MEASURE_TRACE_MIN=bytes` in the environment, the blocks of at
/// least that size are traced: where each live one was allocated (a
/// backtrace, resolved when reported), and how many were allocated per
/// place since [`trace_reset`]. Off (0) by default: tracing costs a
/// backtrace per large block.
static TRACE_MIN: AtomicIsize = AtomicIsize::new(-1);

thread_local! {
    /// This thread is inside the tracer (which allocates): its blocks
    /// are not traced.
    static IN_TRACE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The traced blocks: live ones by address, and allocations per place.
struct Traces {
    live: std::collections::HashMap<usize, (usize, std::sync::Arc<std::backtrace::Backtrace>)>,
    /// Allocations since the last reset: their sizes and backtraces.
    made: Vec<(usize, std::sync::Arc<std::backtrace::Backtrace>)>,
}

static TRACES: std::sync::Mutex<Option<Traces>> = std::sync::Mutex::new(None);

fn trace_min() -> usize {
    let m = TRACE_MIN.load(Ordering::Relaxed);
    if m >= 0 {
        return m as usize;
    }
    // SAFETY: getenv allocates nothing; a non-null result is a C string.
    let v = unsafe { getenv(c"MEASURE_TRACE_MIN".as_ptr()) };
    let m = if v.is_null() {
        0
    } else {
        unsafe { std::ffi::CStr::from_ptr(v) }
            .to_str()
            .ok()
            .and_then(|s| s.parse::<isize>().ok())
            .unwrap_or(0)
    };
    TRACE_MIN.store(m, Ordering::Relaxed);
    m as usize
}

fn traced(ptr: *mut u8, size: usize, alloc: bool) {
    let min = trace_min();
    if min == 0 || size < min || IN_TRACE.with(|t| t.replace(true)) {
        return;
    }
    let mut g = TRACES.lock().unwrap_or_else(|e| e.into_inner());
    let t = g.get_or_insert_with(|| Traces {
        live: Default::default(),
        made: Default::default(),
    });
    if alloc {
        let bt = std::sync::Arc::new(std::backtrace::Backtrace::force_capture());
        t.made.push((size, bt.clone()));
        t.live.insert(ptr as usize, (size, bt));
    } else {
        t.live.remove(&(ptr as usize));
    }
    drop(g);
    IN_TRACE.with(|t| t.set(false));
}

/// Forget the allocations counted per place (the live blocks stay).
#[allow(dead_code)]
pub fn trace_reset() {
    IN_TRACE.with(|t| t.set(true));
    if let Some(t) = TRACES.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
        t.made.clear();
    }
    IN_TRACE.with(|t| t.set(false));
}

/// The traced places: (live blocks, live bytes, allocated since reset,
/// bytes allocated since reset, the place's frames in our and our
/// dependencies' code), by live bytes then allocations.
#[allow(dead_code)]
pub fn trace_report() -> Vec<(usize, usize, usize, usize, String)> {
    IN_TRACE.with(|t| t.set(true));
    let mut by: std::collections::HashMap<String, (usize, usize, usize, usize)> =
        Default::default();
    if let Some(t) = TRACES.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
        for (size, bt) in t.live.values() {
            let e = by.entry(place(bt)).or_default();
            e.0 += 1;
            e.1 += size;
        }
        for (bytes, bt) in &t.made {
            let e = by.entry(place(bt)).or_default();
            e.2 += 1;
            e.3 += bytes;
        }
    }
    let mut v: Vec<_> = by
        .into_iter()
        .map(|(k, (a, b, c, d))| (a, b, c, d, k))
        .collect();
    v.sort_by_key(|e| std::cmp::Reverse((e.1, e.3)));
    IN_TRACE.with(|t| t.set(false));
    v
}

/// A backtrace's first frames outside the allocator and std's
/// collections: where a block was asked for.
fn place(bt: &std::backtrace::Backtrace) -> String {
    let shown = format!("{bt}");
    shown
        .lines()
        .map(str::trim)
        .filter(|l| l.contains("::") && !l.starts_with("at "))
        .map(|l| l.split_once(": ").map_or(l, |(_, f)| f))
        .filter(|f| {
            ![
                "std::",
                "alloc::",
                "core::",
                "heap_count::",
                "<alloc::",
                "<core::",
                "<std::",
                "hashbrown::raw",
                "<hashbrown::raw",
                "__rust",
                "backtrace",
            ]
            .iter()
            .any(|p| f.starts_with(p) || f.contains("heap_count"))
        })
        .take(4)
        .map(|f| f.rsplit_once("::h").map_or(f, |(a, _)| a).to_string())
        .collect::<Vec<_>>()
        .join(" < ")
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
                // Commit as used, as the dispatcher does
                // (`dispatcher::allocator::tune`), but purge freed pages
                // after 10 ms (the dispatcher: 1 s, with an upkeep
                // thread running the due purges, which this tool does
                // not have; options 4 and 15).
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
        let p = unsafe {
            if chosen() == MIMALLOC {
                MiMalloc.alloc(layout)
            } else {
                System.alloc(layout)
            }
        };
        traced(p, layout.size(), true);
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(layout.size(), -1);
        traced(ptr, layout.size(), false);
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
        let p = unsafe {
            if chosen() == MIMALLOC {
                MiMalloc.alloc_zeroed(layout)
            } else {
                System.alloc_zeroed(layout)
            }
        };
        traced(p, layout.size(), true);
        p
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(layout.size(), -1);
        count(new_size, 1);
        traced(ptr, layout.size(), false);
        // SAFETY: as the caller's contract for the allocator.
        let p = unsafe {
            if chosen() == MIMALLOC {
                MiMalloc.realloc(ptr, layout, new_size)
            } else {
                System.realloc(ptr, layout, new_size)
            }
        };
        traced(p, new_size, true);
        p
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

/// mimalloc's small and medium pages of one block size, summed: how many
/// there are, the bytes their blocks span so far (a page's capacity: the
/// blocks it has handed out at least once, which is what it has touched),
/// and the bytes of the blocks in use.
#[allow(dead_code)] // `node_bytes` reads the total only.
#[derive(Default, Clone, Copy, Debug)]
pub struct PageClass {
    pub pages: usize,
    pub capacity: usize,
    pub used: usize,
    /// Pages with no block in use (kept by their thread, not yet purged).
    pub empty: usize,
    /// The bytes of the pages' reserved spans that are resident (mincore).
    pub resident: usize,
}

unsafe extern "C" {
    fn mincore(addr: *mut std::ffi::c_void, length: usize, vec: *mut u8) -> std::ffi::c_int;
}

/// The resident bytes of `[start, start + len)` (whole OS pages of 4 KiB
/// touching it), by mincore in chunks (no allocation).
fn resident_bytes(start: usize, len: usize) -> usize {
    const PAGE: usize = 4096;
    const CHUNK: usize = 4096; // OS pages per mincore call
    let mut flags = [0u8; CHUNK];
    let (mut at, end) = (start & !(PAGE - 1), start + len);
    let mut resident = 0;
    while at < end {
        let pages = (end - at).div_ceil(PAGE).min(CHUNK);
        // SAFETY: mincore reads the page tables of a range of this
        // process (a mapping of mimalloc's; an unmapped range fails with
        // ENOMEM and counts nothing) into `flags`, one byte per page.
        if unsafe { mincore(at as *mut _, pages * PAGE, flags.as_mut_ptr()) } == 0 {
            resident += flags[..pages].iter().filter(|f| **f & 1 != 0).count() * PAGE;
        }
        at += pages * PAGE;
    }
    resident
}

/// The census of mimalloc's pages by block size (ascending), from its
/// page map (every thread's pages of the process's one heap). Read while
/// the process is quiet: mimalloc reads the pages without claiming them,
/// and a block freed by another thread than its page's owner still counts
/// as used until the owner collects it. Empty under the system allocator.
#[allow(dead_code)] // `node_bytes` reads the total only.
pub fn mimalloc_pages() -> Vec<(usize, PageClass)> {
    use std::ffi::c_void;
    /// More block sizes than mimalloc has bins (73), reserved up front so
    /// that the visit allocates nothing.
    const SIZES: usize = 256;
    let mut census: Vec<(usize, PageClass)> = Vec::with_capacity(SIZES);
    if !is_mimalloc() {
        return census;
    }
    unsafe extern "C" fn visit(
        _heap: *const libmimalloc_sys::mi_heap_t,
        area: *const libmimalloc_sys::mi_heap_area_t,
        _block: *mut c_void,
        _block_size: usize,
        arg: *mut c_void,
    ) -> bool {
        // SAFETY: mimalloc passes a valid area and our `arg`, the census.
        let (area, census) = unsafe { (&*area, &mut *(arg as *mut Vec<(usize, PageClass)>)) };
        let k = match census.iter().position(|(b, _)| *b == area.full_block_size) {
            Some(k) => k,
            None if census.len() < SIZES => {
                census.push((area.full_block_size, PageClass::default()));
                census.len() - 1
            }
            None => return true,
        };
        let c = &mut census[k].1;
        c.pages += 1;
        c.capacity += area.committed;
        c.used += area.used * area.full_block_size;
        if area.used == 0 {
            c.empty += 1;
        }
        c.resident += resident_bytes(area.blocks as usize, area.reserved);
        true
    }
    // SAFETY: a null heap is the process's main heap; the visitor only
    // reads the areas it is given and writes the census within its
    // reserved capacity.
    unsafe {
        libmimalloc_sys::mi_heap_visit_blocks(
            std::ptr::null_mut(),
            false,
            Some(visit),
            &mut census as *mut _ as *mut c_void,
        );
    }
    census.sort_by_key(|(b, _)| *b);
    census
}
