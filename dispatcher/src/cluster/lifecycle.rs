//! The job lifecycle: submit, place, start, status, finish, loss, cancel,
//! and the node events that drive it (load reports, heartbeats missed,
//! administrative changes).
//!
//! Invariants: every phase change goes through `Jobs::set_phase`; a job
//! leaves its node (its modelled CPUs freed, its engine task removed or
//! retired) only through [`Cluster::release_from_node`]; a job whose cancel
//! was requested is never placed again (a lost or given-back attempt ends
//! CANCELLED); a DOWN node's engine capacity shrinks to what its jobs hold
//! before any of its jobs is placed again, so no retry lands on it.

use std::sync::Arc;

use proto::v1::{Job, JobSpec, JobState, JobStatus};
use sched::wake::OuterWaker;
use sched::{LeafId, LeafSet, TaskId, TaskSpec, TaskState};
use tonic::Status;

use super::engine::engine_ns;
use super::jobs::{
    End, JobEntry, JobKey, NodeName, PREFETCH_WINDOW, Phase, Requeue, StealLevel, Unplaced, Via,
};
use super::load::PackedLoad;
use super::nodes::{NodeInfo, NodeSlot};
use super::steal::{Move, MoveKind};
use super::wakers::{OwnerWake, WakerKey};
use super::{Cluster, Effects, ToAgent, cancel_on};
use crate::record::JobRecord;
use crate::spec::{align_of, check_submission, policy_of};
use crate::store::{NodeAdmin, Write};

/// What happens to a job's engine task when it leaves its node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum TaskAfter {
    /// Removed: the job is placed again with a fresh start.
    Remove,
    /// The job ended (its waker history is kept in `wakers`, not in the
    /// engine).
    Retire,
}

/// The engine task of a job. Its time limit is the job's `timeout_ms`
/// (the agent kills the job there), which EASY backfill reads to compute a
/// blocked head's reservation; a job without a timeout has none.
/// `predicted` is its run-time prediction, ns ([`Cluster::predicted_ns`]).
pub(super) fn task_spec(
    e: &JobEntry,
    affinity: Option<Arc<LeafSet>>,
    predicted: Option<u64>,
) -> TaskSpec {
    let default;
    let spec = match e.job().spec() {
        Some(s) => s,
        None => {
            default = JobSpec::default();
            &default
        }
    };
    TaskSpec {
        id: e.task,
        nice: spec.nice,
        latency_nice: spec.latency_nice,
        demand: spec.cpus.max(1),
        affinity,
        policy: Some(policy_of(spec)),
        align: align_of(spec),
        // The job's timeout (ns): EASY backfill's reservations and the
        // pending reasons' "until" come from it.
        time_limit: (spec.timeout_ms > 0).then(|| spec.timeout_ms.saturating_mul(1_000_000)),
        predicted,
    }
}

impl Cluster {
    /// The run-time prediction of a job's engine task, ns
    /// (`ClusterConfig::predict`): its identity's history
    /// ([`super::runtimes`]), for jobs without a time limit, or for every
    /// job; `None` without history.
    pub(super) fn predicted_ns(&self, e: &JobEntry) -> Option<u64> {
        let spec = e.job().spec();
        let limited = spec.is_some_and(|s| s.timeout_ms > 0);
        match self.cfg.predict {
            super::runtimes::Predict::Off => return None,
            super::runtimes::Predict::Unlimited if limited => return None,
            _ => {}
        }
        let group = spec.map_or("", |s| s.group.as_str());
        self.runtimes
            .predict(&e.job().owner, group)
            .map(|ms| ms.saturating_mul(1_000_000))
    }

    /// Accept jobs: validate every spec (nothing is created if one is
    /// bad), create the jobs (arrays expand), persist and place them.
    /// The jobs have no owner (a dispatcher without tokens). Returns the
    /// table's records of the jobs created, shared (their protos are
    /// built by whoever answers: `JobRecord::to_proto`).
    pub fn submit(
        &mut self,
        specs: Vec<JobSpec>,
        batch: bool,
        now: i64,
        fx: &mut Effects,
    ) -> Result<Vec<Arc<JobRecord>>, Status> {
        self.submit_as("", specs, batch, now, fx)
    }

    /// [`Cluster::submit`] for `owner` (the authenticated caller's user),
    /// recorded in each job and sent to its agent with the assignment.
    pub fn submit_as(
        &mut self,
        owner: &str,
        specs: Vec<JobSpec>,
        batch: bool,
        now: i64,
        fx: &mut Effects,
    ) -> Result<Vec<Arc<JobRecord>>, Status> {
        // The keys created, in a buffer kept from the last submission.
        let mut created = std::mem::take(&mut self.created);
        created.clear();
        let r = self.create_as(owner, specs, batch, now, fx, &mut created);
        if r.is_ok() {
            self.place_created(&created, now, fx);
        }
        let r = r.map(|()| self.records_of(&created));
        self.created = created;
        r
    }

    /// Several submissions at once, each [`Cluster::submit_as`] with its
    /// own result (a bad one creates nothing and leaves the others be),
    /// in two steps for all of them: every submission is checked and its
    /// jobs created, in order (a job may name as its waker one that an
    /// earlier submission of the same call created); then every job
    /// created is persisted and placed, and the engine's events are
    /// drained once. The core applies a run of SubmitJob commands this
    /// way: each step's code runs once per job in a row, where one job's
    /// way through a whole submission overflows the CPU's instruction
    /// cache (docs/BENCHMARKS.md, "Batches"). The placements are those of
    /// one submission of all the jobs (as an array's elements are placed).
    pub fn submit_each<'a>(
        &mut self,
        submissions: impl IntoIterator<Item = (&'a str, Vec<JobSpec>, bool)>,
        now: i64,
        fx: &mut Effects,
    ) -> Vec<Result<Vec<Arc<JobRecord>>, Status>> {
        let mut created = std::mem::take(&mut self.created);
        created.clear();
        // Per submission: where its keys end in `created`, or its error.
        let ends: Vec<Result<usize, Status>> = submissions
            .into_iter()
            .map(|(owner, specs, batch)| {
                self.create_as(owner, specs, batch, now, fx, &mut created)
                    .map(|()| created.len())
            })
            .collect();
        if !created.is_empty() {
            self.place_created(&created, now, fx);
        }
        let mut start = 0;
        let results = ends
            .into_iter()
            .map(|end| {
                end.map(|end| {
                    let records = self.records_of(&created[start..end]);
                    start = end;
                    records
                })
            })
            .collect();
        self.created = created;
        results
    }

