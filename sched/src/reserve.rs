//! One reservation per steal domain ([`crate::SchedConfig::domain_reservation`]):
//! the cluster form of EASY backfill's single reservation.
//!
//! Per-leaf EASY ([`crate::SchedConfig::backfill`]) gives every leaf's
//! blocked head a [`crate::sched::Reservation`]: with N leaves, N heads
//! are protected where global EASY (Lifka's, Slurm's `bf_` loop) protects
//! one, the oldest job of the queue, and lets every other job start
//! wherever it fits without delaying that one. Here the queue is spread
//! over the leaves of a steal domain, so the oldest job is the head that
//! has waited longest (`queued_at`, then enqueue order) among the leaves
//! that can steal from one another: the LLC, or, when cross-LLC stealing
//! is on and node-limit gating allows it, its parent domain widened to
//! the zones within the node limit (`DomainHeads::new`; the leaf alone
//! when stealing is off, which is per-leaf EASY again). Only that
//! leaf keeps its reservation; the others start any waiting task that
//! fits now, past their own blocked heads, and take newcomers into all
//! of their free capacity. No starvation: a head passed over waits until
//! it is the oldest of its domain, and from then on no task starts that
//! could delay it.
//!
//! State: per leaf the key of its head (`head_key`), per domain the keys
//! of its leaves' heads in a `BTreeSet` whose first entry is the
//! protected leaf. A change of a leaf's head costs O(log leaves of the
//! domain); when the protected leaf changes, the leaf that lost its
//! reservation has its room recomputed and is scheduled after the current
//! operation (`deferred`), so that the work it may now start is not
//! stranded, and the leaf that gained one has its room recomputed at once.
//!
//! With [`crate::SchedConfig::limit_aging`] the domain's queue has two
//! tiers: a task that has waited as long as its remaining limit (its
//! deadline, `queued_at` + remaining limit, is past) is overdue and moves
//! to the first tier; each tier is served shortest remaining limit first.
//! The move is made when the queue is served (`fifo_pull`), from a set of
//! the waiting tasks by deadline: O(log n) per task that becomes overdue.
//! With [`crate::SchedConfig::widest_first`] the overdue tier, or every
//! tier, serves the widest task that fits first, then in its own order:
//! room wide enough for a wide task goes to it rather than to narrow
//! ones, which any CPU that frees can start.

use std::collections::{BTreeMap, BTreeSet};

use crate::config::{SchedConfig, WidestFirst};
use crate::sched::Sched;
use crate::task::{Task, TaskId};
use crate::topology::{LeafId, Topology};

/// A waiting task's place in its domain's queue: (not latency class,
/// order, queued_at, enqueue sequence, task): the latency class first, as
/// in the latency timeline (seed 004), then, with
/// [`crate::SchedConfig::shortest_limit_first`], the shortest remaining
/// limit (`u64::MAX` for a task without a limit; 0 for every task with
/// the switch off), or with [`crate::SchedConfig::deadline_order`] the
/// earliest `queued_at` + remaining limit (saturating), then the longest
/// wait.
pub(crate) type WaitKey = (bool, u64, u64, u64, TaskId);

/// A waiting task's place in the order `fifo_pull` serves: (not latency
/// class, not overdue, width order, its [`WaitKey`]). The width order is
/// `u32::MAX - demand` (the widest first) for a task of a tier that
/// [`crate::SchedConfig::widest_first`] covers, 0 otherwise. Without
/// [`crate::SchedConfig::limit_aging`] no task is overdue; without either
/// switch ranks sort as their wait keys.
pub(crate) type Rank = (bool, bool, u32, WaitKey);

/// The block skip's data in `oldest_fitting`: the reservation, its start,
/// and its task with that task's key.
type BlockSkip<'a> = (
    &'a crate::sched::Reservation,
    u64,
    Option<(WaitKey, &'a Task)>,
);

/// A head's place in its domain: (queued_at, enqueue sequence, leaf).
pub(crate) type HeadKey = (u64, u64, LeafId);

/// [`DomainHeads::head_key`] of a leaf without a head: no enqueue is
/// numbered `u64::MAX` (the sequence counts up from 0 by one).
const NO_HEAD: (u64, u64) = (u64::MAX, u64::MAX);

