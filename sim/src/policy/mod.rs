//! Placement policies behind one interface, [`Placer`]: the baselines
//! implemented here as the comparison (they are *not* our algorithms) and
//! "ours", the dispatcher's own [`dispatcher::cluster::Cluster`] with its
//! mechanisms switched on or off.
//!
//! Names (`--policies`), parsed by [`PolicySpec::parse`]:
//!
//! | name | policy |
//! |---|---|
//! | `random` | a uniformly random node; FIFO queue on that node |
//! | `least-loaded` | Kubernetes LeastAllocated-like: the node with the most free CPUs that fits now, else a central pending queue (latency class first, then arrival), retried when CPUs free up |
//! | `pod[:D]` | power of D choices (default 2): probe D random nodes, join the least loaded ((running + queued CPUs) / capacity); FIFO node queues |
//! | `first-fit` (`slurm`) | Slurm-like: priority FIFO, first-fit nodes with topology/tree's fewest-racks best fit, EASY backfill from time limits ([`firstfit`]) |
//! | `sparrow[:D]` | Sparrow batch sampling: a batch of m jobs probes D x m nodes and places its jobs on the least loaded probes |
//! | `ours` | the dispatcher with its defaults (`ClusterConfig::default()`: steal, cross-rack steal, wake_wide, latency classes, busy-skip, backfill, latency pull, the domain's reservation and queue, shortest limit first with limit aging; spread) |
//! | `ours-steal`, `ours-crossrack`, `ours-wakewide`, `ours-latency`, `ours-busyskip` | one mechanism off |
//! | `ours+domres` / `ours-domres` | with backfill, one reservation per steal domain, held by its oldest waiting head (`SchedConfig::domain_reservation`) |
//! | `ours+domfifo` / `ours-domfifo` | with backfill, one queue per steal domain: a node with room starts the domain's longest-waiting job that fits (`SchedConfig::domain_fifo`) |
//! | `ours+sjbf` / `ours-sjbf` | with the domain's queue, shortest remaining time limit first after the domain's protected head (`SchedConfig::shortest_limit_first`) |
//! | `ours+deadline` / `ours-deadline` | with shortest limit first, the domain's queue by `queued_at` + remaining limit, earliest first (`SchedConfig::deadline_order`) |
//! | `ours+aging` / `ours-aging` | with shortest limit first, a job that has waited longer than its remaining limit goes first, shortest limit first among those (`SchedConfig::limit_aging`; on in the dispatcher's default) |
//! | `ours+widefirst` / `ours-widefirst` / `ours+widefirst:overdue` | the domain's queue serves the widest job that fits first, then in its own order: every job / none / overdue jobs only (`SchedConfig::widest_first`; every job in the dispatcher's default) |
//! | `ours+latpull` / `ours-latpull` | latency-class jobs waiting in a node's steal domain start first where room opens (`SchedConfig::latency_pull`) |
//! | `ours+predict` / `ours+predictall` / `ours-predict` | run-time predictions from each user's last two run times (EASY++) for jobs without a time limit / for every job, capped by its limit / none (`ClusterConfig::predict`); SWF jobs are submitted as their trace's user |
//! | `ours+ownaffine` / `ours+ownfork` / `ours+ownidlest` | a job whose only waker is its owner (SWF jobs with a user) is placed wake-affine toward its owner's last node / by the fork path from that node's zone / on the idlest node, as an anonymous job (`ClusterConfig::owner_wake`) |
//! | `ours+rack` / `ours+rackpref` | gangs that fit in a rack ask for one, required / preferred (relaxed after 300 s) |
//! | `ours+pack`, `ours+nodelimit[:N]` | packing (jobs ask PLACEMENT_POLICY_PACK); seed 000's node-limit gating (global scope, limit N = 2: no stealing when zones > N) |
//!
//! Modifiers combine: `ours-steal-wakewide+pack`.
//!
//! Gangs ([`SubmitReq::nodes`] > 1): `ours` submits them as gangs to the
//! dispatcher (`JobSpec.nodes`, within any); `least-loaded` starts a gang
//! on the least-loaded nodes with room, all members at once, oldest gang
//! first (FIFO among gangs, no reservation); `first-fit` queues gangs
//! with the single jobs in one priority order and reserves nodes for the
//! queue's head (EASY backfill); the sampling baselines have
//! no gang placement and refuse them ([`SimError::Workload`]).

