//! Tests of the etcd store against a real etcd (Debian's `etcd-server`,
//! started on loopback by the end-to-end harness's `Etcd` helper).

use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd::{Client, ConnectOptions, RangeRequest};
use proto::v1::{Job, JobState};

use super::*;
use crate::record::JobKey;

const PREFIX: &str = "/t";

struct Setup {
    _dir: tempfile::TempDir,
    _etcd: e2e::Etcd,
    runtime: tokio::runtime::Runtime,
    client: Client,
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let etcd = e2e::Etcd::start(dir.path()).unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let client = runtime
        .block_on(Client::connect(
            [etcd.url.as_str()],
            &ConnectOptions::new().with_max_message_bytes(MAX_DECODE),
        ))
        .unwrap();
    Setup {
        _dir: dir,
        _etcd: etcd,
        runtime,
        client,
    }
}

impl Setup {
    /// Becomes the leader with a fresh lease (replacing any leader key),
    /// as `ha` does, and returns the fence.
    fn elect(&self) -> Fence {
        let c = &self.client;
        let key = format!("{PREFIX}/leader");
        self.runtime.block_on(async {
            let sent = Instant::now();
            let lease = c.lease_grant(10).await.unwrap();
            c.delete_range(etcd::DeleteRangeRequest {
                key: key.clone().into_bytes(),
                ..Default::default()
            })
            .await
            .unwrap();
            let put = c.put(key.as_str(), "http://me", lease.id).await.unwrap();
            Fence {
                leader_key: key.clone(),
                lease: lease.id,
                create_revision: put.header.unwrap().revision,
                clock: Arc::new(LeaseClock::new(sent, Duration::from_secs(10))),
            }
        })
    }

    fn store(&self, fence: Fence, limits: TxnLimits) -> EtcdStore {
        EtcdStore::new(
            &self.client,
            self.runtime.handle().clone(),
            PREFIX,
            fence,
            limits,
        )
    }

    fn keys(&self, under: &str) -> Vec<String> {
        let key = format!("{PREFIX}/{under}").into_bytes();
        let resp = self
            .runtime
            .block_on(self.client.range(RangeRequest {
                range_end: etcd::prefix_end(&key),
                key,
                keys_only: true,
                ..Default::default()
            }))
            .unwrap();
        resp.kvs
            .iter()
            .map(|kv| String::from_utf8_lossy(&kv.key).into_owned())
            .collect()
    }
}

fn job(id: &str, state: JobState) -> Job {
    Job {
        id: id.into(),
        state: state as i32,
        ..Default::default()
    }
}

fn put(id: &str, state: JobState) -> Write {
    Write::put_job(job(id, state)).unwrap()
}

#[test]
fn commits_load_back_and_batches_may_touch_a_key_twice() {
    let s = setup();
    let mut store = s.store(s.elect(), TxnLimits::default());
    assert_eq!(store.load().unwrap().next_job, 1);
    store
        .commit(&[
            put("j-1", JobState::Pending),
            put("j-2", JobState::Running),
            // The same key twice in one batch: the last write wins.
            put("j-1", JobState::Assigned),
            Write::PutNextJob(3),
            Write::PutNodeAdmin("n1".into(), NodeAdmin::Cordoned),
        ])
        .unwrap();
    store
        .commit(&[
            put("j-1", JobState::Succeeded),
            Write::DeleteJob(JobKey::single(2)),
        ])
        .unwrap();
    let snap = store.load().unwrap();
    assert_eq!(snap.next_job, 3);
    assert_eq!(snap.jobs.len(), 1);
    assert_eq!(snap.jobs[0].state, JobState::Succeeded as i32);
    assert_eq!(snap.node_admin.get("n1"), Some(&NodeAdmin::Cordoned));
}

#[test]
fn batches_beyond_the_txn_limits_commit_whole_through_the_redo_log() {
    let s = setup();
    let limits = TxnLimits {
        max_ops: 16,
        max_bytes: 4096,
    };
    let mut store = s.store(s.elect(), limits);
    let mut writes: Vec<Write> = (0..300)
        .map(|i| put(&format!("j-{i}"), JobState::Pending))
        .collect();
    writes.push(Write::PutNextJob(301));
    store.commit(&writes).unwrap();
    let snap = store.load().unwrap();
    assert_eq!(snap.jobs.len(), 300);
    assert_eq!(snap.next_job, 301);
    assert!(s.keys("redo/").is_empty(), "the redo log was not deleted");
}