/// The domain state of [`crate::SchedConfig::domain_reservation`].
#[derive(Debug, Default)]
pub(crate) struct DomainHeads {
    /// One reservation per domain: backfill and domain_reservation set.
    pub(crate) on: bool,
    /// One queue per domain: backfill and domain_fifo set.
    pub(crate) fifo: bool,
    /// Latency-nice on: the latency class goes first in the queue.
    latency: bool,
    /// Shortest remaining time limit first (`fifo` and
    /// [`crate::SchedConfig::shortest_limit_first`] set).
    shortest: bool,
    /// With `shortest`, the order is `queued_at` + remaining limit
    /// ([`crate::SchedConfig::deadline_order`]).
    deadline: bool,
    /// With `shortest` (not `deadline`): aging bounded by each task's own
    /// limit ([`crate::SchedConfig::limit_aging`]).
    aging: bool,
    /// The overdue tier serves the widest task first
    /// ([`crate::SchedConfig::widest_first`] `Overdue` or `Always`, with
    /// `aging`).
    widest_overdue: bool,
    /// The fresh tier too ([`crate::SchedConfig::widest_first`] `Always`).
    widest_fresh: bool,
    /// Per domain, its waiting tasks by demand, each bucket in queue order
    /// ([`WaitKey`]; kept only with `fifo`); with `aging`, those not
    /// overdue.
    waiting: Vec<BTreeMap<u32, BTreeSet<WaitKey>>>,
    /// With `aging`, per domain, its overdue waiting tasks by demand, each
    /// bucket in queue order: served before `waiting`.
    overdue: Vec<BTreeMap<u32, BTreeSet<WaitKey>>>,
    /// With `aging`, per domain, the tasks of `waiting` that have a limit,
    /// by deadline (`queued_at` + remaining limit), with their demand: the
    /// first ones move to `overdue` when their deadline passes
    /// ([`DomainHeads::promote`]).
    deadlines: Vec<BTreeSet<(u64, u32, WaitKey)>>,
    /// Per domain, how many of its waiting tasks carry a run-time
    /// prediction (kept only with `fifo`): while any does, a reservation
    /// that counts on predictions judges every task on its own (the
    /// block skip of [`Sched::oldest_fitting`] reads limits only).
    predicted_waiting: Vec<usize>,
    /// Domain (dense index) of each leaf, in `u32` (one entry per node of
    /// a cluster): read it through [`DomainHeads::dom`].
    dom_of: Vec<u32>,
    /// Per domain, the heads of its leaves that have one.
    heads: Vec<BTreeSet<HeadKey>>,
    /// Per leaf, its head's key in its domain's set, without the leaf
    /// (the [`HeadKey`] is `(queued_at, enqueue_seq, leaf)`), [`NO_HEAD`]
    /// when it has none: 16 bytes per leaf where an `Option` takes 24 (a
    /// cluster has one per node); kept only with `on`.
    head_key: Vec<(u64, u64)>,
    /// Leaves that lost their domain's reservation during an operation
    /// and must run `schedule` before it returns.
    pub(crate) deferred: Vec<LeafId>,
}

