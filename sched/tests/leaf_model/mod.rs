//! One leaf under EASY backfill (`SchedConfig::backfill`, no stealing),
//! driven by random arrivals, early finishes and time passing, with every
//! property checked after each engine call against the brute-force
//! [`oracle_start`]. Shared by `backfill.rs` (tasks with a time limit or
//! none) and `predictions.rs` (limits, run-time predictions, or neither);
//! a test target includes it with `mod oracle; mod leaf_model;`.
//!
//! Tasks end exactly at their limit or prediction when time passes over
//! it (or earlier, by `FinishEarly`), so every known end holds. The
//! properties, after every call:
//! - no starvation: the head starts no later than the first reservation
//!   it had (and never still waits past it);
//! - the head never waits when it fits, and the engine's reservation
//!   (task and start) is the oracle's;
//! - work conservation: no waiting task that fits now and, by the oracle,
//!   would not delay the head is left waiting;
//! - with [`Model::reservation_never_later`]: the head's earliest start
//!   never moves later while it stays the head.

use std::collections::HashMap;
use std::sync::Arc;

use crate::oracle::oracle_start;
use proptest::prelude::*;
use sched::topology::Topology;
use sched::{Sched, SchedConfig, SchedEvent, TaskId, TaskSpec};

pub const UNIT: u64 = 1_000;

/// The engine's configuration under test: backfill on, stealing off.
pub fn config() -> SchedConfig {
    SchedConfig {
        backfill: true,
        steal: false,
        ..SchedConfig::cluster()
    }
}

/// What a task's end is known by.
#[derive(Clone, Copy, Debug)]
#[allow(dead_code, reason = "backfill.rs draws no predictions")]
pub enum Known {
    Limit(u64),
    Predicted(u64),
    Nothing,
}

impl Known {
    fn end_after(self) -> Option<u64> {
        match self {
            Known::Limit(x) | Known::Predicted(x) => Some(x),
            Known::Nothing => None,
        }
    }
}

#[derive(Clone, Debug)]
pub enum Op {
    /// A task arrives on the leaf.
    Arrive { demand: u32, known: Known },
    /// A running task finishes now (before its limit or prediction).
    FinishEarly { pick: usize },
    /// Time passes; tasks with a limit or a prediction finish exactly at
    /// it.
    Advance { dt: u64 },
}

/// Random operations on a leaf of `cap` CPUs, arrivals' ends drawn from
/// `known`.
pub fn op(cap: u32, known: impl Strategy<Value = Known> + 'static) -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1..=cap, known).prop_map(|(demand, known)| Op::Arrive { demand, known }),
        1 => any::<usize>().prop_map(|pick| Op::FinishEarly { pick }),
        3 => (1u64..40).prop_map(|dt| Op::Advance { dt: dt * UNIT }),
    ]
}

pub struct Model {
    s: Sched,
    cap: u32,
    now: u64,
    next: u64,
    demand: HashMap<TaskId, u32>,
    known: HashMap<TaskId, Known>,
    started_at: HashMap<TaskId, u64>,
    /// Waiting tasks in arrival order (all nice 0, latency-nice 0: FIFO).
    waiting: Vec<TaskId>,
    /// The head and the first known reservation it had.
    head: Option<(TaskId, Option<u64>)>,
    /// Also check that the head's earliest start never moves later while
    /// it stays the head.
    pub reservation_never_later: bool,
}

impl Model {
    pub fn new(cap: u32) -> Self {
        let topo = Arc::new(Topology::from_spec("1z:1r:1n").unwrap());
        Self {
            s: Sched::new(topo, cap, config()),
            cap,
            now: 0,
            next: 0,
            demand: HashMap::new(),
            known: HashMap::new(),
            started_at: HashMap::new(),
            waiting: Vec::new(),
            head: None,
            reservation_never_later: false,
        }
    }

    /// Running tasks: (id, demand, end by limit or prediction).
    fn running(&self) -> Vec<(TaskId, u32, Option<u64>)> {
        self.s
            .rq(0)
            .running
            .iter()
            .map(|id| {
                let end = self.known[id].end_after().map(|x| self.started_at[id] + x);
                (*id, self.demand[id], end)
            })
            .collect()
    }

    fn plan(&self) -> Vec<(u32, Option<u64>)> {
        self.running().into_iter().map(|r| (r.1, r.2)).collect()
    }

