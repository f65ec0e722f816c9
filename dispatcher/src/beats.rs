//! Heartbeats off the core thread: what an agent's stream tells the core
//! about its node's liveness and load, aggregated per connection and
//! applied in batches.
//!
//! Each attached agent has one [`Beat`], shared by its stream's reader
//! task (in [`crate::server`]) and the core. The reader writes, the core
//! reads:
//!
//! - `last_ms`: when the last message of any kind arrived (an atomic the
//!   reader stores on every message). The core copies it into the node's
//!   `last_heartbeat_ms` just before each tick's heartbeat deadline check
//!   ([`Beats::refresh`]), so the deadline is measured exactly as before,
//!   from the last message the dispatcher received, without one core
//!   command per heartbeat.
//! - `last_report_ms`: when the last LoadReport arrived. A DOWN node whose
//!   stream stayed open comes back up on a LoadReport, as before.
//! - the pending change: a LoadReport whose load differs from the last one
//!   of this stream (latest wins), a lease to grant (the latest report's
//!   `seq`), a report from a node the core marked DOWN. Only then is the
//!   beat queued for the core ([`Beats::drain`]), which applies the queue
//!   at most every [`FLUSH_MS`] inside a batch of commands: a lease still
//!   leaves only after that batch's commit, so only a leader that can
//!   still write grants one.
//!
//! A heartbeat that changes nothing therefore costs the core nothing but
//! its share of the per-tick scan of every attached agent.
//!
//! The beat is also the core's link to the attached node ([`Link`]): its
//! session, the sender of its stream's outbound queue and the last report
//! the core accounted for live in the beat, and the core's table of
//! attached nodes is a set of beats keyed by their node's name, so an
//! attached node costs one record of ~100 bytes, its name held once
//! (issue 14: a separate link record in a map keyed by a copy of the name
//! cost ~130 bytes more per node).

use std::borrow::Borrow;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use proto::v1::NodeLoad;

use crate::cluster::load::PackedLoad;
use crate::outbound::AgentTx;

/// The core applies queued beats at most this often (ms): a lease grant
/// or a changed load waits at most this long plus one batch.
pub const FLUSH_MS: u64 = 20;

/// What a stream's reports changed since the core last looked.
#[derive(Debug, Default)]
pub struct Pending {
    /// A load that differs from the last one the core was given (shared
    /// with the reader, which keeps it to compare the next report with).
    pub load: Option<PackedLoad>,
    /// The `seq` of the latest report that asked for a lease (0: none).
    pub lease_seq: u64,
}

/// One agent stream's liveness and pending changes, and the core's link
/// to the stream.
#[derive(Debug)]
pub struct Beat {
    /// The node.
    pub node: Box<str>,
    /// The core's end of the stream's outbound queue, tagged with the
    /// core's session of the stream ([`Beat::session`]; read by the core
    /// only).
    pub tx: AgentTx,
    last_ms: AtomicI64,
    last_report_ms: AtomicI64,
    /// The latest LoadReport time the core has accounted for (a later
    /// one revives the node if it is DOWN). The core's alone: an atomic
    /// only because the beat is shared.
    applied_report_ms: AtomicI64,
    /// The core marked the node DOWN (set by the core after each tick).
    down: AtomicBool,
    /// In the queue of beats the core has still to apply.
    queued: AtomicBool,
    /// The core ended the session by itself (the node registered on
    /// another stream or slot): the reader may drop it.
    ended: AtomicBool,
    pending: Mutex<Pending>,
}

impl Beat {
    /// The core's session of this stream.
    pub fn session(&self) -> u64 {
        self.tx.session()
    }

    /// When the last message arrived (Unix ms).
    pub fn last_ms(&self) -> i64 {
        self.last_ms.load(Ordering::Acquire)
    }

    /// The node was heard from at `now_ms` (a message read, or its
    /// registration answered): its heartbeat clock restarts there.
    pub fn alive(&self, now_ms: i64) {
        self.last_ms.fetch_max(now_ms, Ordering::AcqRel);
    }

    /// When the last LoadReport arrived (Unix ms; `i64::MIN` before any).
    pub fn last_report_ms(&self) -> i64 {
        self.last_report_ms.load(Ordering::Acquire)
    }

