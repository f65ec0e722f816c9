//! Agent registration and reconciliation: a (re-)registering agent
//! reports the job attempts it holds; the dispatcher matches them with
//! its own record.
//!
//! Invariants after a registration: every attempt the agent reports that
//! is not the current attempt of a live job the dispatcher places on that
//! node is cancelled there, unless it is an attempt lost with that node
//! that ended (SUCCEEDED or FAILED) while its retry waits unsent (the job
//! then ends with that result: `Cluster::adopt_stale_end`); every job the
//! dispatcher places on the node
//! that the agent does not report is re-sent (ASSIGNED), retried or lost
//! (RUNNING), or ends CANCELLED (its cancel was requested); a reported
//! job whose cancel was requested gets its `Cancel` again.

use std::collections::{HashMap, HashSet};

use proto::v1::{JobState, JobStatus, Register};
use sched::{LeafId, TaskState};
use tonic::Status;

use super::engine::engine_ns;
use super::jobs::{End, JobKey, Phase, Requeue, Via};
use super::lifecycle::task_spec;
use super::nodes::{NodeInfo, Place};
use super::shapes::Labels;
use super::{Cluster, Effects, NodeName, cancel_on};

impl Cluster {
    /// An agent registers (or re-registers after a reconnect).
    pub fn register(&mut self, reg: Register, now: i64, fx: &mut Effects) -> Result<u64, Status> {
        if reg.node.is_empty() {
            return Err(Status::invalid_argument("register.node: empty"));
        }
        // A larger value would overflow the node's slots.
        if reg.oversubscribe > super::MAX_OVERSUBSCRIBE {
            return Err(Status::invalid_argument(format!(
                "register.oversubscribe: {} jobs per CPU, at most {}",
                reg.oversubscribe,
                super::MAX_OVERSUBSCRIBE
            )));
        }
        let topology = reg
            .topology
            .clone()
            .ok_or_else(|| Status::invalid_argument("register.topology: missing"))?;
        let cpu = self
            .nodes
            .cpu_tree(&topology)
            .map_err(|e| Status::invalid_argument(format!("register.{e}")))?;
        let topology = self.nodes.shapes.intern(topology);
        let label = |labels: &HashMap<String, String>, k: &str, default: &str| {
            labels
                .get(k)
                .cloned()
                .unwrap_or_else(|| default.to_string())
        };
        let place = Place {
            zone: label(&reg.labels, &self.cfg.zone_label, "default"),
            rack: label(&reg.labels, &self.cfg.rack_label, "default"),
            hostgroup: label(&reg.labels, &self.cfg.hostgroup_label, ""),
            region: label(&reg.labels, &self.cfg.region_label, "default"),
        };
        let gpus = super::nodes::count_gpus(&reg.devices);
        let changed = match self.nodes.get(&reg.node) {
            None => true,
            Some(old) => {
                old.oversubscribe != reg.oversubscribe.max(1)
                    || *old.topology != *topology
                    || **old.place() != place
                    || old.gpus != gpus
            }
        };
        let mut node = NodeInfo::new(reg.node.clone(), topology, cpu, now);
        node.labels = Labels::new(&reg.labels, &mut self.nodes.strings);
        node.set_place(self.nodes.places.intern(place));
        node.memory_bytes = reg.memory_bytes;
        node.gpus = gpus;
        node.devices = self.nodes.devices.intern(&reg.devices);
        node.oversubscribe = reg.oversubscribe.max(1);
        node.admin = self.nodes.admin_of(&reg.node);
        let old = self.nodes.insert(node);
        // Re-mark CPUs held by jobs the dispatcher has on this node.
        let held = self.jobs.on(&reg.node, self.nodes.slot(&reg.node));
        for &key in &held {
            self.remodel_cpus(key);
        }
        if changed {
            self.engine.mark_dirty();
        }
        // Reconcile by attempt: a stale attempt still running there must
        // not hide that the current one is missing.
        let reported: HashSet<(String, u32)> = reg
            .jobs
            .iter()
            .map(|s| (s.job_id.clone(), s.attempt))
            .collect();
        for status in reg.jobs {
            let key = JobKey::parse(&status.job_id);
            let current = key.filter(|&k| {
                self.jobs.get(k).is_some_and(|e| {
                    e.job().attempt == status.attempt
                        && e.job().node == reg.node
                        && !e.phase().is_done()
                })
            });
            match current {
                Some(k) => {
                    self.reclaim(k, now);
                    if !self.engine.is_dirty() {
                        self.engine_add_on_node(k, now);
                    }
                    // The Cancel may have been lost with the old stream or
                    // a dispatcher crash: send it again.
                    let cancel = self.jobs.get(k).is_some_and(|e| e.cancel_requested());
                    if cancel && !crate::record::is_terminal_state(status.state) {
                        cancel_on(
                            NodeName::from(&reg.node),
                            status.job_id.clone(),
                            status.attempt,
                            fx,
                        );
                    }
                    self.apply_status(&reg.node, status, now, fx);
                }
                None if self.adopt_stale_end(&reg.node, &status, now, fx) => {}
                None => {
                    // Unknown, stale attempt, or already finished here: make
                    // sure it does not run twice.
                    if matches!(
                        JobState::try_from(status.state),
                        Ok(JobState::Running | JobState::Assigned)
                    ) {
                        cancel_on(
                            NodeName::from(&reg.node),
                            status.job_id.clone(),
                            status.attempt,
                            fx,
                        );
                    }
                }
            }
        }
        // Jobs we had on this node that the agent no longer knows.
        if old.is_some() || !reported.is_empty() || !held.is_empty() {
            for key in held {
                self.reconcile_missing(key, &reg.node, &reported, now, fx);
            }
        }
        if !self.engine.is_dirty() {
            // A known node re-registered: no new tree needed.
            self.refresh_capacity(&reg.node, now, fx);
            self.sync_summary(&reg.node, now);
            self.retry_unplaced(now, fx);
            self.process_events(now, fx);
            self.idle_balance(now, fx);
        }
        // Otherwise the tree is rebuilt once by `settle` (the core calls it
        // after every batch), so a thousand agents registering at once
        // cost one rebuild, not a thousand.
        Ok(self.cfg.heartbeat_interval_ms)
    }