    /// A submission's first step: check its specs (nothing is created if
    /// one is bad), then create its jobs (arrays and gangs expand), their
    /// keys appended to `created`.
    fn create_as(
        &mut self,
        owner: &str,
        mut specs: Vec<JobSpec>,
        batch: bool,
        now: i64,
        fx: &mut Effects,
        created: &mut Vec<JobKey>,
    ) -> Result<(), Status> {
        let jobs = &self.jobs;
        check_submission(&mut specs, batch, &self.cfg.limits, |id| {
            JobKey::parse(id).is_some_and(|k| jobs.contains(k))
        })?;
        self.ensure_engine(now, fx);
        // One owner for the submission's jobs, shared with the last
        // submission's when it is the same user (an `Arc` per call was an
        // allocation per submit).
        if *self.last_owner != *owner {
            self.last_owner = Arc::from(owner);
        }
        let owner = self.last_owner.clone();
        for spec in specs {
            let n = self.jobs.take_number();
            let count = spec.array_count;
            // A gang: one job per member, `j-N.i`, like an array's elements.
            let gang = spec.nodes > 1;
            if gang {
                self.gangs.insert(n, super::gang::Gang::of_spec(&spec, now));
            }
            // Elements `j-N.i` (a gang's members, an array's elements),
            // else the plain `j-N`.
            let elements = if gang {
                spec.nodes
            } else if count > 1 {
                count
            } else {
                0
            };
            let keys = (0..elements)
                .map(|i| JobKey::element(n, i))
                .chain((elements == 0).then(|| JobKey::single(n)));
            let gang_size = if gang { spec.nodes } else { 0 };
            // Moved into the record, shared by an array's elements.
            let spec = Arc::new(spec);
            for key in keys {
                let job = JobRecord::new(key, spec.clone(), owner.clone(), gang_size, now);
                created.push(key);
                self.jobs
                    .insert(key, job, Phase::Unplaced { why: Unplaced::New });
            }
        }
        Ok(())
    }

    /// A submission's second step: persist and place the jobs `created`,
    /// then drain the engine's events (the starts) and place gangs.
    fn place_created(&mut self, created: &[JobKey], now: i64, fx: &mut Effects) {
        fx.writes.push(Write::PutNextJob(self.jobs.next_number()));
        // A placement and its start's room report refresh the node's
        // aggregates once (readers flush what is pending first).
        let outer = self.engine.defer_aggregates();
        // One job: its start's claim is the next thing the events drain
        // does, so the start may take it at once (`place_as`).
        let single = created.len() == 1;
        for &key in created {
            self.persist_emit(key, JobState::Unspecified, now, fx);
            self.place_as(key, now, fx, single);
        }
        self.process_events(now, fx);
        self.schedule_gangs(now, fx);
        self.engine.settle_aggregates(outer);
    }

    /// The table's records of the jobs `keys`.
    fn records_of(&self, keys: &[JobKey]) -> Vec<Arc<JobRecord>> {
        // Sized at once (a `filter_map` collect starts at 4 and grows).
        let mut records = Vec::with_capacity(keys.len());
        records.extend(keys.iter().filter_map(|k| self.jobs.record(*k)));
        records
    }

    /// Place a PENDING job: into the engine (which runs it on a node with
    /// room or queues it on one), or `Unplaced` when no node can take it.
    pub(super) fn place(&mut self, key: JobKey, now: i64, fx: &mut Effects) {
        self.place_as(key, now, fx, false);
    }