mod baseline;
pub mod firstfit;
mod leastloaded;
mod ours;

pub use baseline::NodeQueues;
pub use ours::OursPlacer;

use serde::Serialize;

#[cfg(doc)]
use crate::error::SimError;
use crate::error::{Result, bad_spec};
use crate::layout::Layout;
use dispatcher::cluster::runtimes::Predict;
use dispatcher::cluster::wakers::OwnerWake;

/// Which mechanisms "ours" runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OursFlags {
    /// Idle stealing (seed 000).
    pub steal: bool,
    /// Stealing from the other racks of the zone.
    pub cross_rack: bool,
    /// wake_wide (seed 001).
    pub wake_wide: bool,
    /// Latency classes (seed 004).
    pub latency: bool,
    /// Busy-skip (seed 003).
    pub busy_skip: bool,
    /// Jobs ask for the pack policy (seed 002).
    pub pack: bool,
    /// Node-limit gating, global scope, with this limit.
    pub node_limit: Option<usize>,
    /// EASY backfill within a node (`SchedConfig::backfill`).
    pub backfill: bool,
    /// The idle-balance pass on the tick and every finish
    /// (`SchedConfig::idle_balance`).
    pub idle_balance: bool,
    /// Pulls take the longest-waiting task of a level
    /// (`SchedConfig::pull_longest_wait`).
    pub pull_oldest: bool,
    /// Latency-sensitive jobs waiting in a node's steal domain start
    /// first where room opens (`SchedConfig::latency_pull`).
    pub latency_pull: bool,
    /// Gangs that fit in a rack ask for one (`JobSpec.within = RACK`):
    /// `Some(false)` required (`+rack`), `Some(true)` preferred with the
    /// default relax time, 300 s (`+rackpref`); `None`: within any.
    pub gang_rack: Option<bool>,
    /// With backfill, one reservation per steal domain
    /// (`SchedConfig::domain_reservation`).
    pub domain_reservation: bool,
    /// With backfill, one queue per steal domain served oldest first
    /// (`SchedConfig::domain_fifo`).
    pub domain_fifo: bool,
    /// The domain's queue serves the shortest remaining time limit first
    /// after its protected head (`SchedConfig::shortest_limit_first`).
    pub shortest_limit_first: bool,
    /// With `shortest_limit_first`, the queue by `queued_at` + remaining
    /// limit (`SchedConfig::deadline_order`).
    pub deadline_order: bool,
    /// With `shortest_limit_first`, a job that has waited longer than its
    /// remaining limit goes first (`SchedConfig::limit_aging`).
    pub limit_aging: bool,
    /// Which jobs of the domain's queue start widest first
    /// (`SchedConfig::widest_first`).
    pub widest_first: sched::WidestFirst,
    /// Which jobs get a run-time prediction from their user's history
    /// (`ClusterConfig::predict`, EASY++).
    pub predict: dispatcher::cluster::runtimes::Predict,
    /// How a job whose only waker is its owner is placed
    /// (`ClusterConfig::owner_wake`).
    pub owner_wake: dispatcher::cluster::wakers::OwnerWake,
}

impl Default for OursFlags {
    /// The dispatcher's defaults (`ClusterConfig::default()`), so that
    /// `ours` is what a dispatcher runs unless told otherwise.
    fn default() -> Self {
        let cfg = dispatcher::cluster::ClusterConfig::default();
        let e = cfg.engine;
        Self {
            steal: e.steal,
            cross_rack: e.steal_cross_llc,
            wake_wide: e.wake_wide,
            latency: e.latency,
            busy_skip: e.busy_skip,
            pack: e.default_policy == sched::Policy::Pack,
            node_limit: None,
            backfill: e.backfill,
            idle_balance: e.idle_balance,
            pull_oldest: e.pull_longest_wait,
            latency_pull: e.latency_pull,
            gang_rack: None,
            domain_reservation: e.domain_reservation,
            domain_fifo: e.domain_fifo,
            shortest_limit_first: e.shortest_limit_first,
            deadline_order: e.deadline_order,
            limit_aging: e.limit_aging,
            widest_first: e.widest_first,
            predict: cfg.predict,
            owner_wake: cfg.owner_wake,
        }
    }
}

