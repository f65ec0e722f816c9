//! The etcd store: the dispatcher's state under a key prefix in etcd,
//! written only by the elected leader, every write fenced by its lease.
//!
//! Keys under the prefix `P` (`--etcd-prefix`, default `/dispatch`):
//!
//! | key | value |
//! |---|---|
//! | `P/leader` | the leader's advertise URL, attached to its lease ([`crate::ha`]) |
//! | `P/jobs/<id>` | the job, protobuf (`dispatch.v1.Job`) |
//! | `P/nodes/<name>` | `ready`, `cordoned` or `draining` |
//! | `P/meta/next_job` | the next job number, decimal |
//! | `P/redo/chunk/<n>`, `P/redo/commit` | a batch too large for one transaction (below) |
//!
//! **Fencing.** Every write is one etcd transaction whose compare is the
//! [`Fence`]: the leader key still exists with this replica's lease and
//! the create revision it had when this replica won. A deposed leader's
//! transaction fails its compare and writes nothing
//! ([`StoreError::Fenced`]); the store also refuses to write at all once
//! the [`LeaseClock`] says the lease may have expired.
//!
//! **Atomic batches of any size.** etcd limits a transaction to
//! `--max-txn-ops` operations (128 by default) and a request to
//! `--max-request-bytes` (1.5 MiB). A batch of writes that fits
//! ([`TxnLimits`]) is one transaction. A larger one (a 1,000-job
//! submission, a DOWN node with hundreds of jobs) goes through a redo
//! log, never as non-atomic pieces: its writes are first stored as
//! encoded chunks under `P/redo/chunk/`, then the single key
//! `P/redo/commit` is written — the commit point — then the writes are
//! applied in fenced pieces and the log is deleted. [`EtcdStore::load`]
//! replays a committed log that was not fully applied (and finishes it)
//! and deletes the chunks of one that was never committed, so a crash at
//! any step leaves either all or none of the batch.
//!
//! **Asking again, applying once.** A request to an etcd member whose
//! leader just died waits there until etcd elects another, and may or may
//! not be applied (the proposal may have reached the old leader's log).
//! So each attempt gets a deadline from etcd's election timeout
//! ([`attempt_timeout`]) and the request is sent again when it passes or
//! the connection breaks, within [`OP_TIMEOUT`] in all. A transaction is
//! made safe to send twice by the commit mark `P/meta/commit`: every
//! fenced transaction also compares the mark's mod revision with the one
//! this store last wrote or read, and writes a new mark unique to the
//! transaction (the lease and a count). An attempt that arrives after
//! another attempt of the same transaction, or after a later one, fails
//! that compare and writes nothing; when a retry finds the mark it would
//! have written, an earlier attempt applied and the commit succeeded.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use etcd::{Client, Compare, CompareOp, RangeRequest, RequestOp, TxnRequest};
use prost::Message;
use proto::v1::Job;
use tokio::runtime::Handle;

use super::{NodeAdmin, Snapshot, Store, StoreError, Write};

/// How long one etcd request may take, all attempts together, before the
/// store gives up on it.
pub const OP_TIMEOUT: Duration = Duration::from_secs(5);

/// etcd's default `--election-timeout`.
pub const DEFAULT_ELECTION_TIMEOUT: Duration = Duration::from_millis(1000);

/// The deadline of a request's first attempt with etcd's
/// `--election-timeout` `election`: twice it, the longest a follower waits
/// for a dead leader before it campaigns (raft randomizes the timeout in
/// `[election, 2 * election)`), so the attempt sent again finds a new
/// leader. Each further attempt gets twice the time of the one before
/// (a slow but healthy request is not cut short for ever).
pub fn attempt_timeout(election: Duration) -> Duration {
    election.saturating_mul(2)
}

/// Largest response the store accepts from etcd (a page of jobs).
pub const MAX_DECODE: usize = 64 << 20;

/// Bytes of a job record besides its spec (ids, state, times, reason).
const SPEC_HEADROOM: usize = 16 << 10;

/// Jobs read per request when loading.
const LOAD_PAGE: i64 = 1000;

/// The limits of one etcd transaction the store respects; they must not
/// exceed the etcd server's `--max-txn-ops` and `--max-request-bytes`.
#[derive(Clone, Copy, Debug)]
pub struct TxnLimits {
    /// Operations in the success branch (the store's own commit mark
    /// takes one of them).
    pub max_ops: usize,
    /// Approximate bytes of keys and values in one request.
    pub max_bytes: usize,
}

