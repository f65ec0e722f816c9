//! Waker identities and their flip records: seed 001's `wakee_flips` at
//! cluster level, kept here, outside the engine, so that they survive what
//! the engine forgets (a job's task is re-created on every placement, a
//! retry, an engine rebuild).
//!
//! A job's *waker* is the job named by its `waker` field, else its owner
//! and group (the submitting user and `JobSpec.group`); an anonymous job
//! without a group has none. Each waker has a [`WakerRecord`]: the
//! kernel's `last_wakee`, `wakee_flips` and wipe clock
//! ([`sched::wake::WakeeFlips`]), wiped on the cluster's time scale
//! (`ClusterConfig::wake_flip_decay_ms`, not the kernel's one second), and
//! the node its last wakee was placed on (where an identity "is"), and the
//! room its rack had when the flips last started from zero (the wake_wide
//! factor counts how many wakees of a size that room holds, so a burst's
//! first wakees filling the rack do not shrink the factor for the rest).
//!
//! A flip is recorded when a job is woken: when it is submitted and when a
//! retry makes it PENDING again; placing the same job again (an engine
//! rebuild, a node that stops taking jobs) is no wakeup and records
//! nothing.
//!
//! Memory is bounded: at most `cap` records ([`MAX_WAKERS`] by default).
//! Inserting past the cap evicts the least recently touched records
//! until half the cap is left (one O(records) pass per cap / 2 inserts,
//! so O(1) amortized); an evicted waker starts again from no flips and no
//! node, as a waker the dispatcher never saw.

use std::hash::{BuildHasher, BuildHasherDefault};
use std::sync::atomic::{AtomicU32, Ordering};

use sched::idhash::IdHasher;
use sched::wake::WakeeFlips;

use super::jobs::JobKey;
use crate::record::JobRecord;

/// Records kept at most (as many as the engine used to keep finished
/// jobs' tasks for the same purpose).
pub const MAX_WAKERS: usize = 100_000;

/// How a job whose waker is only its owner (no `waker` job, no
/// `JobSpec.group`) is placed: a user submitting a batch job is closer to
/// a fork (a new task whose parent is the submitter) than to a wakeup of
/// a task that works with the waker's. The flips are recorded whatever
/// the choice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OwnerWake {
    /// As a job waker: wake-affine toward the node the owner's last job
    /// went to, wake_wide past the factor.
    Affine,
    /// The fork path from the owner's last node's zone
    /// (`Sched::select_task_rq_fork`): the idlest rack and node, kept in
    /// the owner's rack only within the `imbalance_pct` bias.
    Fork,
    /// As an anonymous job: the idlest node of the cluster (the
    /// default, docs/BENCHMARKS.md, "Users as wakers").
    #[default]
    Idlest,
}

impl OwnerWake {
    /// Parse `affine`, `fork` or `idlest`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "affine" => Some(Self::Affine),
            "fork" => Some(Self::Fork),
            "idlest" => Some(Self::Idlest),
            _ => None,
        }
    }
}

/// Who woke a job.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum WakerKey {
    /// The job its `waker` field names.
    Job(JobKey),
    /// Its owner and group (either may be empty, not both).
    Owner {
        /// The submitting user.
        owner: String,
        /// `JobSpec.group`.
        group: String,
    },
}

impl WakerKey {
    /// The waker of `job`: its `waker` job, else its owner and group; None
    /// for an anonymous job without a group.
    pub fn of(job: &JobRecord) -> Option<Self> {
        let spec = job.spec();
        let waker = spec.map_or("", |s| s.waker.as_str());
        if let Some(k) = JobKey::parse(waker) {
            return Some(Self::Job(k));
        }
        let group = spec.map_or("", |s| s.group.as_str());
        if job.owner.is_empty() && group.is_empty() {
            return None;
        }
        Some(Self::Owner {
            owner: job.owner.to_string(),
            group: group.to_string(),
        })
    }
}

impl WakerKey {
    /// True for an owner alone (no `waker` job, no group): the waker of a
    /// user's independent job.
    pub fn is_owner_only(&self) -> bool {
        matches!(self, Self::Owner { group, .. } if group.is_empty())
    }
}

/// One waker's record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WakerRecord {
    /// The seed's flip record.
    pub flips: WakeeFlips,
    /// The node its last wakee was placed on (empty: none yet).
    pub node: String,
    /// Free capacity of the waker's rack when its flips last started from
    /// zero: the room its burst of wakees found (the wake_wide factor is
    /// how many of a wakee's size that room holds).
    pub room: Option<u64>,
    /// Clock of the last touch (ns), for eviction.
    touched: u64,
}

