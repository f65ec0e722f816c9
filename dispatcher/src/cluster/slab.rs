//! A keyed slab: the job table's storage. Values sit in fixed-size
//! chunks of slots (a removed value's slot is reused; growing never
//! moves a value, and the slack is at most one chunk), found by key
//! through a hashed index (the lookups every placement, start and finish
//! makes: ~8 per start) and walked in key order through [`Order`]
//! (listings, pagination, an array's elements): keys that arrive in
//! increasing order (every new job's) appended to a sorted vector, the
//! others in a B-tree.
//!
//! The node registry (`cluster::nodes`) keeps its nodes the same way: a
//! slab, a hashed index by name and a B-tree for the order.
//!
//! A lookup tries the slot of the last key found first (`hint`): the
//! lookups of one operation mostly ask for the same job again (a submit's
//! place, start, record and persist; a finish's release, phase and
//! persist), and a hit costs a compare with the key the slot holds, where
//! the hashed index cost ~59 instructions.
//!
//! Invariant: `index` and `order` hold exactly the keys of the occupied
//! slots, each with its slot, and each occupied slot holds its own key
//! (`Slab::check`, and the proptest against a `BTreeMap`).

use std::collections::{BTreeMap, btree_map};
use std::hash::Hash;
use std::ops::{Bound, RangeBounds};
use std::sync::atomic::{AtomicU32, Ordering};

use sched::idhash::IdMap;

/// Slots per chunk.
const CHUNK: usize = 1024;

/// Values by key, in slots.
pub struct Slab<K, V> {
    /// Each slot holds its key with its value: a hinted lookup checks it.
    chunks: Vec<Vec<Option<(K, V)>>>,
    /// Slots freed by removals, reused first.
    free: Vec<u32>,
    /// Each key's slot, hashed.
    index: IdMap<K, u32>,
    /// Each key's slot, in key order.
    order: Order<K>,
    /// The slot of the last key looked up or inserted: a hint only (a
    /// lookup compares the key the slot holds), so a stale one is merely
    /// a miss. Atomic (relaxed: plain loads and stores) so that shared
    /// readers may update it.
    hint: AtomicU32,
}

impl<K, V> Default for Slab<K, V> {
    fn default() -> Self {
        Self {
            chunks: Vec::new(),
            free: Vec::new(),
            index: IdMap::default(),
            order: Order::default(),
            hint: AtomicU32::new(0),
        }
    }
}

impl<K: Copy + Ord + Hash, V> Slab<K, V> {
    fn slot(&self, i: u32) -> Option<&V> {
        self.entry(i).map(|(_, v)| v)
    }

    fn entry(&self, i: u32) -> Option<&(K, V)> {
        let i = i as usize;
        self.chunks.get(i / CHUNK)?.get(i % CHUNK)?.as_ref()
    }

    fn slot_mut(&mut self, i: u32) -> Option<&mut Option<(K, V)>> {
        let i = i as usize;
        self.chunks.get_mut(i / CHUNK)?.get_mut(i % CHUNK)
    }

    /// The slot of `key` from the hashed index, which becomes the hint
    /// (the lookups try the hinted slot first, inline).
    #[inline(never)]
    fn find(&self, key: &K) -> Option<u32> {
        let i = *self.index.get(key)?;
        self.hint.store(i, Ordering::Relaxed);
        Some(i)
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// One value.
    #[inline]
    pub fn get(&self, key: &K) -> Option<&V> {
        if let Some((k, v)) = self.entry(self.hint.load(Ordering::Relaxed))
            && k == key
        {
            return Some(v);
        }
        self.slot(self.find(key)?)
    }

    /// One value, to change.
    #[inline]
    pub fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        let h = *self.hint.get_mut();
        let i = if self.entry(h).is_some_and(|(k, _)| k == key) {
            h
        } else {
            self.find(key)?
        };
        self.slot_mut(i)?.as_mut().map(|(_, v)| v)
    }

