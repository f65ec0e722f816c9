//! Gangs: jobs of `nodes` members, one per node, that start together or
//! not at all, placed through the engine's gang search
//! ([`sched::gang::find_gang_in`]) over the node-level topology (leaf =
//! node, LLC = rack, NUMA = zone), with the EASY-style reservation of the
//! oldest gang that cannot start ([`sched::gang::gang_reservation_in`])
//! and the `preferred` level relaxing after its wait
//! ([`sched::gang::effective_level`]).
//!
//! A gang is built like an array: one job number `j-N` for the gang and
//! one job per member, `j-N.i` (a gang is never an array too), each with
//! `gang_id`, `gang_index` and `gang_size`; members are persisted as jobs,
//! and [`Gangs::restore`] rebuilds the grouping from those fields after a
//! restart. This module owns the grouping and every decision about it:
//!
//! - **all or nothing**: waiting members are `Unplaced { Gang }` and are
//!   not in the engine; `Cluster::schedule_gangs` starts a gang only when
//!   one domain of its level has a node with room for a member *now*
//!   (the engine leaf's `room` for the member's CPUs and alignment, the
//!   same test the single-job path's engine applies) for every waiting
//!   member, and then starts all of them in one operation (one `Effects`,
//!   so one store commit). If the engine does not run every member at
//!   once, none is kept;
//! - **reservation**: the oldest gang that cannot start reserves the
//!   nodes where it will start first, by the running jobs' timeouts. A
//!   single job (or a later gang) may use a reserved node only if its own
//!   timeout ends before the reservation's start: placement removes the
//!   reserved nodes from the affinity of every other job
//!   (`Cluster::outside_reservation`), and when the reserved set
//!   changes, waiting jobs that could be pulled onto it are placed again.
//!   The test is repeated when the engine would start a job on a reserved
//!   node (`Cluster::breaks_reservation`), since a job that fit in time
//!   when placed may only start later. A job without a timeout never
//!   starts on a reserved node;
//! - **end**: the gang ends when every member has; a member that ends
//!   other than SUCCEEDED cancels the others (`End::GangEnded`);
//! - **member lost** (node lost, or not back after a dispatcher restart):
//!   the retry policy: restart-all (every member stopped and requeued, a
//!   new attempt each) or replace-member (the lost member alone, at once,
//!   on a node with room inside the domain of the gang's level that holds
//!   the others; restart-all when there is none). Each counts against the
//!   spec's `retries`; when none is left the lost member ends LOST and the
//!   others are cancelled;
//! - **stealing moves whole gangs only**, in the simplest honest form: a
//!   member is never stolen alone. Members are engine tasks only while
//!   they run on their node (running tasks are never stolen), with their
//!   node as their only affinity, and agent-level steals skip them.
//!
//! - **an unchanged pass is skipped**: a pass that changed nothing
//!   records what it read (the change counters of the jobs, the nodes,
//!   the engine's builds and the gangs, each leaf's free CPUs and rooms
//!   in the engine) and the time window its decisions hold for (until a
//!   preferred gang relaxes, a reservation's ready time is reached, or a
//!   member would no longer end before another gang's reservation); the
//!   next pass with the same inputs inside that window is left out. A
//!   simulated replay ticks millions of times with nothing changed in
//!   between; a differential proptest runs the gang steps with and
//!   without the skip.
//!
//! Invariant (checked by brute force in [`Cluster::check_gangs`]): the
//! live (not ended) members of a gang either all hold a node, each a
//! different one and, for a required level, inside one domain of it, or
//! none holds anything.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;

use proto::v1::{JobSpec, JobState, PendingReason, PendingReasonKind as Kind, dispatcher_message};
use sched::alloc::{align_groups, free_summary_of};
use sched::gang::{effective_level, find_gang_in, gang_reservation_in};
use sched::{Align, LeafId, LeafSet, PlacePath, Placement, TaskState};

use super::engine::engine_ns;
use super::jobs::{End, JobKey, Phase, Requeue, Unplaced, Via};
use super::lifecycle::{TaskAfter, task_spec};
use super::nodes::NodeSlot;
use super::pending::in_time;
use super::{Cluster, Effects, ToAgent, cancel_on};
use crate::record::JobRecord;
use crate::spec::{align_of, policy_of, replaces_members, within_of};

/// One gang's placement constraints and state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gang {
    /// Members.
    pub size: u32,
    /// The level that must (or should) hold every member.
    pub within: Align,
    /// `within` is a preference that relaxes after `relax_after_ms`.
    pub preferred: bool,
    /// The wait before a preferred gang relaxes (ms).
    pub relax_after_ms: u64,
    /// The retry policy is replace-member (else restart-all).
    pub replace: bool,
    /// When the gang began waiting: submission or its last restart (ms).
    pub waiting_since: i64,
    /// The level it was last started at (the domain a replacement stays
    /// in).
    pub level: Align,
    /// A member ended other than SUCCEEDED: the rest is being cancelled and
    /// the gang never starts or restarts again.
    pub ending: bool,
}

impl Gang {
    /// A new gang for a (validated) spec, waiting since `now`.
    pub fn of_spec(spec: &JobSpec, now: i64) -> Self {
        Self {
            size: spec.nodes,
            within: within_of(spec),
            preferred: spec.within_preferred,
            relax_after_ms: spec.relax_after_ms,
            replace: replaces_members(spec),
            waiting_since: now,
            level: within_of(spec),
            ending: false,
        }
    }

    /// The level it is placed at now, after waiting since `waiting_since`.
    pub fn level_at(&self, now: i64) -> Align {
        let waited = (now - self.waiting_since).max(0) as u64;
        effective_level(self.within, self.preferred, waited, self.relax_after_ms)
    }
}

/// The reservation the oldest waiting gang holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    /// The gang's job number.
    pub gang: u64,
    /// When its last reserved node is free (ms).
    pub start_ms: i64,
    /// The reserved nodes, in leaf order.
    pub nodes: Vec<String>,
    /// The same, as engine leaves (valid until the next engine rebuild,
    /// which drops the reservation).
    pub leaves: Arc<LeafSet>,
}

