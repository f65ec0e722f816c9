//! Sparse bitmaps that trade memory for less cache-line contention.
//!
//! This module owns the *sparsemask* data structure and its two companions:
//!
//! * [`SparseMask`] — the single-owner sparse bitmap (`&mut self` mutation);
//! * [`AtomicSparseMask`] — the same layout on atomics, shared by many
//!   threads that set, clear and visit elements concurrently;
//! * [`DenseAtomicBitmap`] — a conventional packed atomic bitmap, kept only as
//!   the baseline the `sparsemask` benchmark compares against.
//!
//! Source: seed 000 patch 1, "[PATCH v3 01/10] sched: Provide sparsemask, a
//! reduced contention bitmap" (Steve Sistare, 2018), in
//! `/work/shared/seeds/000_a368e4bab2d9d2a8.txt`. The idea and the names
//! (`set_elem`, `test_and_set_elem`, `sparsemask_next`,
//! `sparsemask_next_wrap`, `for_each_sparse_wrap`, `SMASK_DENSITY_MAX`, ...)
//! come from there; the code is our own.
//!
//! # Layout
//!
//! The mask is an array of 64-byte chunks ([`SMASK_BYTES`]). Of each chunk
//! only the first 64-bit word is significant, and of that word only the low
//! `2^density` bits: element `e` lives in chunk `e >> density`, at bit
//! `e & (2^density - 1)`. Everything else in the chunk is padding, so threads
//! that update elements of different chunks never write the same cache line —
//! that is the whole point: in the kernel series the mask records overloaded
//! CPUs of a last-level-cache domain, and every CPU sets and clears its own
//! element while idle CPUs scan the mask to steal work.
//!
//! The price is memory and scan length: a mask for `N` elements takes about
//! `N / 2^density * 64` bytes (see [`SparseMask::bytes_for`]), e.g. 8 KiB for
//! 1024 elements at the default density 3, against 128 bytes for a dense
//! bitmap, and a full scan reads `N / 2^density` cache lines.
//!
//! # Out-of-range elements
//!
//! An element `>= nelems` is a caller bug. Like the kernel's
//! `WARN_ON_ONCE(elem >= mask->nelems)` we do not make it fatal in production:
//! every operation `debug_assert!`s the bound (so tests and debug builds panic)
//! and, in release builds, ignores the request — a set or clear does nothing,
//! and a test returns `false`.

use std::fmt;
use std::iter::{Chain, FusedIterator};
use std::sync::atomic::{AtomicU64, Ordering};

/// Suggested density: 2^3 = 8 elements per 64-byte chunk.
pub const SPARSEMASK_DENSITY_DEFAULT: u32 = 3;

/// Largest density: 2^6 = 64 elements, i.e. the whole first word of a chunk.
pub const SMASK_DENSITY_MAX: u32 = 6;

/// Size in bytes of one chunk of a sparse mask (one cache line).
pub const SMASK_BYTES: usize = 64;

/// Number of bits in a storage word.
const WORD_BITS: usize = u64::BITS as usize;

// ---------------------------------------------------------------------------
// Index arithmetic, shared by every bitmap in this module.
// ---------------------------------------------------------------------------

/// Geometry of a mask: how many elements it holds and how many of them share
/// one storage word (`2^density`). All translation between element numbers
/// and (word, bit) positions lives here, written once for the three bitmaps
/// (the dense baseline is simply density 6 with unpadded words).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Layout {
    nelems: usize,
    density: u32,
}

impl Layout {
    fn new(nelems: usize, density: u32) -> Self {
        assert!(
            density <= SMASK_DENSITY_MAX,
            "sparsemask density {density} is out of range: it must be at most \
             SMASK_DENSITY_MAX ({SMASK_DENSITY_MAX})"
        );
        Layout { nelems, density }
    }

    /// Elements per storage word (`2^density`).
    fn elems_per_word(self) -> usize {
        1 << self.density
    }

    /// Number of storage words (chunks, for the sparse masks).
    fn words(self) -> usize {
        self.nelems.div_ceil(self.elems_per_word())
    }

    /// First element stored in `word`.
    fn word_base(self, word: usize) -> usize {
        word << self.density
    }

    /// Word index and bit mask of `elem`, or `None` (after a debug assertion)
    /// when `elem` is out of range: the kernel's `sparsemask_check`.
    fn locate(self, elem: usize) -> Option<(usize, u64)> {
        debug_assert!(
            elem < self.nelems,
            "sparsemask element {elem} out of range (nelems = {})",
            self.nelems
        );
        (elem < self.nelems).then(|| {
            let bit = elem & (self.elems_per_word() - 1);
            (elem >> self.density, 1u64 << bit)
        })
    }

    /// `sparsemask_next`: the first set element after `n` (from 0 when `n`
    /// is `None`, the kernel's `-1`).
    fn next<S: Words + ?Sized>(self, words: &S, n: Option<usize>) -> Option<usize> {
        let lo = match n {
            None => 0,
            Some(n) => {
                debug_assert!(
                    n < self.nelems,
                    "sparsemask element {n} out of range (nelems = {})",
                    self.nelems
                );
                n.saturating_add(1)
            }
        };
        WordIter::new(words, self, lo, self.nelems).next()
    }

    /// `sparsemask_next_wrap`, with the kernel's semantics (see
    /// [`SparseMask::next_wrap`]).
    fn next_wrap<S: Words + ?Sized>(
        self,
        words: &S,
        n: Option<usize>,
        start: usize,
        wrap: bool,
    ) -> Option<usize> {
        debug_assert!(
            start <= self.nelems,
            "sparsemask wrap start {start} out of range (nelems = {})",
            self.nelems
        );
        let mut n = n;
        let mut wrap = wrap;
        loop {
            let below_start = n.is_none_or(|n| n < start);
            match self.next(words, n) {
                // We wrapped around and came back to (or past) the start.
                Some(next) if wrap && below_start && next >= start => return None,
                Some(next) => return Some(next),
                // Ran off the end after wrapping: nothing left to visit.
                // (`n == None` also stops the loop when start > nelems,
                // where the kernel would spin.)
                None if wrap && below_start => return None,
                None => {
                    wrap = true;
                    n = None;
                }
            }
        }
    }

