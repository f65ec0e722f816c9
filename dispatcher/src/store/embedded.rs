//! The embedded store: one redb file under the data directory. Each commit
//! is one write transaction with immediate durability (fsync), so a
//! `kill -9` loses nothing that was acknowledged. Of the writes of one
//! commit only the last of each record is applied (the commit is atomic,
//! so the others would never be visible).

use std::path::Path;

use prost::Message;
use proto::v1::Job;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use super::{NodeAdmin, Snapshot, Store, StoreError, Write};
use crate::record::JobKey;

const JOBS: TableDefinition<&str, &[u8]> = TableDefinition::new("jobs");
const NODES: TableDefinition<&str, u8> = TableDefinition::new("nodes");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");

fn backend(e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(e.to_string())
}

/// The redb-backed store.
pub struct EmbeddedStore {
    db: Database,
}

impl EmbeddedStore {
    /// Open (or create) the store in `dir` (file `dispatch.redb`).
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| StoreError::Backend(format!("create {}: {e}", dir.display())))?;
        let path = dir.join("dispatch.redb");
        let db = Database::create(&path)
            .map_err(|e| StoreError::Backend(format!("open {}: {e}", path.display())))?;
        let tx = db.begin_write().map_err(backend)?;
        {
            tx.open_table(JOBS).map_err(backend)?;
            tx.open_table(NODES).map_err(backend)?;
            tx.open_table(META).map_err(backend)?;
        }
        tx.commit().map_err(backend)?;
        Ok(Self { db })
    }
}

impl Store for EmbeddedStore {
    fn load(&self) -> Result<Snapshot, StoreError> {
        let tx = self.db.begin_read().map_err(backend)?;
        let mut snap = Snapshot::default();
        let jobs = tx.open_table(JOBS).map_err(backend)?;
        for row in jobs.iter().map_err(backend)? {
            let (k, v) = row.map_err(backend)?;
            let job = Job::decode(v.value()).map_err(|e| StoreError::Corrupt {
                key: k.value().to_string(),
                reason: e.to_string(),
            })?;
            snap.jobs.push(job);
        }
        let nodes = tx.open_table(NODES).map_err(backend)?;
        for row in nodes.iter().map_err(backend)? {
            let (k, v) = row.map_err(backend)?;
            snap.node_admin
                .insert(k.value().to_string(), NodeAdmin::from_u8(v.value()));
        }
        let meta = tx.open_table(META).map_err(backend)?;
        snap.next_job = meta
            .get("next_job")
            .map_err(backend)?
            .map_or(1, |v| v.value());
        Ok(snap)
    }

    fn commit(&mut self, writes: &[Write]) -> Result<(), StoreError> {
        if writes.is_empty() {
            return Ok(());
        }
        let tx = self.db.begin_write().map_err(backend)?;
        {
            let mut jobs = tx.open_table(JOBS).map_err(backend)?;
            let mut nodes = tx.open_table(NODES).map_err(backend)?;
            let mut meta = tx.open_table(META).map_err(backend)?;
            // One encoding buffer for the whole commit.
            let mut buf = Vec::new();
            for w in last_writes(writes) {
                match w {
                    Write::PutJob(job) => {
                        buf.clear();
                        job.to_proto().encode(&mut buf).map_err(backend)?;
                        jobs.insert(job.id().as_str(), buf.as_slice())
                            .map_err(backend)?;
                    }
                    Write::DeleteJob(id) => {
                        jobs.remove(id.as_str()).map_err(backend)?;
                    }
                    Write::PutNodeAdmin(name, admin) => {
                        nodes
                            .insert(name.as_str(), admin.to_u8())
                            .map_err(backend)?;
                    }
                    Write::PutNextJob(n) => {
                        meta.insert("next_job", *n).map_err(backend)?;
                    }
                }
            }
        }
        tx.commit().map_err(backend)
    }
}

/// The record a write sets: two writes of one record in a commit leave
/// only the later one visible.
#[derive(PartialEq, Eq, Hash)]
enum Record<'a> {
    Job(JobKey),
    /// A delete of an id that is not a job's (no put writes it).
    OtherJob(&'a str),
    NodeAdmin(&'a str),
    NextJob,
}

fn record_of(w: &Write) -> Record<'_> {
    match w {
        Write::PutJob(job) => Record::Job(job.key()),
        Write::DeleteJob(id) => JobKey::parse(id).map_or(Record::OtherJob(id), Record::Job),
        Write::PutNodeAdmin(name, _) => Record::NodeAdmin(name),
        Write::PutNextJob(_) => Record::NextJob,
    }
}