/// The gangs, by job number.
#[derive(Default)]
pub struct Gangs {
    map: BTreeMap<u64, Gang>,
    /// Gangs with members waiting (`Unplaced`), visited by each pass.
    waiting: BTreeSet<u64>,
    /// The reservation (EASY: one, the oldest gang that cannot start).
    reservation: Option<Held>,
    /// Buffers the pass reuses, so that a pass allocates nothing per gang
    /// or per node (the simulator runs one per tick, millions of them).
    scratch: Scratch,
    /// Bumped by every change to the gangs made outside a pass's own
    /// reservation bookkeeping ([`Gangs::touch`]).
    changes: u64,
    /// What the last pass read, when it changed nothing: the next pass
    /// with the same inputs, before any of its time limits, is skipped.
    quiet: Option<Quiet>,
    /// Never skip a pass (the differential test's reference run).
    no_skip: bool,
    /// Passes skipped so far.
    skipped: u64,
    /// The pass running now: the first time at which one of its
    /// decisions may differ (a preferred level relaxes, a reservation's
    /// ready time or backfill limit passes), and whether it changed
    /// anything (then it is not quiet).
    until: i64,
    acted: bool,
}

/// A quiet pass's inputs ([`Cluster::schedule_gangs`]): the change
/// counters of the jobs, the nodes, the engine's builds and the gangs,
/// each leaf's free CPUs and room at every alignment in the engine (the
/// engine's queues change without a counter: a tick may move the
/// backfill room), and the time window over which its decisions hold.
#[derive(Debug, PartialEq, Eq)]
struct Quiet {
    counters: [u64; 4],
    rooms: Vec<[u32; 6]>,
    /// The pass ran at `since`; it decides the same before `until`.
    since: i64,
    until: i64,
}

/// The gang pass's reusable buffers (empty between passes).
#[derive(Default)]
struct Scratch {
    numbers: Vec<u64>,
    waiting: Vec<JobKey>,
    holding: Vec<JobKey>,
    free_cpus: Vec<u32>,
    ready: ReadyBufs,
}

/// [`Cluster::ready_at`]'s buffers: a node's CPU model and its jobs' ends.
#[derive(Default)]
struct ReadyBufs {
    busy: Vec<bool>,
    ends: Vec<(Option<i64>, JobKey)>,
}

impl Gangs {
    /// Something a pass reads changed here.
    fn touch(&mut self) {
        self.changes += 1;
    }

    /// Whether a gang pass whose inputs did not change since the last
    /// quiet one is skipped (the default; off for the differential test,
    /// which checks that both decide the same).
    pub fn set_skip_unchanged(&mut self, on: bool) {
        self.no_skip = !on;
        self.quiet = None;
    }

    /// Gang passes skipped so far because their inputs had not changed.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// Add a gang.
    pub fn insert(&mut self, number: u64, gang: Gang) {
        self.touch();
        self.map.insert(number, gang);
        self.waiting.insert(number);
    }

    /// Forget a gang (its last member was forgotten).
    pub(super) fn remove(&mut self, number: u64) {
        self.touch();
        self.map.remove(&number);
        self.waiting.remove(&number);
        if self.reservation.as_ref().is_some_and(|h| h.gang == number) {
            self.reservation = None;
        }
    }

    /// No gang at all.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// One gang.
    pub fn get(&self, number: u64) -> Option<&Gang> {
        self.map.get(&number)
    }

    /// The reservation held now, if any.
    pub fn reservation(&self) -> Option<&Held> {
        self.reservation.as_ref()
    }

    /// Drop the reservation (its leaves are stale after a rebuild).
    pub(super) fn drop_reservation(&mut self) {
        self.touch();
        self.reservation = None;
    }

    /// Rebuild the gangs from restored jobs (their `gang_id` fields): each
    /// gang once, waiting since its submission, ending if a member ended
    /// other than SUCCEEDED.
    pub fn restore<'a>(&mut self, jobs: impl Iterator<Item = (JobKey, &'a JobRecord)>) {
        self.touch();
        for (key, job) in jobs {
            if !job.is_gang() {
                continue;
            }
            let Some(spec) = job.spec() else {
                continue;
            };
            let gang = self
                .map
                .entry(key.number())
                .or_insert_with(|| Gang::of_spec(spec, job.submit_time_ms));
            let state = JobState::try_from(job.state).unwrap_or(JobState::Unspecified);
            if matches!(
                state,
                JobState::Failed | JobState::Cancelled | JobState::Lost
            ) {
                gang.ending = true;
            }
            if matches!(state, JobState::Pending | JobState::Unspecified) {
                self.waiting.insert(key.number());
            }
        }
    }
}

/// A level's domain name for messages.
fn level_name(a: Align) -> &'static str {
    match a {
        Align::Llc => "rack",
        Align::Numa => "zone",
        Align::Core => "host group",
        Align::Package => "region",
        Align::Any => "cluster",
    }
}

/// A leaf's free CPUs and its room at every alignment: what the gang pass
/// reads of the engine's queue.
fn room_key(rq: &sched::rq::RunQueue) -> [u32; 6] {
    let r = rq.rooms();
    [rq.free(), r[0], r[1], r[2], r[3], r[4]]
}

/// When a job that starts now would end by its timeout (None: no timeout).
fn ends_by(spec: &JobSpec, now: i64) -> Option<i64> {
    (spec.timeout_ms > 0).then(|| now.saturating_add(spec.timeout_ms.min(i64::MAX as u64) as i64))
}

impl Cluster {
    /// The gang number of a gang member.
    pub(super) fn gang_of(&self, key: JobKey) -> Option<u64> {
        (!key.is_single() && self.gangs.map.contains_key(&key.number())).then_some(key.number())
    }

