//! The embedded store: one redb file under the data directory. Each commit
//! is one write transaction with immediate durability (fsync), so a
//! `kill -9` loses nothing that was acknowledged.

use std::path::Path;

use prost::Message;
use proto::v1::Job;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use super::{NodeAdmin, Snapshot, Store, StoreError, Write};

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
            for w in writes {
                match w {
                    Write::PutJob(job) => {
                        jobs.insert(job.id.as_str(), job.encode_to_vec().as_slice())
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
                Write::PutJob(std::sync::Arc::new(job("j-1", JobState::Pending))),
                Write::PutJob(std::sync::Arc::new(job("j-2", JobState::Running))),
                Write::PutNextJob(3),
                Write::PutNodeAdmin("n1".into(), NodeAdmin::Cordoned),
            ])
            .unwrap();
            s.commit(&[
                Write::PutJob(std::sync::Arc::new(job("j-1", JobState::Succeeded))),
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
