//! Random variates on the harness's SplitMix64 ([`Rng`]): exponential,
//! Pareto and bimodal (two-phase hyperexponential) durations, weighted
//! discrete choices (CPU counts), and the arrival processes (Poisson, and
//! a bursty two-phase Markov-modulated Poisson process). Each has a text
//! form for the command line, parsed here.

use sched::harness::Rng;

use crate::error::{Result, bad_spec};

/// An exponential variate of the given mean (inverse transform).
pub fn exp(rng: &mut Rng, mean: f64) -> f64 {
    // unit() is in [0, 1): 1 - u is in (0, 1], so ln never sees 0.
    -mean * (1.0 - rng.unit()).ln()
}

fn num(what: &'static str, spec: &str, s: &str) -> Result<f64> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| bad_spec(what, spec, format!("{s:?} is not a number")))?;
    if !v.is_finite() {
        return Err(bad_spec(what, spec, format!("{s:?} is not finite")));
    }
    Ok(v)
}

/// Job durations (seconds of wall time with all the job's CPUs).
#[derive(Clone, Debug, PartialEq)]
pub enum Durations {
    /// Always this long.
    Fixed(f64),
    /// Exponential with this mean.
    Exp {
        /// Mean, seconds.
        mean: f64,
    },
    /// Pareto (heavy tail) with shape `alpha` > 1 and this mean; the scale
    /// is `mean (alpha - 1) / alpha`.
    Pareto {
        /// Shape.
        alpha: f64,
        /// Mean, seconds.
        mean: f64,
    },
    /// Two exponential modes: short with probability `1 - p_long`, long
    /// with `p_long` (a two-phase hyperexponential).
    Bimodal {
        /// Mean of the short mode, seconds.
        short: f64,
        /// Mean of the long mode, seconds.
        long: f64,
        /// Probability of the long mode.
        p_long: f64,
    },
}

impl Durations {
    /// Parse `fixed:S`, `exp:MEAN`, `pareto:ALPHA:MEAN` or
    /// `bimodal:SHORT:LONG:P_LONG` (seconds).
    pub fn parse(spec: &str) -> Result<Self> {
        const W: &str = "duration distribution";
        let parts: Vec<&str> = spec.split(':').collect();
        let positive = |v: f64, name: &str| {
            if v > 0.0 {
                Ok(v)
            } else {
                Err(bad_spec(W, spec, format!("{name} must be > 0")))
            }
        };
        match parts.as_slice() {
            ["fixed", s] => Ok(Self::Fixed(positive(num(W, spec, s)?, "duration")?)),
            ["exp", m] => Ok(Self::Exp {
                mean: positive(num(W, spec, m)?, "mean")?,
            }),
            ["pareto", a, m] => {
                let alpha = num(W, spec, a)?;
                if alpha <= 1.0 {
                    return Err(bad_spec(W, spec, "alpha must be > 1 (finite mean)"));
                }
                Ok(Self::Pareto {
                    alpha,
                    mean: positive(num(W, spec, m)?, "mean")?,
                })
            }
            ["bimodal", s, l, p] => {
                let p_long = num(W, spec, p)?;
                if !(0.0..=1.0).contains(&p_long) {
                    return Err(bad_spec(W, spec, "p_long must be in [0, 1]"));
                }
                Ok(Self::Bimodal {
                    short: positive(num(W, spec, s)?, "short")?,
                    long: positive(num(W, spec, l)?, "long")?,
                    p_long,
                })
            }
            _ => Err(bad_spec(
                W,
                spec,
                "want fixed:S, exp:MEAN, pareto:ALPHA:MEAN or bimodal:SHORT:LONG:P_LONG",
            )),
        }
    }

    /// The mean, seconds.
    pub fn mean(&self) -> f64 {
        match *self {
            Self::Fixed(s) => s,
            Self::Exp { mean } | Self::Pareto { mean, .. } => mean,
            Self::Bimodal {
                short,
                long,
                p_long,
            } => (1.0 - p_long) * short + p_long * long,
        }
    }

    /// One variate, seconds.
    pub fn sample(&self, rng: &mut Rng) -> f64 {
        match *self {
            Self::Fixed(s) => s,
            Self::Exp { mean } => exp(rng, mean),
            Self::Pareto { alpha, mean } => {
                let xm = mean * (alpha - 1.0) / alpha;
                xm / (1.0 - rng.unit()).powf(1.0 / alpha)
            }
            Self::Bimodal {
                short,
                long,
                p_long,
            } => {
                if rng.unit() < p_long {
                    exp(rng, long)
                } else {
                    exp(rng, short)
                }
            }
        }
    }
}