    fn head_start(&self) -> Option<Option<u64>> {
        let h = *self.waiting.first()?;
        Some(oracle_start(
            self.cap,
            &self.plan(),
            self.demand[&h],
            self.now,
        ))
    }

    /// Would starting `w` now delay the head (oracle)?
    fn delays_head(&self, w: TaskId) -> bool {
        let h = self.waiting[0];
        let plan = self.plan();
        let end = self.known[&w].end_after().map(|x| self.now + x);
        let Some(before) = oracle_start(self.cap, &plan, self.demand[&h], self.now) else {
            return end.is_none();
        };
        let mut with = plan;
        with.push((self.demand[&w], end));
        oracle_start(self.cap, &with, self.demand[&h], self.now).is_none_or(|t| t > before)
    }

    fn fits_now(&self, w: TaskId) -> bool {
        let used: u32 = self.plan().iter().map(|r| r.0).sum();
        used + self.demand[&w] <= self.cap
    }

    /// One engine call, then every property.
    fn step(&mut self, call: impl FnOnce(&mut Sched, u64)) -> Result<(), TestCaseError> {
        let before = self.head.map(|h| (h.0, self.head_start().flatten()));
        call(&mut self.s, self.now);
        for ev in self.s.drain_events() {
            if let SchedEvent::Started { task, .. } = ev {
                self.started_at.insert(task, self.now);
                self.waiting.retain(|&x| x != task);
                if let Some((h, Some(rec))) = self.head
                    && h == task
                {
                    prop_assert!(
                        self.now <= rec,
                        "head {h:?} started at {} > {rec}",
                        self.now
                    );
                }
            }
        }
        // The head and its recorded reservation.
        match self.waiting.first() {
            None => self.head = None,
            Some(&h) => {
                let start = self.head_start().flatten();
                match self.head {
                    Some((old, rec)) if old == h => {
                        if let Some(rec) = rec {
                            prop_assert!(self.now <= rec, "head {h:?} still waits at {}", self.now);
                        }
                        self.head = Some((h, rec.or(start)));
                    }
                    _ => self.head = Some((h, start)),
                }
                if self.reservation_never_later
                    && let Some((old, Some(prev))) = before
                    && old == h
                {
                    prop_assert!(
                        start.is_some_and(|s| s <= prev),
                        "head {h:?} reservation moved from {prev} to {start:?}"
                    );
                }
                prop_assert!(!self.fits_now(h), "head {h:?} fits but waits");
                let res = self.s.reservation(0, self.now).expect("a head");
                prop_assert_eq!(res.task, h);
                prop_assert_eq!(res.start, start);
                for &w in &self.waiting[1..] {
                    prop_assert!(
                        !self.fits_now(w) || self.delays_head(w),
                        "task {w:?} fits without delaying head {h:?} but waits"
                    );
                }
            }
        }
        Ok(())
    }

    pub fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Arrive { demand, known } => {
                let id = TaskId(self.next);
                self.next += 1;
                let mut spec = TaskSpec::new(id);
                spec.demand = demand;
                match known {
                    Known::Limit(l) => spec.time_limit = Some(l),
                    Known::Predicted(p) => spec.predicted = Some(p),
                    Known::Nothing => {}
                }
                self.s.add_task(spec).unwrap();
                self.demand.insert(id, demand);
                self.known.insert(id, known);
                self.waiting.push(id);
                self.step(|s, now| s.wake_up_on(id, 0, now).unwrap())?;
            }
            Op::FinishEarly { pick } => {
                let running = self.running();
                if !running.is_empty() {
                    let id = running[pick % running.len()].0;
                    self.step(|s, now| s.block(id, now).unwrap())?;
                }
            }
            Op::Advance { dt } => {
                let target = self.now + dt;
                // Finish tasks at their limits or predictions, in order,
                // up to the target.
                while let Some((id, _, Some(end))) = self
                    .running()
                    .into_iter()
                    .filter(|r| r.2.is_some_and(|e| e <= target))
                    .min_by_key(|r| (r.2, r.0))
                {
                    self.now = end;
                    self.step(|s, now| s.block(id, now).unwrap())?;
                }
                self.now = target;
                self.step(|s, now| s.schedule(0, now))?;
            }
        }
        Ok(())
    }
}