    /// [`Cluster::place`]. With `next_drained`, the caller drains the
    /// engine's events next ([`Cluster::process_events`]) and changes
    /// nothing before: when the job starts at once, the claim of its CPUs
    /// that `on_started` would make first thing is made at the start
    /// ([`sched::Sched::wake_up_placed_claiming`]), and the node's room
    /// after it goes into the engine with the start, which refreshes the
    /// node's leaf once instead of at the start and again at the room
    /// report. Only when nothing can come between the two: no gang
    /// reservation (`on_started` would check the start against it first)
    /// and no freed GPUs (the drain would place GPU waiters first).
    pub(super) fn place_as(&mut self, key: JobKey, now: i64, fx: &mut Effects, next_drained: bool) {
        let claim_now = next_drained && !self.jobs.gpus_freed() && !self.holds_reservation();
        if let Some(gang) = self.gang_of(key) {
            // Never alone in the engine: the gang pass places all members.
            self.gang_member_waits(key, gang);
            return;
        }
        let Some(e) = self.jobs.get(key) else {
            return;
        };
        let default;
        let spec = match e.job().spec() {
            Some(s) => s,
            None => {
                default = JobSpec::default();
                &default
            }
        };
        let task = e.task;
        let holds_gpus = spec.gpus > 0;
        // The waker's flip record (seed 001, kept in `wakers` across
        // re-creations of the task): a flip when the job is woken (new, or
        // a retry), none when it is only placed again.
        let waker = WakerKey::of(e.job());
        let woken = matches!(
            e.phase(),
            Phase::Unplaced {
                why: Unplaced::New | Unplaced::Requeued
            }
        );
        // A new job's task (a fresh id from `Jobs::insert`) was never in
        // the engine.
        let fresh = matches!(e.phase(), Phase::Unplaced { why: Unplaced::New });
        let flips = match &waker {
            Some(w) if woken => self.wakers.record(w, task.0, engine_ns(now)),
            Some(w) => self.wakers.flips(w, engine_ns(now)),
            None => 0,
        };
        if self.engine.sched().is_none() {
            self.jobs.set_phase(
                key,
                Phase::Unplaced {
                    why: Unplaced::NoNodes,
                },
            );
            return;
        }
        let allowed = match self
            .engine
            .allowed_leaves(spec, &self.nodes, |n| self.gpus_free_for(n, Some(key)))
            .and_then(|a| self.outside_reservation(key, spec, a, now))
        {
            Ok(a) => a,
            Err(why) => {
                self.jobs.set_phase(key, Phase::Unplaced { why });
                self.persist(key, fx);
                return;
            }
        };
        let tspec = task_spec(e, allowed, self.predicted_ns(e));
        // Where the waker is: its job's node, else where its last wakee went.
        let waker_node = match &waker {
            Some(WakerKey::Job(k)) => self
                .jobs
                .get(*k)
                .map(|w| w.job().node.as_str())
                .filter(|n| !n.is_empty()),
            _ => None,
        }
        .or_else(|| {
            waker
                .as_ref()
                .and_then(|w| self.wakers.get(w))
                .map(|r| r.node.as_str())
        });
        let waker_leaf = waker_node.and_then(|n| self.engine.built_leaf(n));
        // A user's independent job: placed as `owner_wake` says.
        let owner_wake = match &waker {
            Some(w) if w.is_owner_only() => self.cfg.owner_wake,
            _ => OwnerWake::Affine,
        };
        let Some((engine, slots)) = self.engine.sched_and_slots() else {
            return;
        };
        let outer = match (&waker, waker_leaf) {
            (Some(_), Some(leaf)) if owner_wake == OwnerWake::Fork => Some(Outer::Fork(leaf)),
            (Some(w), Some(leaf)) if owner_wake == OwnerWake::Affine => {
                // The room the waker's burst found: taken at its first flip.
                let room = match self.wakers.get(w).and_then(|r| r.room) {
                    Some(room) if !(woken && flips == 1) => room,
                    _ => {
                        // A deferral may be open (`submit_as`).
                        engine.flush_aggregates();
                        let room = engine.llc_free(leaf);
                        self.wakers.set_room(w, room, engine_ns(now));
                        room
                    }
                };
                Some(Outer::Waker(OuterWaker {
                    leaf,
                    flips,
                    room: Some(room),
                }))
            }
            _ => None,
        };
        if !fresh && engine.has_task(task) {
            let _ = engine.remove_task(task, engine_ns(now));
        }
        // `on_started`'s claim, made at the start (`claim_now`).
        let nodes = &mut self.nodes;
        let mut claimed: Option<(Vec<LeafId>, NodeSlot)> = None;
        let claim = |leaf: LeafId| {
            if !claim_now {
                return None;
            }
            let slot = *slots.get(leaf)?;
            let n = nodes.at_mut(slot)?;
            let cpus = n.claim(spec, Vec::new());
            claimed = Some((cpus, slot));
            Some(n.engine_room())
        };
        let placed = engine.add_task(tspec).and_then(|()| match outer {
            Some(Outer::Fork(from)) => {
                let (leaf, how) = engine.select_task_rq_fork(task, from);
                engine
                    .wake_up_on_claiming(task, leaf, engine_ns(now), claim)
                    .map(|_| (leaf, how))
            }
            Some(Outer::Waker(w)) => {
                let (leaf, how) = engine.select_task_rq_outer(task, w);
                engine
                    .wake_up_on_claiming(task, leaf, engine_ns(now), claim)
                    .map(|_| (leaf, how))
            }
            None => engine
                .wake_up_placed_claiming(task, None, false, engine_ns(now), claim)
                .map(|(leaf, how, _)| (leaf, how)),
        });
        let (leaf, how) = match placed {
            Ok(p) => p,
            Err(err) => {
                let why = Unplaced::EngineRefused(err.to_string());
                self.jobs.set_phase(key, Phase::Unplaced { why });
                return;
            }
        };
        // A GPU job holds its node's GPUs from here on: no steal may move
        // it to a node whose GPUs were taken since its affinity was
        // computed (`gpus.rs`).
        if holds_gpus
            && let Some(TaskState::Queued(at) | TaskState::Running(at)) = engine.task_state(task)
        {
            let here = Arc::new(LeafSet::from_leaves(engine.topology().nr_leaves(), [at]));
            let _ = engine.set_cpus_allowed_ptr(task, Some(here));
        }
        let waiting = matches!(engine.task_state(task), Some(TaskState::Queued(_)));
        if let Some((cpus, slot)) = claimed
            && let Some((m, on)) = self.jobs.model_mut(key)
        {
            *m = cpus;
            *on = Some(slot);
        }
        let node = self.engine.name_at(leaf).cloned().unwrap_or_default();
        if let Some(w) = &waker {
            self.wakers.placed(w, &node, engine_ns(now));
        }
        // A new job's Queued phase is written in place (the general path
        // takes the others: a retry, a job placed again).
        let node = if fresh {
            match self.jobs.queue_new(key, node, how, waiting, leaf) {
                Ok(()) => return,
                Err(node) => node,
            }
        } else {
            node
        };
        self.jobs.set_phase(
            key,
            Phase::Queued {
                node,
                via: Via::Placed(how),
                waiting,
            },
        );
    }

    /// Turn engine events into job transitions, agent messages and moves.
    /// A migration is a newidle steal ([`MoveKind::Stolen`]).
    pub(super) fn process_events(&mut self, now: i64, fx: &mut Effects) {
        self.process_events_as(now, fx, MoveKind::Stolen);
    }

