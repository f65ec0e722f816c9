//! Sparse vs dense atomic bitmap (seed 000 patch 1, "sched: Provide
//! sparsemask, a reduced contention bitmap").
//!
//! Compares [`AtomicSparseMask`] at density 3 with the packed
//! [`DenseAtomicBitmap`] baseline, for 64 and 1024 elements:
//!
//! * `iter_wrap_contended`: one `iter_wrap` pass (counting the set elements)
//!   by the benchmark thread while two background threads continuously set
//!   and clear their own disjoint elements. Writer `w` owns the elements of
//!   the 8-element groups `g` with `g % 2 == w`: in the sparse mask each group
//!   is one chunk, so the writers never share a cache line, while in the dense
//!   bitmap 512 consecutive elements share one line and all three threads
//!   fight over it.
//! * `iter_wrap_idle`: the same pass with no writers (the sparse mask reads
//!   `nelems / 8` cache lines, the dense one `nelems / 512`).
//! * `set_clear`: uncontended `set_elem` + `clear_elem` pairs.
//! * `set_clear_contended`: writer throughput, the sparsemask's real
//!   benefit. Each writer owns one 8-element group of a 64-element mask, as
//!   neighbouring CPUs own their elements of an LLC's overload mask: the
//!   benchmark thread group 0 (elements 0..8), a background "hammer" thread
//!   group 1 (elements 8..16). In the sparse mask the two groups are
//!   different 64-byte chunks; in the dense bitmap they are the same word,
//!   so every update of either thread takes the cache line away from the
//!   other (false sharing). Measured: time per `set_elem` + `clear_elem`
//!   pair of the benchmark thread, cycling over its 8 elements, with the
//!   parameter `writers` = 1 (alone: the reference) or 2 (while the hammer
//!   does the same set/clear pairs on its own elements non-stop). The
//!   hammer's own rate is printed to stderr, which shows it really ran
//!   alongside. Needs two CPUs to mean anything; on one CPU the threads
//!   time-slice instead of contending.
//!
//! Background threads run inside `std::thread::scope` and stop through a flag
//! that is raised on drop, so the benchmark also ends cleanly under
//! `cargo test --benches` (criterion's quick test mode) or on a panic.

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use sched::sparsemask::{AtomicSparseMask, DenseAtomicBitmap};

const SIZES: [usize; 2] = [64, 1024];
const SPARSE_DENSITY: u32 = 3;

/// The operations the benchmark needs from both bitmaps.
trait Bitmap: Sync {
    fn nelems(&self) -> usize;
    fn set(&self, e: usize);
    fn clear(&self, e: usize);
    fn count_wrap(&self, start: usize) -> usize;
}

impl Bitmap for AtomicSparseMask {
    fn nelems(&self) -> usize {
        AtomicSparseMask::nelems(self)
    }
    fn set(&self, e: usize) {
        self.set_elem(e);
    }
    fn clear(&self, e: usize) {
        self.clear_elem(e);
    }
    fn count_wrap(&self, start: usize) -> usize {
        self.iter_wrap(start).count()
    }
}

impl Bitmap for DenseAtomicBitmap {
    fn nelems(&self) -> usize {
        DenseAtomicBitmap::nelems(self)
    }
    fn set(&self, e: usize) {
        self.set_elem(e);
    }
    fn clear(&self, e: usize) {
        self.clear_elem(e);
    }
    fn count_wrap(&self, start: usize) -> usize {
        self.iter_wrap(start).count()
    }
}

/// The elements background writer `writer` (0 or 1) toggles.
fn writer_elems(nelems: usize, writer: usize) -> Vec<usize> {
    let group = 1 << SPARSE_DENSITY;
    (0..nelems).filter(|e| (e / group) % 2 == writer).collect()
}

/// Raises the stop flag when dropped (normal exit or unwinding).
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Measures `iter_wrap` passes over `mask`, with two writers if `contended`.
fn bench_iter_wrap<M: Bitmap>(
    c: &mut Criterion,
    group: &str,
    name: &str,
    mask: &M,
    contended: bool,
) {
    let nelems = mask.nelems();
    // Start half full, like the writers keep it on average.
    for e in (0..nelems).step_by(2) {
        mask.set(e);
    }
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let _stop = StopOnDrop(&stop);
        if contended {
            for writer in 0..2 {
                let elems = writer_elems(nelems, writer);
                let stop = &stop;
                s.spawn(move || {
                    let mut pass = 0usize;
                    while !stop.load(Ordering::Relaxed) {
                        for &e in &elems {
                            if (e ^ pass) & 1 == 0 {
                                mask.set(e);
                            } else {
                                mask.clear(e);
                            }
                        }
                        pass = pass.wrapping_add(1);
                    }
                });
            }
        }
        let mut g = c.benchmark_group(group);
        let mut start = 0;
        g.bench_function(BenchmarkId::new(name, nelems), |b| {
            b.iter(|| {
                start = (start + 1) % nelems;
                black_box(mask.count_wrap(black_box(start)))
            });
        });
        g.finish();
    });
}

