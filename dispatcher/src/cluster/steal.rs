//! Moves of jobs between nodes as data ([`Move`]), the rings of recent
//! ones kept for observers, and the agent-level steal: a job sent to an
//! agent that has not started it is asked back when a node of the same
//! rack has room for it.
//!
//! Invariants: every placement (a job sent to its node) and every steal
//! appears once in [`super::Effects::moves`] of the operation that made
//! it, and in the matching ring; at most one `Steal` request is
//! outstanding per ASSIGNED job (`Phase::Assigned::steal_asked`).

use std::collections::HashMap;

use proto::v1::{DispatcherMessage, StealReply, dispatcher_message};

use super::engine::engine_ns;
use super::jobs::{End, JobKey, Phase, Requeue, StealLevel, Unplaced, Via, via_text};
use super::lifecycle::TaskAfter;
use super::{Cluster, Effects, NodeName};

/// How many placements and steals [`Cluster`] keeps for observers.
pub const RECENT_MOVES: usize = 100;

/// What a move was.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MoveKind {
    /// The job was sent to its node.
    Placed {
        /// How it came there.
        via: Via,
        /// Why it had gone back to PENDING before, if it had.
        after: Option<Requeue>,
    },
    /// An idle node took it from an overloaded one's queue.
    Stolen(StealLevel),
    /// A node with room pulled it from an overloaded one's queue in the
    /// idle-balance pass (the periodic / nohz balance: on the tick, after
    /// a finish, when a node registers or comes back), not at the moment
    /// it went idle.
    Balanced(StealLevel),
    /// Its agent gave it back unstarted (the agent-level steal).
    GivenBack,
}

/// A placement or a steal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Move {
    /// When (Unix ms).
    pub at_ms: i64,
    /// The job.
    pub job: JobKey,
    /// The node it left ("" for a placement).
    pub from: NodeName,
    /// The node it went to (for a job given back: where it was placed or
    /// queued again; "" when no node matches it now).
    pub to: NodeName,
    /// What it was.
    pub kind: MoveKind,
}

impl Move {
    /// True for a steal (engine or agent level).
    pub fn is_steal(&self) -> bool {
        !matches!(self.kind, MoveKind::Placed { .. })
    }

    /// Display text: for a placement how the engine chose, for a steal
    /// its level.
    pub fn why(&self) -> String {
        match &self.kind {
            MoveKind::Placed { via, after } => {
                via_text(via, &self.to, after.as_ref()).unwrap_or_default()
            }
            MoveKind::Stolen(level) => level.name().to_string(),
            MoveKind::Balanced(level) => format!("idle balance, {}", level.name()),
            MoveKind::GivenBack => "agent gave it back".into(),
        }
    }
}

/// The last placements and steals, newest last.
#[derive(Default)]
pub struct RecentMoves {
    placements: Ring,
    steals: Ring,
}

/// Up to [`RECENT_MOVES`] moves; once full, a new move overwrites the
/// oldest in place, its node names' buffers reused (a placement's copy
/// then allocates nothing), and `next` turns: the ring was a `VecDeque`
/// whose oldest entry was popped and pushed back, two moves of a `Move`
/// per placement.
#[derive(Default)]
struct Ring {
    moves: Vec<Move>,
    /// The oldest entry once full (else 0).
    next: usize,
}

impl Ring {
    fn push(&mut self, m: &Move) {
        let full = self.moves.len() == RECENT_MOVES;
        match self.moves.get_mut(self.next) {
            Some(old) if full => {
                old.at_ms = m.at_ms;
                old.job = m.job;
                old.from.clone_from(&m.from);
                old.to.clone_from(&m.to);
                if old.kind != m.kind {
                    old.kind.clone_from(&m.kind);
                }
                self.next = (self.next + 1) % RECENT_MOVES;
            }
            _ => self.moves.push(m.clone()),
        }
    }

    /// Oldest first.
    fn iter(&self) -> impl DoubleEndedIterator<Item = &Move> {
        let (newer, older) = self.moves.split_at(self.next);
        older.iter().chain(newer)
    }
}

