//! A fast hasher for maps keyed by small integer ids (task ids, leaf
//! numbers) and short names, on the placement hot path.
//!
//! std's default SipHash-1-3 resists hash flooding by keys an attacker
//! chooses; these keys are ids the engine or the dispatcher hands out (or
//! node names of registered agents), and profiling showed SipHash at ~13%
//! of a simulator run. This is FxHash (rustc's hasher): rotate, xor,
//! multiply by a 64-bit odd constant. Iteration order of these maps is
//! never relied on (it was already random under std's `RandomState`).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// FxHash's multiplier (the golden ratio's 64-bit fraction, odd).
const K: u64 = 0x517c_c1b7_2722_0a95;

/// FxHash state.
#[derive(Clone, Copy, Debug, Default)]
pub struct IdHasher(u64);

impl IdHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(K);
    }
}

impl Hasher for IdHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w));
        }
    }

    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(i as u64);
    }

    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(i as u64);
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
}

/// A `HashMap` with [`IdHasher`]; build it with `IdMap::default()`.
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The map behaves as a map (oracle: a sorted Vec of pairs): the
        /// hasher may only change speed, never contents.
        #[test]
        fn id_map_agrees_with_an_association_list(
            ops in prop::collection::vec((0u64..64, any::<bool>()), 0..200),
        ) {
            let mut m: IdMap<u64, u64> = IdMap::default();
            let mut oracle: Vec<(u64, u64)> = Vec::new();
            for (i, (k, insert)) in ops.into_iter().enumerate() {
                if insert {
                    m.insert(k, i as u64);
                    oracle.retain(|&(x, _)| x != k);
                    oracle.push((k, i as u64));
                } else {
                    m.remove(&k);
                    oracle.retain(|&(x, _)| x != k);
                }
            }
            let mut got: Vec<(u64, u64)> = m.into_iter().collect();
            got.sort();
            oracle.sort();
            prop_assert_eq!(got, oracle);
        }
    }

    #[test]
    fn strings_of_different_lengths_hash_apart() {
        use std::hash::{BuildHasher, BuildHasherDefault};
        let b = BuildHasherDefault::<IdHasher>::default();
        let names = ["n1", "n12", "n000001", "n0000001", "n00000001"];
        let hashes: std::collections::HashSet<u64> = names.iter().map(|n| b.hash_one(n)).collect();
        assert_eq!(hashes.len(), names.len());
    }
}