    /// The slot of `key` (the hint first, as [`Slab::get`]), for
    /// [`Slab::get_at`] later.
    #[inline]
    pub fn slot_of(&self, key: &K) -> Option<u32> {
        let h = self.hint.load(Ordering::Relaxed);
        if self.entry(h).is_some_and(|(k, _)| k == key) {
            return Some(h);
        }
        self.find(key)
    }

    /// The value of `key` if slot `slot` holds it (a slot from
    /// [`Slab::slot_of`]: once the key is removed its slot may hold
    /// another key, or none): an index and a compare, no hashing, and the
    /// hint is left alone.
    #[inline]
    pub fn get_at(&self, slot: u32, key: &K) -> Option<&V> {
        self.entry(slot).filter(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// True when `key` has a value.
    pub fn contains_key(&self, key: &K) -> bool {
        self.index.contains_key(key)
    }

    /// Insert or replace; returns the value replaced. Inline: the value
    /// (a job table entry) is moved in by value, and the call moved it
    /// twice more (into the call, into the slot's `Option`).
    #[inline]
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        use std::collections::hash_map::Entry;
        // One hash of the key for the lookup and the insert.
        let vacant = match self.index.entry(key) {
            Entry::Occupied(o) => {
                let i = *o.get();
                return self
                    .slot_mut(i)
                    .and_then(|s| s.replace((key, value)))
                    .map(|(_, v)| v);
            }
            Entry::Vacant(v) => v,
        };
        let i = match self.free.pop() {
            Some(i) => {
                let i = i as usize;
                if let Some(s) = self
                    .chunks
                    .get_mut(i / CHUNK)
                    .and_then(|c| c.get_mut(i % CHUNK))
                {
                    *s = Some((key, value));
                }
                i as u32
            }
            None => {
                if self.chunks.last().is_none_or(|c| c.len() == CHUNK) {
                    self.chunks.push(Vec::with_capacity(CHUNK));
                }
                let n = self.chunks.len() - 1;
                let chunk = &mut self.chunks[n];
                chunk.push(Some((key, value)));
                (n * CHUNK + chunk.len() - 1) as u32
            }
        };
        vacant.insert(i);
        self.order.insert(key, i);
        *self.hint.get_mut() = i;
        None
    }

    /// Remove a value.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        let i = self.index.remove(key)?;
        self.order.remove(key);
        let v = self.slot_mut(i)?.take();
        self.free.push(i);
        v.map(|(_, v)| v)
    }

    /// All values in key order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (&K, &V)> {
        self.range(..)
    }

    /// The values with keys in `range`, in key order.
    pub fn range<R: std::ops::RangeBounds<K>>(
        &self,
        range: R,
    ) -> impl DoubleEndedIterator<Item = (&K, &V)> {
        self.order
            .range(range)
            .filter_map(|(k, i)| Some((k, self.slot(i)?)))
    }

    /// Check the invariant: both maps hold exactly the occupied slots'
    /// keys, with their slots.
    pub fn check(&self) -> Result<(), String> {
        let occupied = self.chunks.iter().flatten().filter(|s| s.is_some()).count();
        if occupied != self.index.len() || self.index.len() != self.order.len() {
            return Err(format!(
                "slab: {occupied} values, {} hashed, {} ordered",
                self.index.len(),
                self.order.len()
            ));
        }
        self.order.check()?;
        for (k, i) in self.order.range(..) {
            if self.index.get(k) != Some(&i) || self.entry(i).is_none_or(|(own, _)| own != k) {
                return Err(format!("slab: slot {i} of a key is not its own"));
            }
        }
        if self.free.iter().any(|&i| self.slot(i).is_some()) {
            return Err("slab: a free slot holds a value".into());
        }
        Ok(())
    }
}

/// A removed key's slot in [`Order::tail`].
const DEAD: u32 = u32::MAX;

/// Keys in order, each with its slot. A key larger than every key in
/// `tail` (a new job's: keys grow) is appended there, and its removal is
/// a search from where the last one ended ([`Order::search`]) and a
/// tombstone ([`DEAD`]; the tombstones are dropped
/// when they outnumber the live entries by 64); any other key goes to
/// the B-tree `rest` (a key restored out of order), or back into its own
/// tombstone. Reads merge the two, which never share a live key.
struct Order<K> {
    /// Sorted by key, strictly increasing; `dead` of them are tombstones.
    tail: Vec<(K, u32)>,
    dead: usize,
    rest: BTreeMap<K, u32>,
    /// Where in `tail` the last search ended: the next one starts there
    /// ([`Order::search`]).
    finger: usize,
}