impl RecentMoves {
    /// Keep a copy of `m`.
    fn push(&mut self, m: &Move) {
        if m.is_steal() {
            self.steals.push(m);
        } else {
            self.placements.push(m);
        }
    }

    /// Placements, oldest first.
    pub fn placements(&self) -> impl DoubleEndedIterator<Item = &Move> {
        self.placements.iter()
    }

    /// Steals, oldest first.
    pub fn steals(&self) -> impl DoubleEndedIterator<Item = &Move> {
        self.steals.iter()
    }
}

impl Cluster {
    /// The idle-balance pass ([`sched::Sched::idle_balance`], the kernel's
    /// periodic / nohz idle balance) when `ClusterConfig::engine` turns it
    /// on: every node with room for a job waiting in its steal domain
    /// pulls it, in seed 000's order. Run on the tick, after every finish
    /// and wherever a node gains room (registration, recovery); each pull
    /// becomes a [`MoveKind::Balanced`] move and the job's phase follows
    /// as for a steal (queued on the puller via `Via::Stolen`, then
    /// assigned there and persisted when it starts).
    pub(super) fn idle_balance(&mut self, now: i64, fx: &mut Effects) {
        if !self.cfg.engine.idle_balance {
            return;
        }
        self.ensure_engine(now, fx);
        // Events of the operation before the pass keep their own kind.
        self.process_events(now, fx);
        let Some(engine) = self.engine.sched_mut() else {
            return;
        };
        if engine.idle_balance(engine_ns(now)) > 0 {
            self.process_events_as(now, fx, MoveKind::Balanced);
        }
    }

    /// Record a move for observers and in the operation's effects.
    pub(super) fn record_move(&mut self, m: Move, fx: &mut Effects) {
        self.moves.push(&m);
        fx.moves.push(m);
    }

    /// How far a move between two nodes goes.
    pub(super) fn steal_level(&self, from: &str, to: &str) -> StealLevel {
        match (self.nodes.get(from), self.nodes.get(to)) {
            (Some(a), Some(b)) if a.zone() == b.zone() && a.rack() == b.rack() => {
                StealLevel::SameRack
            }
            (Some(a), Some(b)) if a.zone() == b.zone() => StealLevel::SameZone,
            _ => StealLevel::OtherZone,
        }
    }

    /// Idle stealing one level down: a job sent to an agent that has not
    /// started it (an oversubscribed agent holds it in its own queue, e.g.
    /// a gang waiting for aligned CPUs) is asked back (`Steal`) when a node
    /// of the same rack has room for it, the seed's steal across the
    /// dispatcher/agent boundary. At most one request per idle node per
    /// tick; the agent answers with `StealReply`.
    pub(super) fn request_agent_steals(&mut self, now: i64, fx: &mut Effects) {
        let grace = self.cfg.heartbeat_interval_ms as i64;
        // Most ticks find no job held unstarted past the grace period:
        // the index of jobs not asked back, by the time they were sent,
        // says so without visiting every ASSIGNED job, before the idle
        // nodes are indexed (O(nodes)).
        let due = self.jobs.unasked_since(now.saturating_sub(grace));
        if due.is_empty() {
            return;
        }
        let Some(engine) = self.engine.sched() else {
            return;
        };
        let mut idle_by_rack: HashMap<(&str, &str), Vec<u32>> = HashMap::new();
        for (leaf, name) in self.engine.order().iter().enumerate() {
            let Some(n) = self.nodes.get(name) else {
                continue;
            };
            let room = engine.rq(leaf).room(sched::Align::Any);
            if n.schedulable() && room > 0 {
                idle_by_rack
                    .entry((n.zone(), n.rack()))
                    .or_default()
                    .push(room);
            }
        }
        if idle_by_rack.is_empty() {
            return;
        }
        let mut requests = Vec::new();
        for key in due {
            // Stealing moves whole gangs only: a member never alone.
            if self.gang_of(key).is_some() {
                continue;
            }
            let Some(e) = self.jobs.get(key) else {
                continue;
            };
            let Some(n) = e.phase().node().and_then(|n| self.nodes.get(n)) else {
                continue;
            };
            let Some(rooms) = idle_by_rack.get_mut(&(n.zone(), n.rack())) else {
                continue;
            };
            if let Some(pos) = rooms.iter().position(|&r| r >= e.cpus()) {
                rooms.swap_remove(pos);
                requests.push((key, n.name.clone(), e.job().attempt));
            }
        }
        for (key, node, attempt) in requests {
            self.jobs.set_steal_asked(key, Some(now));
            fx.to_agents.push((
                node,
                DispatcherMessage {
                    msg: Some(dispatcher_message::Msg::Steal(proto::v1::Steal {
                        job_id: key.to_string(),
                        attempt,
                    })),
                }
                .into(),
            ));
        }
    }