    /// The latest LoadReport time the core accounted for (the core).
    pub fn applied_report_ms(&self) -> i64 {
        self.applied_report_ms.load(Ordering::Relaxed)
    }

    /// The core accounted for the reports up to `ms`.
    pub fn set_applied_report_ms(&self, ms: i64) {
        self.applied_report_ms.store(ms, Ordering::Relaxed);
    }

    /// The core tells the stream whether its node is DOWN.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::Release);
    }

    /// What the core last told the stream ([`Self::set_down`]).
    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::Acquire)
    }

    /// The core ended this session (set before it tells the stream).
    pub fn set_ended(&self) {
        self.ended.store(true, Ordering::Release);
    }

    /// Whether the core ended this session ([`Self::set_ended`]).
    pub fn is_ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    /// Take the pending change (the core).
    pub fn take(&self) -> Pending {
        std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// The beats queued for the core, and the constructor of beats.
#[derive(Debug, Default)]
pub struct Beats {
    queue: Mutex<Vec<Arc<Beat>>>,
    /// Set while the queue is not empty (read without the lock).
    nonempty: AtomicBool,
}

/// An attached node's beat as the core's link to it: an entry of the
/// core's set of attached nodes, found by the node's name (`&str`).
#[derive(Clone, Debug)]
pub struct Link(pub Arc<Beat>);

impl std::ops::Deref for Link {
    type Target = Beat;
    fn deref(&self) -> &Beat {
        &self.0
    }
}

impl Borrow<str> for Link {
    fn borrow(&self) -> &str {
        &self.0.node
    }
}

// Hashed and compared as its name, as `Borrow<str>` requires.
impl Hash for Link {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.node.hash(state);
    }
}

impl PartialEq for Link {
    fn eq(&self, other: &Self) -> bool {
        self.0.node == other.0.node
    }
}

impl Eq for Link {}

impl Beats {
    /// A beat for a stream attached at `now_ms`, whose messages go out
    /// through `tx` (tagged with `session`).
    pub fn beat(&self, node: &str, session: u64, tx: AgentTx, now_ms: i64) -> Arc<Beat> {
        Arc::new(Beat {
            node: node.into(),
            tx: tx.in_session(session),
            last_ms: AtomicI64::new(now_ms),
            last_report_ms: AtomicI64::new(i64::MIN),
            applied_report_ms: AtomicI64::new(i64::MIN),
            down: AtomicBool::new(false),
            queued: AtomicBool::new(false),
            ended: AtomicBool::new(false),
            pending: Mutex::new(Pending::default()),
        })
    }

    /// Whether beats wait for the core.
    pub fn pending(&self) -> bool {
        self.nonempty.load(Ordering::Acquire)
    }

    /// Take every queued beat (the core). A beat reported again after
    /// this is queued again.
    pub fn drain(&self) -> Vec<Arc<Beat>> {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        self.nonempty.store(false, Ordering::Release);
        let beats = std::mem::take(&mut *q);
        drop(q);
        for b in &beats {
            b.queued.store(false, Ordering::Release);
        }
        beats
    }

    /// Queue `beat`; true when the queue was empty (the core should be
    /// woken).
    fn enqueue(&self, beat: &Arc<Beat>) -> bool {
        if beat.queued.swap(true, Ordering::AcqRel) {
            return false;
        }
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let was_empty = q.is_empty();
        q.push(beat.clone());
        self.nonempty.store(true, Ordering::Release);
        was_empty
    }
}

/// The reader side of one node's session: compares each report, packed,
/// with the last one it queued, so an unchanged heartbeat touches only an
/// atomic. The last load is kept packed and shared with the core (which
/// keeps it as the node's last load): one copy per node. The buffer each
/// report is packed in is the stream reader's (one per stream, however
/// many nodes it carries), and so is the queue of beats it reports to
/// (passed in: two pointers a node, not three).
#[derive(Debug)]
pub struct Reporter {
    beat: Arc<Beat>,
    /// The last load handed to the core (None before the first).
    last_load: Option<PackedLoad>,
}