impl<K> Default for Order<K> {
    fn default() -> Self {
        Self {
            tail: Vec::new(),
            dead: 0,
            rest: BTreeMap::new(),
            finger: 0,
        }
    }
}

impl<K: Copy + Ord> Order<K> {
    fn len(&self) -> usize {
        self.tail.len() - self.dead + self.rest.len()
    }

    /// Add `key` (not present) at slot `i`.
    fn insert(&mut self, key: K, i: u32) {
        if self.tail.last().is_none_or(|&(last, _)| key > last) {
            self.tail.push((key, i));
            return;
        }
        match self.search(&key) {
            Ok(p) => {
                debug_assert_eq!(self.tail[p].1, DEAD, "a present key inserted again");
                self.tail[p].1 = i;
                self.dead -= 1;
            }
            Err(_) => {
                self.rest.insert(key, i);
            }
        }
    }

    /// `key`'s position in `tail` (`Err`: where it would go), as
    /// `binary_search` answers, found by galloping from where the last
    /// search ended (`finger`): 2 log2(d) + 1 probes for a key d places
    /// away, all near the last one. Keys removed in increasing order (the
    /// retention's, [`super::Cluster::retire_done`]) are a few places
    /// apart, so each removal reads the lines the previous one read,
    /// where a binary search over 100,000 retained jobs read ~17 entries,
    /// the last few from memory.
    fn search(&mut self, key: &K) -> Result<usize, usize> {
        let t = &self.tail;
        let n = t.len();
        if n == 0 {
            return Err(0);
        }
        let f = self.finger.min(n - 1);
        // The key's place is in `lo..hi` (`hi` included for an `Err`).
        let (lo, hi) = match t[f].0.cmp(key) {
            std::cmp::Ordering::Equal => return Ok(f),
            std::cmp::Ordering::Less => {
                let (mut lo, mut step) = (f + 1, 1);
                loop {
                    let c = f + step;
                    if c >= n {
                        break (lo, n);
                    }
                    if t[c].0 >= *key {
                        break (lo, c + 1);
                    }
                    lo = c + 1;
                    step *= 2;
                }
            }
            std::cmp::Ordering::Greater => {
                let (mut hi, mut step) = (f, 1);
                loop {
                    if step > hi {
                        break (0, hi);
                    }
                    let c = hi - step;
                    if t[c].0 <= *key {
                        break (c, hi);
                    }
                    hi = c;
                    step *= 2;
                }
            }
        };
        let found = t[lo..hi]
            .binary_search_by(|e| e.0.cmp(key))
            .map(|p| p + lo)
            .map_err(|p| p + lo);
        self.finger = found.unwrap_or_else(|p| p);
        found
    }

    /// Take `key` out.
    fn remove(&mut self, key: &K) {
        if let Ok(p) = self.search(key)
            && self.tail[p].1 != DEAD
        {
            self.tail[p].1 = DEAD;
            self.dead += 1;
            if self.dead > self.tail.len() - self.dead + 64 {
                self.tail.retain(|e| e.1 != DEAD);
                self.dead = 0;
            }
            return;
        }
        self.rest.remove(key);
    }