/// A policy and its parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PolicyKind {
    /// Uniformly random node.
    Random,
    /// Most free CPUs, central queue.
    LeastLoaded,
    /// Slurm-like first fit with EASY backfill.
    FirstFit,
    /// Power of d choices.
    Pod {
        /// Probes per job.
        d: u32,
    },
    /// Sparrow batch sampling.
    Sparrow {
        /// Probes per job of a batch.
        d: u32,
    },
    /// The dispatcher.
    Ours(OursFlags),
}

/// A named policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicySpec {
    /// Canonical name.
    pub name: String,
    /// What it is.
    pub kind: PolicyKind,
}

/// The baselines and "ours" (`--policies default`).
pub const DEFAULT_POLICIES: &str = "random,least-loaded,pod:2,sparrow:2,ours";
/// "ours" with each mechanism toggled (`--policies ablation`).
pub const ABLATION_POLICIES: &str = "ours,ours-steal,ours-crossrack,ours-wakewide,ours-latency,ours-busyskip,ours+pack,ours+nodelimit,ours-backfill,ours+idlebal,ours+oldest";

impl PolicySpec {
    /// Parse one name (see the module's table).
    pub fn parse(name: &str) -> Result<Self> {
        const W: &str = "policy";
        let name = name.trim();
        let d_of = |rest: Option<&str>| -> Result<u32> {
            match rest {
                None => Ok(2),
                Some(d) => d
                    .parse()
                    .ok()
                    .filter(|&d| (1..=1000).contains(&d))
                    .ok_or_else(|| bad_spec(W, name, "D is an integer 1..=1000")),
            }
        };
        let (head, rest) = match name.split_once(':') {
            Some((h, r)) if !h.starts_with("ours") => (h, Some(r)),
            _ => (name, None),
        };
        let kind = match head {
            "random" => PolicyKind::Random,
            "least-loaded" | "leastloaded" | "k8s" => PolicyKind::LeastLoaded,
            "first-fit" | "firstfit" | "slurm" => PolicyKind::FirstFit,
            "pod" | "p2c" => PolicyKind::Pod { d: d_of(rest)? },
            "sparrow" => PolicyKind::Sparrow { d: d_of(rest)? },
            _ if head.starts_with("ours") => PolicyKind::Ours(parse_ours(name)?),
            _ => {
                return Err(bad_spec(
                    W,
                    name,
                    "want random, least-loaded, first-fit, pod[:D], sparrow[:D] or ours[-MECH|+pack|+nodelimit[:N]]...",
                ));
            }
        };
        let name = match &kind {
            PolicyKind::Random => "random".to_string(),
            PolicyKind::LeastLoaded => "least-loaded".to_string(),
            PolicyKind::FirstFit => "first-fit".to_string(),
            PolicyKind::Pod { d } => format!("pod:{d}"),
            PolicyKind::Sparrow { d } => format!("sparrow:{d}"),
            PolicyKind::Ours(_) => name.to_string(),
        };
        Ok(Self { name, kind })
    }

    /// Parse a comma-separated list; `default`, `ablation` and `all` expand
    /// to the preset lists.
    pub fn parse_list(list: &str) -> Result<Vec<Self>> {
        let mut out: Vec<Self> = Vec::new();
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let expanded: Vec<&str> = match item {
                "default" | "baselines" => DEFAULT_POLICIES.split(',').collect(),
                "ablation" => ABLATION_POLICIES.split(',').collect(),
                "all" => DEFAULT_POLICIES
                    .split(',')
                    .chain(ABLATION_POLICIES.split(','))
                    .collect(),
                one => vec![one],
            };
            for name in expanded {
                let p = Self::parse(name)?;
                if !out.iter().any(|q| q.name == p.name) {
                    out.push(p);
                }
            }
        }
        if out.is_empty() {
            return Err(bad_spec("policy list", list, "empty"));
        }
        Ok(out)
    }

    /// True for the dispatcher's policies.
    pub fn is_ours(&self) -> bool {
        matches!(self.kind, PolicyKind::Ours(_))
    }
}