/// The records, bounded.
#[derive(Debug)]
pub struct Wakers {
    /// The records with their keys, in no order.
    slots: Vec<(WakerKey, WakerRecord)>,
    /// Their positions in `slots`, hashed by key. FxHash: a waker's key is
    /// hashed at every submission and placement, and std's SipHash of an
    /// owner's and group's names cost ~350 instructions each time (the
    /// keys are the dispatcher's own: job keys, and the names of users it
    /// authenticated).
    index: hashbrown::HashTable<u32>,
    /// The position of the last key found: a placement asks for its
    /// waker's record four or five times (its flips, its node, its room,
    /// where its wakee went), ~190-450 instructions a hashed lookup where
    /// a compare with the hinted slot's key does. A hint only: checked
    /// against the key there. Atomic (relaxed) so that `&self` lookups may
    /// set it and the cluster stays `Sync`.
    hint: AtomicU32,
    period_ns: u64,
    cap: usize,
}

impl Wakers {
    /// Records wiped every `period_ms`, at most `cap` of them (at least 2).
    pub fn new(period_ms: u64, cap: usize) -> Self {
        Self {
            slots: Vec::new(),
            index: hashbrown::HashTable::new(),
            hint: AtomicU32::new(0),
            period_ns: period_ms.saturating_mul(1_000_000),
            cap: cap.max(2),
        }
    }

    fn hash(key: &WakerKey) -> u64 {
        BuildHasherDefault::<IdHasher>::default().hash_one(key)
    }

    /// The slot of `key`: the hinted one if it holds `key`, else the
    /// index's (which becomes the hint).
    #[inline]
    fn find(&self, key: &WakerKey) -> Option<usize> {
        let h = self.hint.load(Ordering::Relaxed) as usize;
        if self.slots.get(h).is_some_and(|(k, _)| k == key) {
            return Some(h);
        }
        let slots = &self.slots;
        let i = *self
            .index
            .find(Self::hash(key), |&i| slots[i as usize].0 == *key)?;
        self.hint.store(i, Ordering::Relaxed);
        Some(i as usize)
    }

    /// The wipe period, ns.
    pub fn period_ns(&self) -> u64 {
        self.period_ns
    }

    /// Records held.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// True when no record is held.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// A waker's record.
    pub fn get(&self, key: &WakerKey) -> Option<&WakerRecord> {
        self.find(key).map(|i| &self.slots[i].1)
    }

    /// `record_wakee`: `key` woke job `wakee` (its engine task's number, unique
    /// per job) at `now` (ns). Returns the waker's flips, this one counted.
    pub fn record(&mut self, key: &WakerKey, wakee: u64, now: u64) -> u32 {
        let period = self.period_ns;
        let r = self.touch(key, now);
        r.flips.record(wakee, now, period);
        r.flips.flips
    }

    /// The waker's flips as of `now`, decayed (0 without a record).
    pub fn flips(&self, key: &WakerKey, now: u64) -> u32 {
        self.get(key)
            .map_or(0, |r| r.flips.current(now, self.period_ns))
    }

    /// Set the room the waker's burst found (see [`WakerRecord::room`]).
    pub fn set_room(&mut self, key: &WakerKey, room: u64, now: u64) {
        self.touch(key, now).room = Some(room);
    }

    /// A wakee of `key` was placed on `node` at `now` (ns).
    pub fn placed(&mut self, key: &WakerKey, node: &str, now: u64) {
        let r = self.touch(key, now);
        if r.node != node {
            r.node.clear();
            r.node.push_str(node);
        }
    }

    fn touch(&mut self, key: &WakerKey, now: u64) -> &mut WakerRecord {
        let i = match self.find(key) {
            Some(i) => i,
            None => {
                // The key is copied (its names) only for a new record.
                if self.slots.len() >= self.cap {
                    self.evict();
                }
                let i = self.slots.len();
                self.slots.push((key.clone(), WakerRecord::default()));
                let slots = &self.slots;
                self.index.insert_unique(Self::hash(key), i as u32, |&j| {
                    Self::hash(&slots[j as usize].0)
                });
                *self.hint.get_mut() = i as u32;
                i
            }
        };
        let r = &mut self.slots[i].1;
        r.touched = r.touched.max(now);
        r
    }