    /// Ascending iterator over the set elements (`for_each_sparse`).
    fn iter<S: Words + ?Sized>(self, words: &S) -> WordIter<'_, S> {
        WordIter::new(words, self, 0, self.nelems)
    }

    /// Wrapping iterator (`for_each_sparse_wrap`): `[start, nelems)` then
    /// `[0, start)`. The word holding `start` is read twice, but each read
    /// is masked to a disjoint half, so no element can be reported twice.
    fn iter_wrap<S: Words + ?Sized>(
        self,
        words: &S,
        start: usize,
    ) -> Chain<WordIter<'_, S>, WordIter<'_, S>> {
        debug_assert!(
            start <= self.nelems,
            "sparsemask wrap start {start} out of range (nelems = {})",
            self.nelems
        );
        // Like the kernel, a start of nelems means "from 0"; in release
        // builds a larger (invalid) start is treated the same way.
        let start = if start >= self.nelems { 0 } else { start };
        WordIter::new(words, self, start, self.nelems).chain(WordIter::new(words, self, 0, start))
    }

    /// Number of set elements (`sparsemask_weight`).
    fn weight<S: Words + ?Sized>(self, words: &S) -> usize {
        (0..self.words())
            .map(|w| words.load(w).count_ones() as usize)
            .sum()
    }

    fn is_empty<S: Words + ?Sized>(self, words: &S) -> bool {
        (0..self.words()).all(|w| words.load(w) == 0)
    }

    /// `Debug` output shared by the three bitmaps.
    fn fmt_debug<S: Words + ?Sized>(
        self,
        name: &str,
        words: &S,
        f: &mut fmt::Formatter<'_>,
    ) -> fmt::Result {
        struct Elems<'a, S: ?Sized>(Layout, &'a S);
        impl<S: Words + ?Sized> fmt::Debug for Elems<'_, S> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_set().entries(self.0.iter(self.1)).finish()
            }
        }
        f.debug_struct(name)
            .field("nelems", &self.nelems)
            .field("density", &self.density)
            .field("elems", &Elems(self, words))
            .finish()
    }
}

/// Read access to the significant word of each chunk.
trait Words {
    fn load(&self, word: usize) -> u64;
}

/// A word with its low `width` bits set (all 64 when `width >= 64`).
fn low_bits(width: usize) -> u64 {
    if width >= WORD_BITS {
        u64::MAX
    } else {
        (1u64 << width) - 1
    }
}

/// Iterator over the set elements in `[lo, hi)`, ascending. It loads each
/// storage word exactly once, when it reaches it, and reports the bits of
/// that single load.
struct WordIter<'a, S: ?Sized> {
    words: &'a S,
    layout: Layout,
    lo: usize,
    hi: usize,
    next_word: usize,
    end_word: usize,
    base: usize,
    pending: u64,
}

impl<'a, S: Words + ?Sized> WordIter<'a, S> {
    fn new(words: &'a S, layout: Layout, lo: usize, hi: usize) -> Self {
        let hi = hi.min(layout.nelems);
        let (next_word, end_word) = if lo < hi {
            (lo >> layout.density, ((hi - 1) >> layout.density) + 1)
        } else {
            (0, 0)
        };
        WordIter {
            words,
            layout,
            lo,
            hi,
            next_word,
            end_word,
            base: 0,
            pending: 0,
        }
    }
}

impl<S: Words + ?Sized> Iterator for WordIter<'_, S> {
    type Item = usize;

    #[inline]
    fn next(&mut self) -> Option<usize> {
        loop {
            if self.pending != 0 {
                let bit = self.pending.trailing_zeros() as usize;
                self.pending &= self.pending - 1;
                return Some(self.base + bit);
            }
            if self.next_word >= self.end_word {
                return None;
            }
            let word = self.next_word;
            self.next_word += 1;
            let base = self.layout.word_base(word);
            // Keep only the significant bits that fall inside [lo, hi).
            let width = (self.hi - base).min(self.layout.elems_per_word());
            let mut bits = self.words.load(word) & low_bits(width);
            if self.lo > base {
                bits &= u64::MAX << (self.lo - base);
            }
            self.base = base;
            self.pending = bits;
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let pending = self.pending.count_ones() as usize;
        let unread =
            (self.end_word - self.next_word.min(self.end_word)) * self.layout.elems_per_word();
        (pending, Some(pending + unread))
    }
}

impl<S: Words + ?Sized> FusedIterator for WordIter<'_, S> {}

// Manual impl: a derive would needlessly require `S: Clone`.
impl<S: ?Sized> Clone for WordIter<'_, S> {
    fn clone(&self) -> Self {
        WordIter { ..*self }
    }
}

// ---------------------------------------------------------------------------
// SparseMask
// ---------------------------------------------------------------------------

/// One 64-byte chunk of a [`SparseMask`]: the significant word, padded to a
/// cache line by the alignment.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
#[repr(C, align(64))]
struct PlainChunk {
    word: u64,
}

const _: () = assert!(size_of::<PlainChunk>() == SMASK_BYTES);

impl Words for [PlainChunk] {
    #[inline]
    fn load(&self, word: usize) -> u64 {
        self[word].word
    }
}

/// A sparse bitmap over the elements `0..nelems`, owned by one thread.
///
/// Each 64-byte chunk stores `2^density` elements in the low bits of its first
/// word (see the [module docs](self)). This is the `struct sparsemask` of the
/// seed with the kernel's non-atomic (`__sparsemask_set_elem`) accessors;
/// share an [`AtomicSparseMask`] instead when several threads update the
/// mask. Out-of-range elements are a debug assertion and otherwise ignored.
#[derive(Clone, PartialEq, Eq)]
pub struct SparseMask {
    layout: Layout,
    chunks: Vec<PlainChunk>,
}

impl SparseMask {
    /// An empty mask for `nelems` elements at [`SPARSEMASK_DENSITY_DEFAULT`].
    pub fn new(nelems: usize) -> Self {
        Self::with_density(nelems, SPARSEMASK_DENSITY_DEFAULT)
    }

    /// An empty mask for `nelems` elements storing `2^density` elements per
    /// 64-byte chunk.
    ///
    /// # Panics
    ///
    /// If `density > SMASK_DENSITY_MAX` (a programming error).
    pub fn with_density(nelems: usize, density: u32) -> Self {
        let layout = Layout::new(nelems, density);
        SparseMask {
            layout,
            chunks: vec![PlainChunk::default(); layout.words()],
        }
    }

    /// Heap bytes used by a mask of `nelems` elements at `density`:
    /// `ceil(nelems / 2^density) * 64` (the kernel's `sparsemask_size`,
    /// without the header).
    ///
    /// # Panics
    ///
    /// If `density > SMASK_DENSITY_MAX`.
    pub fn bytes_for(nelems: usize, density: u32) -> usize {
        Layout::new(nelems, density).words() * SMASK_BYTES
    }

    /// Number of elements the mask can hold.
    pub fn nelems(&self) -> usize {
        self.layout.nelems
    }

    /// The density: `2^density` elements share one chunk.
    pub fn density(&self) -> u32 {
        self.layout.density
    }

    /// Heap bytes used by the chunks (see [`SparseMask::bytes_for`]).
    pub fn bytes(&self) -> usize {
        self.chunks.len() * SMASK_BYTES
    }

    /// Adds `elem` to the set (`sparsemask_set_elem`).
    pub fn set_elem(&mut self, elem: usize) {
        if let Some((w, bit)) = self.layout.locate(elem) {
            self.chunks[w].word |= bit;
        }
    }

    /// Removes `elem` from the set (`sparsemask_clear_elem`).
    pub fn clear_elem(&mut self, elem: usize) {
        if let Some((w, bit)) = self.layout.locate(elem) {
            self.chunks[w].word &= !bit;
        }
    }