    /// The live keys in `range`, in order, with their slots.
    fn range<R: RangeBounds<K>>(&self, range: R) -> Merge<'_, K> {
        let (start, end) = (range.start_bound().cloned(), range.end_bound().cloned());
        let t = &self.tail;
        let lo = match start {
            Bound::Included(s) => t.partition_point(|e| e.0 < s),
            Bound::Excluded(s) => t.partition_point(|e| e.0 <= s),
            Bound::Unbounded => 0,
        };
        let hi = match end {
            Bound::Included(x) => t.partition_point(|e| e.0 <= x),
            Bound::Excluded(x) => t.partition_point(|e| e.0 < x),
            Bound::Unbounded => t.len(),
        };
        Merge {
            tail: &t[lo.min(hi)..hi],
            rest: self.rest.range((start, end)),
        }
    }

    /// The structure's invariant: `tail` strictly increasing, `dead`
    /// its tombstones, within the compaction bound, and no live key in
    /// both parts.
    fn check(&self) -> Result<(), String> {
        if self.tail.windows(2).any(|w| w[0].0 >= w[1].0) {
            return Err("slab order: the tail is not strictly increasing".into());
        }
        let dead = self.tail.iter().filter(|e| e.1 == DEAD).count();
        if dead != self.dead || dead > self.tail.len() - dead + 64 {
            return Err(format!(
                "slab order: {dead} tombstones, {} counted, {} entries",
                self.dead,
                self.tail.len()
            ));
        }
        if self.rest.keys().any(|k| {
            self.tail
                .binary_search_by(|e| e.0.cmp(k))
                .is_ok_and(|p| self.tail[p].1 != DEAD)
        }) {
            return Err("slab order: a key in both parts".into());
        }
        Ok(())
    }
}

/// [`Order::range`]: the tail's slice and the B-tree's range, merged.
struct Merge<'a, K> {
    tail: &'a [(K, u32)],
    rest: btree_map::Range<'a, K, u32>,
}

