//! The harness's seeded PRNG: SplitMix64 (Steele, Lea and Flood, "Fast
//! splittable pseudorandom number generators", 2014; the seeding generator
//! of xoshiro). One 64-bit state word, a Weyl increment and a 64-bit
//! finaliser: passes BigCrush, needs no external crate, and a run is a
//! pure function of its seed. Not for cryptography.

/// A SplitMix64 generator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator seeded with `seed` (any value, 0 included).
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform value in `0..n` (0 when `n` is 0), by Lemire's
    /// multiply-shift (bias below 2^-32 for the sizes used here).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// A uniform value in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// `base` scaled by a uniform factor in `[1 - frac, 1 + frac]`
    /// (`frac` clamped to `[0, 1]`): the spread of a cost that varies from
    /// call to call (cache misses, branch mispredictions).
    pub fn jitter(&mut self, base: u64, frac: f64) -> u64 {
        let frac = frac.clamp(0.0, 1.0);
        if frac == 0.0 || base == 0 {
            return base;
        }
        let f = 1.0 - frac + 2.0 * frac * self.unit();
        (base as f64 * f).round() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_reference_values() {
        // First outputs for seed 1234567 (reference implementation).
        let mut r = Rng::new(1_234_567);
        assert_eq!(r.next_u64(), 6_457_827_717_110_365_317);
        assert_eq!(r.next_u64(), 3_203_168_211_198_807_973);
    }

    #[test]
    fn ranges() {
        let mut r = Rng::new(7);
        for _ in 0..10_000 {
            assert!(r.below(10) < 10);
            let u = r.unit();
            assert!((0.0..1.0).contains(&u));
            let j = r.jitter(1000, 0.25);
            assert!((750..=1250).contains(&j));
        }
        assert_eq!(r.below(0), 0);
        assert_eq!(r.jitter(1000, 0.0), 1000);
    }
}