    /// The `Assign` of a job's current attempt. A gang member's copy of
    /// the spec also carries its gang in the environment, so that members
    /// find each other: `DISPATCH_GANG_ID`, `DISPATCH_GANG_INDEX`,
    /// `DISPATCH_GANG_SIZE` and `DISPATCH_GANG_NODES` (the members' nodes
    /// by index, comma-separated, as placed when this attempt was sent).
    /// Any other job's is its shared record ([`ToAgent::Assign`]), built
    /// when it is sent.
    pub(super) fn assign_msg(&self, key: JobKey) -> Option<ToAgent> {
        let e = self.jobs.get(key)?;
        if !e.job().is_gang() {
            return Some(ToAgent::Assign(e.record()));
        }
        let job = e.job();
        let mut msg = job.assign();
        if let Some(dispatcher_message::Msg::Assign(a)) = msg.msg.as_mut()
            && let Some(spec) = a.spec.as_mut()
        {
            let nodes: Vec<String> = self
                .jobs
                .elements(key.array())
                .map(|k| {
                    self.jobs
                        .get(k)
                        .and_then(|e| e.phase().node())
                        .unwrap_or("")
                        .to_string()
                })
                .collect();
            let env = [
                ("DISPATCH_GANG_ID", job.gang_id()),
                ("DISPATCH_GANG_INDEX", job.index().to_string()),
                ("DISPATCH_GANG_SIZE", job.gang_size.to_string()),
                ("DISPATCH_GANG_NODES", nodes.join(",")),
            ];
            // The member's own copy of the gang's spec, with its env.
            let spec = spec.make_mut();
            for (k, v) in env {
                spec.env.insert(k.to_string(), v);
            }
        }
        Some(ToAgent::Msg(msg))
    }

    /// The gangs (job numbers) with a member holding `node` (ASSIGNED or
    /// RUNNING there), ascending: O(jobs on the node).
    pub fn gangs_on(&self, node: &str) -> Vec<u64> {
        let mut gangs: Vec<u64> = self
            .jobs
            .on(node, self.nodes.slot(node))
            .into_iter()
            .filter_map(|k| self.gang_of(k))
            .collect();
        gangs.sort_unstable();
        gangs.dedup();
        gangs
    }

    /// The gangs.
    pub fn gangs(&self) -> &Gangs {
        &self.gangs
    }

    /// A gang member asked to be placed: it waits with its gang (never in
    /// the engine alone); the next gang pass decides.
    pub(super) fn gang_member_waits(&mut self, key: JobKey, number: u64) {
        let unplaced_already = matches!(
            self.jobs.get(key).map(|e| e.phase()),
            Some(Phase::Unplaced {
                why: Unplaced::Gang | Unplaced::NoMatch { .. }
            })
        );
        if !unplaced_already {
            self.jobs.set_phase(
                key,
                Phase::Unplaced {
                    why: Unplaced::Gang,
                },
            );
        }
        self.gangs.touch();
        self.gangs.waiting.insert(number);
    }

    /// The gang pass: oldest gang first, start every waiting gang that
    /// fits now, give the reservation to the oldest one that does not,
    /// replace members of running gangs; when the reserved nodes change,
    /// place again the jobs the reservation now keeps off them.
    pub(super) fn schedule_gangs(&mut self, now: i64, fx: &mut Effects) {
        if self.gangs.waiting.is_empty() && self.gangs.reservation.is_none() {
            return;
        }
        if self.engine.sched().is_none() || self.engine.is_dirty() {
            return;
        }
        let counters = self.gang_counters();
        let mut quiet = self.gangs.quiet.take();
        if let Some(q) = quiet.as_mut() {
            if !self.gangs.no_skip
                && q.counters == counters
                && q.since <= now
                && now < q.until
                && self.same_rooms(&q.rooms)
            {
                self.gangs.quiet = quiet;
                self.gangs.skipped += 1;
                return;
            }
            q.rooms.clear();
        }
        let mut rooms = quiet.map(|q| q.rooms).unwrap_or_default();
        self.rooms_into(&mut rooms);
        self.gangs.until = i64::MAX;
        self.gangs.acted = false;
        let before = self.gangs.reservation.take();
        let mut sc = std::mem::take(&mut self.gangs.scratch);
        sc.numbers.clear();
        sc.numbers.extend(self.gangs.waiting.iter().copied());
        // An upper bound of the nodes a member could start on, by free
        // CPUs alone, ascending; it stays an upper bound while gangs start
        // during the pass (they only take CPUs). A gang with more members
        // than nodes with its CPUs free cannot start: once the reservation
        // is given, a gang already waiting for nodes goes on waiting
        // without the O(nodes) search (a gang waiting for another reason
        // still gets the full pass, which says why).
        self.schedulable_free_cpus(&mut sc.free_cpus);
        sc.free_cpus.sort_unstable();
        for &n in &sc.numbers {
            self.members_by_phase_into(n, &mut sc.waiting, &mut sc.holding);
            let waiting = &sc.waiting;
            if waiting.is_empty() || self.gangs.map.get(&n).is_none_or(|g| g.ending) {
                self.gangs.touch();
                self.gangs.waiting.remove(&n);
                continue;
            }
            if !sc.holding.is_empty() {
                self.gangs.acted = true;
                // Members wait while others hold nodes (restored, or
                // given back): replace them, else restart the gang.
                if !self.replace_members(n, waiting, now, fx) {
                    self.restart_gang(n, None, now, fx);
                    // Each member's node given back reschedules that node
                    // (`requeue_member`'s room push): a job waiting there
                    // may start. The pass is its operation's last step, so
                    // claim those starts here (else they stay unsent, and
                    // the engine's room below the model's).
                    self.process_events(now, fx);
                }
                continue;
            }
            if self.gangs.reservation.is_some()
                && let Some(cpus) = self.gang_cpus(n)
                && sc.free_cpus.len() - sc.free_cpus.partition_point(|&f| f < cpus) < waiting.len()
                && waiting.iter().all(|&k| {
                    matches!(
                        self.jobs.get(k).map(|e| e.phase()),
                        Some(Phase::Unplaced {
                            why: Unplaced::Gang
                        })
                    )
                })
            {
                // Already waiting for nodes, and still no room for it.
                continue;
            }
            if self.try_start_gang(n, waiting, now, &mut sc.ready, fx) {
                self.gangs.waiting.remove(&n);
            }
        }
        sc.waiting.clear();
        sc.holding.clear();
        self.gangs.scratch = sc;
        let same = before == self.gangs.reservation;
        let key = |h: &Held| (h.gang, h.nodes.clone());
        if before.as_ref().map(key) != self.gangs.reservation.as_ref().map(key) {
            self.enforce_reservation(before.as_ref(), now, fx);
        }
        // Quiet: the pass changed nothing (no start tried, no member
        // moved, the same reservation), so the same inputs give the same
        // pass until one of its time limits.
        if same && !self.gangs.acted && self.gang_counters() == counters {
            self.gangs.quiet = Some(Quiet {
                counters,
                rooms,
                since: now,
                until: self.gangs.until,
            });
        }
    }