/// A weighted choice of integers (CPU counts).
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    values: Vec<u32>,
    /// Cumulative probabilities, last = 1.
    cum: Vec<f64>,
}

impl Choice {
    /// Parse `V[:W],V[:W],...` (weights default to 1) or a range `A-B`
    /// (uniform).
    pub fn parse(spec: &str) -> Result<Self> {
        const W: &str = "CPU choice";
        let mut pairs = Vec::new();
        if let Some((a, b)) = spec.split_once('-') {
            let a: u32 = a
                .trim()
                .parse()
                .map_err(|_| bad_spec(W, spec, "range bounds must be integers"))?;
            let b: u32 = b
                .trim()
                .parse()
                .map_err(|_| bad_spec(W, spec, "range bounds must be integers"))?;
            if a == 0 || b < a {
                return Err(bad_spec(W, spec, "want 1 <= A <= B"));
            }
            pairs.extend((a..=b).map(|v| (v, 1.0)));
        } else {
            for part in spec.split(',') {
                let (v, w) = match part.split_once(':') {
                    Some((v, w)) => (v, num(W, spec, w)?),
                    None => (part, 1.0),
                };
                let v: u32 = v
                    .trim()
                    .parse()
                    .map_err(|_| bad_spec(W, spec, format!("{v:?} is not a CPU count")))?;
                if v == 0 || w < 0.0 {
                    return Err(bad_spec(W, spec, "counts must be >= 1, weights >= 0"));
                }
                pairs.push((v, w));
            }
        }
        Self::from_weights(&pairs).ok_or_else(|| bad_spec(W, spec, "weights sum to 0"))
    }

    /// From (value, weight) pairs; `None` when the weights sum to 0.
    pub fn from_weights(pairs: &[(u32, f64)]) -> Option<Self> {
        let total: f64 = pairs.iter().map(|p| p.1).sum();
        if pairs.is_empty() || total <= 0.0 || !total.is_finite() {
            return None;
        }
        let mut acc = 0.0;
        let mut cum = Vec::with_capacity(pairs.len());
        for p in pairs {
            acc += p.1 / total;
            cum.push(acc);
        }
        if let Some(last) = cum.last_mut() {
            *last = 1.0;
        }
        Some(Self {
            values: pairs.iter().map(|p| p.0).collect(),
            cum,
        })
    }

    /// A single value.
    pub fn constant(v: u32) -> Self {
        Self {
            values: vec![v.max(1)],
            cum: vec![1.0],
        }
    }

    /// The mean of `min(value, cap)`.
    pub fn mean_capped(&self, cap: u32) -> f64 {
        let mut prev = 0.0;
        let mut m = 0.0;
        for (v, c) in self.values.iter().zip(&self.cum) {
            m += (c - prev) * (*v).min(cap) as f64;
            prev = *c;
        }
        m
    }

    /// The largest value.
    pub fn max(&self) -> u32 {
        self.values.iter().copied().max().unwrap_or(1)
    }

    /// One draw.
    pub fn sample(&self, rng: &mut Rng) -> u32 {
        let u = rng.unit();
        let i = self.cum.partition_point(|&c| c <= u);
        self.values[i.min(self.values.len() - 1)]
    }
}

/// The arrival process of independent (root) jobs.
#[derive(Clone, Debug, PartialEq)]
pub enum Arrivals {
    /// Poisson: exponential inter-arrival times.
    Poisson,
    /// Two-phase Markov-modulated Poisson process: phases of exponential
    /// length (mean `phase_s`) alternate between rate `factor x rate` and
    /// `(2 - factor) x rate`, so the mean rate is kept. `factor` in
    /// [1, 2]; 2 is ON/OFF.
    Bursty {
        /// Burst factor.
        factor: f64,
        /// Mean phase length, seconds.
        phase_s: f64,
    },
}

impl Arrivals {
    /// Parse `poisson` or `bursty[:FACTOR[:PHASE_S]]` (defaults 1.8, 300 s).
    pub fn parse(spec: &str) -> Result<Self> {
        const W: &str = "arrival process";
        let parts: Vec<&str> = spec.split(':').collect();
        match parts.as_slice() {
            ["poisson"] => Ok(Self::Poisson),
            ["bursty", rest @ ..] if rest.len() <= 2 => {
                let factor = match rest.first() {
                    Some(f) => num(W, spec, f)?,
                    None => 1.8,
                };
                let phase_s = match rest.get(1) {
                    Some(p) => num(W, spec, p)?,
                    None => 300.0,
                };
                if !(1.0..=2.0).contains(&factor) || phase_s <= 0.0 {
                    return Err(bad_spec(W, spec, "want 1 <= FACTOR <= 2 and PHASE_S > 0"));
                }
                Ok(Self::Bursty { factor, phase_s })
            }
            _ => Err(bad_spec(
                W,
                spec,
                "want poisson or bursty[:FACTOR[:PHASE_S]]",
            )),
        }
    }