    /// A stale attempt that the dispatcher retried after losing `node`
    /// reports from there that it ended, SUCCEEDED or FAILED: it ran to
    /// its end while the node was cut off (before its lease fenced it),
    /// and the report came when the node returned. While the retry waits
    /// unsent (PENDING: no node was sent its Assign), the job takes that
    /// result: the retry is withdrawn and the job ends in the attempt's
    /// state with its facts, so a job that finished is not run again (a
    /// job's `retries` are for attempts lost with their node, and this
    /// one was not lost: its program ran to its exit, as Slurm records a
    /// job that ended before its node failed). A retry already sent may
    /// start before a Cancel reaches its node, and a gang's members
    /// restart together: the report is then stale as before. Returns
    /// whether the job took the result.
    pub(super) fn adopt_stale_end(
        &mut self,
        node: &str,
        status: &JobStatus,
        now: i64,
        fx: &mut Effects,
    ) -> bool {
        let state = match JobState::try_from(status.state) {
            Ok(s @ (JobState::Succeeded | JobState::Failed)) => s,
            _ => return false,
        };
        let Some(key) = JobKey::parse(&status.job_id) else {
            return false;
        };
        let Some(e) = self.jobs.get(key) else {
            return false;
        };
        // This node lost this attempt (its retry is the dispatcher's
        // doing, not a failure of the attempt).
        let retried_from_here = e.requeues.iter().any(|r| {
            matches!(r, Requeue::Retry { n, node: lost, .. } if *n == status.attempt && lost == node)
        });
        if !retried_from_here || e.job().attempt <= status.attempt {
            return false;
        }
        // Only a retry no node was sent: once its Assign is on its way,
        // the node may start it before a Cancel arrives, and a job shown
        // SUCCEEDED must not start anywhere after (the model test's
        // promise: no Assign of an attempt the dispatcher has ended).
        if !matches!(e.phase(), Phase::Unplaced { .. } | Phase::Queued { .. })
            || self.gang_of(key).is_some()
        {
            return false;
        }
        let retry = e.job().attempt;
        if let Some(mut f) = self.jobs.facts(key) {
            f.set_exit(status.exit_code, status.signal);
            f.set_cpus(&status.cpus);
            f.set_gpus(&status.gpus);
            if status.time_ms > 0 {
                f.set_start(status.time_ms);
            }
        }
        tracing::info!(
            job = %status.job_id,
            attempt = status.attempt,
            %node,
            retry,
            state = state.as_str_name(),
            "a retried attempt had ended: the job takes its result, the retry is withdrawn"
        );
        let done = Phase::Done {
            state,
            end: End::StaleAttemptEnded {
                attempt: status.attempt,
                node: node.to_string(),
                state,
            },
        };
        self.finish(key, done, now, fx);
        true
    }