fn parse_ours(name: &str) -> Result<OursFlags> {
    const W: &str = "policy";
    let mut flags = OursFlags::default();
    let mut rest = name
        .strip_prefix("ours")
        .ok_or_else(|| bad_spec(W, name, "not an ours policy"))?;
    while !rest.is_empty() {
        let on = match rest.as_bytes()[0] {
            b'+' => true,
            b'-' => false,
            _ => return Err(bad_spec(W, name, "modifiers start with + or -")),
        };
        let body = &rest[1..];
        let end = body.find(['+', '-']).unwrap_or(body.len());
        let word = &body[..end];
        rest = &body[end..];
        match (word, on) {
            ("steal", _) => flags.steal = on,
            ("crossrack", _) => flags.cross_rack = on,
            ("wakewide", _) => flags.wake_wide = on,
            ("latency", _) => flags.latency = on,
            ("busyskip", _) => flags.busy_skip = on,
            ("pack", _) => flags.pack = on,
            ("backfill", _) => flags.backfill = on,
            ("idlebal", _) => flags.idle_balance = on,
            ("oldest", _) => flags.pull_oldest = on,
            ("latpull", _) => flags.latency_pull = on,
            ("rack", _) => flags.gang_rack = on.then_some(false),
            ("rackpref", _) => flags.gang_rack = on.then_some(true),
            ("domres", _) => flags.domain_reservation = on,
            ("domfifo", _) => flags.domain_fifo = on,
            ("sjbf", _) => flags.shortest_limit_first = on,
            ("deadline", _) => flags.deadline_order = on,
            ("aging", _) => flags.limit_aging = on,
            ("widefirst", true) => flags.widest_first = sched::WidestFirst::Always,
            ("widefirst", false) => flags.widest_first = sched::WidestFirst::Never,
            ("widefirst:overdue", true) => flags.widest_first = sched::WidestFirst::Overdue,
            ("predict", true) => flags.predict = Predict::Unlimited,
            ("predictall", true) => flags.predict = Predict::All,
            ("predict" | "predictall", false) => flags.predict = Predict::Off,
            ("ownaffine", true) => flags.owner_wake = OwnerWake::Affine,
            ("ownfork", true) => flags.owner_wake = OwnerWake::Fork,
            ("ownidlest", true) => flags.owner_wake = OwnerWake::Idlest,
            ("nodelimit", true) => flags.node_limit = Some(2),
            ("nodelimit", false) => flags.node_limit = None,
            (w, true) if w.starts_with("nodelimit:") => {
                let n = w["nodelimit:".len()..]
                    .parse()
                    .map_err(|_| bad_spec(W, name, "nodelimit:N wants an integer"))?;
                flags.node_limit = Some(n);
            }
            _ => {
                return Err(bad_spec(
                    W,
                    name,
                    format!(
                        "unknown modifier {word:?} (steal, crossrack, wakewide, latency, busyskip, pack, nodelimit[:N], backfill, idlebal, oldest, latpull, domres, domfifo, sjbf, deadline, aging, widefirst[:overdue], predict, predictall, ownaffine, ownfork, ownidlest, rack, rackpref)"
                    ),
                ));
            }
        }
    }
    Ok(flags)
}

/// A job handed to a policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SubmitReq {
    /// Index in the workload.
    pub job: u32,
    /// CPUs (per member for a gang).
    pub cpus: u32,
    /// Members: 1 for a plain job, N > 1 for a gang that starts on N
    /// distinct nodes at once (one [`Started`] per member in the same
    /// call's output) and ends on all of them together.
    pub nodes: u32,
    /// Latency class.
    pub latency: bool,
    /// The job whose end released it.
    pub waker: Option<u32>,
    /// Its time limit (µs; the dispatcher's `timeout_ms`), if it has one.
    pub limit_us: Option<u64>,
    /// Whole GPUs on its node (`JobSpec.gpus`); only `least-loaded` and
    /// `ours` place GPU jobs (the simulation refuses the others).
    pub gpus: u32,
    /// Its user ([`crate::workload::Workload::users`]): `ours` submits it
    /// as that owner; the baselines ignore it.
    pub user: Option<u32>,
}