    /// [`Cluster::process_events`], with the move kind a migration gets
    /// (the mechanism that ran since the events were last drained).
    pub(super) fn process_events_as(
        &mut self,
        now: i64,
        fx: &mut Effects,
        pulled: fn(StealLevel) -> MoveKind,
    ) {
        let mut events = self.engine.take_event_buf();
        // Leaves where the engine started a task that had moved on by the
        // time its event was read (`on_started`).
        let mut stale_starts: Vec<LeafId> = Vec::new();
        loop {
            // Jobs waiting for GPUs, when a job's GPUs were freed.
            self.place_gpu_waiters(now, fx);
            match self.engine.sched_mut() {
                Some(e) => e.drain_events_into(&mut events),
                None => break,
            }
            if events.is_empty() {
                if stale_starts.is_empty() {
                    break;
                }
                // Every start the engine made is now claimed in the model
                // (or undone), so the model's room is the node's room.
                // Pushing it reschedules the leaf (`set_free_summary`): a
                // job queued there may start, and the next round claims
                // that start (left undrained, the job would not be sent
                // and the engine's room would stay below the model's).
                for leaf in std::mem::take(&mut stale_starts) {
                    if let Some(name) = self.engine.node_at(leaf).map(str::to_owned) {
                        self.sync_summary(&name, now);
                    }
                }
                continue;
            }
            for ev in events.drain(..) {
                match ev {
                    sched::SchedEvent::Started { task, leaf } => {
                        self.on_started(task, leaf, now, fx, &mut stale_starts)
                    }
                    sched::SchedEvent::Migrated { task, from, to } => {
                        self.on_migrated(task, from, to, now, pulled, fx)
                    }
                    sched::SchedEvent::Preempted { .. } => {}
                }
            }
        }
        self.engine.put_event_buf(events);
    }

    /// A node with room took a queued job (a newidle steal, or a pull of
    /// the idle-balance pass: `pulled` says which).
    fn on_migrated(
        &mut self,
        task: TaskId,
        from: LeafId,
        to: LeafId,
        now: i64,
        pulled: fn(StealLevel) -> MoveKind,
        fx: &mut Effects,
    ) {
        let (Some(from), Some(to)) = (self.engine.name_at(from), self.engine.name_at(to)) else {
            return;
        };
        let (from, to) = (from.clone(), to.clone());
        let Some(key) = self.jobs.of_task(task) else {
            return;
        };
        if !matches!(
            self.jobs.get(key).map(JobEntry::phase),
            Some(Phase::Queued { .. })
        ) {
            return;
        }
        // Events are drained after whole operations: the task may have
        // been placed again since it was stolen. Only where it is now
        // counts.
        let (to_leaf, now_state) = (
            self.engine.built_leaf(&to),
            self.engine.sched().and_then(|e| e.task_state(task)),
        );
        let waiting = match now_state {
            Some(TaskState::Queued(l)) if Some(l) == to_leaf => true,
            Some(TaskState::Running(l)) if Some(l) == to_leaf => false,
            _ => return,
        };
        let level = self.steal_level(&from, &to);
        self.jobs.set_phase(
            key,
            Phase::Queued {
                node: to.clone(),
                via: Via::Stolen {
                    from: from.clone(),
                    level,
                },
                waiting,
            },
        );
        let m = Move {
            at_ms: now,
            job: key,
            from,
            to,
            kind: pulled(level),
        };
        self.record_move(m, fx);
    }

    /// The engine started a queued job on a node: send it there. A start
    /// whose job has moved on since goes to `stale_starts` (the engine
    /// counted it in that leaf's room).
    fn on_started(
        &mut self,
        task: TaskId,
        leaf: LeafId,
        now: i64,
        fx: &mut Effects,
        stale_starts: &mut Vec<LeafId>,
    ) {
        let Some(key) = self.jobs.of_task(task) else {
            return;
        };
        let Some(name) = self.engine.name_at(leaf).cloned() else {
            return;
        };
        let Some(e) = self.jobs.get(key) else {
            return;
        };
        // Only a PENDING job in the engine is sent; a job already on its
        // node re-entering a rebuilt engine is not.
        let via = match e.phase() {
            Phase::Queued {
                node,
                via: Via::Placed(how),
                waiting: true,
            } if *node == name => Via::Waited(*how),
            Phase::Queued { via, .. } => via.clone(),
            _ => return,
        };
        // Events are drained after whole operations, so a Started event
        // may be stale (the task was preempted and placed elsewhere since):
        // only the leaf the task runs on now counts.
        let running_here = self
            .engine
            .sched()
            .and_then(|en| en.task_state(task))
            .is_some_and(|s| s == TaskState::Running(leaf));
        if !running_here {
            // The engine counted this start in the leaf's room, and the
            // model never claimed it: the drain's end gives the node the
            // model's room again.
            stale_starts.push(leaf);
            return;
        }
        if self.breaks_reservation(key, leaf, now) {
            // EASY backfill at gang level, checked when it would start: it
            // would not leave the reserved node by the gang's start.
            if let Some(engine) = self.engine.sched_mut() {
                let _ = engine.block(task, engine_ns(now));
            }
            // The engine counted the start in the node's room: the model,
            // which never claimed, says again what is free.
            self.sync_summary(&name, now);
            self.place(key, now, fx);
            self.persist(key, fx);
            return;
        }
        let Some(e) = self.jobs.get(key) else {
            return;
        };
        let after = e.requeues.last().cloned();
        // Model the CPUs the agent will give it, and tell the engine the
        // node's room after them ([`Self::sync_summary`] of the node at
        // `leaf`: the engine's leaves, node names and registry slots are
        // one-to-one, so none is looked up by name again).
        debug_assert_eq!(self.engine.built_leaf(&name), Some(leaf), "{name}");
        let slot = self.engine.slot_at(leaf);
        debug_assert_eq!(slot, self.nodes.slot(&name), "{name}");
        // Claimed at the start already, the room reported with it
        // (`place_as`): the model holds the claim on this node.
        let claimed = slot.is_some() && e.model_node == slot;
        if !claimed {
            let cpus = match slot.and_then(|s| self.nodes.at_mut(s)) {
                Some(n) => {
                    let cpus = match e.job().spec.as_ref() {
                        Some(spec) => n.claim(spec, Vec::new()),
                        None => n.claim(&JobSpec::default(), Vec::new()),
                    };
                    self.engine.report_summary(leaf, n, now);
                    cpus
                }
                None => Vec::new(),
            };
            if let Some((m, on)) = self.jobs.model_mut(key) {
                *m = cpus;
                *on = slot;
            }
        }
        // A job queued to be sent becomes Assigned in place (its Queued
        // phase's name and way move into the new phase); the general path
        // takes the others (a job that waited, was stolen or requeued).
        let to_agent = if self.jobs.assign_started(key, &name, now) {
            name.clone()
        } else {
            let previous = self.jobs.replace_phase(
                key,
                Phase::Assigned {
                    node: name.clone(),
                    since: now,
                    steal_asked: None,
                    via: via.clone(),
                },
            );
            // The queued phase's copy of the node's name, reused.
            match previous {
                Some(Phase::Queued { node, .. }) if node == name => node,
                _ => name.clone(),
            }
        };
        // A plain job's Assign (its record) pushed as built: through
        // `assign_msg`'s return the whole message enum was copied.
        match self.jobs.get(key) {
            Some(e) if !e.job().is_gang() => {
                fx.to_agents.push((to_agent, ToAgent::Assign(e.record())));
            }
            _ => {
                let Some(assign) = self.assign_msg(key) else {
                    return;
                };
                fx.to_agents.push((to_agent, assign));
            }
        }
        let m = Move {
            at_ms: now,
            job: key,
            from: NodeName::default(),
            to: name,
            kind: MoveKind::Placed { via, after },
        };
        self.record_move(m, fx);
        self.persist_emit(key, JobState::Pending, now, fx);
    }