    /// A job the dispatcher has on `node` that the agent did not report.
    fn reconcile_missing(
        &mut self,
        key: JobKey,
        node: &str,
        reported: &HashSet<(String, u32)>,
        now: i64,
        fx: &mut Effects,
    ) {
        let Some(e) = self.jobs.get(key) else {
            return;
        };
        if reported.contains(&(e.job().id(), e.job().attempt)) || e.phase().is_done() {
            return;
        }
        if e.cancel_requested() {
            // Cancelled while on this node, which no longer runs it: done,
            // never re-sent.
            let done = Phase::Done {
                state: JobState::Cancelled,
                end: End::CancelledGone(node.to_string()),
            };
            self.finish(key, done, now, fx);
        } else if e.phase().state() == JobState::Assigned {
            // The Assign may have been lost with the old stream or a
            // dispatcher crash: resend (the agent ignores duplicates).
            if matches!(e.phase(), Phase::AwaitingNode { .. }) {
                self.reclaim(key, now);
                if !self.engine.is_dirty() {
                    self.engine_add_on_node(key, now);
                }
            }
            if let Some(assign) = self.assign_msg(key) {
                fx.to_agents.push((NodeName::from(node), assign));
            }
        } else {
            self.job_lost_on_node(key, "its agent restarted without it", now, fx);
        }
    }

    /// A restored job its node reported (or was sent again): on its node
    /// again, in the state the store had.
    fn reclaim(&mut self, key: JobKey, now: i64) {
        let Some(Phase::AwaitingNode { node, running, .. }) =
            self.jobs.get(key).map(|e| e.phase().clone())
        else {
            return;
        };
        let phase = if running {
            Phase::Running {
                node,
                via: Via::Restored,
            }
        } else {
            Phase::Assigned {
                node,
                since: now,
                steal_asked: None,
                via: Via::Restored,
            }
        };
        self.jobs.set_phase(key, phase);
    }

    /// Apply deferred work (a rebuilt node tree after registrations, which
    /// also places waiting jobs). The core calls it before every command
    /// but a registration or a load report, on its tick, and at most once
    /// per `REBUILD_EVERY` during a burst of registrations (`core.rs`).
    pub fn settle(&mut self, now: i64, fx: &mut Effects) {
        if self.engine.is_dirty() {
            self.ensure_engine(now, fx);
            // New nodes have room: the idle-balance pass.
            self.idle_balance(now, fx);
        }
    }

    /// Put a job on its node into the engine, running there.
    fn engine_add_on_node(&mut self, key: JobKey, now: i64) {
        let Some(e) = self.jobs.get(key) else { return };
        let Some(leaf) = self.engine.built_leaf(&e.job().node) else {
            return;
        };
        let tspec = task_spec(e, None, self.predicted_ns(e));
        let task = e.task;
        if let Some(engine) = self.engine.sched_mut() {
            if !engine.has_task(task) && engine.add_task(tspec).is_err() {
                return;
            }
            if engine
                .task(task)
                .is_some_and(|t| t.state == TaskState::Sleeping)
            {
                let _ = engine.wake_up_on(task, leaf, engine_ns(now));
            }
        }
    }

    /// Mark a job's modelled CPUs on its node from the CPUs it reported (or
    /// a fresh aligned choice when it reported none).
    pub(super) fn remodel_cpus(&mut self, key: JobKey) {
        let Some(e) = self.jobs.get(key) else { return };
        let slot = self.nodes.slot(&e.job().node);
        let Some(n) = slot.and_then(|s| self.nodes.at_mut(s)) else {
            return;
        };
        let spec = e.job().spec.clone().unwrap_or_default();
        n.release(&e.model_cpus);
        let reported: Vec<LeafId> = e
            .job()
            .cpus
            .iter()
            .filter_map(|&c| n.cpu_topo().leaf_of_os_id(c as u64))
            .collect();
        let cpus = n.claim(&spec, reported);
        if let Some((m, on)) = self.jobs.model_mut(key) {
            *m = cpus;
            *on = slot;
        }
    }
}