impl TxnLimits {
    /// Writes of a batch one transaction holds besides the commit mark.
    fn data_ops(&self) -> usize {
        self.max_ops.saturating_sub(1).max(1)
    }
}

impl Default for TxnLimits {
    /// etcd's defaults (128 operations, 1.5 MiB) with room for the
    /// request's framing.
    fn default() -> Self {
        Self {
            max_ops: 128,
            max_bytes: 1 << 20,
        }
    }
}

/// Whether this replica's lease may still be alive: extended by the
/// keepalive loop on each confirmed renewal (from the time the renewal was
/// *sent*, so the local view expires no later than etcd's), dropped for
/// good by [`LeaseClock::lose`].
#[derive(Debug)]
pub struct LeaseClock {
    base: Instant,
    valid_until_ms: AtomicU64,
    lost: AtomicBool,
}

impl LeaseClock {
    /// A clock valid for `ttl` from `granted_at` (when the grant was sent).
    pub fn new(granted_at: Instant, ttl: Duration) -> Self {
        let clock = Self {
            base: granted_at,
            valid_until_ms: AtomicU64::new(0),
            lost: AtomicBool::new(false),
        };
        clock.extend(granted_at, ttl);
        clock
    }

    /// A renewal sent at `sent_at` was confirmed with `ttl`.
    pub fn extend(&self, sent_at: Instant, ttl: Duration) {
        let until = sent_at.saturating_duration_since(self.base) + ttl;
        self.valid_until_ms
            .fetch_max(until.as_millis() as u64, Ordering::SeqCst);
    }

    /// The lease is gone (expired, revoked, or this replica stepped down).
    pub fn lose(&self) {
        self.lost.store(true, Ordering::SeqCst);
    }

    /// True while the lease may be alive and has not been given up.
    pub fn valid(&self) -> bool {
        !self.lost.load(Ordering::SeqCst)
            && (self.base.elapsed().as_millis() as u64) < self.valid_until_ms.load(Ordering::SeqCst)
    }
}

/// What makes a write the leader's: the leader key, the lease it must be
/// attached to and its create revision at election.
#[derive(Clone, Debug)]
pub struct Fence {
    /// `P/leader`.
    pub leader_key: String,
    /// This replica's lease.
    pub lease: i64,
    /// The leader key's create revision when this replica won.
    pub create_revision: i64,
    /// The local view of the lease.
    pub clock: Arc<LeaseClock>,
}

impl Fence {
    fn compares(&self) -> Vec<Compare> {
        vec![
            Compare::create_revision(
                self.leader_key.as_str(),
                CompareOp::Equal,
                self.create_revision,
            ),
            Compare::lease(self.leader_key.as_str(), CompareOp::Equal, self.lease),
        ]
    }
}

/// One key's change after coalescing a batch (etcd refuses a transaction
/// that touches a key twice).
#[derive(Clone, Debug, PartialEq)]
enum KeyOp {
    Put(Vec<u8>),
    Delete,
}

/// A batch's changes in the redo log.
#[derive(Clone, PartialEq, prost::Message)]
struct RedoChunk {
    #[prost(message, repeated, tag = "1")]
    ops: Vec<RedoOp>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RedoOp {
    #[prost(string, tag = "1")]
    key: String,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
    #[prost(bool, tag = "3")]
    delete: bool,
}

/// The store on etcd; see the module documentation.
pub struct EtcdStore {
    client: Client,
    runtime: Handle,
    prefix: String,
    fence: Fence,
    limits: TxnLimits,
    /// The first attempt's deadline ([`attempt_timeout`]).
    attempt: Duration,
    /// The commit mark's mod revision as this store last wrote or read it
    /// (0: absent); read before the first transaction.
    mark_revision: std::cell::Cell<Option<i64>>,
    /// Fenced transactions this store applied (the mark's count).
    applied: std::cell::Cell<u64>,
}

/// One fenced transaction, ready to send (again).
#[derive(Clone, Debug)]
struct Prepared {
    txn: TxnRequest,
    /// The commit mark it writes.
    mark: Vec<u8>,
}

fn backend(what: &str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(format!("etcd {what}: {e}"))
}

fn admin_str(a: NodeAdmin) -> &'static str {
    match a {
        NodeAdmin::Ready => "ready",
        NodeAdmin::Cordoned => "cordoned",
        NodeAdmin::Draining => "draining",
    }
}