    /// An agent's answer to `Steal`: a released job is placed again (on
    /// the node with room, normally); a released job whose cancel was
    /// requested runs nowhere and is done.
    pub fn steal_reply(&mut self, node: &str, reply: StealReply, now: i64, fx: &mut Effects) {
        let Some(key) = JobKey::parse(&reply.job_id) else {
            return;
        };
        self.jobs.set_steal_asked(key, None);
        if !reply.released {
            return;
        }
        let Some(e) = self.jobs.get(key) else { return };
        if e.job().attempt != reply.attempt
            || !matches!(e.phase(), Phase::Assigned { node: n, .. } if n == node)
        {
            return;
        }
        let cancel = e.cancel_requested();
        self.ensure_engine(now, fx);
        self.release_from_node(key, TaskAfter::Remove, now);
        if cancel {
            self.sync_summary(node, now);
            self.finish(
                key,
                Phase::Done {
                    state: proto::v1::JobState::Cancelled,
                    end: End::CancelledGivenBack(node.to_string()),
                },
                now,
                fx,
            );
            return;
        }
        self.jobs
            .push_requeue(key, Requeue::GivenBack(node.to_string()));
        let previous = self.jobs.set_phase(
            key,
            Phase::Unplaced {
                why: Unplaced::Requeued,
            },
        );
        self.persist_emit(key, previous, now, fx);
        self.sync_summary(node, now);
        self.place(key, now, fx);
        self.process_events(now, fx);
        let to = self
            .jobs
            .get(key)
            .and_then(|e| e.phase().node_name().cloned())
            .unwrap_or_default();
        let m = Move {
            at_ms: now,
            job: key,
            from: NodeName::from(node),
            to,
            kind: MoveKind::GivenBack,
        };
        self.record_move(m, fx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The rings keep what a plain queue of the last
        /// [`RECENT_MOVES`] placements and steals keeps, oldest first,
        /// forwards and backwards, whatever their kinds and names.
        #[test]
        fn recent_moves_are_the_last_ones(
            moves in prop::collection::vec((0u8..4, 0u8..3, 0u8..3), 0..350),
        ) {
            let mut recent = RecentMoves::default();
            let (mut placements, mut steals) = (std::collections::VecDeque::new(), std::collections::VecDeque::new());
            let names = ["", "n1", "a-longer-node-name"];
            for (i, (kind, from, to)) in moves.into_iter().enumerate() {
                let kind = match kind {
                    0 => MoveKind::Placed { via: Via::Restored, after: None },
                    1 => MoveKind::Placed { via: Via::Restored, after: Some(Requeue::GivenBack("n9".into())) },
                    2 => MoveKind::Stolen(StealLevel::SameRack),
                    _ => MoveKind::GivenBack,
                };
                let m = Move {
                    at_ms: i as i64,
                    job: JobKey::single(i as u64 + 1),
                    from: names[from as usize].into(),
                    to: names[to as usize].into(),
                    kind,
                };
                recent.push(&m);
                let ring = if m.is_steal() { &mut steals } else { &mut placements };
                if ring.len() == RECENT_MOVES {
                    ring.pop_front();
                }
                ring.push_back(m);
                prop_assert!(recent.placements().eq(placements.iter()));
                prop_assert!(recent.steals().eq(steals.iter()));
                prop_assert!(recent.placements().rev().eq(placements.iter().rev()));
                prop_assert!(recent.steals().rev().eq(steals.iter().rev()));
            }
        }
    }
}