impl DomainHeads {
    /// The domains of `topo` under `config` (empty state; keys are filled
    /// by the engine's `rq_changed`).
    ///
    /// A leaf's domain is the widest group of leaves that steal from one
    /// another under node-limit gating (seed 000, patch 9:
    /// `sched_steal_node_limit`): the leaf alone when stealing is off or
    /// gated; the LLC when cross-LLC stealing is off or gated for it;
    /// otherwise the LLC's parent (cluster: the zone) and, from there, each
    /// further ancestor while it spans no more than `steal_node_limit` NUMA
    /// nodes (cluster: zones). That is the seed's order of reach, same
    /// rack, the other racks of the zone, then the zones within the node
    /// limit, as one queue and one reservation: with the domain stopped at
    /// the zone, two zones under the limit were two queues and no mechanism
    /// moved waiting work between them, so one zone idled while the other
    /// queued (NASA-iPSC at time-scale 1.6 on two zones of 16 nodes: 10%
    /// worse mean response than a central least-loaded queue, 0 cross-zone
    /// moves; docs/BENCHMARKS.md, quality's notes of session 15). Beyond the limit the domains
    /// stay apart, as the seed's stealing does.
    pub(crate) fn new(
        topo: &Topology,
        config: &SchedConfig,
        steal_llc_allowed: bool,
        steal_cross_allowed: &[bool],
    ) -> Self {
        let on = config.backfill && config.domain_reservation;
        let fifo = config.backfill && config.domain_fifo;
        let n = topo.nr_leaves();
        if !on && !fifo {
            return Self::default();
        }
        let mut dense = vec![usize::MAX; topo.nodes().len()];
        let mut next = 0;
        let mut dom_of = Vec::with_capacity(n);
        // NUMA span of each ancestor looked at, computed once per ancestor
        // (a span walks the ancestor's leaves).
        let mut span: BTreeMap<usize, usize> = BTreeMap::new();
        let aging =
            fifo && config.shortest_limit_first && config.limit_aging && !config.deadline_order;
        for leaf in 0..n {
            let llc = topo.llc_of(leaf);
            let node = if !(config.steal && steal_llc_allowed) {
                leaf
            } else {
                let llc_node = topo.llcs()[llc].node;
                match topo.node(llc_node).parent() {
                    Some(p) if config.steal_cross_llc && steal_cross_allowed[llc] => {
                        let mut d = p;
                        while let Some(g) = topo.node(d).parent()
                            && *span.entry(g).or_insert_with(|| topo.numa_span(g))
                                <= config.steal_node_limit
                        {
                            d = g;
                        }
                        d
                    }
                    _ => llc_node,
                }
            };
            if dense[node] == usize::MAX {
                dense[node] = next;
                next += 1;
            }
            dom_of.push(dense[node] as u32);
        }
        Self {
            on,
            fifo,
            latency: config.latency,
            shortest: fifo && config.shortest_limit_first,
            deadline: fifo && config.shortest_limit_first && config.deadline_order,
            aging,
            widest_overdue: aging && config.widest_first != WidestFirst::Never,
            widest_fresh: fifo && config.widest_first == WidestFirst::Always,
            waiting: if fifo {
                vec![BTreeMap::new(); next]
            } else {
                Vec::new()
            },
            overdue: if aging {
                vec![BTreeMap::new(); next]
            } else {
                Vec::new()
            },
            deadlines: if aging {
                vec![BTreeSet::new(); next]
            } else {
                Vec::new()
            },
            predicted_waiting: if fifo { vec![0; next] } else { Vec::new() },
            dom_of,
            heads: vec![BTreeSet::new(); next],
            head_key: if on { vec![NO_HEAD; n] } else { Vec::new() },
            deferred: Vec::new(),
        }
    }

    /// The domain (dense index) of `leaf`.
    #[inline]
    pub(crate) fn dom(&self, leaf: LeafId) -> usize {
        self.dom_of[leaf] as usize
    }

    /// The protected leaf of `leaf`'s domain, if any head waits there.
    pub(crate) fn protected_of(&self, leaf: LeafId) -> Option<LeafId> {
        self.heads[self.dom(leaf)].first().map(|k| k.2)
    }

    /// True when a head that begins to wait on `leaf` (now empty) at
    /// `now`, with the newest enqueue sequence, would not take its
    /// domain's reservation from another leaf: no head waits in the
    /// domain, or the first has waited since `now` or earlier. Always
    /// true without one reservation per domain.
    pub(crate) fn head_sorts_last(&self, leaf: LeafId, now: u64) -> bool {
        !self.on
            || self.heads[self.dom(leaf)]
                .first()
                .is_none_or(|k| k.0 <= now)
    }

    /// `t`'s key in its domain's queue. Stable while it waits: its
    /// executed time changes only while it runs.
    fn wait_key(&self, t: &Task) -> WaitKey {
        self.wait_key_at(t, t.queued_at, t.enqueue_seq)
    }