fn parse_admin(s: &[u8]) -> Option<NodeAdmin> {
    match s {
        b"ready" => Some(NodeAdmin::Ready),
        b"cordoned" => Some(NodeAdmin::Cordoned),
        b"draining" => Some(NodeAdmin::Draining),
        _ => None,
    }
}

impl EtcdStore {
    /// A store over `client` under `prefix`, writing as the holder of
    /// `fence`. Its methods block on `runtime` (the dispatcher's): call
    /// them from a thread outside the runtime (the core's thread, or
    /// `spawn_blocking`). The client must accept responses of
    /// [`MAX_DECODE`] bytes (`ConnectOptions::with_max_message_bytes`).
    pub fn new(
        client: &Client,
        runtime: Handle,
        prefix: &str,
        fence: Fence,
        limits: TxnLimits,
    ) -> Self {
        Self {
            client: client.clone(),
            runtime,
            prefix: prefix.trim_end_matches('/').to_string(),
            fence,
            limits,
            attempt: attempt_timeout(DEFAULT_ELECTION_TIMEOUT),
            mark_revision: std::cell::Cell::new(None),
            applied: std::cell::Cell::new(0),
        }
    }

    /// Requests are sent again when an attempt has had no answer for
    /// `first` (then twice as long, ...): [`attempt_timeout`] of the etcd
    /// servers' election timeout.
    pub fn with_attempt_timeout(mut self, first: Duration) -> Self {
        self.attempt = first.max(Duration::from_millis(1));
        self
    }

    fn key(&self, rest: &str) -> String {
        format!("{}/{rest}", self.prefix)
    }

    fn redo_chunk_key(&self, n: usize) -> String {
        self.key(&format!("redo/chunk/{n:08}"))
    }