    /// The change counters a gang pass depends on: the jobs, the nodes,
    /// the engine's builds, the gangs.
    fn gang_counters(&self) -> [u64; 4] {
        [
            self.jobs.changes(),
            self.nodes.changes(),
            self.engine.builds(),
            self.gangs.changes,
        ]
    }

    /// Each leaf's free CPUs and room at every alignment, into `out`
    /// (cleared first).
    fn rooms_into(&self, out: &mut Vec<[u32; 6]>) {
        out.clear();
        if let Some(engine) = self.engine.sched() {
            out.extend((0..engine.topology().nr_leaves()).map(|leaf| room_key(engine.rq(leaf))));
        }
    }

    /// True when every leaf's free CPUs and rooms are `rooms`.
    fn same_rooms(&self, rooms: &[[u32; 6]]) -> bool {
        let Some(engine) = self.engine.sched() else {
            return false;
        };
        let nr = engine.topology().nr_leaves();
        nr == rooms.len() && (0..nr).all(|leaf| room_key(engine.rq(leaf)) == rooms[leaf])
    }

    /// A time limit of the running pass: its decisions may differ from
    /// `at` on.
    fn pass_until(&mut self, at: i64) {
        self.gangs.until = self.gangs.until.min(at);
    }

    /// A gang's members split into the waiting (`Unplaced`) and those
    /// holding a node; ended members are in neither.
    fn members_by_phase(&self, n: u64) -> (Vec<JobKey>, Vec<JobKey>) {
        let (mut waiting, mut holding) = (Vec::new(), Vec::new());
        self.members_by_phase_into(n, &mut waiting, &mut holding);
        (waiting, holding)
    }

    /// [`Self::members_by_phase`] into the caller's buffers (cleared
    /// first).
    fn members_by_phase_into(&self, n: u64, waiting: &mut Vec<JobKey>, holding: &mut Vec<JobKey>) {
        waiting.clear();
        holding.clear();
        for k in self.jobs.elements(JobKey::single(n)) {
            match self.jobs.get(k).map(|e| e.phase()) {
                Some(Phase::Unplaced { .. } | Phase::Queued { .. }) => waiting.push(k),
                Some(p) if p.holds().is_some() => holding.push(k),
                _ => {}
            }
        }
    }

    /// The node of an engine leaf, through its registry slot (no name
    /// hashing: leaves, names and slots are one-to-one while the engine
    /// is not dirty, which the gang pass checks first).
    fn leaf_node(&self, leaf: LeafId) -> Option<&super::NodeInfo> {
        self.nodes.at(self.engine.slot_at(leaf)?)
    }

    /// Free CPUs of each schedulable node in the engine (any order), into
    /// `out` (cleared first).
    fn schedulable_free_cpus(&self, out: &mut Vec<u32>) {
        out.clear();
        let Some(engine) = self.engine.sched() else {
            return;
        };
        out.extend(
            (0..engine.topology().nr_leaves())
                .filter(|&leaf| {
                    self.leaf_node(leaf)
                        .is_some_and(super::NodeInfo::schedulable)
                })
                .map(|leaf| engine.rq(leaf).free()),
        );
    }

    /// CPUs per member of gang `n` (its spec's, at least 1).
    fn gang_cpus(&self, n: u64) -> Option<u32> {
        let first = self.jobs.elements(JobKey::single(n)).next()?;
        Some(self.jobs.get(first)?.job().spec.as_ref()?.cpus.max(1))
    }

    /// Members that wait for their gang's nodes say so (`Unplaced::Gang`),
    /// persisted when it changed.
    fn mark_gang_waiting(&mut self, waiting: &[JobKey], fx: &mut Effects) {
        for &k in waiting {
            if !matches!(
                self.jobs.get(k).map(|e| e.phase()),
                Some(Phase::Unplaced {
                    why: Unplaced::Gang
                })
            ) {
                self.jobs.set_phase(
                    k,
                    Phase::Unplaced {
                        why: Unplaced::Gang,
                    },
                );
                self.persist(k, fx);
            }
        }
    }

    /// The spec members share (the first member's).
    fn gang_spec(&self, n: u64) -> Option<Arc<JobSpec>> {
        let first = self.jobs.elements(JobKey::single(n)).next()?;
        self.jobs.get(first)?.job().spec.clone()
    }