#[test]
fn a_committed_redo_log_is_finished_by_the_next_leader_and_an_uncommitted_one_dropped() {
    let s = setup();
    let limits = TxnLimits {
        max_ops: 8,
        max_bytes: 1 << 20,
    };
    let old = s.store(s.elect(), limits);
    // The old leader stored a batch's log and its commit mark, then died
    // before applying it.
    let ops: Vec<(String, KeyOp)> = old
        .coalesce(
            &(0..50)
                .map(|i| put(&format!("j-{i}"), JobState::Pending))
                .collect::<Vec<_>>(),
        )
        .into_iter()
        .collect();
    let chunks = old.write_redo_chunks(&ops).unwrap();
    assert!(chunks > 1);
    old.fenced_txn(vec![etcd::RequestOp::put(
        old.key("redo/commit"),
        chunks.to_string(),
        0,
    )])
    .unwrap();
    drop(old);
    let new = s.store(s.elect(), limits);
    assert_eq!(new.load().unwrap().jobs.len(), 50);
    assert!(s.keys("redo/").is_empty());
    assert_eq!(s.keys("jobs/").len(), 50, "the batch was not applied");

    // A log without its commit mark never happened.
    let ops: Vec<(String, KeyOp)> = new
        .coalesce(
            &(50..80)
                .map(|i| put(&format!("j-{i}"), JobState::Pending))
                .collect::<Vec<_>>(),
        )
        .into_iter()
        .collect();
    new.write_redo_chunks(&ops).unwrap();
    drop(new);
    let newer = s.store(s.elect(), limits);
    assert_eq!(newer.load().unwrap().jobs.len(), 50);
    assert!(s.keys("redo/").is_empty());
}

#[test]
fn a_deposed_leader_writes_nothing() {
    let s = setup();
    let mut old = s.store(s.elect(), TxnLimits::default());
    old.commit(&[put("j-1", JobState::Running)]).unwrap();
    // Another replica wins (the old leader key is gone, a new one holds
    // another lease).
    let mut new = s.store(s.elect(), TxnLimits::default());
    let err = old
        .commit(&[put("j-1", JobState::Failed), put("j-2", JobState::Pending)])
        .unwrap_err();
    assert!(matches!(err, StoreError::Fenced(_)), "{err}");
    // Large batches too, before any chunk is written.
    let big: Vec<Write> = (0..200)
        .map(|i| put(&format!("j-{}", 100 + i), JobState::Pending))
        .collect();
    assert!(matches!(old.commit(&big), Err(StoreError::Fenced(_))));
    let snap = new.load().unwrap();
    assert_eq!(snap.jobs.len(), 1);
    assert_eq!(snap.jobs[0].state, JobState::Running as i32);
    assert!(s.keys("redo/").is_empty());
    new.commit(&[put("j-1", JobState::Succeeded)]).unwrap();
}

#[test]
fn a_lost_lease_clock_refuses_writes_without_asking_etcd() {
    let s = setup();
    let fence = s.elect();
    let clock = fence.clock.clone();
    let mut store = s.store(fence, TxnLimits::default());
    store.commit(&[put("j-1", JobState::Running)]).unwrap();
    clock.lose();
    assert!(matches!(
        store.commit(&[put("j-1", JobState::Failed)]),
        Err(StoreError::Fenced(_))
    ));
    // Even an empty batch (agent messages without writes) is refused.
    assert!(matches!(store.commit(&[]), Err(StoreError::Fenced(_))));
    assert_eq!(
        store.load().unwrap().jobs[0].state,
        JobState::Running as i32
    );
}