    /// `t`'s key were it queued at `queued_at` with enqueue sequence `seq`.
    fn wait_key_at(&self, t: &Task, queued_at: u64, seq: u64) -> WaitKey {
        let remaining = if self.shortest {
            t.time_limit
                .map_or(u64::MAX, |l| l.saturating_sub(t.sum_exec_runtime))
        } else {
            0
        };
        let order = if self.deadline {
            queued_at.saturating_add(remaining)
        } else {
            remaining
        };
        (!t.latency_class(self.latency), order, queued_at, seq, t.id)
    }

    /// The deadline of the task of `key` under `aging`: `queued_at` +
    /// remaining limit (`u64::MAX`, never, without a limit).
    fn deadline_of(key: &WaitKey) -> u64 {
        if key.1 == u64::MAX {
            u64::MAX
        } else {
            key.2.saturating_add(key.1)
        }
    }

    /// With `aging`: move the tasks of domain `dom` whose deadline is at
    /// or before `now` to the overdue tier.
    fn promote(&mut self, dom: usize, now: u64) {
        while let Some(&(d, demand, key)) = self.deadlines[dom].first()
            && d <= now
        {
            self.deadlines[dom].pop_first();
            if let Some(set) = self.waiting[dom].get_mut(&demand) {
                set.remove(&key);
                if set.is_empty() {
                    self.waiting[dom].remove(&demand);
                }
            }
            self.overdue[dom].entry(demand).or_default().insert(key);
        }
    }

    /// With `aging`: true when a task of domain `dom` is due to move to
    /// the overdue tier at `now` and has not moved yet.
    fn promotion_due(&self, dom: usize, now: u64) -> bool {
        self.aging && self.deadlines[dom].first().is_some_and(|e| e.0 <= now)
    }

    /// The rank of `t`, waiting in domain `dom` ([`Rank`]).
    fn rank_of(&self, dom: usize, t: &Task) -> Rank {
        let key = self.wait_key(t);
        let overdue = self.aging
            && self.overdue[dom]
                .get(&t.demand)
                .is_some_and(|s| s.contains(&key));
        self.rank(key, !overdue, t.demand)
    }

    /// The [`Rank`] of the task of `key` and `demand`, in the fresh tier
    /// or the overdue one.
    #[inline]
    fn rank(&self, key: WaitKey, fresh: bool, demand: u32) -> Rank {
        let width = if (fresh && self.widest_fresh) || (!fresh && self.widest_overdue) {
            u32::MAX - demand
        } else {
            0
        };
        (key.0, fresh, width, key)
    }

    /// True when the task of `key`, and every task after it of its class
    /// in its demand bucket, would end after `shadow` if started at `now`
    /// on its limit. Shortest first, the key's order is the remaining
    /// limit, and later keys have one as long or longer. By deadline, a
    /// later key has a deadline `d' >= d` and was queued at or before
    /// `now`, so it ends at `now` + remaining `>= d'`: all end after
    /// `shadow` once `d` does (a task with `d <= shadow` is judged on its
    /// own).
    fn ends_after(&self, key: &WaitKey, now: u64, shadow: u64) -> bool {
        if self.deadline {
            key.1 > shadow
        } else {
            now.saturating_add(key.1) > shadow
        }
    }

    /// Task `t` starts waiting on `leaf` (its `queued_at` and
    /// `enqueue_seq` set).
    pub(crate) fn wait_insert(&mut self, leaf: LeafId, t: &Task) {
        if self.fifo {
            let key = self.wait_key(t);
            let dom = self.dom(leaf);
            if self.waiting[dom].entry(t.demand).or_default().insert(key) && t.predicted.is_some() {
                self.predicted_waiting[dom] += 1;
            }
            if self.aging && key.1 != u64::MAX {
                self.deadlines[dom].insert((Self::deadline_of(&key), t.demand, key));
            }
        }
    }