/// The writes of a commit that stay visible: the last write of each
/// record, in their order. A commit is applied whole, so applying only
/// these leaves the same state as applying every write in order; a job
/// submitted, assigned, started and finished within one batch of the core
/// is encoded and inserted once instead of four times.
fn last_writes(writes: &[Write]) -> Vec<&Write> {
    let mut seen = std::collections::HashSet::with_capacity(writes.len());
    let mut last: Vec<&Write> = writes
        .iter()
        .rev()
        .filter(|w| seen.insert(record_of(w)))
        .collect();
    last.reverse();
    last
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::v1::JobState;

    fn job(id: &str, state: JobState) -> Job {
        Job {
            id: id.into(),
            state: state as i32,
            ..Default::default()
        }
    }

    #[test]
    fn commits_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut s = EmbeddedStore::open(dir.path()).unwrap();
            assert_eq!(s.load().unwrap().next_job, 1);
            s.commit(&[
                Write::put_job(job("j-1", JobState::Pending)).unwrap(),
                Write::put_job(job("j-2", JobState::Running)).unwrap(),
                Write::PutNextJob(3),
                Write::PutNodeAdmin("n1".into(), NodeAdmin::Cordoned),
            ])
            .unwrap();
            s.commit(&[
                Write::put_job(job("j-1", JobState::Succeeded)).unwrap(),
                Write::DeleteJob("j-2".into()),
            ])
            .unwrap();
        }
        let s = EmbeddedStore::open(dir.path()).unwrap();
        let snap = s.load().unwrap();
        assert_eq!(snap.next_job, 3);
        assert_eq!(snap.jobs.len(), 1);
        assert_eq!(snap.jobs[0].state, JobState::Succeeded as i32);
        assert_eq!(snap.node_admin.get("n1"), Some(&NodeAdmin::Cordoned));
    }

    /// Every write applied in order to a plain map, the oracle of a commit.
    type Image = (
        std::collections::BTreeMap<String, i32>,
        std::collections::BTreeMap<String, u8>,
        Option<u64>,
    );

    fn apply<'a>(writes: impl IntoIterator<Item = &'a Write>) -> Image {
        let mut image = Image::default();
        for w in writes {
            match w {
                Write::PutJob(j) => {
                    image.0.insert(j.id(), j.state);
                }
                Write::DeleteJob(id) => {
                    image.0.remove(id);
                }
                Write::PutNodeAdmin(n, a) => {
                    image.1.insert(n.clone(), a.to_u8());
                }
                Write::PutNextJob(n) => image.2 = Some(*n),
            }
        }
        image
    }

    fn arb_write() -> impl proptest::strategy::Strategy<Value = Write> {
        use proptest::prelude::*;
        prop_oneof![
            (0..6u8, 1..7i32).prop_map(|(id, state)| Write::put_job(Job {
                id: format!("j-{id}"),
                state,
                ..Default::default()
            })
            .unwrap()),
            (0..6u8).prop_map(|id| Write::DeleteJob(format!("j-{id}"))),
            (0..3u8, 0..3u8)
                .prop_map(|(n, a)| Write::PutNodeAdmin(format!("n{n}"), NodeAdmin::from_u8(a))),
            (0..100u64).prop_map(Write::PutNextJob),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// Only the last write of each record is applied, and that leaves
        /// what every write in order leaves, in a map and in the store.
        #[test]
        fn the_last_writes_leave_what_all_writes_leave(
            before in proptest::collection::vec(arb_write(), 0..20),
            writes in proptest::collection::vec(arb_write(), 0..40),
        ) {
            let last = last_writes(&writes);
            let mut records: Vec<_> = last.iter().map(|w| record_of(w)).collect();
            let n = records.len();
            records.dedup();
            proptest::prop_assert_eq!(records.len(), n);
            let all: Vec<&Write> = before.iter().chain(&writes).collect();
            let compacted: Vec<&Write> = before.iter().chain(last).collect();
            proptest::prop_assert_eq!(apply(compacted), apply(all.clone()));
            let dir = tempfile::tempdir().unwrap();
            let mut s = EmbeddedStore::open(dir.path()).unwrap();
            s.commit(&before).unwrap();
            s.commit(&writes).unwrap();
            let snap = s.load().unwrap();
            let want = apply(all);
            let jobs: std::collections::BTreeMap<String, i32> =
                snap.jobs.iter().map(|j| (j.id.clone(), j.state)).collect();
            proptest::prop_assert_eq!(jobs, want.0);
            let admin: std::collections::BTreeMap<String, u8> =
                snap.node_admin.iter().map(|(n, a)| (n.clone(), a.to_u8())).collect();
            proptest::prop_assert_eq!(admin, want.1);
            proptest::prop_assert_eq!(snap.next_job, want.2.unwrap_or(1));
        }
    }

    #[test]
    fn corrupt_records_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let s = EmbeddedStore::open(dir.path()).unwrap();
        let tx = s.db.begin_write().unwrap();
        {
            let mut jobs = tx.open_table(JOBS).unwrap();
            jobs.insert("bad", [0xffu8, 0xff, 0xff].as_slice()).unwrap();
        }
        tx.commit().unwrap();
        assert!(matches!(s.load(), Err(StoreError::Corrupt { .. })));
    }
}
