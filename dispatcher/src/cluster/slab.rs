//! A keyed slab: the job table's storage. Values sit in fixed-size
//! chunks of slots (a removed value's slot is reused; growing never
//! moves a value, and the slack is at most one chunk), found by key
//! through a hashed index (the lookups every placement, start and finish
//! makes: ~8 per start) and walked in key order through an ordered map
//! of key to slot (listings, pagination, an array's elements).
//!
//! The node registry (`cluster::nodes`) keeps its nodes the same way: a
//! slab, a hashed index by name and a B-tree for the order.
//!
//! Invariant: `index` and `order` hold exactly the keys of the occupied
//! slots, each with its slot (`Slab::check`, and the proptest against a
//! `BTreeMap`).

use std::collections::BTreeMap;
use std::hash::Hash;

use sched::idhash::IdMap;

/// Slots per chunk.
const CHUNK: usize = 1024;

/// Values by key, in slots.
pub struct Slab<K, V> {
    chunks: Vec<Vec<Option<V>>>,
    /// Slots freed by removals, reused first.
    free: Vec<u32>,
    /// Each key's slot, hashed.
    index: IdMap<K, u32>,
    /// Each key's slot, in key order.
    order: BTreeMap<K, u32>,
}

impl<K, V> Default for Slab<K, V> {
    fn default() -> Self {
        Self {
            chunks: Vec::new(),
            free: Vec::new(),
            index: IdMap::default(),
            order: BTreeMap::new(),
        }
    }
}

impl<K: Copy + Ord + Hash, V> Slab<K, V> {
    fn slot(&self, i: u32) -> Option<&V> {
        let i = i as usize;
        self.chunks.get(i / CHUNK)?.get(i % CHUNK)?.as_ref()
    }

    fn slot_mut(&mut self, i: u32) -> Option<&mut Option<V>> {
        let i = i as usize;
        self.chunks.get_mut(i / CHUNK)?.get_mut(i % CHUNK)
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// One value.
    pub fn get(&self, key: &K) -> Option<&V> {
        self.slot(*self.index.get(key)?)
    }

    /// One value, to change.
    pub fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        let i = *self.index.get(key)?;
        self.slot_mut(i)?.as_mut()
    }

    /// True when `key` has a value.
    pub fn contains_key(&self, key: &K) -> bool {
        self.index.contains_key(key)
    }

    /// Insert or replace; returns the value replaced.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        if let Some(&i) = self.index.get(&key) {
            return self.slot_mut(i).and_then(|s| s.replace(value));
        }
        let i = match self.free.pop() {
            Some(i) => {
                if let Some(s) = self.slot_mut(i) {
                    *s = Some(value);
                }
                i
            }
            None => {
                if self.chunks.last().is_none_or(|c| c.len() == CHUNK) {
                    self.chunks.push(Vec::with_capacity(CHUNK));
                }
                let n = self.chunks.len() - 1;
                let chunk = &mut self.chunks[n];
                chunk.push(Some(value));
                (n * CHUNK + chunk.len() - 1) as u32
            }
        };
        self.index.insert(key, i);
        self.order.insert(key, i);
        None
    }

    /// Remove a value.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        let i = self.index.remove(key)?;
        self.order.remove(key);
        let v = self.slot_mut(i)?.take();
        self.free.push(i);
        v
    }

    /// All values in key order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (&K, &V)> {
        self.order
            .iter()
            .filter_map(|(k, &i)| Some((k, self.slot(i)?)))
    }

    /// The values with keys in `range`, in key order.
    pub fn range<R: std::ops::RangeBounds<K>>(
        &self,
        range: R,
    ) -> impl DoubleEndedIterator<Item = (&K, &V)> {
        self.order
            .range(range)
            .filter_map(|(k, &i)| Some((k, self.slot(i)?)))
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
        for (k, i) in &self.order {
            if self.index.get(k) != Some(i) || self.slot(*i).is_none() {
                return Err(format!("slab: slot {i} of a key is not its own"));
            }
        }
        if self.free.iter().any(|&i| self.slot(i).is_some()) {
            return Err("slab: a free slot holds a value".into());
        }
        Ok(())
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
    }

    fn op() -> impl Strategy<Value = Op> {
        // Few keys: replaces, removals of present keys and reuse of free
        // slots all happen; enough values to fill several chunks.
        prop_oneof![
            4 => (0u16..3000, any::<u32>()).prop_map(|(k, v)| Op::Insert(k, v)),
            2 => (0u16..3000).prop_map(Op::Remove),
            1 => (0u16..3000, any::<u32>()).prop_map(|(k, v)| Op::Change(k, v)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// The slab behaves as a `BTreeMap` (the oracle) under any
        /// sequence of inserts, replaces, removals and changes in place:
        /// the same answers, the same key order, the same ranges.
        #[test]
        fn a_slab_is_a_map(ops in prop::collection::vec(op(), 1..4000), lo in 0u16..3000, hi in 0u16..3000) {
            let mut slab: Slab<u16, u32> = Slab::default();
            let mut oracle: BTreeMap<u16, u32> = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Insert(k, v) => prop_assert_eq!(slab.insert(k, v), oracle.insert(k, v)),
                    Op::Remove(k) => prop_assert_eq!(slab.remove(&k), oracle.remove(&k)),
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
    }
}