    /// Task `t` stops waiting on `leaf`.
    pub(crate) fn wait_remove(&mut self, leaf: LeafId, t: &Task) {
        if self.fifo {
            let key = self.wait_key(t);
            let dom = self.dom(leaf);
            let mut removed = false;
            let tiers = if self.aging { 2 } else { 1 };
            for tier in 0..tiers {
                let d = if tier == 0 {
                    &mut self.waiting[dom]
                } else {
                    &mut self.overdue[dom]
                };
                if let Some(set) = d.get_mut(&t.demand) {
                    removed |= set.remove(&key);
                    if set.is_empty() {
                        d.remove(&t.demand);
                    }
                }
                if removed {
                    break;
                }
            }
            if removed && t.predicted.is_some() {
                self.predicted_waiting[dom] -= 1;
            }
            if self.aging && key.1 != u64::MAX {
                self.deadlines[dom].remove(&(Self::deadline_of(&key), t.demand, key));
            }
        }
    }
}

impl Sched {
    /// True when `leaf`'s head is protected by its reservation: always
    /// under per-leaf EASY; with one reservation per domain, only for the
    /// domain's oldest head.
    pub(crate) fn protected(&self, leaf: LeafId) -> bool {
        !self.domains.on || self.domains.protected_of(leaf) == Some(leaf)
    }

    /// The leaf whose head holds the reservation of `leaf`'s steal domain
    /// ([`crate::SchedConfig::domain_reservation`]); `None` when nothing
    /// waits there, or with the switch (or backfill) off.
    pub fn domain_protected(&self, leaf: LeafId) -> Option<LeafId> {
        if !self.domains.on || leaf >= self.topo.nr_leaves() {
            return None;
        }
        self.domains.protected_of(leaf)
    }

    /// Bring `leaf`'s head key up to date. Returns the domain's protected
    /// leaf before and after when it changed.
    pub(crate) fn update_head_key(
        &mut self,
        leaf: LeafId,
    ) -> Option<(Option<LeafId>, Option<LeafId>)> {
        if !self.domains.on {
            return None;
        }
        let key = if self.rqs[leaf].nothing_waits() {
            None
        } else {
            self.next_to_run(leaf)
                .and_then(|h| self.tasks.get(&h))
                .map(|t| (t.queued_at, t.enqueue_seq, leaf))
        };
        let d = &mut self.domains;
        let stored = key.map_or(NO_HEAD, |(at, seq, _)| {
            debug_assert!(seq != NO_HEAD.1, "an enqueue numbered u64::MAX");
            (at, seq)
        });
        if stored == d.head_key[leaf] {
            return None;
        }
        let dom = d.dom(leaf);
        let set = &mut d.heads[dom];
        let before = set.first().map(|k| k.2);
        let (at, seq) = d.head_key[leaf];
        if (at, seq) != NO_HEAD {
            set.remove(&(at, seq, leaf));
        }
        if let Some(new) = key {
            set.insert(new);
        }
        d.head_key[leaf] = stored;
        let after = set.first().map(|k| k.2);
        (before != after).then_some((before, after))
    }

    /// `fifo_pull` ([`crate::SchedConfig::domain_fifo`]): while `dst` has
    /// spare capacity, start the first task of its domain's queue (the
    /// longest wait, or with `shortest_limit_first` the shortest remaining
    /// limit; with [`crate::SchedConfig::widest_first`], the widest first
    /// in the tiers it covers) among those that can start on `dst` now (its own, or one
    /// waiting on another leaf of the domain, which moves as a steal does;
    /// with backfill, without delaying `dst`'s protected head). Returns
    /// the number of tasks started.
    ///
    /// Cost: per task started, one look per distinct waiting demand that
    /// fits `dst`'s free capacity, plus the tasks passed over because
    /// they cannot start on `dst` (affinity, alignment, or `dst`'s
    /// reservation). Shortest limit first, the tasks a reservation refuses
    /// for their limit are passed over as a block (see
    /// [`Sched::oldest_fitting`]).
    pub(crate) fn fifo_pull(&mut self, dst: LeafId, now: u64) -> usize {
        if !self.domains.fifo {
            return 0;
        }
        if self.domains.aging {
            let dom = self.domains.dom(dst);
            self.domains.promote(dom, now);
        }
        let mut started = 0;
        while self.rqs[dst].has_spare() {
            let Some((p, src)) = self.oldest_fitting(dst, now) else {
                break;
            };
            started += 1;
            if src == dst {
                self.set_next(p, dst, now);
            } else {
                self.stats.fifo_pull += 1;
                self.pull_task(p, src, dst, now, false);
            }
        }
        started
    }