    /// Start a waiting gang if one domain has room for every member now;
    /// else mark its members waiting and, if no gang holds it yet, take the
    /// reservation. True when it started.
    fn try_start_gang(
        &mut self,
        n: u64,
        waiting: &[JobKey],
        now: i64,
        bufs: &mut ReadyBufs,
        fx: &mut Effects,
    ) -> bool {
        let (Some(spec), Some(gang)) = (self.gang_spec(n), self.gangs.map.get(&n)) else {
            return false;
        };
        let (level, preferred) = (gang.level_at(now), gang.preferred);
        let relax = gang.relax_after_ms.min(i64::MAX as u64) as i64;
        let relaxes_at = gang.waiting_since.saturating_add(relax);
        if preferred && level != Align::Any {
            // The level relaxes when the wait reaches `relax_after_ms`.
            self.pass_until(relaxes_at);
        }
        let allowed = match self
            .engine
            .allowed_leaves(&spec, &self.nodes, |n| self.gpus_free_for(n, None))
        {
            Ok(a) => a,
            Err(why) => {
                for &k in waiting {
                    if !matches!(self.jobs.get(k).map(|e| e.phase()), Some(Phase::Unplaced { why: w }) if *w == why)
                    {
                        self.jobs.set_phase(k, Phase::Unplaced { why: why.clone() });
                        self.persist(k, fx);
                    }
                }
                return false;
            }
        };
        let ends = ends_by(&spec, now);
        if let Some(h) = self.gangs.reservation.as_ref()
            && h.gang != n
            && let Some(e) = ends
            && e <= h.start_ms
        {
            // A member ends in time for the reservation while `now`
            // stays at most `start_ms - timeout`.
            let at = now
                .saturating_add(h.start_ms.saturating_sub(e))
                .saturating_add(1);
            self.pass_until(at);
        }
        let Some(engine) = self.engine.sched() else {
            return false;
        };
        let none = HashSet::new();
        let found = find_gang_in(
            engine.topology(),
            waiting.len(),
            level,
            policy_of(&spec),
            |leaf| {
                self.member_room(
                    leaf,
                    &spec,
                    allowed.as_deref(),
                    self.gangs.reservation.as_ref(),
                    n,
                    ends,
                    &none,
                )
            },
        );
        if let Some(leaves) = found {
            self.gangs.acted = true;
            let pairs: Vec<(JobKey, LeafId)> = waiting.iter().copied().zip(leaves).collect();
            if self.start_members(&pairs, now) {
                self.gangs.touch();
                if let Some(g) = self.gangs.map.get_mut(&n) {
                    g.level = level;
                }
                self.process_events(now, fx);
                return true;
            }
        }
        self.mark_gang_waiting(waiting, fx);
        if self.gangs.reservation.is_none()
            && let Some(engine) = self.engine.sched()
        {
            let topo = engine.topology();
            let (busy, ends) = (&mut bufs.busy, &mut bufs.ends);
            // The ready times are `max(end, now)`: the pass's choice
            // holds until `now` reaches the earliest one still ahead (or
            // not at all when one moves with `now`, `until` = now).
            let mut until = i64::MAX;
            let res = gang_reservation_in(topo, waiting.len(), level, |leaf| {
                self.ready_at(leaf, &spec, allowed.as_deref(), now, busy, ends, &mut until)
                    .map(|ms| ms.max(0) as u64)
            });
            let nr = topo.nr_leaves();
            self.pass_until(until);
            if let Some(r) = res {
                if i64::try_from(r.start).is_ok_and(|s| s <= now) {
                    // It starts "now": the next pass's start is later.
                    self.pass_until(now);
                }
                let nodes = r
                    .leaves
                    .iter()
                    .filter_map(|&l| self.engine.node_at(l).map(str::to_string))
                    .collect();
                let leaves = Arc::new(LeafSet::from_leaves(nr, r.leaves));
                self.gangs.reservation = Some(Held {
                    gang: n,
                    start_ms: i64::try_from(r.start).unwrap_or(i64::MAX),
                    nodes,
                    leaves,
                });
            }
        }
        false
    }

    /// Room a member of gang `n` would leave on `leaf` if it started there
    /// now (None: it does not fit now, may not go there, or the node is
    /// reserved for another gang and the member would not end by then).
    #[allow(clippy::too_many_arguments)]
    fn member_room(
        &self,
        leaf: LeafId,
        spec: &JobSpec,
        allowed: Option<&LeafSet>,
        held: Option<&Held>,
        n: u64,
        ends: Option<i64>,
        exclude: &HashSet<LeafId>,
    ) -> Option<u32> {
        let engine = self.engine.sched()?;
        let node = self.leaf_node(leaf)?;
        if !node.schedulable() || exclude.contains(&leaf) {
            return None;
        }
        if allowed.is_some_and(|a| !a.contains(leaf)) {
            return None;
        }
        if let Some(h) = held
            && h.gang != n
            && h.leaves.contains(leaf)
            && ends.is_none_or(|e| e > h.start_ms)
        {
            return None;
        }
        let rq = engine.rq(leaf);
        let cpus = spec.cpus.max(1);
        if rq.room(align_of(spec)) < cpus {
            return None;
        }
        Some(rq.free().saturating_sub(cpus))
    }

    /// When a member could start on `leaf` (ms): now if it fits now, else
    /// when enough of the node's jobs have ended by their timeouts for its
    /// aligned CPUs (the node's CPU model with their CPUs freed, earliest
    /// end first); None when that needs a job without a timeout, or never.
    #[allow(clippy::too_many_arguments)]
    fn ready_at(
        &self,
        leaf: LeafId,
        spec: &JobSpec,
        allowed: Option<&LeafSet>,
        now: i64,
        busy: &mut Vec<bool>,
        ends: &mut Vec<(Option<i64>, JobKey)>,
        until: &mut i64,
    ) -> Option<i64> {
        let engine = self.engine.sched()?;
        let node = self.leaf_node(leaf)?;
        if !node.schedulable() || allowed.is_some_and(|a| !a.contains(leaf)) {
            return None;
        }
        let (cpus, align) = (spec.cpus.max(1), align_of(spec));
        let rq = engine.rq(leaf);
        if rq.room(align) >= cpus {
            return Some(now);
        }
        busy.clear();
        busy.extend(node.busy_flags());
        let mut free = rq.free();
        let fits = |busy: &[bool], free: u32| {
            free >= cpus && free_summary_of(node.cpu_topo(), |l| !busy[l]).get(align) >= cpus
        };
        if fits(busy, free) {
            return Some(now);
        }
        ends.clear();
        ends.extend(
            self.jobs
                .keys_on(&node.name, NodeSlot::of(&node.name))
                .filter_map(|k| {
                    let e = self.jobs.get(k)?;
                    let timeout = e.job().spec.as_ref().map_or(0, |s| s.timeout_ms);
                    let start = match (e.job().start_time_ms, e.phase()) {
                        (s, _) if s > 0 => s,
                        (_, Phase::Assigned { since, .. }) => *since,
                        _ => {
                            // An end that moves with `now`.
                            *until = (*until).min(now);
                            now
                        }
                    };
                    let end = (timeout > 0)
                        .then(|| start.saturating_add(timeout.min(i64::MAX as u64) as i64));
                    Some((end, k))
                }),
        );
        ends.sort_by_key(|&(end, k)| (end.is_none(), end, k));
        for &(end, k) in ends.iter() {
            let end = end?;
            let e = self.jobs.get(k)?;
            for &c in &e.model_cpus {
                if let Some(b) = busy.get_mut(c) {
                    *b = false;
                }
            }
            free = free.saturating_add(e.cpus());
            if fits(busy, free) {
                if end > now {
                    *until = (*until).min(end);
                }
                return Some(end.max(now));
            }
        }
        None
    }