    /// Free what a job holds on its node: its modelled CPUs, and its
    /// engine task.
    pub(super) fn release_from_node(&mut self, key: JobKey, after: TaskAfter, now: i64) {
        if let Some((task, _)) = self.release_cpus(key) {
            self.drop_task(task, after, now);
        }
    }

    /// The engine's part of [`Self::release_from_node`].
    fn drop_task(&mut self, task: TaskId, after: TaskAfter, now: i64) {
        match after {
            TaskAfter::Remove => self.engine.remove(task, now),
            TaskAfter::Retire => self.engine.retire(task, now),
        }
    }

    /// The model's part of [`Self::release_from_node`]: the job's CPUs
    /// freed on its node. Returns its engine task and its node's slot
    /// (None for an unknown job; no slot when no node has its node's
    /// name).
    fn release_cpus(&mut self, key: JobKey) -> Option<(TaskId, Option<NodeSlot>)> {
        let (cpus, on) = self
            .jobs
            .model_mut(key)
            .map(|(m, on)| (std::mem::take(m), on.take()))?;
        let e = self.jobs.get(key)?;
        // The node its CPUs were claimed on, when that is still its node
        // (a name compare); else found by name. The job table and the
        // node model are separate fields: the name is borrowed.
        let name = &e.job().node;
        let slot = on
            .filter(|&s| self.nodes.at(s).is_some_and(|n| n.name == *name))
            .or_else(|| self.nodes.slot(name));
        if let Some(n) = slot.and_then(|s| self.nodes.at_mut(s)) {
            n.release(&cpus);
        }
        Some((e.task, slot))
    }

    /// [`Self::release_from_node`] of a job that ends
    /// ([`TaskAfter::Retire`]), with its node's modelled room after the
    /// release passed into the task's removal when the node takes new
    /// jobs: the engine refreshes the node's leaf and the aggregates above
    /// it once, where the removal and then [`Self::sync_summary`] did it
    /// twice. True when the room was passed (the caller does not sync it
    /// again).
    fn release_ended(&mut self, key: JobKey, now: i64) -> bool {
        let Some((task, slot)) = self.release_cpus(key) else {
            return false;
        };
        // `slot`: the job's node's, as the release found it.
        let room = slot.and_then(|s| {
            let n = self.nodes.at(s).filter(|n| n.schedulable())?;
            let leaf = self.engine.built_leaf_at(s)?;
            Some((leaf, n.engine_room()))
        });
        match room {
            Some((leaf, summary)) => self.engine.retire_freeing(task, leaf, summary, now),
            None => {
                self.drop_task(task, TaskAfter::Retire, now);
                false
            }
        }
    }

    /// A load report (the heartbeat). A node marked DOWN whose stream
    /// stayed open (it stalled, then recovered) is back: its jobs were
    /// already retried or lost, and anything it still runs from before is
    /// cancelled when it reports it.
    pub fn load_report(
        &mut self,
        node: &str,
        load: impl Into<PackedLoad>,
        now: i64,
        fx: &mut Effects,
    ) {
        let mut revived = false;
        if let Some(n) = self.nodes.get_mut(node) {
            n.load = load.into();
            n.last_heartbeat_ms = now;
            if n.down && n.connected {
                n.down = false;
                revived = true;
            }
        }
        if revived {
            tracing::info!(%node, "node reports again: it is up");
            self.ensure_engine(now, fx);
            self.refresh_capacity(node, now, fx);
            self.sync_summary(node, now);
            self.retry_unplaced(now, fx);
            self.process_events(now, fx);
            self.idle_balance(now, fx);
        }
    }

    /// Any message from an agent proves it alive.
    pub fn load_report_time(&mut self, node: &str, now: i64) {
        if let Some(n) = self.nodes.get_mut(node) {
            n.last_heartbeat_ms = now;
        }
    }