    /// Whether `elem` is in the set (`sparsemask_test_elem`).
    pub fn test_elem(&self, elem: usize) -> bool {
        self.layout
            .locate(elem)
            .is_some_and(|(w, bit)| self.chunks[w].word & bit != 0)
    }

    /// Adds `elem` and returns whether it was already set
    /// (`sparsemask_test_and_set_elem`).
    pub fn test_and_set_elem(&mut self, elem: usize) -> bool {
        self.layout.locate(elem).is_some_and(|(w, bit)| {
            let old = self.chunks[w].word;
            self.chunks[w].word = old | bit;
            old & bit != 0
        })
    }

    /// Removes `elem` and returns whether it was set
    /// (`sparsemask_test_and_clear_elem`).
    pub fn test_and_clear_elem(&mut self, elem: usize) -> bool {
        self.layout.locate(elem).is_some_and(|(w, bit)| {
            let old = self.chunks[w].word;
            self.chunks[w].word = old & !bit;
            old & bit != 0
        })
    }

    /// Number of set elements (`sparsemask_weight`).
    pub fn weight(&self) -> usize {
        self.layout.weight(&self.chunks[..])
    }

    /// Whether no element is set.
    pub fn is_empty(&self) -> bool {
        self.layout.is_empty(&self.chunks[..])
    }

    /// Clears every element.
    pub fn clear_all(&mut self) {
        self.chunks.fill(PlainChunk::default());
    }

    /// `sparsemask_next`: the first set element strictly greater than `n`,
    /// or the first set element when `n` is `None` (the kernel's `-1`).
    /// Returns `None` where the kernel returns `nelems`.
    pub fn next(&self, n: Option<usize>) -> Option<usize> {
        self.layout.next(&self.chunks[..], n)
    }

    /// `sparsemask_next_wrap`: the next set element after `n` in a walk that
    /// starts at `start` and wraps past `nelems - 1` to 0, or `None` once the
    /// walk is complete.
    ///
    /// Kernel semantics: take `next(n)`; if `wrap` is true, `n < start`
    /// (`None` counts as `-1`) and that element is `>= start` (or there is
    /// none), the walk has come back to its start and is over. Otherwise, if
    /// the end of the mask was reached, wrap around (`wrap = true`, `n = -1`)
    /// and look again. The walk of `for_each_sparse_wrap(elem, mask, start)`
    /// is:
    ///
    /// ```
    /// # use sched::sparsemask::SparseMask;
    /// # let mut mask = SparseMask::new(20);
    /// # mask.set_elem(3);
    /// # mask.set_elem(12);
    /// # let start: usize = 5;
    /// let mut seen = Vec::new();
    /// let mut elem = mask.next_wrap(start.checked_sub(1), start, false);
    /// while let Some(e) = elem {
    ///     seen.push(e);
    ///     elem = mask.next_wrap(Some(e), start, true);
    /// }
    /// assert_eq!(seen, mask.iter_wrap(start).collect::<Vec<_>>());
    /// ```
    ///
    /// `start` must be `<= nelems` (debug assertion).
    pub fn next_wrap(&self, n: Option<usize>, start: usize, wrap: bool) -> Option<usize> {
        self.layout.next_wrap(&self.chunks[..], n, start, wrap)
    }

    /// Iterates over the set elements in ascending order (`for_each_sparse`).
    pub fn iter(&self) -> impl FusedIterator<Item = usize> + '_ {
        self.layout.iter(&self.chunks[..])
    }

    /// Iterates over the set elements starting at `start` (inclusive, set or
    /// not), going up and wrapping past `nelems - 1` to 0, and stopping before
    /// `start` is reached again: each set element is visited exactly once
    /// (`for_each_sparse_wrap`). The order is: the elements `>= start`
    /// ascending, then the elements `< start` ascending.
    ///
    /// `start` must be `< nelems`; `start == nelems` is accepted and means 0,
    /// as in the kernel. A larger `start` is a debug assertion and is treated
    /// as 0 in release builds.
    pub fn iter_wrap(&self, start: usize) -> impl FusedIterator<Item = usize> + '_ {
        self.layout.iter_wrap(&self.chunks[..], start)
    }
}

impl fmt::Debug for SparseMask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.layout.fmt_debug("SparseMask", &self.chunks[..], f)
    }
}

// ---------------------------------------------------------------------------
// AtomicSparseMask
// ---------------------------------------------------------------------------

/// One 64-byte chunk of an [`AtomicSparseMask`]: the significant atomic word,
/// alone in its cache line thanks to the alignment (the rest of the line is
/// padding). Two chunks therefore never share a line, so threads updating
/// elements of different chunks do not contend.
#[derive(Default)]
#[repr(C, align(64))]
struct Chunk {
    word: AtomicU64,
}

const _: () = assert!(size_of::<Chunk>() == SMASK_BYTES && align_of::<Chunk>() == SMASK_BYTES);

impl Words for [Chunk] {
    #[inline]
    fn load(&self, word: usize) -> u64 {
        self[word].word.load(Ordering::Acquire)
    }
}

/// A [`SparseMask`] whose elements many threads may set, clear, test and
/// iterate concurrently through `&self` (the kernel's atomic `set_bit` /
/// `clear_bit` based accessors). It is `Send + Sync`.
///
/// # Memory ordering
///
/// * [`set_elem`](Self::set_elem) and [`clear_elem`](Self::clear_elem) are
///   `fetch_or` / `fetch_and` with `Release`: a thread that publishes state
///   and then sets its element (e.g. "CPU 7 is overloaded, its queue holds a
///   stealable task") makes that state visible to any thread that observes
///   the element.
/// * Reads ([`test_elem`](Self::test_elem), [`weight`](Self::weight), the
///   iterators, [`snapshot`](Self::snapshot)) load with `Acquire`, pairing
///   with the releases above.
/// * [`test_and_set_elem`](Self::test_and_set_elem) and
///   [`test_and_clear_elem`](Self::test_and_clear_elem) are `AcqRel` RMWs:
///   they both publish and observe, so they can be used to claim an element.
///
/// Each word is read and updated atomically, but operations spanning several
/// words (weight, iteration, `clear_all`, `snapshot`) are not atomic as a
/// whole: they see each word at some instant during the call.
pub struct AtomicSparseMask {
    layout: Layout,
    chunks: Box<[Chunk]>,
}

impl AtomicSparseMask {
    /// An empty mask for `nelems` elements at [`SPARSEMASK_DENSITY_DEFAULT`].
    pub fn new(nelems: usize) -> Self {
        Self::with_density(nelems, SPARSEMASK_DENSITY_DEFAULT)
    }

    /// An empty mask for `nelems` elements storing `2^density` elements per
    /// 64-byte chunk (one cache line).
    ///
    /// # Panics
    ///
    /// If `density > SMASK_DENSITY_MAX` (a programming error).
    pub fn with_density(nelems: usize, density: u32) -> Self {
        let layout = Layout::new(nelems, density);
        AtomicSparseMask {
            layout,
            chunks: (0..layout.words()).map(|_| Chunk::default()).collect(),
        }
    }

