//! Run-time predictions from each user's history (EASY++: Tsafrir, Etsion
//! and Feitelson, "Backfilling using system-generated predictions rather
//! than user runtime estimates", IEEE TPDS 2007): a job is predicted to
//! run as long as the mean of its identity's last two completed run times.
//!
//! A job's identity is its owner and group (the submitting user and
//! `JobSpec.group`, as for wakers, [`super::wakers::WakerKey::Owner`]); an
//! anonymous job without a group has none, and no prediction (all such
//! jobs sharing one history would predict nothing useful). A run time is
//! recorded when a job ends SUCCEEDED or FAILED after it started (its
//! start and end times, ms); cancelled and lost jobs say nothing about how
//! long the user's jobs run.
//!
//! What a prediction is used for ([`Predict`], `ClusterConfig::predict`):
//! the engine task of a job gets it as `TaskSpec::predicted`, which EASY
//! backfill counts on where it is shorter than the job's limit or the job
//! has none. The engine keeps the no-starvation bound when a prediction is
//! wrong (doubling a prediction a job outlives, and counting on
//! predictions for a waiting head only until one fails:
//! `sched::Sched::reservation`).
//!
//! Soft state: nothing is persisted. After a restart the history is rebuilt
//! from the finished jobs the store still holds (`Cluster::restore`, in
//! end order), so it is as good as the retention
//! (`ClusterConfig::retention`) keeps it; an identity whose jobs were all
//! deleted starts again without a prediction. Memory is bounded as for
//! wakers: at most `cap` identities, the least recently touched half
//! evicted when the cap is passed (O(1) amortized).

use std::sync::Arc;

use sched::idhash::IdMap;

/// Identities kept at most.
pub const MAX_IDENTITIES: usize = 100_000;

/// Which jobs get a run-time prediction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Predict {
    /// None: backfill reads time limits only.
    #[default]
    Off,
    /// Jobs without a time limit (`timeout_ms` 0): their reservations and
    /// backfill get a date where they had none.
    Unlimited,
    /// Every job, capped by its limit where it has one (EASY++ proper).
    All,
}

impl Predict {
    /// Parse `off`, `unlimited` or `all`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "off" => Some(Self::Off),
            "unlimited" => Some(Self::Unlimited),
            "all" => Some(Self::All),
            _ => None,
        }
    }
}

/// One identity's last two run times (ms), newest first.
#[derive(Clone, Copy, Debug, Default)]
struct Record {
    last: [Option<u64>; 2],
    touched: u64,
}

/// The per-identity history.
#[derive(Debug)]
pub struct Runtimes {
    /// Owner -> group -> record. FxHash (`IdMap`): a job's identity is
    /// looked up at its placement and its end, and std's SipHash of the
    /// two names was ~350 instructions a lookup (the names are the
    /// dispatcher's authenticated users' and their jobs' groups).
    records: IdMap<Arc<str>, IdMap<String, Record>>,
    len: usize,
    cap: usize,
    clock: u64,
}

impl Default for Runtimes {
    fn default() -> Self {
        Self::new(MAX_IDENTITIES)
    }
}

impl Runtimes {
    /// An empty history of at most `cap` identities (at least 2).
    pub fn new(cap: usize) -> Self {
        Self {
            records: IdMap::default(),
            len: 0,
            cap: cap.max(2),
            clock: 0,
        }
    }

    /// Identities held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no identity is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Record a completed run of `run_ms` by `owner`/`group` (ignored for
    /// an anonymous job without a group).
    pub fn record(&mut self, owner: &Arc<str>, group: &str, run_ms: u64) {
        if owner.is_empty() && group.is_empty() {
            return;
        }
        self.clock += 1;
        let clock = self.clock;
        let groups = match self.records.get_mut(&**owner) {
            Some(g) => g,
            None => self.records.entry(owner.clone()).or_default(),
        };
        let r = match groups.get_mut(group) {
            Some(r) => r,
            None => {
                self.len += 1;
                groups.entry(group.to_string()).or_default()
            }
        };
        r.last = [Some(run_ms), r.last[0]];
        r.touched = clock;
        if self.len > self.cap {
            self.evict();
        }
    }

    /// The predicted run time of the next job of `owner`/`group`, ms: the
    /// mean of its last two recorded run times (the one if only one); at
    /// least 1. `None` without history.
    pub fn predict(&self, owner: &str, group: &str) -> Option<u64> {
        let r = self.records.get(owner)?.get(group)?;
        let p = match r.last {
            [Some(a), Some(b)] => a / 2 + b / 2 + (a % 2 + b % 2) / 2,
            [Some(a), None] => a,
            _ => return None,
        };
        Some(p.max(1))
    }

    /// Keep the `cap / 2` most recently touched identities.
    fn evict(&mut self) {
        let mut stamps: Vec<u64> = self
            .records
            .values()
            .flat_map(|g| g.values().map(|r| r.touched))
            .collect();
        let keep = self.cap / 2;
        if stamps.len() <= keep {
            return;
        }
        let cut = stamps.len() - keep;
        let (_, &mut threshold, _) = stamps.select_nth_unstable(cut);
        let mut len = 0;
        self.records.retain(|_, groups| {
            groups.retain(|_, r| r.touched >= threshold);
            len += groups.len();
            !groups.is_empty()
        });
        self.len = len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn predicts_the_mean_of_the_last_two_runs_per_identity() {
        let mut h = Runtimes::default();
        let alice: Arc<str> = Arc::from("alice");
        assert_eq!(h.predict("alice", ""), None);
        h.record(&alice, "", 100);
        assert_eq!(h.predict("alice", ""), Some(100));
        h.record(&alice, "", 301);
        assert_eq!(h.predict("alice", ""), Some(200));
        h.record(&alice, "", 500);
        assert_eq!(h.predict("alice", ""), Some(400));
        // Groups and users are separate identities.
        assert_eq!(h.predict("alice", "sim"), None);
        assert_eq!(h.predict("bob", ""), None);
        // Anonymous without a group: no history.
        h.record(&Arc::from(""), "", 7);
        assert_eq!(h.predict("", ""), None);
        h.record(&Arc::from(""), "g", 0);
        assert_eq!(h.predict("", "g"), Some(1));
        assert_eq!(h.len(), 2);
    }

    #[test]
    fn eviction_keeps_the_most_recently_touched_half() {
        let mut h = Runtimes::new(10);
        for i in 0..11u64 {
            h.record(&Arc::from(format!("u{i}")), "", i + 1);
        }
        assert_eq!(h.len(), 5);
        for i in 6..11u64 {
            assert_eq!(h.predict(&format!("u{i}"), ""), Some(i + 1));
        }
        assert_eq!(h.predict("u0", ""), None);
    }
}