    /// [`Self::load_report_time`] for every node at once (the core, before
    /// its tick): `last` gives the time of a node's last message, and a
    /// later one than its heartbeat time moves it there.
    pub fn heard_from(&mut self, mut last: impl FnMut(&str) -> Option<i64>) {
        for n in self.nodes.iter_mut() {
            if let Some(t) = last(&n.name)
                && t > n.last_heartbeat_ms
            {
                n.last_heartbeat_ms = t;
            }
        }
    }

    /// An agent's batch of job statuses, applied one by one and in order
    /// ([`Cluster::job_status`]) with the node aggregates' refresh
    /// deferred over the whole batch: the batch's ends on one node
    /// refresh its aggregates once, not once each (a reader in between,
    /// a placement or a steal, flushes what is pending first, so every
    /// decision reads the same aggregates).
    pub fn job_statuses(
        &mut self,
        node: &str,
        statuses: impl IntoIterator<Item = JobStatus>,
        now: i64,
        fx: &mut Effects,
    ) {
        self.ensure_engine(now, fx);
        let outer = self.engine.defer_aggregates();
        for status in statuses {
            self.job_status(node, status, now, fx);
        }
        self.engine.settle_aggregates(outer);
    }

    /// A job status from an agent. A report about anything but the
    /// current attempt on the node the dispatcher names is stale: a stale
    /// copy reported running is cancelled.
    pub fn job_status(&mut self, node: &str, status: JobStatus, now: i64, fx: &mut Effects) {
        self.ensure_engine(now, fx);
        let key = JobKey::parse(&status.job_id);
        let current = key.and_then(|k| self.jobs.get(k));
        let ours = current.is_some_and(|e| {
            e.job().attempt == status.attempt && e.job().node == node && !e.phase().is_done()
        });
        if let (true, Some(key)) = (ours, key) {
            // The removal and the starts it allows refresh a node's
            // aggregates once (see `submit_as`).
            let outer = self.engine.defer_aggregates();
            self.apply_status_of(node, key, status, now, fx);
            self.process_events(now, fx);
            self.engine.settle_aggregates(outer);
        } else if matches!(JobState::try_from(status.state), Ok(JobState::Running)) {
            cancel_on(NodeName::from(node), status.job_id, status.attempt, fx);
        } else {
            // A stale attempt that ended: its result may be the job's.
            self.adopt_stale_end(node, &status, now, fx);
        }
    }

    /// Apply a status of the current attempt.
    pub(super) fn apply_status(
        &mut self,
        node: &str,
        status: JobStatus,
        now: i64,
        fx: &mut Effects,
    ) {
        if let Some(key) = JobKey::parse(&status.job_id) {
            self.apply_status_of(node, key, status, now, fx);
        }
    }

    /// [`Self::apply_status`] of the job `key` (`status.job_id` parsed).
    fn apply_status_of(
        &mut self,
        node: &str,
        key: JobKey,
        status: JobStatus,
        now: i64,
        fx: &mut Effects,
    ) {
        let Some(e) = self.jobs.get(key) else { return };
        match JobState::try_from(status.state).unwrap_or(JobState::Unspecified) {
            JobState::Running => {
                let via = match e.phase() {
                    Phase::Queued { via, .. }
                    | Phase::Assigned { via, .. }
                    | Phase::Running { via, .. } => via.clone(),
                    _ => Via::Restored,
                };
                // The record's copy of the name when it is this node's
                // (a count, not an allocation).
                let node_name = if e.job().node == node {
                    e.job().node.clone()
                } else {
                    NodeName::from(node)
                };
                let previous = self.jobs.set_phase(
                    key,
                    Phase::Running {
                        node: node_name,
                        via,
                    },
                );
                if let Some(mut f) = self.jobs.facts(key) {
                    f.set_cpus(&status.cpus);
                    f.set_gpus(&status.gpus);
                    f.set_start(if status.time_ms > 0 {
                        status.time_ms
                    } else {
                        now
                    });
                }
                self.remodel_cpus(key);
                self.sync_summary(node, now);
                if previous != JobState::Running {
                    self.persist_emit(key, previous, now, fx);
                }
            }
            terminal @ (JobState::Succeeded
            | JobState::Failed
            | JobState::Cancelled
            | JobState::Lost) => {
                // A job that ends here (not done yet) takes its end time
                // with the report's facts: one copy-on-write access of
                // its record, where `finish` took a second.
                let ends = !e.phase().is_done();
                if let Some(mut f) = self.jobs.facts(key) {
                    f.set_exit(status.exit_code, status.signal);
                    if !status.cpus.is_empty() {
                        f.set_cpus(&status.cpus);
                    }
                    if !status.gpus.is_empty() {
                        f.set_gpus(&status.gpus);
                    }
                    if status.time_ms > 0 {
                        f.set_start(status.time_ms);
                    }
                    if ends {
                        f.set_end(now);
                    }
                }
                let end = End::Reported(status.message);
                let done = Phase::Done {
                    state: terminal,
                    end,
                };
                if ends {
                    self.finish_ended(key, done, now, fx);
                } else {
                    self.finish(key, done, now, fx);
                }
            }
            JobState::Assigned | JobState::Pending | JobState::Unspecified => {}
        }
    }

    /// Put a job in a terminal phase (`done`): free its CPUs and its engine
    /// capacity (which may start or steal queued jobs), persist, announce.
    pub(super) fn finish(&mut self, key: JobKey, done: Phase, now: i64, fx: &mut Effects) {
        if self.jobs.get(key).is_none_or(|e| e.phase().is_done()) {
            return;
        }
        if let Some(mut f) = self.jobs.facts(key) {
            f.set_end(now);
        }
        self.finish_ended(key, done, now, fx);
    }