    /// Number of elements the mask can hold.
    pub fn nelems(&self) -> usize {
        self.layout.nelems
    }

    /// The density: `2^density` elements share one chunk.
    pub fn density(&self) -> u32 {
        self.layout.density
    }

    /// Heap bytes used by the chunks (see [`SparseMask::bytes_for`]).
    pub fn bytes(&self) -> usize {
        self.chunks.len() * SMASK_BYTES
    }

    /// Atomically adds `elem` (`sparsemask_set_elem`; `Release`).
    pub fn set_elem(&self, elem: usize) {
        if let Some((w, bit)) = self.layout.locate(elem) {
            self.chunks[w].word.fetch_or(bit, Ordering::Release);
        }
    }

    /// Atomically removes `elem` (`sparsemask_clear_elem`; `Release`).
    pub fn clear_elem(&self, elem: usize) {
        if let Some((w, bit)) = self.layout.locate(elem) {
            self.chunks[w].word.fetch_and(!bit, Ordering::Release);
        }
    }

    /// Whether `elem` is currently set (`sparsemask_test_elem`; `Acquire`).
    pub fn test_elem(&self, elem: usize) -> bool {
        self.layout
            .locate(elem)
            .is_some_and(|(w, bit)| self.chunks[w].word.load(Ordering::Acquire) & bit != 0)
    }

    /// Atomically adds `elem` and returns whether it was already set
    /// (`sparsemask_test_and_set_elem`; `AcqRel`). Exactly one of several
    /// racing callers gets `false`.
    pub fn test_and_set_elem(&self, elem: usize) -> bool {
        self.layout
            .locate(elem)
            .is_some_and(|(w, bit)| self.chunks[w].word.fetch_or(bit, Ordering::AcqRel) & bit != 0)
    }

    /// Atomically removes `elem` and returns whether it was set
    /// (`sparsemask_test_and_clear_elem`; `AcqRel`). Exactly one of several
    /// racing callers gets `true`.
    pub fn test_and_clear_elem(&self, elem: usize) -> bool {
        self.layout.locate(elem).is_some_and(|(w, bit)| {
            self.chunks[w].word.fetch_and(!bit, Ordering::AcqRel) & bit != 0
        })
    }

    /// Number of set elements, summed one chunk at a time
    /// (`sparsemask_weight`).
    pub fn weight(&self) -> usize {
        self.layout.weight(&self.chunks[..])
    }

    /// Whether no element was set when each chunk was read.
    pub fn is_empty(&self) -> bool {
        self.layout.is_empty(&self.chunks[..])
    }

    /// Clears every element, one chunk at a time (`Release` stores).
    pub fn clear_all(&self) {
        for chunk in &self.chunks[..] {
            chunk.word.store(0, Ordering::Release);
        }
    }

    /// `sparsemask_next`; see [`SparseMask::next`].
    pub fn next(&self, n: Option<usize>) -> Option<usize> {
        self.layout.next(&self.chunks[..], n)
    }

    /// `sparsemask_next_wrap`; see [`SparseMask::next_wrap`].
    pub fn next_wrap(&self, n: Option<usize>, start: usize, wrap: bool) -> Option<usize> {
        self.layout.next_wrap(&self.chunks[..], n, start, wrap)
    }

    /// Iterates over the set elements in ascending order
    /// (`for_each_sparse`). Same concurrency guarantees as
    /// [`iter_wrap`](Self::iter_wrap).
    pub fn iter(&self) -> impl FusedIterator<Item = usize> + '_ {
        self.layout.iter(&self.chunks[..])
    }

    /// Iterates from `start`, wrapping around, over the set elements
    /// (`for_each_sparse_wrap`); order and `start` rules as in
    /// [`SparseMask::iter_wrap`].
    ///
    /// The iterator reads one chunk word at a time, when it reaches it, and
    /// reports the bits of that read. While other threads set and clear
    /// elements concurrently, one iteration therefore
    ///
    /// * yields each element at most once, in wrap order (the chunk holding
    ///   `start` is read twice, but its two reads are masked to disjoint
    ///   halves);
    /// * yields every element that stays set during the whole iteration;
    /// * may or may not yield an element set or cleared meanwhile.
    pub fn iter_wrap(&self, start: usize) -> impl FusedIterator<Item = usize> + '_ {
        self.layout.iter_wrap(&self.chunks[..], start)
    }

    /// Copies the mask into a [`SparseMask`], reading one chunk at a time
    /// (not an atomic snapshot of the whole mask when writers are active).
    pub fn snapshot(&self) -> SparseMask {
        SparseMask {
            layout: self.layout,
            chunks: self
                .chunks
                .iter()
                .map(|c| PlainChunk {
                    word: c.word.load(Ordering::Acquire),
                })
                .collect(),
        }
    }
}

impl From<&SparseMask> for AtomicSparseMask {
    /// An atomic mask with the same geometry and elements as `mask`.
    fn from(mask: &SparseMask) -> Self {
        AtomicSparseMask {
            layout: mask.layout,
            chunks: mask
                .chunks
                .iter()
                .map(|c| Chunk {
                    word: AtomicU64::new(c.word),
                })
                .collect(),
        }
    }
}

impl fmt::Debug for AtomicSparseMask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.layout
            .fmt_debug("AtomicSparseMask", &self.chunks[..], f)
    }
}

// ---------------------------------------------------------------------------
// DenseAtomicBitmap (benchmark baseline)
// ---------------------------------------------------------------------------

impl Words for [AtomicU64] {
    #[inline]
    fn load(&self, word: usize) -> u64 {
        self[word].load(Ordering::Acquire)
    }
}

/// The baseline for [`AtomicSparseMask`]: a conventional packed atomic
/// bitmap, 64 elements per `u64`, eight words per cache line (the kernel's
/// `cpumask`). It is what the `sparsemask` benchmark compares against — its
/// scans touch few cache lines, but threads updating neighbouring elements
/// fight over the same line. Same API, memory ordering and concurrency
/// guarantees as [`AtomicSparseMask`]; out-of-range elements are handled the
/// same way.
pub struct DenseAtomicBitmap {
    layout: Layout,
    words: Box<[AtomicU64]>,
}