    /// Put members on their leaves, all in the engine at once; keep them
    /// only if the engine runs every one of them now (else remove them all
    /// and report false: nothing is held). The caller drains the engine's
    /// events, which send the assignments.
    fn start_members(&mut self, pairs: &[(JobKey, LeafId)], now: i64) -> bool {
        let nr = match self.engine.sched() {
            Some(e) => e.topology().nr_leaves(),
            None => return false,
        };
        let mut added = Vec::new();
        let mut ok = true;
        for &(key, leaf) in pairs {
            let (Some(e), Some(node)) = (self.jobs.get(key), self.engine.name_at(leaf)) else {
                ok = false;
                break;
            };
            let node = node.clone();
            let only_here = Arc::new(LeafSet::from_leaves(nr, [leaf]));
            let tspec = task_spec(e, Some(only_here), self.predicted_ns(e));
            let task = e.task;
            let how = Placement {
                wake: Default::default(),
                path: match e.job().spec().map(policy_of) {
                    Some(sched::Policy::Pack) => PlacePath::Pack,
                    _ => PlacePath::Target,
                },
            };
            let Some(engine) = self.engine.sched_mut() else {
                return false;
            };
            if engine.has_task(task) {
                let _ = engine.remove_task(task, engine_ns(now));
            }
            if engine.add_task(tspec).is_err() {
                ok = false;
                break;
            }
            added.push((key, task));
            self.jobs.set_phase(
                key,
                Phase::Queued {
                    node,
                    via: Via::Placed(how),
                    waiting: false,
                },
            );
            let Some(engine) = self.engine.sched_mut() else {
                return false;
            };
            if engine.wake_up_on(task, leaf, engine_ns(now)).is_err() {
                ok = false;
                break;
            }
        }
        ok =
            ok && pairs.iter().zip(&added).all(|(&(_, leaf), &(_, task))| {
                self.engine
                    .sched()
                    .and_then(|en| en.task_state(task))
                    .is_some_and(|s| s == TaskState::Running(leaf))
            }) && added.len() == pairs.len();
        if !ok {
            for (key, task) in added {
                self.engine.remove(task, now);
                self.jobs.set_phase(
                    key,
                    Phase::Unplaced {
                        why: Unplaced::Gang,
                    },
                );
            }
        }
        ok
    }

    /// Start waiting members of a running gang on nodes with room inside
    /// the domain (of the level the gang started at) that holds its other
    /// members, best fit first. False (nothing started) when the domain
    /// has too few.
    fn replace_members(&mut self, n: u64, waiting: &[JobKey], now: i64, fx: &mut Effects) -> bool {
        let (Some(spec), Some(gang)) = (self.gang_spec(n), self.gangs.map.get(&n).cloned()) else {
            return false;
        };
        if gang.ending {
            return false;
        }
        let Some(topo) = self.engine.sched().map(|e| e.topology().clone()) else {
            return false;
        };
        let (_, holding) = self.members_by_phase(n);
        let used: HashSet<LeafId> = holding
            .iter()
            .filter_map(|k| self.jobs.get(*k)?.phase().holds())
            .filter_map(|node| self.engine.leaf(node))
            .collect();
        let Some(&anchor) = used.iter().min() else {
            return false;
        };
        let Some(domain) = align_groups(&topo, gang.level)
            .into_iter()
            .find(|g| g.contains(&anchor))
            .map(<[LeafId]>::to_vec)
        else {
            return false;
        };
        let allowed = match self
            .engine
            .allowed_leaves(&spec, &self.nodes, |n| self.gpus_free_for(n, None))
        {
            Ok(a) => a,
            Err(_) => return false,
        };
        let held = self.gangs.reservation.clone();
        let ends = ends_by(&spec, now);
        let mut rooms: Vec<(u32, LeafId)> = domain
            .iter()
            .filter_map(|&l| {
                self.member_room(l, &spec, allowed.as_deref(), held.as_ref(), n, ends, &used)
                    .map(|r| (r, l))
            })
            .collect();
        if rooms.len() < waiting.len() {
            return false;
        }
        rooms.sort_unstable();
        let pairs: Vec<(JobKey, LeafId)> = waiting
            .iter()
            .copied()
            .zip(rooms.into_iter().map(|(_, l)| l))
            .collect();
        if !self.start_members(&pairs, now) {
            return false;
        }
        self.process_events(now, fx);
        true
    }

    /// Take a member off its node and back to waiting with its gang: the
    /// node is told to cancel the attempt, what it held is freed, and the
    /// next attempt waits.
    fn requeue_member(&mut self, key: JobKey, retry: Requeue, now: i64, fx: &mut Effects) {
        let Some(e) = self.jobs.get(key) else { return };
        let (node, attempt) = (e.job().node.clone(), e.job().attempt);
        if e.phase().holds().is_some() && !node.is_empty() {
            cancel_on(node, key.to_string(), attempt, fx);
        }
        let node = self
            .jobs
            .get(key)
            .map(|e| e.job().node.clone())
            .unwrap_or_default();
        self.release_from_node(key, TaskAfter::Remove, now);
        self.sync_summary(&node, now);
        if let Some(mut f) = self.jobs.facts(key) {
            f.next_attempt();
            f.set_cpus(&[]);
            f.set_start(0);
        }
        self.jobs.push_requeue(key, retry);
        let previous = self.jobs.set_phase(
            key,
            Phase::Unplaced {
                why: Unplaced::Gang,
            },
        );
        self.gangs.touch();
        self.gangs.waiting.insert(key.number());
        self.persist_emit(key, previous, now, fx);
    }