    /// Run `op` within [`OP_TIMEOUT`], again while it fails in a way
    /// that may pass ([`transient`]) or has no answer within its attempt's
    /// deadline. Callers send only requests that are safe to send twice
    /// (reads, and transactions guarded by the commit mark).
    ///
    /// Found by tests/faults_etcd.rs: the client balances over every
    /// endpoint and keeps handing requests to a member that died until it
    /// gives up on it (without the retry each one stopped the core, and
    /// leadership flapped for seconds after the etcd leader's kill); and a
    /// request a follower forwarded to the dying leader was held there
    /// for all of `OP_TIMEOUT` (5.29 s to resume leadership in CI).
    fn block_on<T, Fut>(&self, what: &str, mut op: impl FnMut() -> Fut) -> Result<T, StoreError>
    where
        Fut: std::future::Future<Output = Result<T, etcd::Error>>,
    {
        self.runtime.block_on(async {
            let deadline = tokio::time::Instant::now() + OP_TIMEOUT;
            let mut attempt = self.attempt;
            loop {
                let now = tokio::time::Instant::now();
                let until = (now + attempt).min(deadline);
                match tokio::time::timeout_at(until, op()).await {
                    Ok(Ok(v)) => return Ok(v),
                    Ok(Err(e)) if transient(&e) && tokio::time::Instant::now() < deadline => {
                        tracing::debug!(what, err = %e, "etcd request failed; asking again");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    Ok(Err(e)) => return Err(backend(what, e)),
                    Err(_) if until < deadline => {
                        tracing::info!(what, ?attempt, "no answer from etcd; asking again");
                        attempt = attempt.saturating_mul(2);
                    }
                    Err(_) => {
                        return Err(backend(what, format!("no answer within {OP_TIMEOUT:?}")));
                    }
                }
            }
        })
    }

    /// The batch as one change per key, the last one winning.
    fn coalesce(&self, writes: &[Write]) -> BTreeMap<String, KeyOp> {
        let mut ops = BTreeMap::new();
        for w in writes {
            let (k, op) = match w {
                Write::PutJob(job) => (
                    self.key(&format!("jobs/{}", job.key())),
                    KeyOp::Put({
                        let mut value = Vec::new();
                        job.encode_proto(&mut value);
                        value
                    }),
                ),
                Write::DeleteJob(key) => (self.key(&format!("jobs/{key}")), KeyOp::Delete),
                Write::PutNodeAdmin(name, admin) => (
                    self.key(&format!("nodes/{name}")),
                    KeyOp::Put(admin_str(*admin).as_bytes().to_vec()),
                ),
                Write::PutNextJob(n) => (
                    self.key("meta/next_job"),
                    KeyOp::Put(n.to_string().into_bytes()),
                ),
            };
            ops.insert(k, op);
        }
        ops
    }

    fn op_size(key: &str, op: &KeyOp) -> usize {
        key.len()
            + 16
            + match op {
                KeyOp::Put(v) => v.len(),
                KeyOp::Delete => 0,
            }
    }

    /// Splits `ops` into pieces within the transaction limits.
    fn pieces(&self, ops: &[(String, KeyOp)]) -> Vec<Vec<(String, KeyOp)>> {
        let mut out: Vec<Vec<(String, KeyOp)>> = Vec::new();
        let mut cur = Vec::new();
        let mut bytes = 0;
        for (k, op) in ops {
            let size = Self::op_size(k, op);
            if !cur.is_empty()
                && (cur.len() >= self.limits.data_ops() || bytes + size > self.limits.max_bytes)
            {
                out.push(std::mem::take(&mut cur));
                bytes = 0;
            }
            bytes += size;
            cur.push((k.clone(), op.clone()));
        }
        if !cur.is_empty() {
            out.push(cur);
        }
        out
    }

    /// One fenced transaction: all of `ops` or, when this replica is not
    /// the leader any more, none; applied once however often it is sent.
    fn fenced_txn(&self, ops: Vec<RequestOp>) -> Result<(), StoreError> {
        let prepared = self.prepare(ops)?;
        self.send(&prepared)
    }

    fn mark_key(&self) -> String {
        self.key("meta/commit")
    }

    /// The transaction for `ops`: the fence and the commit mark compared,
    /// `ops` and the next mark written; on a failed compare it reads the
    /// leader key and the mark, to tell why.
    fn prepare(&self, mut ops: Vec<RequestOp>) -> Result<Prepared, StoreError> {
        if !self.fence.clock.valid() {
            return Err(StoreError::Fenced(
                "the leader lease expired or was given up".into(),
            ));
        }
        let revision = match self.mark_revision.get() {
            Some(r) => r,
            None => {
                let key = self.mark_key();
                let resp = self.block_on("get", || {
                    self.client.range(RangeRequest {
                        key: key.clone().into_bytes(),
                        ..Default::default()
                    })
                })?;
                let r = resp.kvs.first().map_or(0, |kv| kv.mod_revision);
                self.mark_revision.set(Some(r));
                r
            }
        };
        let mark = format!("{:x}/{}", self.fence.lease, self.applied.get() + 1).into_bytes();
        let key = self.mark_key();
        let mut compare = self.fence.compares();
        compare.push(Compare::mod_revision(
            key.as_str(),
            CompareOp::Equal,
            revision,
        ));
        ops.push(RequestOp::put(key.as_str(), mark.clone(), 0));
        Ok(Prepared {
            txn: TxnRequest {
                compare,
                success: ops,
                failure: vec![
                    RequestOp::get(self.fence.leader_key.as_str()),
                    RequestOp::get(key.as_str()),
                ],
            },
            mark,
        })
    }

    /// Sends `p` (again while it may pass) and says whether it applied.
    fn send(&self, p: &Prepared) -> Result<(), StoreError> {
        if !self.fence.clock.valid() {
            return Err(StoreError::Fenced(
                "the leader lease expired or was given up".into(),
            ));
        }
        let resp = self.block_on("txn", || self.client.txn(p.txn.clone()))?;
        let applied = |revision: i64| {
            self.mark_revision.set(Some(revision));
            self.applied.set(self.applied.get() + 1);
            Ok(())
        };
        if resp.succeeded {
            return applied(etcd::revision(resp.header.as_ref()));
        }
        let read = |i: usize| {
            resp.responses
                .get(i)
                .and_then(|r| r.as_range())
                .and_then(|r| r.kvs.first())
        };
        // An earlier attempt of this transaction applied (its answer was
        // lost or came too late): done.
        if let Some(mark) = read(1)
            && mark.value == p.mark
        {
            return applied(mark.mod_revision);
        }
        let fenced = read(0).is_none_or(|leader| {
            leader.create_revision != self.fence.create_revision || leader.lease != self.fence.lease
        });
        if fenced {
            self.fence.clock.lose();
            return Err(StoreError::Fenced(format!(
                "the leader key {} no longer holds lease {:x} from revision {}",
                self.fence.leader_key, self.fence.lease, self.fence.create_revision
            )));
        }
        // Still the leader, but the mark is not the one this store last
        // saw: written by someone else. Read it again next term.
        self.mark_revision.set(None);
        Err(StoreError::Backend(format!(
            "the commit mark {} changed under this leader (to {:?})",
            self.mark_key(),
            read(1).map(|kv| String::from_utf8_lossy(&kv.value).into_owned())
        )))
    }

    fn txn_ops(ops: &[(String, KeyOp)]) -> Vec<RequestOp> {
        ops.iter()
            .map(|(k, op)| match op {
                KeyOp::Put(v) => RequestOp::put(k.as_str(), v.clone(), 0),
                KeyOp::Delete => RequestOp::delete(k.as_str()),
            })
            .collect()
    }

    /// Applies a committed redo log's changes and deletes the log.
    fn finish_redo(&self, ops: &[(String, KeyOp)]) -> Result<(), StoreError> {
        for piece in self.pieces(ops) {
            self.fenced_txn(Self::txn_ops(&piece))?;
        }
        self.delete_redo()
    }

    fn delete_redo(&self) -> Result<(), StoreError> {
        let prefix = self.key("redo/");
        self.fenced_txn(vec![RequestOp::delete_prefix(prefix.as_str())])
    }

    /// Writes a batch too large for one transaction through the redo log.
    fn commit_through_redo(&self, ops: Vec<(String, KeyOp)>) -> Result<(), StoreError> {
        let chunks = self.write_redo_chunks(&ops)?;
        // The commit point.
        self.fenced_txn(vec![RequestOp::put(
            self.key("redo/commit"),
            chunks.to_string(),
            0,
        )])?;
        self.finish_redo(&ops)
    }

    /// Stores `ops` as redo chunks (not yet committed); returns how many.
    fn write_redo_chunks(&self, ops: &[(String, KeyOp)]) -> Result<usize, StoreError> {
        let pieces = self.pieces(ops);
        // Each chunk record holds one piece: within the byte limit by
        // construction, one put per transaction.
        for (n, piece) in pieces.iter().enumerate() {
            let chunk = RedoChunk {
                ops: piece
                    .iter()
                    .map(|(k, op)| RedoOp {
                        key: k.clone(),
                        value: match op {
                            KeyOp::Put(v) => v.clone(),
                            KeyOp::Delete => Vec::new(),
                        },
                        delete: *op == KeyOp::Delete,
                    })
                    .collect(),
            };
            self.fenced_txn(vec![RequestOp::put(
                self.redo_chunk_key(n),
                chunk.encode_to_vec(),
                0,
            )])?;
        }
        Ok(pieces.len())
    }

    /// Every key under the prefix at one revision, page by page.
    fn read_all(&self) -> Result<BTreeMap<String, Vec<u8>>, StoreError> {
        let start = format!("{}/", self.prefix);
        let end = {
            let mut e = start.clone().into_bytes();
            if let Some(last) = e.last_mut() {
                *last += 1; // '/' + 1 = '0': the end of the prefix range
            }
            e
        };
        let mut out = BTreeMap::new();
        let mut from = start.into_bytes();
        let mut revision = 0;
        loop {
            let req = RangeRequest {
                key: from.clone(),
                range_end: end.clone(),
                limit: LOAD_PAGE,
                // 0 on the first page: the newest revision.
                revision,
                ..Default::default()
            };
            let resp = self.block_on("get", || self.client.range(req.clone()))?;
            if revision == 0 {
                revision = etcd::revision(resp.header.as_ref());
            }
            let kvs = resp.kvs;
            let last = kvs.last().map(|kv| kv.key.clone());
            for kv in kvs {
                let key = String::from_utf8_lossy(&kv.key).into_owned();
                out.insert(key, kv.value);
            }
            match last {
                Some(last) if resp.more => {
                    from = last;
                    from.push(0);
                }
                _ => return Ok(out),
            }
        }
    }
}

impl Store for EtcdStore {
    /// Reads the state. As the leader's first act it also completes a
    /// committed redo log a previous leader left half applied (and drops
    /// an uncommitted one), so the snapshot is exactly what was
    /// acknowledged.
    fn load(&self) -> Result<Snapshot, StoreError> {
        let mut all = self.read_all()?;
        let redo_prefix = self.key("redo/");
        let commit_key = self.key("redo/commit");
        let chunks: Vec<(String, Vec<u8>)> = all
            .range(redo_prefix.clone()..)
            .take_while(|(k, _)| k.starts_with(&redo_prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        if !chunks.is_empty() {
            if let Some(count) = all.get(&commit_key) {
                let count: usize =
                    String::from_utf8_lossy(count)
                        .parse()
                        .map_err(|e| StoreError::Corrupt {
                            key: commit_key.clone(),
                            reason: format!("{e}"),
                        })?;
                let mut ops = Vec::new();
                for n in 0..count {
                    let key = self.redo_chunk_key(n);
                    let raw = all.get(&key).ok_or_else(|| StoreError::Corrupt {
                        key: key.clone(),
                        reason: "a committed redo log misses this chunk".into(),
                    })?;
                    let chunk =
                        RedoChunk::decode(raw.as_slice()).map_err(|e| StoreError::Corrupt {
                            key: key.clone(),
                            reason: e.to_string(),
                        })?;
                    for op in chunk.ops {
                        let kop = if op.delete {
                            KeyOp::Delete
                        } else {
                            KeyOp::Put(op.value)
                        };
                        ops.push((op.key, kop));
                    }
                }
                tracing::warn!(
                    writes = ops.len(),
                    "finishing a committed batch a previous leader left half applied"
                );
                for (k, op) in &ops {
                    match op {
                        KeyOp::Put(v) => {
                            all.insert(k.clone(), v.clone());
                        }
                        KeyOp::Delete => {
                            all.remove(k);
                        }
                    }
                }
                self.finish_redo(&ops)?;
            } else {
                tracing::warn!("dropping an uncommitted batch a previous leader left");
                self.delete_redo()?;
            }
        }
        let jobs_prefix = self.key("jobs/");
        let nodes_prefix = self.key("nodes/");
        let mut snap = Snapshot {
            next_job: 1,
            ..Snapshot::default()
        };
        for (k, v) in &all {
            if k.starts_with(&jobs_prefix) {
                let job = Job::decode(v.as_slice()).map_err(|e| StoreError::Corrupt {
                    key: k.clone(),
                    reason: e.to_string(),
                })?;
                snap.jobs.push(job);
            } else if let Some(name) = k.strip_prefix(&nodes_prefix) {
                let admin = parse_admin(v).ok_or_else(|| StoreError::Corrupt {
                    key: k.clone(),
                    reason: format!("unknown node state {:?}", String::from_utf8_lossy(v)),
                })?;
                snap.node_admin.insert(name.to_string(), admin);
            } else if *k == self.key("meta/next_job") {
                snap.next_job =
                    String::from_utf8_lossy(v)
                        .parse()
                        .map_err(|e| StoreError::Corrupt {
                            key: k.clone(),
                            reason: format!("{e}"),
                        })?;
            }
        }
        Ok(snap)
    }

    /// A job record is its spec plus a little state; one record must fit
    /// in one transaction's bytes.
    fn max_spec_bytes(&self) -> Option<usize> {
        Some(self.limits.max_bytes.saturating_sub(SPEC_HEADROOM))
    }

    fn commit(&mut self, writes: &[Write]) -> Result<(), StoreError> {
        if !self.fence.clock.valid() {
            return Err(StoreError::Fenced(
                "the leader lease expired or was given up".into(),
            ));
        }
        if writes.is_empty() {
            return Ok(());
        }
        let ops: Vec<(String, KeyOp)> = self.coalesce(writes).into_iter().collect();
        let bytes: usize = ops.iter().map(|(k, op)| Self::op_size(k, op)).sum();
        if ops.len() <= self.limits.data_ops() && bytes <= self.limits.max_bytes {
            self.fenced_txn(Self::txn_ops(&ops))
        } else {
            self.commit_through_redo(ops)
        }
    }
}

#[cfg(test)]
#[path = "etcd_tests.rs"]
mod tests;

/// The request failed in a way that may pass when it is sent again: its
/// connection failed or broke, or etcd had no leader or timed out waiting
/// for one (etcd says UNAVAILABLE). Refusals (too many operations, too
/// large, no space) are not.
pub(crate) fn transient(e: &etcd::Error) -> bool {
    matches!(e, etcd::Error::Rpc { status, .. }
    if matches!(
        status.code(),
        tonic::Code::Unavailable
            | tonic::Code::Unknown
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Cancelled
            | tonic::Code::Aborted
    ))
}