    /// The first task in the queue order of `dst`'s domain that can start
    /// on `dst` now, and the leaf it waits on. The order is the [`Rank`]
    /// (with [`crate::SchedConfig::limit_aging`], two tiers; with
    /// [`crate::SchedConfig::widest_first`], the width before the key):
    /// each tier is walked as one queue (the overdue tier first, as moved
    /// by the last `fifo_pull`), the best rank found in each fitting demand
    /// bucket compared. The domain's protected head
    /// takes its turn in that order like any task; its reservation is
    /// what bounds its wait (its own leaf holds room for it).
    ///
    /// Skipped without a look (same answer, fewer visits), when `dst`'s
    /// reservation judges the tasks, the queue is shortest limit first and
    /// the reservation has a start: in a demand bucket above the
    /// reservation's extra capacity, once a task's key says it would end
    /// after that start (`now` + remaining limit, the key's second field),
    /// every later task of its class in the bucket would too (a longer or
    /// equal remaining limit, or none; by deadline, see
    /// [`DomainHeads::ends_after`]), so `backfill_ok` refuses them all:
    /// the walk jumps to the next class (latency class, then batch) or
    /// bucket. The reservation's own task, judged by `can_start` instead,
    /// is looked at on its own if it lies in the skipped block. At a
    /// queueing load the domain's queue is long and a protected leaf
    /// walked all of it on every call. Off with
    /// [`Sched::set_steal_skip`]`(false)` (the full walk, for tests).
    fn oldest_fitting(&self, dst: LeafId, now: u64) -> Option<(TaskId, LeafId)> {
        // Nothing waits in the domain: no task to find (what follows only
        // reads).
        let dom = self.domains.dom(dst);
        if self.domains.waiting[dom].is_empty()
            && (!self.domains.aging || self.domains.overdue[dom].is_empty())
            && self.shortcuts()
        {
            return None;
        }
        let rq = &self.rqs[dst];
        // Every test below needs `can_start` on `dst`.
        let free = if self.steal_skip {
            rq.start_bound()
        } else {
            rq.free()
        };
        // In age order, `dst`'s own head holds room only while it is
        // blocked: a head that can start now takes its turn in the domain's
        // age order. Shortest first, a protected head that can start now
        // still holds its room: a shorter task taking it would move its
        // reservation later (EASY starts the head before it backfills).
        let res = if rq.nothing_waits() || !self.protected(dst) {
            None
        } else {
            self.reservation(dst, now).filter(|r| {
                self.domains.shortest
                    || self
                        .tasks
                        .get(&r.task)
                        .is_some_and(|h| !rq.can_start(h.demand, h.align))
            })
        };
        // The block skip's data: the reservation's start, and its task
        // with that task's key.
        // Judged on predictions, a task may end by the start whatever its
        // remaining limit: no block is skipped while any waiting task of
        // the domain has a prediction.
        let skip = match &res {
            Some(r)
                if self.steal_skip
                    && self.domains.shortest
                    && !(r.predicted
                        && self.domains.predicted_waiting[self.domains.dom(dst)] > 0) =>
            {
                r.start.map(|shadow| {
                    let head = self
                        .tasks
                        .get(&r.task)
                        .map(|h| (self.domains.wait_key(h), h));
                    (r, shadow, head)
                })
            }
            _ => None,
        };
        let mut best: Option<(Rank, LeafId)> = None;
        if self.domains.aging {
            self.walk_tier(
                &self.domains.overdue[dom],
                false,
                (dst, free, now),
                res.as_ref(),
                skip.as_ref(),
                &mut best,
            );
        }
        self.walk_tier(
            &self.domains.waiting[dom],
            true,
            (dst, free, now),
            res.as_ref(),
            skip.as_ref(),
            &mut best,
        );
        best.map(|((_, _, _, (_, _, _, _, p)), src)| (p, src))
    }