    /// Restart-all: every member holding a node is stopped and requeued
    /// (with `lost`'s record, when a member was lost), and the gang waits
    /// again from `now` at its full level.
    fn restart_gang(
        &mut self,
        n: u64,
        lost: Option<(&str, &'static str, u32, u32)>,
        now: i64,
        fx: &mut Effects,
    ) {
        let (_, holding) = self.members_by_phase(n);
        for k in holding {
            let retry = match lost {
                Some((node, why, attempt, of)) => Requeue::Retry {
                    n: attempt,
                    of,
                    node: node.to_string(),
                    why,
                },
                None => Requeue::GangRestart,
            };
            let node = self
                .jobs
                .get(k)
                .map(|e| e.job().node.clone())
                .unwrap_or_default();
            self.requeue_member(k, retry, now, fx);
            if !self
                .nodes
                .get(&node)
                .is_some_and(super::NodeInfo::schedulable)
            {
                self.refresh_capacity(&node, now, fx);
            }
        }
        self.gangs.touch();
        if let Some(g) = self.gangs.map.get_mut(&n) {
            g.waiting_since = now;
            g.level = g.within;
        }
        self.gangs.waiting.insert(n);
    }

    /// A member's node was lost (or did not come back): the gang's retry
    /// policy within the spec's `retries`.
    pub(super) fn gang_member_lost(
        &mut self,
        key: JobKey,
        n: u64,
        why: &'static str,
        now: i64,
        fx: &mut Effects,
    ) {
        let Some(e) = self.jobs.get(key) else { return };
        let retries = e.job().spec.as_ref().map_or(0, |s| s.retries);
        let attempt = e.job().attempt;
        let node = e.job().node.clone();
        let ending = self.gangs.map.get(&n).is_none_or(|g| g.ending);
        if attempt > retries || ending {
            if !node.is_empty() {
                cancel_on(node.clone(), key.to_string(), attempt, fx);
            }
            let done = Phase::Done {
                state: JobState::Lost,
                end: End::Lost {
                    node: node.to_string(),
                    why,
                },
            };
            self.finish(key, done, now, fx);
            return;
        }
        let replace = self.gangs.map.get(&n).is_some_and(|g| g.replace);
        if replace {
            let retry = Requeue::Retry {
                n: attempt,
                of: retries,
                node: node.to_string(),
                why,
            };
            self.requeue_member(key, retry, now, fx);
            if !self
                .nodes
                .get(&node)
                .is_some_and(super::NodeInfo::schedulable)
            {
                self.refresh_capacity(&node, now, fx);
            }
            if self.replace_members(n, &[key], now, fx) {
                return;
            }
        }
        self.restart_gang(n, Some((&node, why, attempt, retries)), now, fx);
        self.schedule_gangs(now, fx);
    }

    /// A member ended: unless it succeeded, the rest of the gang is
    /// cancelled (once).
    pub(super) fn gang_member_ended(&mut self, key: JobKey, n: u64, now: i64, fx: &mut Effects) {
        let state = self
            .jobs
            .get(key)
            .map_or(JobState::Unspecified, |e| e.phase().state());
        if state == JobState::Succeeded {
            return;
        }
        match self.gangs.map.get_mut(&n) {
            Some(g) if !g.ending => g.ending = true,
            _ => return,
        }
        self.gangs.touch();
        self.gangs.waiting.remove(&n);
        if self.gangs.reservation.as_ref().is_some_and(|h| h.gang == n) {
            let old = self.gangs.reservation.take();
            self.enforce_reservation(old.as_ref(), now, fx);
        }
        let end = || End::GangEnded { member: key, state };
        for k in self.jobs.elements(JobKey::single(n)).collect::<Vec<_>>() {
            let Some(e) = self.jobs.get(k) else { continue };
            let cancelled = Phase::Done {
                state: JobState::Cancelled,
                end: end(),
            };
            match e.phase() {
                Phase::Done { .. } => {}
                Phase::Assigned { node, .. } | Phase::Running { node, .. }
                    if self.nodes.get(node).is_some_and(super::NodeInfo::reachable) =>
                {
                    if e.cancel_requested() {
                        continue;
                    }
                    let (node, attempt) = (node.clone(), e.job().attempt);
                    if let Some(mut f) = self.jobs.facts(k) {
                        f.request_cancel();
                    }
                    self.persist(k, fx);
                    cancel_on(node, k.to_string(), attempt, fx);
                }
                _ => self.finish(k, cancelled, now, fx),
            }
        }
    }

    /// A job's allowed nodes without the reserved ones, unless it ends
    /// before the reservation's start (EASY backfill) or is the gang
    /// holding it. `Err` when no node is left.
    pub(super) fn outside_reservation(
        &self,
        key: JobKey,
        spec: &JobSpec,
        allowed: Option<Arc<LeafSet>>,
        now: i64,
    ) -> Result<Option<Arc<LeafSet>>, Unplaced> {
        let Some(h) = self.gangs.reservation.as_ref() else {
            return Ok(allowed);
        };
        if key.number() == h.gang || ends_by(spec, now).is_some_and(|e| e <= h.start_ms) {
            return Ok(allowed);
        }
        let Some(nr) = self.engine.sched().map(|e| e.topology().nr_leaves()) else {
            return Ok(allowed);
        };
        let leaves: Vec<LeafId> = (0..nr)
            .filter(|&l| !h.leaves.contains(l) && allowed.as_ref().is_none_or(|a| a.contains(l)))
            .collect();
        if leaves.is_empty() {
            return Err(Unplaced::Reserved {
                gang: JobKey::single(h.gang),
                until_ms: h.start_ms,
            });
        }
        Ok(Some(Arc::new(LeafSet::from_leaves(nr, leaves))))
    }

    /// Whether a gang holds a reservation: without one no start breaks
    /// it ([`Cluster::breaks_reservation`] is false for every job and
    /// leaf).
    pub(super) fn holds_reservation(&self) -> bool {
        self.gangs.reservation.is_some()
    }

    /// True when job `key` starting on `leaf` now would break the
    /// reservation: the leaf is reserved for another gang and the job
    /// (not a gang member: the gang pass checks those) would not end by
    /// the reservation's start. A job placed there when it would have
    /// ended in time may start only later (it waited in the node's queue,
    /// or an idle reserved node pulls it): this is the check at the start.
    pub(super) fn breaks_reservation(&self, key: JobKey, leaf: LeafId, now: i64) -> bool {
        let Some(h) = self.gangs.reservation.as_ref() else {
            return false;
        };
        if key.number() == h.gang || !h.leaves.contains(leaf) || self.gang_of(key).is_some() {
            return false;
        }
        let ends = self
            .jobs
            .get(key)
            .and_then(|e| e.job().spec.as_ref())
            .and_then(|s| ends_by(s, now));
        ends.is_none_or(|e| e > h.start_ms)
    }

    /// The reserved nodes changed (from `old`): place again every waiting
    /// job the reservation keeps off them that is queued where it could
    /// start on one (its own node reserved, or a reserved node could pull
    /// it), every job the old reservation kept off its nodes (its affinity
    /// excludes one of them), and every job held unplaced by it.
    fn enforce_reservation(&mut self, old: Option<&Held>, now: i64, fx: &mut Effects) {
        let mut again = Vec::new();
        for key in self.jobs.unplaced() {
            if matches!(
                self.jobs.get(key).map(|e| e.phase()),
                Some(Phase::Unplaced {
                    why: Unplaced::Reserved { .. }
                })
            ) {
                again.push(key);
            }
        }
        let new = self.gangs.reservation.as_ref();
        if let Some(engine) = self.engine.sched()
            && (new.is_some() || old.is_some())
        {
            for key in self.jobs.queued() {
                let Some(e) = self.jobs.get(key) else {
                    continue;
                };
                if !matches!(e.phase(), Phase::Queued { waiting: true, .. }) {
                    continue;
                }
                let Some(task) = engine.task(e.task) else {
                    continue;
                };
                let ends = e.job().spec.as_ref().and_then(|s| ends_by(s, now));
                let kept_off_new = new.is_some_and(|h| {
                    key.number() != h.gang
                        && ends.is_none_or(|end| end > h.start_ms)
                        && h.leaves.iter().any(|l| task.allowed(l))
                });
                let kept_off_old = old.is_some_and(|h| {
                    task.affinity.is_some() && h.leaves.iter().any(|l| !task.allowed(l))
                });
                if kept_off_new || kept_off_old {
                    again.push(key);
                }
            }
        }
        for key in again {
            if let Some(task) = self.jobs.get(key).map(|e| e.task)
                && let Some(engine) = self.engine.sched_mut()
                && engine.has_task(task)
            {
                let _ = engine.block(task, engine_ns(now));
            }
            self.place(key, now, fx);
            self.persist(key, fx);
        }
        self.process_events(now, fx);
    }

    /// Why a waiting gang member (or a job kept off reserved nodes) waits.
    pub(super) fn gang_pending(&self, key: JobKey, why: &Unplaced, now: i64) -> PendingReason {
        let until = |at: i64| in_time(at, now);
        if let Unplaced::Reserved { until_ms, .. } = why {
            return PendingReason {
                kind: Kind::GangReservation as i32,
                until_ms: *until_ms,
                message: format!("{why}, {}", until(*until_ms)),
                ..Default::default()
            };
        }
        let n = key.number();
        let Some(g) = self.gangs.map.get(&n) else {
            return PendingReason {
                kind: Kind::GangResources as i32,
                message: why.to_string(),
                ..Default::default()
            };
        };
        let level = g.level_at(now);
        let (waiting, _) = self.members_by_phase(n);
        let cpus = self
            .jobs
            .get(key)
            .and_then(|e| e.job().spec.as_ref())
            .map_or(1, |s| s.cpus.max(1));
        let gang = JobKey::single(n);
        let relax = if g.preferred && level != Align::Any {
            format!(
                "; the {} is preferred: placed anywhere {}",
                level_name(g.within),
                until(g.waiting_since + g.relax_after_ms.min(i64::MAX as u64) as i64)
            )
        } else {
            String::new()
        };
        match self.gangs.reservation.as_ref() {
            Some(h) if h.gang == n => PendingReason {
                kind: Kind::GangReservation as i32,
                until_ms: h.start_ms,
                message: format!(
                    "gang {gang} ({} members waiting, within one {}) holds the reservation of \
                     {}: starts when they are free, {} at the latest by the running jobs' \
                     timeouts{relax}",
                    waiting.len(),
                    level_name(level),
                    h.nodes.join(", "),
                    until(h.start_ms)
                ),
                ..Default::default()
            },
            other => PendingReason {
                kind: Kind::GangResources as i32,
                message: format!(
                    "gang {gang}: no {} has {} nodes with room for a member ({cpus} CPUs) now, \
                     and nothing is held meanwhile{}{relax}",
                    level_name(level),
                    waiting.len(),
                    match other {
                        Some(h) => format!(
                            "; gang j-{} holds the reservation of {} until {}",
                            h.gang,
                            h.nodes.join(", "),
                            until(h.start_ms)
                        ),
                        None => String::new(),
                    }
                ),
                ..Default::default()
            },
        }
    }

    /// Check the gang invariant by brute force over the job table: the
    /// live members of each gang either all hold a node, on distinct
    /// nodes, inside one domain of a required level, or none holds
    /// anything; no member is ever queued in the engine. For tests.
    pub fn check_gangs(&self) -> Result<(), String> {
        let mut by_gang: BTreeMap<String, Vec<(JobKey, &Phase)>> = BTreeMap::new();
        for (key, e) in self.jobs.iter() {
            if e.job().is_gang() {
                by_gang
                    .entry(e.job().gang_id())
                    .or_default()
                    .push((key, e.phase()));
            }
        }
        for (id, members) in by_gang {
            let live: Vec<&(JobKey, &Phase)> =
                members.iter().filter(|(_, p)| !p.is_done()).collect();
            if let Some((k, _)) = live.iter().find(|(_, p)| matches!(p, Phase::Queued { .. })) {
                return Err(format!("gang {id}: member {k} is queued alone"));
            }
            let nodes: Vec<&str> = live.iter().filter_map(|(_, p)| p.holds()).collect();
            if !nodes.is_empty() && nodes.len() != live.len() {
                return Err(format!(
                    "gang {id}: {} of {} live members hold nodes: {members:?}",
                    nodes.len(),
                    live.len()
                ));
            }
            let distinct: HashSet<&str> = nodes.iter().copied().collect();
            if distinct.len() != nodes.len() {
                return Err(format!("gang {id}: two members share a node: {nodes:?}"));
            }
            let Some(g) = JobKey::parse(&id).and_then(|k| self.gangs.map.get(&k.number())) else {
                continue;
            };
            if g.preferred || nodes.is_empty() {
                continue;
            }
            let domain = |node: &str| {
                self.nodes.get(node).map(|n| match g.within {
                    Align::Llc => (
                        n.region().to_string(),
                        n.zone().to_string(),
                        n.rack().to_string(),
                    ),
                    Align::Numa => (n.region().to_string(), n.zone().to_string(), String::new()),
                    _ => Default::default(),
                })
            };
            let domains: HashSet<_> = nodes.iter().map(|n| domain(n)).collect();
            if domains.len() > 1 {
                return Err(format!(
                    "gang {id}: members span {} {}s: {nodes:?}",
                    domains.len(),
                    level_name(g.within)
                ));
            }
        }
        Ok(())
    }
}