impl DenseAtomicBitmap {
    /// An empty bitmap for `nelems` elements.
    pub fn new(nelems: usize) -> Self {
        let layout = Layout::new(nelems, SMASK_DENSITY_MAX);
        DenseAtomicBitmap {
            layout,
            words: (0..layout.words()).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Number of elements the bitmap can hold.
    pub fn nelems(&self) -> usize {
        self.layout.nelems
    }

    /// Heap bytes used: `ceil(nelems / 64) * 8`.
    pub fn bytes(&self) -> usize {
        self.words.len() * size_of::<AtomicU64>()
    }

    /// Atomically adds `elem` (`Release`).
    pub fn set_elem(&self, elem: usize) {
        if let Some((w, bit)) = self.layout.locate(elem) {
            self.words[w].fetch_or(bit, Ordering::Release);
        }
    }

    /// Atomically removes `elem` (`Release`).
    pub fn clear_elem(&self, elem: usize) {
        if let Some((w, bit)) = self.layout.locate(elem) {
            self.words[w].fetch_and(!bit, Ordering::Release);
        }
    }

    /// Whether `elem` is currently set (`Acquire`).
    pub fn test_elem(&self, elem: usize) -> bool {
        self.layout
            .locate(elem)
            .is_some_and(|(w, bit)| self.words[w].load(Ordering::Acquire) & bit != 0)
    }

    /// Atomically adds `elem`, returning whether it was already set
    /// (`AcqRel`).
    pub fn test_and_set_elem(&self, elem: usize) -> bool {
        self.layout
            .locate(elem)
            .is_some_and(|(w, bit)| self.words[w].fetch_or(bit, Ordering::AcqRel) & bit != 0)
    }

    /// Atomically removes `elem`, returning whether it was set (`AcqRel`).
    pub fn test_and_clear_elem(&self, elem: usize) -> bool {
        self.layout
            .locate(elem)
            .is_some_and(|(w, bit)| self.words[w].fetch_and(!bit, Ordering::AcqRel) & bit != 0)
    }

    /// Number of set elements, summed one word at a time.
    pub fn weight(&self) -> usize {
        self.layout.weight(&self.words[..])
    }

    /// Whether no element was set when each word was read.
    pub fn is_empty(&self) -> bool {
        self.layout.is_empty(&self.words[..])
    }

    /// Clears every element, one word at a time.
    pub fn clear_all(&self) {
        for word in &self.words[..] {
            word.store(0, Ordering::Release);
        }
    }

    /// First set element greater than `n` (from 0 when `None`).
    pub fn next(&self, n: Option<usize>) -> Option<usize> {
        self.layout.next(&self.words[..], n)
    }

    /// Wrapping walk step; see [`SparseMask::next_wrap`].
    pub fn next_wrap(&self, n: Option<usize>, start: usize, wrap: bool) -> Option<usize> {
        self.layout.next_wrap(&self.words[..], n, start, wrap)
    }

    /// Iterates over the set elements in ascending order.
    pub fn iter(&self) -> impl FusedIterator<Item = usize> + '_ {
        self.layout.iter(&self.words[..])
    }

    /// Iterates from `start`, wrapping around, one word at a time; same order
    /// and guarantees as [`AtomicSparseMask::iter_wrap`].
    pub fn iter_wrap(&self, start: usize) -> impl FusedIterator<Item = usize> + '_ {
        self.layout.iter_wrap(&self.words[..], start)
    }
}