impl Reporter {
    /// The reader of `beat`'s stream.
    pub fn new(beat: Arc<Beat>) -> Self {
        Self {
            beat,
            last_load: None,
        }
    }

    /// The session's beat.
    pub fn beat(&self) -> &Arc<Beat> {
        &self.beat
    }

    /// Any message arrived at `now_ms`: the node is alive.
    pub fn alive(&self, now_ms: i64) {
        self.beat.alive(now_ms);
    }

    /// A LoadReport arrived at `now_ms` (packed in `scratch` to compare
    /// it); a change is queued on `beats`. Returns true when the core must
    /// be woken (the first beat of an empty queue).
    pub fn report(
        &mut self,
        beats: &Beats,
        load: NodeLoad,
        seq: u64,
        now_ms: i64,
        scratch: &mut Vec<u8>,
    ) -> bool {
        self.alive(now_ms);
        self.beat.last_report_ms.fetch_max(now_ms, Ordering::AcqRel);
        let changed = match &self.last_load {
            Some(last) => last.changed(&load, scratch),
            None => Some(PackedLoad::new(&load)),
        };
        let down = self.beat.down.load(Ordering::Acquire);
        if changed.is_none() && seq == 0 && !down {
            return false;
        }
        {
            let mut p = self.beat.pending.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(load) = changed {
                p.load = Some(load.clone());
                self.last_load = Some(load);
            }
            if seq != 0 {
                p.lease_seq = seq;
            }
        }
        beats.enqueue(&self.beat)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::v1::CpuLoad;

    fn load(busy: bool) -> NodeLoad {
        NodeLoad {
            cpus: vec![CpuLoad {
                cpu: 0,
                busy,
                runnable: u32::from(busy),
            }],
            ..Default::default()
        }
    }

    #[test]
    fn an_unchanged_heartbeat_only_moves_the_liveness_stamp() {
        let beats = Arc::new(Beats::default());
        let beat = beats.beat("n1", 1, crate::outbound::channel().0, 100);
        let mut r = Reporter::new(beat.clone());
        assert!(
            r.report(&beats, load(false), 0, 200, &mut Vec::new()),
            "the first report wakes"
        );
        assert!(
            !r.report(&beats, load(false), 0, 300, &mut Vec::new()),
            "queued already"
        );
        let drained = beats.drain();
        assert_eq!(drained.len(), 1);
        assert_eq!(
            drained[0].take().load.map(|l| l.to_proto()),
            Some(load(false))
        );
        assert!(!beats.pending());
        // The same load again: nothing queued, the stamps move.
        assert!(!r.report(&beats, load(false), 0, 1_300, &mut Vec::new()));
        assert!(!beats.pending());
        assert_eq!(beat.last_ms(), 1_300);
        assert_eq!(beat.last_report_ms(), 1_300);
        // A stamp never goes back.
        r.alive(1_000);
        assert_eq!(beat.last_ms(), 1_300);
    }

    #[test]
    fn a_change_a_lease_or_a_down_node_queue_the_beat_once() {
        let beats = Arc::new(Beats::default());
        let beat = beats.beat("n1", 1, crate::outbound::channel().0, 0);
        let mut r = Reporter::new(beat.clone());
        r.report(&beats, load(false), 0, 1, &mut Vec::new());
        beats.drain();
        let _ = beat.take();
        // Changed load, then a lease: one queue entry, the latest of each.
        assert!(r.report(&beats, load(true), 0, 2, &mut Vec::new()));
        assert!(!r.report(&beats, load(true), 7, 3, &mut Vec::new()));
        assert!(!r.report(&beats, load(true), 8, 4, &mut Vec::new()));
        let drained = beats.drain();
        assert_eq!(drained.len(), 1);
        let p = drained[0].take();
        assert_eq!(
            (p.load.map(|l| l.to_proto()), p.lease_seq),
            (Some(load(true)), 8)
        );
        // The core marked the node down: an unchanged report is queued.
        beat.set_down(true);
        assert!(r.report(&beats, load(true), 0, 5, &mut Vec::new()));
        let p = beats.drain()[0].take();
        assert_eq!((p.load, p.lease_seq), (None, 0));
    }
}