    /// [`Self::finish`] of a job not done whose end time is set.
    fn finish_ended(&mut self, key: JobKey, done: Phase, now: i64, fx: &mut Effects) {
        // Its run time joins its user's history before its room goes to
        // others, so the jobs it lets start are predicted with it.
        if let (Phase::Done { state, .. }, Some(e)) = (&done, self.jobs.get(key))
            && matches!(state, JobState::Succeeded | JobState::Failed)
        {
            let j = e.job();
            if j.start_time_ms > 0 && now >= j.start_time_ms {
                let group = j.spec().map_or("", |s| s.group.as_str());
                let owner = j.owner.clone();
                self.runtimes
                    .record(&owner, group, (now - j.start_time_ms) as u64);
            }
        }
        let synced = self.release_ended(key, now);
        let previous = self.jobs.set_phase(key, done);
        self.persist_emit(key, previous, now, fx);
        // `synced`: the release found the node in the engine and taking
        // new jobs, and passed its room; neither the node nor the engine
        // changed since, so there is nothing more to do for the node (and
        // its name is not copied and looked up twice more).
        if !synced {
            let node = self
                .jobs
                .get(key)
                .map(|e| e.job().node.clone())
                .unwrap_or_default();
            if !node.is_empty() && self.engine.built_leaf(&node).is_some() {
                if !self.nodes.get(&node).is_some_and(NodeInfo::schedulable) {
                    self.refresh_capacity(&node, now, fx);
                }
                self.sync_summary(&node, now);
            }
        }
        self.process_events(now, fx);
        // The node gained room: the idle-balance pass (nohz kick).
        self.idle_balance(now, fx);
        if let Some(gang) = self.gang_of(key) {
            self.gang_member_ended(key, gang, now, fx);
        }
        self.schedule_gangs(now, fx);
    }

    /// The agent's stream closed. The node stays up until its heartbeats
    /// are overdue, so a quick reconnect loses nothing.
    pub fn disconnected(&mut self, node: &str) {
        if let Some(n) = self.nodes.get_mut(node) {
            n.connected = false;
        }
    }