impl fmt::Debug for DenseAtomicBitmap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.layout
            .fmt_debug("DenseAtomicBitmap", &self.words[..], f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;
    use std::sync::Barrier;
    use std::sync::atomic::AtomicBool;

    /// Sizes that exercise empty, single-element, chunk-boundary and
    /// non-multiple-of-chunk masks at every density.
    const SIZES: &[usize] = &[0, 1, 2, 7, 8, 9, 63, 64, 65, 100, 129, 200];

    /// Common view of the three bitmaps, for tests generic over them.
    trait TestMask {
        fn make(nelems: usize, density: u32) -> Self;
        fn nelems(&self) -> usize;
        fn set(&mut self, e: usize);
        fn clear(&mut self, e: usize);
        fn tas(&mut self, e: usize) -> bool;
        fn tac(&mut self, e: usize) -> bool;
        fn test(&self, e: usize) -> bool;
        fn weight(&self) -> usize;
        fn is_empty(&self) -> bool;
        fn clear_all(&mut self);
        fn next(&self, n: Option<usize>) -> Option<usize>;
        fn next_wrap(&self, n: Option<usize>, start: usize, wrap: bool) -> Option<usize>;
        fn elems(&self) -> Vec<usize>;
        fn wrap(&self, start: usize) -> Vec<usize>;
        /// Raw words, to check that only significant bits are ever set.
        fn raw(&self) -> Vec<u64>;
        fn layout(&self) -> Layout;
    }

    macro_rules! impl_test_mask {
        ($ty:ty, $make:expr, $raw:expr) => {
            impl TestMask for $ty {
                fn make(nelems: usize, density: u32) -> Self {
                    $make(nelems, density)
                }
                fn nelems(&self) -> usize {
                    <$ty>::nelems(self)
                }
                fn set(&mut self, e: usize) {
                    self.set_elem(e)
                }
                fn clear(&mut self, e: usize) {
                    self.clear_elem(e)
                }
                fn tas(&mut self, e: usize) -> bool {
                    self.test_and_set_elem(e)
                }
                fn tac(&mut self, e: usize) -> bool {
                    self.test_and_clear_elem(e)
                }
                fn test(&self, e: usize) -> bool {
                    self.test_elem(e)
                }
                fn weight(&self) -> usize {
                    <$ty>::weight(self)
                }
                fn is_empty(&self) -> bool {
                    <$ty>::is_empty(self)
                }
                fn clear_all(&mut self) {
                    <$ty>::clear_all(self)
                }
                fn next(&self, n: Option<usize>) -> Option<usize> {
                    <$ty>::next(self, n)
                }
                fn next_wrap(&self, n: Option<usize>, start: usize, wrap: bool) -> Option<usize> {
                    <$ty>::next_wrap(self, n, start, wrap)
                }
                fn elems(&self) -> Vec<usize> {
                    self.iter().collect()
                }
                fn wrap(&self, start: usize) -> Vec<usize> {
                    self.iter_wrap(start).collect()
                }
                fn raw(&self) -> Vec<u64> {
                    $raw(self)
                }
                fn layout(&self) -> Layout {
                    self.layout
                }
            }
        };
    }

    impl_test_mask!(SparseMask, SparseMask::with_density, |m: &SparseMask| {
        m.chunks.iter().map(|c| c.word).collect()
    });
    impl_test_mask!(
        AtomicSparseMask,
        AtomicSparseMask::with_density,
        |m: &AtomicSparseMask| m
            .chunks
            .iter()
            .map(|c| c.word.load(Ordering::Relaxed))
            .collect()
    );
    impl_test_mask!(
        DenseAtomicBitmap,
        |n, _density| DenseAtomicBitmap::new(n),
        |m: &DenseAtomicBitmap| m.words.iter().map(|w| w.load(Ordering::Relaxed)).collect()
    );

    /// The kernel's `for_each_sparse_wrap` loop, written with `next_wrap`.
    fn kernel_wrap_walk<M: TestMask>(m: &M, start: usize) -> Vec<usize> {
        let mut seen = Vec::new();
        let mut elem = m.next_wrap(start.checked_sub(1), start, false);
        while let Some(e) = elem {
            seen.push(e);
            assert!(seen.len() <= m.nelems(), "next_wrap walk does not end");
            elem = m.next_wrap(Some(e), start, true);
        }
        seen
    }

    /// Oracle for `iter_wrap(start)`: elements >= start, then < start.
    fn oracle_wrap(oracle: &BTreeSet<usize>, start: usize) -> Vec<usize> {
        oracle
            .range(start..)
            .chain(oracle.range(..start))
            .copied()
            .collect()
    }

    /// Checks every read-side operation of `m` against `oracle`.
    fn check_against_oracle<M: TestMask>(m: &M, oracle: &BTreeSet<usize>) {
        let n = m.nelems();
        let expected: Vec<usize> = oracle.iter().copied().collect();
        assert_eq!(m.elems(), expected);
        assert_eq!(m.weight(), oracle.len());
        assert_eq!(m.is_empty(), oracle.is_empty());
        for e in 0..n {
            assert_eq!(m.test(e), oracle.contains(&e), "test_elem({e})");
        }
        // next(None) and next(Some(e)) for every e.
        assert_eq!(m.next(None), oracle.iter().next().copied());
        for e in 0..n {
            assert_eq!(
                m.next(Some(e)),
                oracle.range(e + 1..).next().copied(),
                "next({e})"
            );
        }
        // iter_wrap and the kernel's next_wrap walk, from every start.
        for start in 0..n {
            let want = oracle_wrap(oracle, start);
            assert_eq!(m.wrap(start), want, "iter_wrap({start})");
            assert_eq!(
                kernel_wrap_walk(m, start),
                want,
                "next_wrap walk from {start}"
            );
        }
        // start == nelems behaves like 0, as in the kernel.
        assert_eq!(m.wrap(n), expected);
        assert_eq!(kernel_wrap_walk(m, n), expected);
        // Only significant bits are ever set.
        let layout = m.layout();
        for (w, word) in m.raw().into_iter().enumerate() {
            let base = layout.word_base(w);
            let width = (n - base).min(layout.elems_per_word());
            assert_eq!(word & !low_bits(width), 0, "stray bits in word {w}");
        }
    }

    fn each_density_and_size(mut f: impl FnMut(usize, u32)) {
        for density in 0..=SMASK_DENSITY_MAX {
            for &n in SIZES {
                f(n, density);
            }
        }
    }

    fn basic_ops<M: TestMask>() {
        each_density_and_size(|n, density| {
            let mut m = M::make(n, density);
            let mut oracle = BTreeSet::new();
            check_against_oracle(&m, &oracle);
            // Set every third element, then the last one.
            for e in (0..n).step_by(3).chain(n.checked_sub(1)) {
                m.set(e);
                oracle.insert(e);
            }
            check_against_oracle(&m, &oracle);
            // Setting twice is idempotent.
            if let Some(&e) = oracle.iter().next() {
                m.set(e);
                check_against_oracle(&m, &oracle);
            }
            // Clear every other element (set or not).
            for e in (0..n).step_by(2) {
                m.clear(e);
                oracle.remove(&e);
            }
            check_against_oracle(&m, &oracle);
            // test_and_set / test_and_clear return the old value.
            for e in 0..n {
                assert_eq!(m.tas(e), !oracle.insert(e), "test_and_set({e})");
                assert!(m.test(e));
                assert!(m.tas(e), "second test_and_set({e})");
            }
            check_against_oracle(&m, &oracle);
            assert_eq!(m.weight(), n);
            for e in (0..n).rev().step_by(2) {
                assert!(m.tac(e), "test_and_clear({e})");
                assert!(!m.tac(e), "second test_and_clear({e})");
                oracle.remove(&e);
            }
            check_against_oracle(&m, &oracle);
            m.clear_all();
            oracle.clear();
            check_against_oracle(&m, &oracle);
            assert!(m.is_empty());
        });
    }

    #[test]
    fn sparse_mask_basic_ops_every_density() {
        basic_ops::<SparseMask>();
    }

    #[test]
    fn atomic_sparse_mask_basic_ops_every_density() {
        basic_ops::<AtomicSparseMask>();
    }

    #[test]
    fn dense_bitmap_basic_ops() {
        basic_ops::<DenseAtomicBitmap>();
    }

    #[test]
    fn constructors_and_geometry() {
        let m = SparseMask::new(100);
        assert_eq!(m.nelems(), 100);
        assert_eq!(m.density(), SPARSEMASK_DENSITY_DEFAULT);
        let a = AtomicSparseMask::new(100);
        assert_eq!(a.nelems(), 100);
        assert_eq!(a.density(), SPARSEMASK_DENSITY_DEFAULT);
        for density in 0..=SMASK_DENSITY_MAX {
            let m = SparseMask::with_density(100, density);
            assert_eq!(m.density(), density);
            assert_eq!(m.bytes(), 100usize.div_ceil(1 << density) * 64);
            assert_eq!(m.bytes(), SparseMask::bytes_for(100, density));
            assert_eq!(
                AtomicSparseMask::with_density(100, density).bytes(),
                m.bytes()
            );
        }
        assert_eq!(SparseMask::bytes_for(1024, 3), 8192);
        assert_eq!(SparseMask::bytes_for(0, 3), 0);
        assert_eq!(SparseMask::bytes_for(1, 0), 64);
        assert_eq!(DenseAtomicBitmap::new(1024).bytes(), 128);
        assert_eq!(DenseAtomicBitmap::new(65).bytes(), 16);
        assert_eq!(DenseAtomicBitmap::new(0).bytes(), 0);
    }

    #[test]
    #[should_panic(expected = "SMASK_DENSITY_MAX")]
    fn density_too_large_panics() {
        let _ = SparseMask::with_density(10, SMASK_DENSITY_MAX + 1);
    }

    #[test]
    #[should_panic(expected = "SMASK_DENSITY_MAX")]
    fn atomic_density_too_large_panics() {
        let _ = AtomicSparseMask::with_density(10, 7);
    }

    #[test]
    fn layout_arithmetic() {
        let l = Layout::new(100, 3);
        assert_eq!(l.words(), 13);
        assert_eq!(l.locate(0), Some((0, 1)));
        assert_eq!(l.locate(7), Some((0, 1 << 7)));
        assert_eq!(l.locate(8), Some((1, 1)));
        assert_eq!(l.locate(99), Some((12, 1 << 3)));
        let l = Layout::new(130, 6);
        assert_eq!(l.words(), 3);
        assert_eq!(l.locate(63), Some((0, 1 << 63)));
        assert_eq!(l.locate(129), Some((2, 1 << 1)));
        let l = Layout::new(5, 0);
        assert_eq!(l.words(), 5);
        assert_eq!(l.locate(4), Some((4, 1)));
    }

    #[test]
    fn chunks_are_separate_cache_lines() {
        let m = AtomicSparseMask::with_density(64, 3);
        assert_eq!(m.chunks.len(), 8);
        for pair in m.chunks.windows(2) {
            let a = std::ptr::from_ref(&pair[0].word) as usize;
            let b = std::ptr::from_ref(&pair[1].word) as usize;
            assert_eq!(a % 64, 0);
            assert_eq!(b - a, 64);
        }
        assert_eq!(m.bytes(), 8 * 64);
    }

    #[test]
    fn next_and_next_wrap_examples() {
        let mut m = SparseMask::with_density(20, 2);
        for e in [3, 4, 12, 19] {
            m.set_elem(e);
        }
        assert_eq!(m.next(None), Some(3));
        assert_eq!(m.next(Some(3)), Some(4));
        assert_eq!(m.next(Some(4)), Some(12));
        assert_eq!(m.next(Some(12)), Some(19));
        assert_eq!(m.next(Some(19)), None);
        // First call of a walk starting at 5: next after 4 is 12.
        assert_eq!(m.next_wrap(Some(4), 5, false), Some(12));
        assert_eq!(m.next_wrap(Some(12), 5, true), Some(19));
        // End of mask: wrap to the beginning.
        assert_eq!(m.next_wrap(Some(19), 5, true), Some(3));
        assert_eq!(m.next_wrap(Some(3), 5, true), Some(4));
        // Back past the start: done.
        assert_eq!(m.next_wrap(Some(4), 5, true), None);
        assert_eq!(m.iter_wrap(5).collect::<Vec<_>>(), [12, 19, 3, 4]);
        assert_eq!(m.iter_wrap(4).collect::<Vec<_>>(), [4, 12, 19, 3]);
        assert_eq!(m.iter_wrap(0).collect::<Vec<_>>(), [3, 4, 12, 19]);
        assert_eq!(m.iter_wrap(19).collect::<Vec<_>>(), [19, 3, 4, 12]);
        assert_eq!(m.iter_wrap(20).collect::<Vec<_>>(), [3, 4, 12, 19]);
        // An empty mask: walks end at once.
        let e = SparseMask::new(10);
        assert_eq!(e.next_wrap(None, 0, false), None);
        assert_eq!(e.next_wrap(Some(4), 5, false), None);
        assert_eq!(e.iter_wrap(5).count(), 0);
    }

    #[test]
    fn zero_and_one_element_masks() {
        let m = SparseMask::new(0);
        assert_eq!(m.bytes(), 0);
        assert!(m.is_empty());
        assert_eq!(m.weight(), 0);
        assert_eq!(m.next(None), None);
        assert_eq!(m.iter().count(), 0);
        assert_eq!(m.iter_wrap(0).count(), 0);
        assert_eq!(m.next_wrap(None, 0, false), None);
        let a = AtomicSparseMask::new(0);
        assert_eq!(a.iter_wrap(0).count(), 0);
        let d = DenseAtomicBitmap::new(0);
        assert_eq!(d.iter_wrap(0).count(), 0);

        for density in 0..=SMASK_DENSITY_MAX {
            let mut m = SparseMask::with_density(1, density);
            assert!(!m.test_and_set_elem(0));
            assert_eq!(m.iter_wrap(0).collect::<Vec<_>>(), [0]);
            assert_eq!(m.next(None), Some(0));
            assert_eq!(m.next(Some(0)), None);
            assert!(m.test_and_clear_elem(0));
            assert!(m.is_empty());
        }
    }

    #[test]
    fn snapshot_and_from_round_trip() {
        for density in 0..=SMASK_DENSITY_MAX {
            let mut m = SparseMask::with_density(77, density);
            for e in [0, 5, 8, 40, 63, 64, 76] {
                m.set_elem(e);
            }
            let a = AtomicSparseMask::from(&m);
            assert_eq!(a.density(), density);
            assert_eq!(a.iter().collect::<Vec<_>>(), m.iter().collect::<Vec<_>>());
            let s = a.snapshot();
            assert_eq!(s, m);
            a.clear_elem(5);
            assert_ne!(a.snapshot(), m);
        }
    }

    #[test]
    fn debug_lists_elements() {
        let mut m = SparseMask::new(10);
        m.set_elem(2);
        m.set_elem(9);
        assert_eq!(
            format!("{m:?}"),
            "SparseMask { nelems: 10, density: 3, elems: {2, 9} }"
        );
        let a = AtomicSparseMask::from(&m);
        assert_eq!(
            format!("{a:?}"),
            "AtomicSparseMask { nelems: 10, density: 3, elems: {2, 9} }"
        );
        let d = DenseAtomicBitmap::new(10);
        d.set_elem(4);
        assert_eq!(
            format!("{d:?}"),
            "DenseAtomicBitmap { nelems: 10, density: 6, elems: {4} }"
        );
    }

    #[test]
    fn size_hint_bounds_the_count() {
        let mut m = SparseMask::with_density(100, 2);
        for e in (0..100).step_by(7) {
            m.set_elem(e);
        }
        let mut it = m.layout.iter(&m.chunks[..]);
        loop {
            let (lo, hi) = it.size_hint();
            let rest = it.clone().count();
            assert!(lo <= rest && hi.is_some_and(|hi| rest <= hi));
            if it.next().is_none() {
                break;
            }
        }
    }

    #[test]
    fn traits_for_sharing() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<AtomicSparseMask>();
        assert_send_sync::<DenseAtomicBitmap>();
        assert_send_sync::<SparseMask>();
    }

    #[cfg(debug_assertions)]
    mod out_of_range_debug {
        use super::*;

        #[test]
        #[should_panic(expected = "out of range")]
        fn set_panics() {
            SparseMask::new(10).set_elem(10);
        }

        #[test]
        #[should_panic(expected = "out of range")]
        fn atomic_test_panics() {
            let _ = AtomicSparseMask::new(10).test_elem(64);
        }

        #[test]
        #[should_panic(expected = "out of range")]
        fn dense_clear_panics() {
            DenseAtomicBitmap::new(0).clear_elem(0);
        }

        #[test]
        #[should_panic(expected = "out of range")]
        fn next_panics() {
            let _ = SparseMask::new(10).next(Some(10));
        }

        #[test]
        #[should_panic(expected = "out of range")]
        fn wrap_start_panics() {
            let _ = SparseMask::new(10).iter_wrap(11);
        }
    }

    #[cfg(not(debug_assertions))]
    #[test]
    fn out_of_range_is_ignored_in_release() {
        let mut m = SparseMask::new(10);
        m.set_elem(10);
        m.set_elem(usize::MAX);
        assert!(!m.test_and_set_elem(12));
        assert!(!m.test_elem(12));
        assert!(m.is_empty());
        assert_eq!(m.next(Some(10)), None);
        m.set_elem(3);
        assert_eq!(m.iter_wrap(11).collect::<Vec<_>>(), [3]);
        let a = AtomicSparseMask::new(10);
        a.set_elem(64);
        assert!(a.is_empty());
        let d = DenseAtomicBitmap::new(0);
        d.set_elem(0);
        assert!(d.is_empty());
    }

    // ---- property tests against a BTreeSet oracle ----

    #[derive(Clone, Copy, Debug)]
    enum Op {
        Set(usize),
        Clear(usize),
        TestAndSet(usize),
        TestAndClear(usize),
    }

    fn op_strategy() -> impl Strategy<Value = Op> {
        // Element numbers are reduced modulo nelems when applied.
        prop_oneof![
            any::<usize>().prop_map(Op::Set),
            any::<usize>().prop_map(Op::Clear),
            any::<usize>().prop_map(Op::TestAndSet),
            any::<usize>().prop_map(Op::TestAndClear),
        ]
    }

    fn run_ops<M: TestMask>(nelems: usize, density: u32, ops: &[Op], wrap_start: usize) {
        let mut m = M::make(nelems, density);
        let mut oracle = BTreeSet::new();
        for &op in ops {
            if nelems == 0 {
                break;
            }
            match op {
                Op::Set(e) => {
                    let e = e % nelems;
                    m.set(e);
                    oracle.insert(e);
                }
                Op::Clear(e) => {
                    let e = e % nelems;
                    m.clear(e);
                    oracle.remove(&e);
                }
                Op::TestAndSet(e) => {
                    let e = e % nelems;
                    assert_eq!(m.tas(e), !oracle.insert(e));
                }
                Op::TestAndClear(e) => {
                    let e = e % nelems;
                    assert_eq!(m.tac(e), oracle.remove(&e));
                }
            }
            // Cheap checks after every op...
            assert_eq!(m.weight(), oracle.len());
            assert_eq!(m.elems(), oracle.iter().copied().collect::<Vec<_>>());
            let start = wrap_start % nelems;
            assert_eq!(m.wrap(start), oracle_wrap(&oracle, start));
        }
        // ...and the exhaustive ones at the end.
        check_against_oracle(&m, &oracle);
    }

    proptest! {
        #[test]
        fn prop_sparse_mask_matches_oracle(
            nelems in 0usize..300,
            density in 0u32..=SMASK_DENSITY_MAX,
            ops in prop::collection::vec(op_strategy(), 0..120),
            wrap_start in any::<usize>(),
        ) {
            run_ops::<SparseMask>(nelems, density, &ops, wrap_start);
        }

        #[test]
        fn prop_atomic_sparse_mask_matches_oracle(
            nelems in 0usize..300,
            density in 0u32..=SMASK_DENSITY_MAX,
            ops in prop::collection::vec(op_strategy(), 0..120),
            wrap_start in any::<usize>(),
        ) {
            run_ops::<AtomicSparseMask>(nelems, density, &ops, wrap_start);
        }

        #[test]
        fn prop_dense_bitmap_matches_oracle(
            nelems in 0usize..300,
            ops in prop::collection::vec(op_strategy(), 0..120),
            wrap_start in any::<usize>(),
        ) {
            run_ops::<DenseAtomicBitmap>(nelems, SMASK_DENSITY_MAX, &ops, wrap_start);
        }
    }

    // ---- concurrency ----

    /// The shared-access API used by the concurrency test.
    trait Shared: Sync {
        fn set(&self, e: usize);
        fn clear(&self, e: usize);
        fn wrap_into(&self, start: usize, out: &mut Vec<usize>);
    }

    macro_rules! impl_shared {
        ($ty:ty) => {
            impl Shared for $ty {
                fn set(&self, e: usize) {
                    self.set_elem(e)
                }
                fn clear(&self, e: usize) {
                    self.clear_elem(e)
                }
                fn wrap_into(&self, start: usize, out: &mut Vec<usize>) {
                    out.clear();
                    out.extend(self.iter_wrap(start));
                }
            }
        };
    }
    impl_shared!(AtomicSparseMask);
    impl_shared!(DenseAtomicBitmap);

    /// Two writers toggle disjoint element ranges while a reader iterates
    /// with `iter_wrap` from varying starts. Every iteration must be
    /// duplicate-free, in wrap order, and contain every permanent element.
    fn concurrent_iteration<M: Shared>(mask: &M, nelems: usize) {
        const READS: usize = 20_000;
        const MAX_WRITER_PASSES: usize = 200_000;
        let permanent = |e: usize| e.is_multiple_of(5);
        for e in (0..nelems).filter(|&e| permanent(e)) {
            mask.set(e);
        }
        let done = AtomicBool::new(false);
        // All three threads start together, so the reads overlap the writes.
        let go = Barrier::new(3);
        let half = nelems / 2;
        std::thread::scope(|s| {
            for range in [0..half, half..nelems] {
                let (done, go) = (&done, &go);
                s.spawn(move || {
                    let elems: Vec<usize> = range.filter(|&e| !permanent(e)).collect();
                    go.wait();
                    for pass in 0..MAX_WRITER_PASSES {
                        if done.load(Ordering::Relaxed) {
                            break;
                        }
                        for &e in &elems {
                            if (e ^ pass) & 1 == 0 {
                                mask.set(e);
                            } else {
                                mask.clear(e);
                            }
                        }
                    }
                });
            }
            // Set `done` even if an assertion below panics, so the
            // writers stop and the scope can join them.
            struct SetOnDrop<'a>(&'a AtomicBool);
            impl Drop for SetOnDrop<'_> {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::Relaxed);
                }
            }
            let _stop = SetOnDrop(&done);
            go.wait();
            let mut seen = Vec::with_capacity(nelems);
            for i in 0..READS {
                let start = (i * 7) % nelems;
                mask.wrap_into(start, &mut seen);
                let key = |e: usize| (e + nelems - start) % nelems;
                for pair in seen.windows(2) {
                    assert!(
                        key(pair[0]) < key(pair[1]),
                        "iteration {i} from {start}: {} then {} is not wrap order",
                        pair[0],
                        pair[1]
                    );
                }
                assert!(seen.iter().all(|&e| e < nelems));
                let permanents = seen.iter().filter(|&&e| permanent(e)).count();
                assert_eq!(
                    permanents,
                    nelems.div_ceil(5),
                    "iteration {i} from {start} missed a permanent element"
                );
            }
        });
    }

    #[test]
    fn atomic_sparse_mask_concurrent_iteration() {
        for density in [0, 3, 6] {
            let nelems = 203;
            concurrent_iteration(&AtomicSparseMask::with_density(nelems, density), nelems);
        }
    }

    #[test]
    fn dense_bitmap_concurrent_iteration() {
        let nelems = 203;
        concurrent_iteration(&DenseAtomicBitmap::new(nelems), nelems);
    }

    #[test]
    fn racing_test_and_set_has_one_winner() {
        let mask = AtomicSparseMask::new(64);
        for round in 0..2_000 {
            let e = round % 64;
            let wins = std::thread::scope(|s| {
                let handles: Vec<_> = (0..2)
                    .map(|_| s.spawn(|| usize::from(!mask.test_and_set_elem(e))))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or(0))
                    .sum::<usize>()
            });
            assert_eq!(wins, 1);
            assert!(mask.test_and_clear_elem(e));
        }
    }
}