#[test]
fn lease_clock_expires_from_the_send_time_of_the_last_renewal() {
    // No sleeps: the clock is granted 10 s in the past, so "now" sits at a
    // known point of its timeline with seconds of margin either side, and
    // each step below holds only if renewal does what it must.
    let base = Instant::now()
        .checked_sub(Duration::from_secs(10))
        .expect("the monotonic clock is older than 10 s");
    let ttl = Duration::from_secs(5);
    let clock = LeaseClock::new(base, ttl);
    assert!(!clock.valid(), "valid 10 s after a grant of 5 s");
    // A renewal confirmed now but sent at +1 s runs to +6 s: still over.
    clock.extend(base + Duration::from_secs(1), ttl);
    assert!(
        !clock.valid(),
        "a renewal counted from its confirmation, not from when it was sent"
    );
    // Sent at +8 s: valid until +13 s, and now is +10 s.
    clock.extend(base + Duration::from_secs(8), ttl);
    assert!(
        clock.valid(),
        "a renewal sent at +8 s did not extend the lease"
    );
    // A late confirmation of an older renewal never shortens it.
    clock.extend(base + Duration::from_secs(2), ttl);
    assert!(clock.valid(), "an older renewal shortened the lease");
    // Given up is given up, whatever the renewals say.
    clock.lose();
    assert!(!clock.valid());
    clock.extend(Instant::now(), Duration::from_secs(60));
    assert!(!clock.valid(), "a renewal revived a lost lease");
}

fn signal(etcd: &e2e::Etcd, sig: &str) {
    let pid = etcd.proc.as_ref().map(|p| p.pid()).unwrap();
    let ok = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} {pid}");
}

fn state_of(store: &EtcdStore, id: &str) -> i32 {
    let snap = store.load().unwrap();
    snap.jobs.iter().find(|j| j.id == id).unwrap().state
}

#[test]
fn a_commit_whose_answer_was_lost_applies_once_when_sent_again() {
    let s = setup();
    let mut store = s.store(s.elect(), TxnLimits::default());
    store.commit(&[put("j-1", JobState::Pending)]).unwrap();
    // An attempt etcd applied but whose answer never came back: sent
    // behind the store's back.
    let ops: Vec<(String, KeyOp)> = store
        .coalesce(&[put("j-1", JobState::Running)])
        .into_iter()
        .collect();
    let running = store.prepare(EtcdStore::txn_ops(&ops)).unwrap();
    let first = s
        .runtime
        .block_on(s.client.txn(running.txn.clone()))
        .unwrap();
    assert!(first.succeeded);
    // The store asks again: it recognises its own mark, and goes on.
    store.send(&running).unwrap();
    store.commit(&[put("j-1", JobState::Succeeded)]).unwrap();
    // A copy of the old attempt that arrives late writes nothing.
    let late = s
        .runtime
        .block_on(s.client.txn(running.txn.clone()))
        .unwrap();
    assert!(
        !late.succeeded,
        "a stale attempt applied after a later commit"
    );
    assert_eq!(state_of(&store, "j-1"), JobState::Succeeded as i32);
}

#[test]
fn a_batch_fills_a_transaction_beside_the_commit_mark() {
    // etcd refuses more than --max-txn-ops operations: with the mark, a
    // batch of exactly max_ops writes must not go as one transaction.
    let s = setup();
    let limits = TxnLimits {
        max_ops: 128,
        max_bytes: 1 << 20,
    };
    let mut store = s.store(s.elect(), limits);
    let writes: Vec<Write> = (0..128)
        .map(|i| put(&format!("j-{i}"), JobState::Pending))
        .collect();
    store.commit(&writes).unwrap();
    store.commit(&writes[..127]).unwrap();
    assert_eq!(store.load().unwrap().jobs.len(), 128);
}

#[test]
fn a_commit_held_past_its_attempt_deadline_is_sent_again_and_applies_once() {
    let s = setup();
    let mut store = s
        .store(s.elect(), TxnLimits::default())
        .with_attempt_timeout(Duration::from_millis(100));
    store.commit(&[put("j-1", JobState::Pending)]).unwrap();
    // etcd stops answering for several attempts' deadlines (100, 200 ms).
    signal(&s._etcd, "-STOP");
    let (tx, rx) = std::sync::mpsc::channel();
    let committer = std::thread::spawn(move || {
        let r = store.commit(&[put("j-1", JobState::Running), put("j-2", JobState::Pending)]);
        tx.send(()).unwrap();
        (store, r)
    });
    let held = rx.recv_timeout(Duration::from_millis(500));
    signal(&s._etcd, "-CONT");
    assert!(held.is_err(), "the commit returned while etcd was stopped");
    let (mut store, r) = committer.join().unwrap();
    r.unwrap();
    store.commit(&[put("j-2", JobState::Succeeded)]).unwrap();
    assert_eq!(state_of(&store, "j-1"), JobState::Running as i32);
    assert_eq!(state_of(&store, "j-2"), JobState::Succeeded as i32);
}