impl<'a, K: Ord> Iterator for Merge<'a, K> {
    type Item = (&'a K, u32);

    fn next(&mut self) -> Option<Self::Item> {
        while let Some((e, more)) = self.tail.split_first() {
            if e.1 != DEAD {
                break;
            }
            self.tail = more;
        }
        let first = self.tail.first();
        match (first, self.rest.clone().next()) {
            (Some(e), Some((k, _))) if e.0 > *k => self.rest.next().map(|(k, &i)| (k, i)),
            (Some(e), _) => {
                self.tail = &self.tail[1..];
                Some((&e.0, e.1))
            }
            (None, _) => self.rest.next().map(|(k, &i)| (k, i)),
        }
    }
}

impl<K: Ord> DoubleEndedIterator for Merge<'_, K> {
    fn next_back(&mut self) -> Option<Self::Item> {
        while let Some((e, more)) = self.tail.split_last() {
            if e.1 != DEAD {
                break;
            }
            self.tail = more;
        }
        let last = self.tail.last();
        match (last, self.rest.clone().next_back()) {
            (Some(e), Some((k, _))) if e.0 < *k => self.rest.next_back().map(|(k, &i)| (k, i)),
            (Some(e), _) => {
                self.tail = &self.tail[..self.tail.len() - 1];
                Some((&e.0, e.1))
            }
            (None, _) => self.rest.next_back().map(|(k, &i)| (k, i)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u16, u32),
        Remove(u16),
        Change(u16, u32),
        /// Look a key up (through the hint left by the ops before).
        Get(u16),
        /// Insert the next key of a growing counter from 3000, above the
        /// other keys (a new job's).
        Append(u32),
        /// Remove the `n` smallest keys (retention of old jobs).
        Drain(u16),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Few keys: replaces, removals of present keys and reuse of free
        // slots all happen; enough values to fill several chunks.
        prop_oneof![
            4 => (0u16..3000, any::<u32>()).prop_map(|(k, v)| Op::Insert(k, v)),
            2 => (0u16..3000).prop_map(Op::Remove),
            1 => (0u16..3000, any::<u32>()).prop_map(|(k, v)| Op::Change(k, v)),
            3 => (0u16..3300).prop_map(Op::Get),
            4 => any::<u32>().prop_map(Op::Append),
            1 => (0u16..2000).prop_map(Op::Drain),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// The slab behaves as a `BTreeMap` (the oracle) under any
        /// sequence of inserts (in and out of key order), replaces,
        /// removals (of the oldest keys in bulk, too) and changes in
        /// place: the same answers, the same key order, the same ranges;
        /// a slot from `slot_of` answers for its key only while it holds it.
        #[test]
        fn a_slab_is_a_map(ops in prop::collection::vec(op(), 1..4000), lo in 0u16..3000, hi in 0u16..3000) {
            let mut slab: Slab<u16, u32> = Slab::default();
            let mut oracle: BTreeMap<u16, u32> = BTreeMap::new();
            let mut next = 3000u16;
            // The slots `slot_of` gave, kept across later ops (as the
            // unasked log keeps them): `get_at` of a stale one answers
            // nothing, never another key's value.
            let mut slots: BTreeMap<u16, u32> = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Append(v) => {
                        prop_assert_eq!(slab.insert(next, v), oracle.insert(next, v));
                        next += 1;
                    }
                    Op::Drain(n) => {
                        let old: Vec<u16> = oracle.keys().take(n as usize).copied().collect();
                        for k in old {
                            prop_assert_eq!(slab.remove(&k), oracle.remove(&k));
                        }
                        slab.check().map_err(TestCaseError::fail)?;
                    }
                    Op::Insert(k, v) => prop_assert_eq!(slab.insert(k, v), oracle.insert(k, v)),
                    Op::Remove(k) => prop_assert_eq!(slab.remove(&k), oracle.remove(&k)),
                    Op::Get(k) => {
                        if let Some(&old) = slots.get(&k) {
                            let at = slab.get_at(old, &k);
                            prop_assert!(at.is_none() || at == oracle.get(&k), "slot {} of {}", old, k);
                        }
                        match slab.slot_of(&k) {
                            Some(i) => {
                                prop_assert_eq!(slab.get_at(i, &k), oracle.get(&k));
                                slots.insert(k, i);
                            }
                            None => prop_assert!(!oracle.contains_key(&k)),
                        }
                        prop_assert_eq!(slab.get(&k), oracle.get(&k));
                        prop_assert_eq!(slab.get_mut(&k).map(|v| *v), oracle.get(&k).copied());
                    }
                    Op::Change(k, v) => {
                        if let Some(x) = slab.get_mut(&k) { *x = v; }
                        if let Some(x) = oracle.get_mut(&k) { *x = v; }
                    }
                }
            }
            slab.check().map_err(TestCaseError::fail)?;
            prop_assert_eq!(slab.len(), oracle.len());
            let all: Vec<(u16, u32)> = slab.iter().map(|(k, v)| (*k, *v)).collect();
            let want: Vec<(u16, u32)> = oracle.iter().map(|(k, v)| (*k, *v)).collect();
            prop_assert_eq!(all, want);
            let back: Vec<u16> = slab.iter().rev().map(|(k, _)| *k).collect();
            let want_back: Vec<u16> = oracle.keys().rev().copied().collect();
            prop_assert_eq!(back, want_back);
            let (lo, hi) = (lo.min(hi), lo.max(hi));
            let r: Vec<u16> = slab.range(lo..hi).map(|(k, _)| *k).collect();
            let want_r: Vec<u16> = oracle.range(lo..hi).map(|(k, _)| *k).collect();
            prop_assert_eq!(r, want_r);
            let below: Vec<u16> = slab.range(..hi).rev().map(|(k, _)| *k).collect();
            let want_below: Vec<u16> = oracle.range(..hi).rev().map(|(k, _)| *k).collect();
            prop_assert_eq!(below, want_below);
            for k in [lo, hi] {
                prop_assert_eq!(slab.get(&k), oracle.get(&k));
                prop_assert_eq!(slab.contains_key(&k), oracle.contains_key(&k));
            }
        }

        /// The galloping search answers as `binary_search` does (the
        /// oracle), from any finger, for keys present, absent, below and
        /// above all; a run of searches keeps agreeing as the finger
        /// moves.
        #[test]
        fn a_search_from_the_finger_is_a_binary_search(
            keys in prop::collection::btree_set(0u16..5000, 0..600),
            finger in 0usize..700,
            probes in prop::collection::vec(0u16..5100, 1..40),
        ) {
            let mut order: Order<u16> = Order {
                tail: keys.iter().map(|&k| (k, 0)).collect(),
                finger,
                ..Order::default()
            };
            for k in probes {
                let want = order.tail.binary_search_by(|e| e.0.cmp(&k));
                prop_assert_eq!(order.search(&k), want);
            }
        }
    }
}