    /// A job on a lost node: retry it within its budget, else LOST (or
    /// CANCELLED when its cancel was requested).
    pub(super) fn job_lost_on_node(
        &mut self,
        key: JobKey,
        why: &'static str,
        now: i64,
        fx: &mut Effects,
    ) {
        let Some(e) = self.jobs.get(key) else { return };
        if e.phase().is_done() {
            return;
        }
        if e.cancel_requested() {
            let done = Phase::Done {
                state: JobState::Cancelled,
                end: End::CancelledLost,
            };
            self.finish(key, done, now, fx);
            return;
        }
        if let Some(gang) = self.gang_of(key) {
            self.gang_member_lost(key, gang, why, now, fx);
            return;
        }
        let retries = e.job().spec.as_ref().map_or(0, |s| s.retries);
        let attempt = e.job().attempt;
        let node = e.job().node.clone();
        // The node may only be stalled with its stream still open (a
        // paused agent, a partition that keeps the TCP connection): tell
        // it to cancel this attempt, so the copy stops as soon as the node
        // reads its stream again instead of running beside the retry. A
        // disconnected node gets it when it re-registers (the stale
        // attempt is cancelled there).
        if !node.is_empty() {
            cancel_on(node.clone(), key.to_string(), attempt, fx);
        }
        if attempt > retries {
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
        self.release_from_node(key, TaskAfter::Remove, now);
        if let Some(mut f) = self.jobs.facts(key) {
            f.next_attempt();
            f.set_cpus(&[]);
            f.set_gpus(&[]);
            f.set_start(0);
        }
        let retry = Requeue::Retry {
            n: attempt,
            of: retries,
            node: node.to_string(),
            why,
        };
        self.jobs.push_requeue(key, retry);
        let previous = self.jobs.set_phase(
            key,
            Phase::Unplaced {
                why: Unplaced::Requeued,
            },
        );
        // The lost node's capacity shrinks to what its remaining jobs hold
        // before the retry is placed: removing the task freed capacity
        // there.
        if !self.nodes.get(&node).is_some_and(NodeInfo::schedulable) {
            self.refresh_capacity(&node, now, fx);
        }
        self.persist_emit(key, previous, now, fx);
        self.place(key, now, fx);
    }

    /// Periodic work: overdue heartbeats make nodes DOWN, restored jobs
    /// whose node never came back are lost, busy flags are set lazily,
    /// agents are asked to give back jobs they hold unstarted.
    pub fn tick(&mut self, now: i64, fx: &mut Effects) {
        self.ensure_engine(now, fx);
        let deadline = (self.cfg.heartbeat_interval_ms * self.cfg.missed_heartbeats) as i64;
        let overdue = self.nodes.overdue(now, deadline);
        // Every overdue node is DOWN, with its capacity shrunk, before any
        // job is retried: no retry lands on a node this tick marks DOWN.
        for name in &overdue {
            tracing::warn!(node = %name, "node missed its heartbeats: marking it down");
            if let Some(n) = self.nodes.get_mut(name) {
                n.down = true;
            }
        }
        for name in &overdue {
            self.shrink_capacity(name, now);
        }
        for name in overdue {
            for key in self.jobs.on(&name, self.nodes.slot(&name)) {
                self.job_lost_on_node(key, "missed heartbeats", now, fx);
            }
            self.refresh_capacity(&name, now, fx);
        }
        for key in self.jobs.awaiting() {
            let expired = matches!(
                self.jobs.get(key).map(JobEntry::phase),
                Some(Phase::AwaitingNode { deadline, .. }) if *deadline <= now
            );
            if expired {
                self.job_lost_on_node(
                    key,
                    "its node did not come back after a dispatcher restart",
                    now,
                    fx,
                );
            }
        }
        if let Some(engine) = self.engine.sched_mut() {
            // NO_HZ idle: nodes with nothing on them do not tick.
            engine.tick_all(engine_ns(now));
        }
        self.process_events(now, fx);
        // The periodic balance: work a missed newidle moment left waiting.
        self.idle_balance(now, fx);
        self.request_agent_steals(now, fx);
        // Gangs: a preferred level may have relaxed, nodes may be free.
        self.schedule_gangs(now, fx);
        self.retire_done(now, fx);
    }

    /// Forget the terminal jobs whose retention is over
    /// ([`super::Retention`]): out of the table, and out of the store in
    /// the same commit as the rest of the tick's changes (a job deleted
    /// is never reloaded; one kept is reloaded with its end time, which
    /// its retention counts from). A gang is forgotten with its last
    /// member. The tick's last step; public for the placement bench,
    /// whose nodes send no heartbeats (the whole tick would mark them
    /// DOWN as its clock advances) but whose steady state must forget
    /// done jobs as the dispatcher does.
    pub fn retire_done(&mut self, now: i64, fx: &mut Effects) {
        let r = self.cfg.retention;
        if r == super::Retention::KEEP_ALL {
            return;
        }
        let mut expired = self.jobs.expired(now, r.min_age_ms, r.max_done_jobs);
        // In key order: each removal's search of the table's key order
        // then starts a few places from the last one's (`slab::Order::search`).
        expired.sort_unstable();
        // Their records were last touched when they ended: the loads of
        // a window of them are issued together, while the window before
        // is dropped, so that the misses overlap with each other and with
        // the drops. A window, not the whole tick's: a dispatcher at
        // 50,000 jobs/s forgets ~25,000 a tick, whose lines, fetched at
        // once, would push each other out of the cache before their drop.
        let mut windows = expired.chunks(PREFETCH_WINDOW).peekable();
        if let Some(first) = windows.peek() {
            self.jobs.prefetch_records(first);
        }
        while let Some(window) = windows.next() {
            if let Some(next) = windows.peek() {
                self.jobs.prefetch_records(next);
            }
            for &key in window {
                self.retire_one(key, fx);
            }
        }
    }

    /// Forget the done job `key` (one of [`Cluster::retire_done`]'s).
    fn retire_one(&mut self, key: JobKey, fx: &mut Effects) {
        if self.jobs.remove(key).is_none() {
            return;
        }
        fx.writes.push(Write::DeleteJob(key));
        if !key.is_single() && self.jobs.elements(key.array()).next().is_none() {
            self.gangs.remove(key.number());
        }
    }

    /// Place every unplaced job again (a node came up or registered).
    /// Latency-class jobs (latency_nice < 0) are placed first, then the
    /// others, each in submission order: when room is scarce the latency
    /// class gets it (seed 004 at cluster level).
    pub(super) fn retry_unplaced(&mut self, now: i64, fx: &mut Effects) {
        let mut keys = self.jobs.unplaced();
        let latency = |k: &JobKey| {
            self.jobs
                .get(*k)
                .and_then(|e| e.job().spec.as_ref())
                .is_some_and(|s| s.latency_nice < 0)
        };
        keys.sort_by_key(|k| (!latency(k), *k));
        for key in keys {
            self.place(key, now, fx);
            self.persist(key, fx);
        }
        self.schedule_gangs(now, fx);
    }

    /// Cancel a job, or every element of an array.
    pub fn cancel(&mut self, id: &str, now: i64, fx: &mut Effects) -> Result<Job, Status> {
        self.ensure_engine(now, fx);
        let not_found = || Status::not_found(format!("id: no job {id:?}"));
        let key = JobKey::parse(id).ok_or_else(not_found)?;
        if !self.jobs.contains(key) && key.is_single() {
            let elements: Vec<JobKey> = self.jobs.elements(key).collect();
            let first = *elements.first().ok_or_else(not_found)?;
            for k in elements {
                self.cancel_one(k, now, fx);
            }
            return Ok(self
                .jobs
                .get(first)
                .map(|e| e.job().to_proto())
                .unwrap_or_default());
        }
        if !self.jobs.contains(key) {
            return Err(not_found());
        }
        self.cancel_one(key, now, fx);
        self.process_events(now, fx);
        self.get_job(id)
    }

    fn cancel_one(&mut self, key: JobKey, now: i64, fx: &mut Effects) {
        let Some(e) = self.jobs.get(key) else { return };
        let cancelled = |end| Phase::Done {
            state: JobState::Cancelled,
            end,
        };
        match e.phase() {
            Phase::Unplaced { .. } | Phase::Queued { .. } => {
                self.finish(key, cancelled(End::CancelledPending), now, fx);
            }
            Phase::Assigned { node, .. }
            | Phase::Running { node, .. }
            | Phase::AwaitingNode { node, .. } => {
                let node = node.clone();
                let attempt = e.job().attempt;
                if self.nodes.get(&node).is_some_and(NodeInfo::reachable) {
                    if let Some(mut f) = self.jobs.facts(key) {
                        f.request_cancel();
                    }
                    self.persist(key, fx);
                    cancel_on(node, key.to_string(), attempt, fx);
                } else {
                    self.finish(
                        key,
                        cancelled(End::CancelledUnreachable(node.to_string())),
                        now,
                        fx,
                    );
                }
            }
            Phase::Done { .. } => {}
        }
    }

    /// Cordon, drain or uncordon a node.
    pub fn set_node_admin(
        &mut self,
        name: &str,
        admin: NodeAdmin,
        now: i64,
        fx: &mut Effects,
    ) -> Result<proto::v1::Node, Status> {
        self.ensure_engine(now, fx);
        let n = self
            .nodes
            .get_mut(name)
            .ok_or_else(|| Status::not_found(format!("name: no node {name:?}")))?;
        n.admin = admin;
        fx.writes.push(Write::PutNodeAdmin(name.to_string(), admin));
        self.refresh_capacity(name, now, fx);
        // An uncordoned node has room again.
        self.idle_balance(now, fx);
        self.schedule_gangs(now, fx);
        self.node(name).map(|n| self.node_proto(n))
    }
}

/// How `place` hands a job's waker to the engine.
enum Outer {
    /// The fork path from this leaf's zone ([`OwnerWake::Fork`]).
    Fork(sched::LeafId),
    /// Wake-affine / wake_wide toward the waker.
    Waker(OuterWaker),
}