    /// A generator of arrival times (seconds) at mean `rate` per second.
    pub fn times(&self, rate: f64) -> ArrivalClock {
        ArrivalClock {
            process: self.clone(),
            rate,
            t: 0.0,
            high: true,
            phase_end: None,
        }
    }
}

/// Successive arrival times of an [`Arrivals`] process.
#[derive(Clone, Debug)]
pub struct ArrivalClock {
    process: Arrivals,
    rate: f64,
    t: f64,
    high: bool,
    phase_end: Option<f64>,
}

impl ArrivalClock {
    /// The next arrival time, seconds.
    pub fn next(&mut self, rng: &mut Rng) -> f64 {
        match self.process {
            Arrivals::Poisson => {
                self.t += exp(rng, 1.0 / self.rate);
                self.t
            }
            Arrivals::Bursty { factor, phase_s } => loop {
                let end = match self.phase_end {
                    Some(e) => e,
                    None => {
                        let e = self.t + exp(rng, phase_s);
                        self.phase_end = Some(e);
                        e
                    }
                };
                let r = if self.high {
                    factor * self.rate
                } else {
                    (2.0 - factor) * self.rate
                };
                let dt = if r > 0.0 {
                    exp(rng, 1.0 / r)
                } else {
                    f64::INFINITY
                };
                if self.t + dt <= end {
                    self.t += dt;
                    return self.t;
                }
                // Memoryless: restart the draw in the next phase.
                self.t = end;
                self.high = !self.high;
                self.phase_end = None;
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mean_of(d: &Durations, n: usize) -> f64 {
        let mut rng = Rng::new(3);
        (0..n).map(|_| d.sample(&mut rng)).sum::<f64>() / n as f64
    }

    #[test]
    fn durations_have_their_means() {
        for spec in ["exp:10", "bimodal:1:100:0.1", "fixed:3"] {
            let d = Durations::parse(spec).unwrap();
            let m = mean_of(&d, 200_000);
            assert!((m / d.mean() - 1.0).abs() < 0.02, "{spec}: {m}");
        }
        // Heavy tail: the sample mean converges slowly; check the median
        // instead (xm 2^(1/alpha)).
        let d = Durations::parse("pareto:2.5:10").unwrap();
        let mut rng = Rng::new(9);
        let mut v: Vec<f64> = (0..100_001).map(|_| d.sample(&mut rng)).collect();
        v.sort_by(f64::total_cmp);
        let xm = 10.0 * 1.5 / 2.5;
        let median = xm * 2f64.powf(1.0 / 2.5);
        assert!((v[50_000] / median - 1.0).abs() < 0.02);
    }

    #[test]
    fn bad_specs_are_refused() {
        for spec in [
            "exp",
            "exp:-1",
            "pareto:1:5",
            "bimodal:1:2:3",
            "zipf:1",
            "exp:x",
        ] {
            assert!(Durations::parse(spec).is_err(), "{spec}");
        }
        for spec in ["0", "4-2", "a,b", "1:-1", ""] {
            assert!(Choice::parse(spec).is_err(), "{spec}");
        }
        for spec in ["bursty:3", "poison", "bursty:1.5:0"] {
            assert!(Arrivals::parse(spec).is_err(), "{spec}");
        }
    }

    #[test]
    fn choices_follow_weights() {
        let c = Choice::parse("1:3,8:1").unwrap();
        assert_eq!(c.max(), 8);
        assert!((c.mean_capped(64) - 2.75).abs() < 1e-9);
        assert!((c.mean_capped(4) - 1.75).abs() < 1e-9);
        let mut rng = Rng::new(1);
        let ones = (0..40_000).filter(|_| c.sample(&mut rng) == 1).count();
        assert!((ones as f64 / 40_000.0 - 0.75).abs() < 0.01);
        assert_eq!(Choice::parse("2-4").unwrap().mean_capped(64), 3.0);
    }

    #[test]
    fn arrival_processes_keep_the_mean_rate() {
        for spec in ["poisson", "bursty:1.8:5", "bursty:2:2"] {
            let a = Arrivals::parse(spec).unwrap();
            let mut clock = a.times(2.0);
            let mut rng = Rng::new(5);
            let mut t = 0.0;
            for _ in 0..200_000 {
                t = clock.next(&mut rng);
            }
            let rate = 200_000.0 / t;
            assert!((rate / 2.0 - 1.0).abs() < 0.03, "{spec}: {rate}");
        }
    }
}