/// How far a job moved after it was first queued (a steal).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Move {
    /// Not moved.
    #[default]
    None,
    /// Within its rack.
    SameRack,
    /// To another rack of the zone.
    CrossRack,
    /// To another zone.
    CrossZone,
}

/// A policy's decision: run this job (a gang: this member) on this node
/// now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Started {
    /// Job index.
    pub job: u32,
    /// Node index.
    pub node: u32,
    /// A steal brought it here.
    pub moved: Move,
}

/// Counters a policy keeps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Counters {
    /// Jobs moved from the node they were queued on (steals).
    pub steals: u64,
    /// Of those, to another rack.
    pub cross_rack: u64,
    /// Of those, to another zone.
    pub cross_zone: u64,
    /// Nodes (or aggregates) examined by searches: the engine's
    /// `sis_scanned + steal_scanned`, or the baselines' probes.
    pub visits: u64,
    /// Engine: wakeups placed near the waker.
    pub wake_affine: u64,
    /// Engine: wakeups spread by wake_wide.
    pub wake_wide: u64,
    /// Engine: searches skipped by busy-skip.
    pub busy_skip: u64,
    /// Engine: placements by the pack policy.
    pub pack_placed: u64,
    /// Engine: latency-class picks ahead of the fair order.
    pub latency_picks: u64,
}

/// A placement policy driven by the simulation. Times are µs of simulated
/// time.
pub trait Placer {
    /// Jobs arrive (one batch). Jobs that start now are appended to `out`.
    fn submit(&mut self, now: u64, jobs: &[SubmitReq], out: &mut Vec<Started>) -> Result<()>;
    /// A job ended on `node`: its CPUs are free. A gang's end is one call
    /// per member, each with its node.
    fn finished(&mut self, now: u64, job: u32, node: u32, out: &mut Vec<Started>) -> Result<()>;
    /// CPU-level mode: the node's agent started the job on these CPUs.
    fn running(
        &mut self,
        _now: u64,
        _job: u32,
        _node: u32,
        _cpus: &[u32],
        _out: &mut Vec<Started>,
    ) {
    }
    /// Periodic work ([`Placer::tick_period`]).
    fn tick(&mut self, _now: u64, _out: &mut Vec<Started>) -> Result<()> {
        Ok(())
    }
    /// Tick period in µs, if the policy wants ticks.
    fn tick_period(&self) -> Option<u64> {
        None
    }
    /// Counters so far.
    fn counters(&self) -> Counters;
}

/// Build the placer for `spec` over `layout`. `tick_us` is the dispatcher's
/// tick period; `seed` seeds the baselines' probes.
pub fn build(
    spec: &PolicySpec,
    layout: &Layout,
    tick_us: u64,
    seed: u64,
) -> Result<Box<dyn Placer>> {
    Ok(match spec.kind {
        PolicyKind::Random => Box::new(baseline::Sampling::new(layout, 1, false, seed)),
        PolicyKind::Pod { d } => Box::new(baseline::Sampling::new(layout, d, false, seed)),
        PolicyKind::Sparrow { d } => Box::new(baseline::Sampling::new(layout, d, true, seed)),
        PolicyKind::LeastLoaded => Box::new(leastloaded::LeastLoaded::new(layout)),
        PolicyKind::FirstFit => Box::new(firstfit::FirstFit::new(layout)),
        PolicyKind::Ours(flags) => Box::new(OursPlacer::new(layout, flags, tick_us)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_canonicalise() {
        assert_eq!(PolicySpec::parse("p2c").unwrap().name, "pod:2");
        assert_eq!(
            PolicySpec::parse("sparrow:3").unwrap().kind,
            PolicyKind::Sparrow { d: 3 }
        );
        let PolicyKind::Ours(f) = PolicySpec::parse("ours-steal+pack+nodelimit:1")
            .unwrap()
            .kind
        else {
            panic!("not ours")
        };
        assert!(!f.steal && f.pack && f.node_limit == Some(1) && f.wake_wide);
        for bad in ["ours-warp", "pod:0", "fifo", "ours*pack", "sparrow:x"] {
            assert!(PolicySpec::parse(bad).is_err(), "{bad}");
        }
        let all = PolicySpec::parse_list("all,ours").unwrap();
        assert_eq!(all.len(), 15, "presets expand without duplicates");
    }
}