    /// One tier of `oldest_fitting`'s walk (`fresh`: not overdue): in each
    /// demand bucket that fits `free`, the first task in queue order that
    /// can start on `dst` now replaces `best` if it ranks before it.
    fn walk_tier(
        &self,
        tier: &BTreeMap<u32, BTreeSet<WaitKey>>,
        fresh: bool,
        (dst, free, now): (LeafId, u32, u64),
        res: Option<&crate::sched::Reservation>,
        skip: Option<&BlockSkip<'_>>,
        best: &mut Option<(Rank, LeafId)>,
    ) {
        let rq = &self.rqs[dst];
        for (&demand, set) in tier.range(..=free) {
            let mut keys = set.range(..);
            while let Some(&key) = keys.next() {
                let rank = self.domains.rank(key, fresh, demand);
                if best.is_some_and(|(b, _)| rank >= b) {
                    break;
                }
                if let Some((r, shadow, head)) = skip
                    && demand > r.extra
                    && key.4 != r.task
                    && self.domains.ends_after(&key, now, *shadow)
                {
                    // This task and the rest of its class in the bucket
                    // end after the reservation's start: refused. Only
                    // the reservation's own task may start among them.
                    if let Some((hk, h)) = head
                        && h.demand == demand
                        && hk.0 == key.0
                        && *hk > key
                        && (!self.domains.aging || set.contains(hk))
                        && best.is_none_or(|(b, _)| self.domains.rank(*hk, fresh, demand) < b)
                        && let crate::task::TaskState::Queued(src) = h.state
                        && h.allowed(dst)
                        && rq.can_start(h.demand, h.align)
                    {
                        *best = Some((self.domains.rank(*hk, fresh, demand), src));
                        break;
                    }
                    if key.0 {
                        break;
                    }
                    keys = set.range((true, 0, 0, 0, TaskId(0))..);
                    continue;
                }
                let Some(t) = self.tasks.get(&key.4) else {
                    continue;
                };
                let crate::task::TaskState::Queued(src) = t.state else {
                    continue;
                };
                let ok = t.allowed(dst)
                    && match res {
                        Some(r) if r.task != t.id => self.backfill_ok(dst, r, t, now),
                        _ => rq.can_start(t.demand, t.align),
                    };
                if ok {
                    *best = Some((rank, src));
                    break;
                }
            }
        }
    }

    /// With one queue per domain: true when `fifo_pull` on `dst` would
    /// start `t` first were it waiting on `dst` (queued at `now` with
    /// enqueue sequence `seq`), `t` having room on `dst` and not waiting
    /// yet, and nothing waiting on `dst`. Judged on the queue without `t`:
    /// the first task that can start on `dst` now ([`Sched::oldest_fitting`],
    /// with no reservation on `dst`, as nothing waits there) must sort
    /// after `t`. With `t` waiting, `dst` may hold a reservation for it,
    /// which only refuses more tasks, never fewer, and `t` itself can
    /// start: so `t` would be the first.
    pub(crate) fn fifo_starts_first(&self, dst: LeafId, t: &Task, now: u64, seq: u64) -> bool {
        let key = self.domains.wait_key_at(t, now, seq);
        // Aging: a task due to become overdue moves when the queue is
        // served; and `t` would be overdue at once with no limit left.
        // Left to the slow path.
        let dom = self.domains.dom(dst);
        if self.domains.aging
            && (self.domains.promotion_due(dom, now) || DomainHeads::deadline_of(&key) <= now)
        {
            return false;
        }
        match self.oldest_fitting(dst, now) {
            None => true,
            Some((p, _)) => self.tasks.get(&p).is_some_and(|o| {
                self.domains.rank_of(dom, o) > self.domains.rank(key, true, t.demand)
            }),
        }
    }

    /// Rebuild the domains after a configuration change (every leaf's
    /// room is recomputed by the caller).
    pub(crate) fn rebuild_domains(&mut self) {
        self.domains = DomainHeads::new(
            &self.topo,
            &self.config,
            self.steal_llc_allowed,
            &self.steal_cross_allowed,
        );
        for leaf in 0..self.rqs.len() {
            self.update_head_key(leaf);
            let waiting: Vec<TaskId> = self.rqs[leaf].waiting().collect();
            for id in waiting {
                if let Some(t) = self.tasks.get(&id) {
                    self.domains.wait_insert(leaf, t);
                }
            }
        }
    }
}