    /// Keep the `cap / 2` most recently touched records (ties broken
    /// arbitrarily), then index them again.
    fn evict(&mut self) {
        let keep = self.cap / 2;
        let drop = self.slots.len().saturating_sub(keep);
        if drop == 0 {
            return;
        }
        // The `drop`-th oldest touch: every record touched before it goes,
        // and as many of those touched at it as make `drop`.
        let mut ages: Vec<u64> = self.slots.iter().map(|(_, r)| r.touched).collect();
        let (_, &mut cut, _) = ages.select_nth_unstable(drop - 1);
        let before = ages.iter().filter(|&&t| t < cut).count();
        let mut at_cut = drop - before;
        self.slots.retain(|(_, r)| {
            if r.touched < cut {
                return false;
            }
            if r.touched == cut && at_cut > 0 {
                at_cut -= 1;
                return false;
            }
            true
        });
        self.index.clear();
        for (i, (k, _)) in self.slots.iter().enumerate() {
            let slots = &self.slots;
            self.index.insert_unique(Self::hash(k), i as u32, |&j| {
                Self::hash(&slots[j as usize].0)
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    const SEC: u64 = 1_000_000_000;

    fn job(n: u64) -> WakerKey {
        WakerKey::Job(JobKey::single(n))
    }

    #[test]
    fn keys_are_the_waker_job_else_owner_and_group() {
        let of = |j: &proto::v1::Job| WakerKey::of(&JobRecord::from_proto(j.clone()).unwrap());
        let mut j = proto::v1::Job {
            id: "j-1".into(),
            owner: "ann".into(),
            spec: Some(proto::v1::JobSpec {
                waker: "j-7".into(),
                group: "etl".into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(of(&j), Some(job(7)));
        j.spec.as_mut().unwrap().waker.clear();
        let owner = |o: &str, g: &str| WakerKey::Owner {
            owner: o.into(),
            group: g.into(),
        };
        assert_eq!(of(&j), Some(owner("ann", "etl")));
        j.owner.clear();
        assert_eq!(of(&j), Some(owner("", "etl")));
        j.spec.as_mut().unwrap().group.clear();
        assert_eq!(of(&j), None, "anonymous and ungrouped");
    }

    #[test]
    fn flips_decay_on_the_configured_period() {
        let mut w = Wakers::new(60_000, 10);
        assert_eq!(w.period_ns(), 60 * SEC);
        for (wakee, t) in [(1, 0), (2, SEC), (2, 2 * SEC), (3, 3 * SEC)] {
            w.record(&job(1), wakee, t);
        }
        assert_eq!(w.flips(&job(1), 3 * SEC), 3);
        assert_eq!(
            w.flips(&job(1), 59 * SEC),
            3,
            "the kernel's 1 s is not ours"
        );
        assert_eq!(w.flips(&job(1), 61 * SEC), 0, "decayed");
        assert_eq!(w.record(&job(1), 4, 61 * SEC), 1, "wiped, then counted");
        assert_eq!(w.flips(&job(2), 0), 0, "no record");
    }

    #[test]
    fn the_last_node_is_kept_and_eviction_keeps_the_recent_half() {
        let mut w = Wakers::new(60_000, 4);
        w.placed(&job(1), "n1", 10);
        assert_eq!(w.get(&job(1)).unwrap().node, "n1");
        for (i, t) in [(2, 20), (3, 30), (4, 40)] {
            w.record(&job(i), i, t);
        }
        w.record(&job(1), 9, 50);
        assert_eq!(w.len(), 4);
        w.record(&job(5), 5, 60);
        let mut kept: Vec<u64> = [1, 2, 3, 4, 5]
            .into_iter()
            .filter(|&i| w.get(&job(i)).is_some())
            .collect();
        kept.sort();
        assert_eq!(
            kept,
            vec![1, 4, 5],
            "2 and 3 were the least recently touched"
        );
        assert_eq!(w.get(&job(1)).unwrap().node, "n1");
    }

    proptest! {
        /// Against a brute-force oracle that keeps every event of every
        /// waker and recounts from scratch: the bounded records hold at most
        /// `cap` wakers, and every waker still held has the oracle's flips
        /// counted since it was (re)created (an evicted waker restarts).
        #[test]
        fn flips_match_a_replay_of_every_event(
            cap in 2usize..8,
            period in 1u64..50,
            events in prop::collection::vec((0u64..10, 0u64..4, 0u64..20), 1..200),
        ) {
            let mut w = Wakers::new(period, cap);
            let period_ns = period * 1_000_000;
            // Oracle: per waker, the events since its record was created.
            let mut history: HashMap<u64, Vec<(u64, u64)>> = HashMap::new();
            let mut now = 0;
            for (waker, wakee, dt) in events {
                now += dt * 1_000_000;
                let key = job(waker);
                if w.get(&key).is_none() {
                    history.remove(&waker);
                }
                let got = w.record(&key, wakee, now);
                history.entry(waker).or_default().push((wakee, now));
                // Replay: the kernel's rule read literally, a wipe whenever
                // more than `period` passed since the last wipe.
                let (mut flips, mut wiped, mut last) = (0u32, 0u64, None);
                for &(e, t) in &history[&waker] {
                    if t > wiped + period_ns {
                        flips = 0;
                        wiped = t;
                    }
                    if last != Some(e) {
                        flips += 1;
                        last = Some(e);
                    }
                }
                prop_assert_eq!(got, flips);
                prop_assert!(w.len() <= cap);
                prop_assert!(w.get(&key).is_some(), "the waker just touched is kept");
            }
        }
    }
}

/// The records driven through the cluster's lifecycle.
#[cfg(test)]
mod cluster_tests {
    use proto::v1::{JobSpec, JobState, JobStatus, NodeLoad};

    use super::*;
    use crate::cluster::tests::register_node;
    use crate::cluster::{Cluster, ClusterConfig, Effects, Phase, Via};

    /// One zone, racks `r1` and `r2` of two 4-CPU nodes each (`a1 a2`,
    /// `b1 b2`): a rack holds eight 1-CPU jobs.
    fn cluster() -> Cluster {
        let mut c = Cluster::new(ClusterConfig::default());
        let mut fx = Effects::default();
        for (n, r) in [("a1", "r1"), ("a2", "r1"), ("b1", "r2"), ("b2", "r2")] {
            register_node(&mut c, n, "1s:4c:1t", ("z1", r), 0, &mut fx);
        }
        c.settle(0, &mut fx);
        c
    }

    fn spec(cpus: u32, waker: &str) -> JobSpec {
        JobSpec {
            command: vec!["true".into()],
            cpus,
            waker: waker.into(),
            ..Default::default()
        }
    }

    fn submit(c: &mut Cluster, specs: Vec<JobSpec>, now: i64) -> Vec<String> {
        let batch = specs.len() > 1;
        let jobs = c
            .submit(specs, batch, now, &mut Effects::default())
            .unwrap();
        jobs.into_iter().map(|j| j.id()).collect()
    }

    fn end(c: &mut Cluster, id: &str, now: i64) {
        let node = c.get_job(id).unwrap().node;
        let st = |state: JobState| JobStatus {
            job_id: id.into(),
            attempt: 1,
            state: state as i32,
            ..Default::default()
        };
        c.job_status(&node, st(JobState::Succeeded), now, &mut Effects::default());
    }

    fn rack(node: &str) -> char {
        node.chars().next().unwrap_or('?')
    }

    fn wake(c: &Cluster, id: &str) -> Option<sched::WakeChoice> {
        match c.phase(id) {
            Some(
                Phase::Queued {
                    via: Via::Placed(how) | Via::Waited(how),
                    ..
                }
                | Phase::Assigned {
                    via: Via::Placed(how) | Via::Waited(how),
                    ..
                },
            ) => Some(how.wake),
            _ => None,
        }
    }

    #[test]
    fn a_fan_out_larger_than_its_rack_goes_wide() {
        let mut c = cluster();
        let parent = submit(&mut c, vec![spec(1, "")], 1).remove(0);
        let home = rack(&c.get_job(&parent).unwrap().node);
        end(&mut c, &parent, 2);
        // 12 children of 1 CPU: the parent's rack holds 8.
        let children = submit(&mut c, vec![spec(1, &parent); 12], 3);
        let stats = *c.engine().unwrap().stats();
        assert!(stats.wake_wide > 0, "{stats:?}");
        let wide = children
            .iter()
            .filter(|id| wake(&c, id) == Some(sched::WakeChoice::Wide))
            .count();
        assert_eq!(wide as u64, stats.wake_wide);
        let nodes: Vec<String> = children
            .iter()
            .map(|id| c.get_job(id).unwrap().node)
            .collect();
        let at_home = nodes.iter().filter(|n| rack(n) == home).count();
        // The first 8 fill the room the burst found in the waker's rack,
        // the other 4 go wide (to the other rack: the waker's is full).
        assert_eq!(at_home, 8, "{nodes:?}");
        assert_eq!(wide, 4, "{nodes:?}");
        // All 12 start at once: 16 CPUs for 12 jobs.
        for id in &children {
            assert_eq!(
                JobState::try_from(c.get_job(id).unwrap().state),
                Ok(JobState::Assigned),
                "{id}: {nodes:?}"
            );
        }
        assert_eq!(
            c.wakers
                .flips(&WakerKey::Job(JobKey::parse(&parent).unwrap()), 3_000_000),
            12
        );
    }

    #[test]
    fn a_one_to_one_pipeline_stays_affine_in_its_rack() {
        let mut c = cluster();
        // The first stage's rack is kept nearly full (7 of 8 CPUs), the
        // other rack empty: the idlest node is never in the first's rack.
        let first = submit(&mut c, vec![spec(1, "")], 1).remove(0);
        let home = rack(&c.get_job(&first).unwrap().node);
        let label = if home == 'a' { "r1" } else { "r2" };
        let mut filler = spec(3, "");
        filler
            .node_selector
            .insert("dispatch.io/rack".into(), label.into());
        for f in submit(&mut c, vec![filler.clone(), filler], 2) {
            assert_eq!(rack(&c.get_job(&f).unwrap().node), home);
        }
        let mut prev = first;
        for t in 0..6 {
            let now = 10 + 10 * t;
            end(&mut c, &prev, now);
            let next = submit(&mut c, vec![spec(1, &prev)], now + 1).remove(0);
            assert_eq!(wake(&c, &next), Some(sched::WakeChoice::Affine), "{next}");
            assert_eq!(rack(&c.get_job(&next).unwrap().node), home, "{next}");
            prev = next;
        }
        let stats = *c.engine().unwrap().stats();
        assert_eq!(stats.wake_wide, 0, "{stats:?}");
    }

    /// Where one after another of `owner`'s 1-CPU jobs (separate
    /// submissions, `group`) goes, with `owner_wake`; and how each was
    /// placed.
    fn owners_jobs(
        owner_wake: OwnerWake,
        owner: &str,
        group: &str,
    ) -> Vec<(String, Option<sched::WakeChoice>)> {
        let mut c = Cluster::new(ClusterConfig {
            owner_wake,
            ..ClusterConfig::default()
        });
        let mut fx = Effects::default();
        for (n, r) in [("a1", "r1"), ("a2", "r1"), ("b1", "r2"), ("b2", "r2")] {
            register_node(&mut c, n, "1s:4c:1t", ("z1", r), 0, &mut fx);
        }
        c.settle(0, &mut fx);
        let mut job = spec(1, "");
        job.group = group.into();
        (1..=4)
            .map(|t| {
                let id = c
                    .submit_as(owner, vec![job.clone()], false, t, &mut Effects::default())
                    .unwrap()
                    .remove(0)
                    .id();
                (c.get_job(&id).unwrap().node, wake(&c, &id))
            })
            .collect()
    }

    /// A user's independent jobs (no waker job, no group) are new work, a
    /// fork from outside the cluster, not a wakeup of a job they work
    /// with: by default (`OwnerWake::Idlest`) each goes where the same job
    /// submitted anonymously goes (here one per node, 4 nodes for 4 jobs),
    /// never wake-affine beside the owner's last job. The owner's flips
    /// are still recorded. A group names a relation: the same jobs with a
    /// group stay wake-affine, beside each other.
    #[test]
    fn a_users_independent_jobs_are_placed_as_anonymous_ones() {
        assert_eq!(ClusterConfig::default().owner_wake, OwnerWake::Idlest);
        let anonymous = owners_jobs(OwnerWake::Idlest, "", "");
        let owned = owners_jobs(ClusterConfig::default().owner_wake, "ann", "");
        assert_eq!(owned, anonymous);
        let mut nodes: Vec<&str> = owned.iter().map(|(n, _)| n.as_str()).collect();
        nodes.sort_unstable();
        nodes.dedup();
        assert_eq!(nodes.len(), 4, "spread like new jobs: {owned:?}");
        assert!(
            owned
                .iter()
                .all(|(_, w)| *w != Some(sched::WakeChoice::Affine))
        );
        // The old behaviour, for contrast: beside the owner's last job.
        let affine = owners_jobs(OwnerWake::Affine, "ann", "");
        assert!(
            affine[1..]
                .iter()
                .all(|(n, w)| *n == affine[0].0 && *w == Some(sched::WakeChoice::Affine)),
            "{affine:?}"
        );
        // With a group: a declared relation, wake-affine whatever the mode.
        let grouped = owners_jobs(OwnerWake::Idlest, "ann", "etl");
        assert!(
            grouped[1..]
                .iter()
                .all(|(n, w)| *n == grouped[0].0 && *w == Some(sched::WakeChoice::Affine)),
            "{grouped:?}"
        );
    }

    /// `OwnerWake::Fork`: the kernel's fork balancing from the owner's
    /// last node. Racks of two 16-CPU nodes; the owner's first job and an
    /// 11-CPU filler in its rack (12 of 32 CPUs used), an 11-CPU filler
    /// in the other (11 of 32): the other rack is idler, but within
    /// `imbalance_pct` (100 x 12 <= 117 x 11), so the fork path keeps the
    /// owner's next job in the owner's rack, where `Idlest` (the default)
    /// takes the idler rack.
    #[test]
    fn the_fork_path_keeps_an_owners_job_in_its_rack_within_the_imbalance() {
        let second = |owner_wake: OwnerWake| {
            let mut c = Cluster::new(ClusterConfig {
                owner_wake,
                ..ClusterConfig::default()
            });
            let mut fx = Effects::default();
            for (n, r) in [("a1", "r1"), ("a2", "r1"), ("b1", "r2"), ("b2", "r2")] {
                register_node(&mut c, n, "1s:16c:1t", ("z1", r), 0, &mut fx);
            }
            c.settle(0, &mut fx);
            let ann = |c: &mut Cluster, t| {
                let id = c
                    .submit_as("ann", vec![spec(1, "")], false, t, &mut Effects::default())
                    .unwrap()
                    .remove(0)
                    .id();
                c.get_job(&id).unwrap().node
            };
            let first = ann(&mut c, 1);
            for label in ["r1", "r2"] {
                let mut filler = spec(11, "");
                filler
                    .node_selector
                    .insert("dispatch.io/rack".into(), label.into());
                submit(&mut c, vec![filler], 2);
            }
            (rack(&first), rack(&ann(&mut c, 3)))
        };
        let (home, fork) = second(OwnerWake::Fork);
        assert_eq!(fork, home, "kept in the owner's rack");
        let (home, idlest) = second(OwnerWake::Idlest);
        assert_ne!(idlest, home, "the idler rack");
    }

    #[test]
    fn records_survive_a_rebuild_and_a_retry() {
        let mut c = cluster();
        let parent = submit(&mut c, vec![spec(1, "")], 1).remove(0);
        end(&mut c, &parent, 2);
        // Every node full: the children queue.
        submit(&mut c, vec![spec(4, ""); 4], 3);
        let mut retried = spec(1, &parent);
        retried.retries = 2;
        let mut children = submit(&mut c, vec![spec(1, &parent), spec(1, &parent)], 3);
        children.extend(submit(&mut c, vec![retried], 4));
        for id in &children {
            assert!(matches!(
                c.phase(id),
                Some(Phase::Queued { waiting: true, .. })
            ));
        }
        let key = WakerKey::Job(JobKey::parse(&parent).unwrap());
        let at = |ms: u64| ms * 1_000_000;
        assert_eq!(c.wakers.flips(&key, at(4)), 3);
        // A node registers: the engine is rebuilt, every task re-created
        // and every queued child placed again (no wakeup: no flip).
        let mut fx = Effects::default();
        register_node(&mut c, "a3", "1s:4c:1t", ("z1", "r1"), 5, &mut fx);
        c.settle(5, &mut fx);
        assert_eq!(c.wakers.flips(&key, at(5)), 3, "kept across the rebuild");
        assert_eq!(c.get_job(&children[2]).unwrap().node, "a3");
        // The last child's node misses its heartbeats: the child is
        // retried, the same wakee again, no flip.
        let lost = c.get_job(&children[2]).unwrap().node;
        for t in [1000, 2000, 3000, 4000] {
            for n in ["a1", "a2", "a3", "b1", "b2"]
                .into_iter()
                .filter(|n| *n != lost)
            {
                c.load_report(n, NodeLoad::default(), t, &mut Effects::default());
            }
            c.tick(t, &mut Effects::default());
        }
        let job = c.get_job(&children[2]).unwrap();
        assert_eq!(job.attempt, 2, "{job:?}");
        assert_eq!(
            c.wakers.flips(&key, at(4000)),
            3,
            "a retry of the last wakee"
        );
        assert_eq!(c.wakers.get(&key).unwrap().node, job.node);
    }
}