fn iter_wrap_contended(c: &mut Criterion) {
    for n in SIZES {
        let sparse = AtomicSparseMask::with_density(n, SPARSE_DENSITY);
        bench_iter_wrap(c, "iter_wrap_contended", "sparse_d3", &sparse, true);
        let dense = DenseAtomicBitmap::new(n);
        bench_iter_wrap(c, "iter_wrap_contended", "dense", &dense, true);
    }
}

fn iter_wrap_idle(c: &mut Criterion) {
    for n in SIZES {
        let sparse = AtomicSparseMask::with_density(n, SPARSE_DENSITY);
        bench_iter_wrap(c, "iter_wrap_idle", "sparse_d3", &sparse, false);
        let dense = DenseAtomicBitmap::new(n);
        bench_iter_wrap(c, "iter_wrap_idle", "dense", &dense, false);
    }
}

fn bench_set_clear<M: Bitmap>(c: &mut Criterion, name: &str, mask: &M) {
    let nelems = mask.nelems();
    let mut g = c.benchmark_group("set_clear");
    let mut e = 0;
    g.bench_function(BenchmarkId::new(name, nelems), |b| {
        b.iter(|| {
            e = (e + 1) % nelems;
            mask.set(black_box(e));
            mask.clear(black_box(e));
        });
    });
    g.finish();
}

fn set_clear(c: &mut Criterion) {
    for n in SIZES {
        bench_set_clear(
            c,
            "sparse_d3",
            &AtomicSparseMask::with_density(n, SPARSE_DENSITY),
        );
        bench_set_clear(c, "dense", &DenseAtomicBitmap::new(n));
    }
}

/// Elements per writer in `set_clear_contended`: one sparse chunk at
/// density 3.
const GROUP: usize = 1 << SPARSE_DENSITY;
/// Mask size of `set_clear_contended` (one LLC's worth of CPUs).
const CONTENDED_NELEMS: usize = 64;

/// Measures the benchmark thread's set+clear pairs on elements
/// `0..GROUP` while, if `contended`, a hammer thread does the same on
/// `GROUP..2 * GROUP` (same dense word, different sparse chunk).
fn bench_set_clear_contended<M: Bitmap>(c: &mut Criterion, name: &str, mask: &M, contended: bool) {
    let mine: Vec<usize> = (0..GROUP).collect();
    let theirs: Vec<usize> = (GROUP..2 * GROUP).collect();
    let stop = AtomicBool::new(false);
    let started = AtomicBool::new(false);
    std::thread::scope(|s| {
        let hammer = contended.then(|| {
            let (stop, started, theirs) = (&stop, &started, &theirs);
            s.spawn(move || {
                started.store(true, Ordering::Release);
                let t0 = Instant::now();
                let mut pairs = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for &e in theirs {
                        mask.set(e);
                        mask.clear(e);
                    }
                    pairs += theirs.len() as u64;
                }
                (pairs, t0.elapsed())
            })
        });
        {
            // Raised when this block ends, also on a panic in criterion.
            let _stop = StopOnDrop(&stop);
            while contended && !started.load(Ordering::Acquire) {
                std::hint::spin_loop();
            }
            let mut g = c.benchmark_group("set_clear_contended");
            let mut i = 0;
            let writers = if contended { 2 } else { 1 };
            g.bench_function(BenchmarkId::new(name, format!("writers={writers}")), |b| {
                b.iter(|| {
                    let e = mine[i % GROUP];
                    i += 1;
                    mask.set(black_box(e));
                    mask.clear(black_box(e));
                });
            });
            g.finish();
        }
        if let Some(h) = hammer {
            let (pairs, took) = h.join().expect("hammer thread");
            eprintln!(
                "set_clear_contended/{name}: hammer did {pairs} pairs, {:.1} ns/pair",
                took.as_nanos() as f64 / pairs.max(1) as f64
            );
        }
    });
}

fn set_clear_contended(c: &mut Criterion) {
    for contended in [false, true] {
        bench_set_clear_contended(
            c,
            "sparse_d3",
            &AtomicSparseMask::with_density(CONTENDED_NELEMS, SPARSE_DENSITY),
            contended,
        );
        bench_set_clear_contended(
            c,
            "dense",
            &DenseAtomicBitmap::new(CONTENDED_NELEMS),
            contended,
        );
    }
}

criterion_group!(
    benches,
    iter_wrap_contended,
    iter_wrap_idle,
    set_clear,
    set_clear_contended
);
criterion_main!(benches);
