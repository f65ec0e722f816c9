//! The embedded store: one redb file under the data directory. Each commit
//! is one write transaction with immediate durability (fsync), so a
//! `kill -9` loses nothing that was acknowledged. Of the writes of one
//! commit only the last of each record is applied (the commit is atomic,
//! so the others would never be visible).
//!
//! Tables: `plain`, job number -> a plain job's encoded proto `Job`
//! without its id (the number gives it back), length-prefixed and padded
//! so that its later records fit in the same length ([`plain_value`]);
//! `jobs`, id -> the encoded
//! proto `Job` of an element stored whole (see below); `elements`, (job number,
//! index) -> an array element or gang member whose spec is its array's
//! (`JobRecord::element_proto`: no ids, no spec), and `specs`, job number
//! -> that spec and the reason texts its elements share, stored once per
//! array ([`StoredArray`]). An array's elements share one spec in the job
//! table, and mostly one text while they wait; storing them once per
//! element made them most of each element's bytes in the file and in
//! redb's page cache, which holds every page written (up to its 1 GiB
//! default). An element whose spec is not its array's stored one goes to
//! `jobs` whole, as every job did before (files written before read as
//! they were). An array's row goes with its last element in `elements`.
//!
//! Plain jobs were in `jobs` too, keyed by their id text: each insert
//! compared id strings down the tree, and ids sort `j-10000 < j-100000 <
//! j-10001`, so new jobs landed all over it. Keyed by number, a new job
//! appends at the right edge. A file written before has its plain jobs
//! moved to `plain` when it is opened, their bytes as they were.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::path::Path;
use std::sync::Arc;

use prost::Message;
use proto::v1::{Job, JobSpec};
use redb::{Database, ReadableDatabase, ReadableTable, Table, TableDefinition};

use super::{NodeAdmin, Snapshot, Store, StoreError, Write};
use crate::record::{JobKey, JobRecord, is_terminal_state};

const JOBS: TableDefinition<&str, &[u8]> = TableDefinition::new("jobs");
const PLAIN: TableDefinition<u64, &[u8]> = TableDefinition::new("plain");
const ELEMENTS: TableDefinition<(u64, u32), &[u8]> = TableDefinition::new("elements");
const SPECS: TableDefinition<u64, &[u8]> = TableDefinition::new("specs");
const NODES: TableDefinition<&str, u8> = TableDefinition::new("nodes");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");

fn backend(e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(e.to_string())
}

/// The redb-backed store.
pub struct EmbeddedStore {
    db: Database,
    /// The length of the value in `plain` of each plain job not finished
    /// that this store wrote, by number (see [`plain_value`]): a later
    /// write of the job pads to it when it fits. Only a hint: any length
    /// reads the same.
    plain_lengths: HashMap<u64, u32, std::hash::BuildHasherDefault<sched::idhash::IdHasher>>,
}

/// Bytes of padding a plain job's value gets when it is written before
/// it finishes, for what its later records add (its start and end times,
/// its CPUs: ~20 bytes), so they fit in the same length.
const PLAIN_ROOM: usize = 24;

/// A plain job's value in `plain` (in `buf`): the length of its record,
/// its record (`JobRecord::encode_proto` without the id), and zero bytes
/// up to `at_least` bytes in all. redb rewrites a committed leaf whole
/// (and splits it when full) to change the length of a value in it, but
/// patches a copy of it for a value of the same length (in place in a
/// leaf this commit wrote): a job written again with a record of the
/// length it had leaves its leaf as it was but for its bytes.
fn plain_value(job: &JobRecord, at_least: usize, buf: &mut Vec<u8>) {
    buf.clear();
    job.encode_proto_parts(false, true, buf);
    crate::record::prefix_length(buf, 0);
    if buf.len() < at_least {
        buf.resize(at_least, 0);
    }
}

/// The record of a value of `plain` (see [`plain_value`]).
fn plain_record(mut value: &[u8]) -> Result<&[u8], String> {
    let len = prost::encoding::decode_varint(&mut value).map_err(|e| e.to_string())?;
    usize::try_from(len)
        .ok()
        .and_then(|len| value.get(..len))
        .ok_or_else(|| format!("a record of {len} bytes in {} bytes", value.len()))
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
            let mut jobs = tx.open_table(JOBS).map_err(backend)?;
            let mut plain = tx.open_table(PLAIN).map_err(backend)?;
            migrate_plain(&mut jobs, &mut plain)?;
            tx.open_table(ELEMENTS).map_err(backend)?;
            tx.open_table(SPECS).map_err(backend)?;
            tx.open_table(NODES).map_err(backend)?;
            tx.open_table(META).map_err(backend)?;
        }
        tx.commit().map_err(backend)?;
        Ok(Self {
            db,
            plain_lengths: HashMap::default(),
        })
    }
}

/// Moves the plain jobs of a file written before `plain` existed (whole
/// in `jobs`, keyed by their id) to `plain`, their bytes as they were
/// (the id they hold is their key's), unpadded. Rows
/// whose key is not the id of a plain job as the dispatcher writes it
/// stay in `jobs`.
fn migrate_plain(
    jobs: &mut Table<'_, &'static str, &'static [u8]>,
    plain: &mut Table<'_, u64, &'static [u8]>,
) -> Result<(), StoreError> {
    let mut moved = Vec::new();
    for row in jobs.iter().map_err(backend)? {
        let (k, v) = row.map_err(backend)?;
        let id = k.value();
        if let Some(key) = JobKey::parse(id).filter(|k| k.is_single())
            && key.to_string() == id
        {
            moved.push((key.number(), id.to_string(), v.value().to_vec()));
        }
    }
    for (number, id, value) in moved {
        let mut framed = Vec::with_capacity(value.len() + 5);
        prost::encoding::encode_varint(value.len() as u64, &mut framed);
        framed.extend_from_slice(&value);
        plain.insert(number, framed.as_slice()).map_err(backend)?;
        jobs.remove(id.as_str()).map_err(backend)?;
    }
    Ok(())
}

/// The row of an array in `specs`: its elements' spec and the reason
/// texts they share (an element names one by its number, see
/// [`encode_element`]).
#[derive(Clone, PartialEq, prost::Message)]
struct StoredArray {
    #[prost(message, optional, tag = "1")]
    spec: Option<JobSpec>,
    #[prost(string, repeated, tag = "2")]
    texts: Vec<String>,
}

/// Texts an array's row keeps at most: an array's waiting elements show
/// one or two ("submitted", why no node takes them, "cancelled ...");
/// the texts of elements on nodes name their node, and stay with them.
const SHARED_TEXTS: usize = 4;

/// An array met in a commit: its row as stored, whether it changed, and
/// the spec it holds when that is the elements' (else None: the
/// elements here are stored whole).
struct ArrayRow {
    row: StoredArray,
    changed: bool,
    spec: Option<Arc<JobSpec>>,
}

/// The table `slot` holds, opened in `tx` first if it is not yet.
fn opened<'s, 't, K: redb::Key + 'static, V: redb::Value + 'static>(
    tx: &'t redb::WriteTransaction,
    slot: &'s mut Option<Table<'t, K, V>>,
    table: TableDefinition<K, V>,
) -> Result<&'s mut Table<'t, K, V>, StoreError> {
    if slot.is_none() {
        *slot = Some(tx.open_table(table).map_err(backend)?);
    }
    slot.as_mut()
        .ok_or_else(|| StoreError::Backend("a table just opened is gone".into()))
}

/// Array `number`'s row, for elements of `spec`: read, or new if the
/// array has none.
fn array_row(
    specs: &Table<'_, u64, &'static [u8]>,
    number: u64,
    spec: &Arc<JobSpec>,
) -> Result<ArrayRow, StoreError> {
    let stored = specs
        .get(number)
        .map_err(backend)?
        .map(|v| StoredArray::decode(v.value()));
    Ok(match stored {
        // Compared decoded: a node selector's encoding follows its map's
        // order, which equal maps need not share.
        Some(Ok(row)) => {
            let same = row.spec.as_ref() == Some(&**spec);
            ArrayRow {
                row,
                changed: false,
                spec: same.then(|| spec.clone()),
            }
        }
        Some(Err(_)) => ArrayRow {
            row: StoredArray::default(),
            changed: false,
            spec: None,
        },
        None => ArrayRow {
            row: StoredArray {
                spec: Some(JobSpec::clone(spec)),
                texts: Vec::new(),
            },
            changed: true,
            spec: Some(spec.clone()),
        },
    })
}

/// An element's value in `elements`: a varint naming its reason text
/// (0: in the record; k: the array's text k - 1), then its record. The
/// text is taken out of `proto` when the array shares it, or can
/// share it (a row keeps [`SHARED_TEXTS`]).
fn encode_element(row: &mut ArrayRow, mut proto: Job, buf: &mut Vec<u8>) -> Result<(), StoreError> {
    let mut text = 0;
    if !proto.reason.is_empty() {
        let texts = &mut row.row.texts;
        match texts.iter().position(|t| *t == proto.reason) {
            Some(i) => text = i + 1,
            None if texts.len() < SHARED_TEXTS => {
                texts.push(std::mem::take(&mut proto.reason));
                row.changed = true;
                text = texts.len();
            }
            None => {}
        }
        if text > 0 {
            proto.reason.clear();
        }
    }
    buf.clear();
    prost::encoding::encode_varint(text as u64, buf);
    proto.encode(buf).map_err(backend)
}

/// An element's record from its value (see [`encode_element`]) and its
/// array's row.
fn decode_element(
    key: JobKey,
    mut value: &[u8],
    row: Option<&StoredArray>,
) -> Result<Job, StoreError> {
    let corrupt = |reason: String| StoreError::Corrupt {
        key: key.to_string(),
        reason,
    };
    let text = prost::encoding::decode_varint(&mut value).map_err(|e| corrupt(e.to_string()))?;
    let mut stored = Job::decode(value).map_err(|e| corrupt(e.to_string()))?;
    let row = row.ok_or_else(|| corrupt("no spec stored for its array".into()))?;
    let spec = row
        .spec
        .clone()
        .ok_or_else(|| corrupt("its array's row has no spec".into()))?;
    if text > 0 {
        stored.reason = usize::try_from(text - 1)
            .ok()
            .and_then(|i| row.texts.get(i))
            .cloned()
            .ok_or_else(|| corrupt(format!("no text {text} in its array's row")))?;
    }
    JobRecord::element_from_stored(key, stored, spec)
        .ok_or_else(|| corrupt("not an element's key".into()))
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
        for row in tx
            .open_table(PLAIN)
            .map_err(backend)?
            .iter()
            .map_err(backend)?
        {
            let (k, v) = row.map_err(backend)?;
            let key = JobKey::single(k.value());
            let mut job = plain_record(v.value())
                .and_then(|r| Job::decode(r).map_err(|e| e.to_string()))
                .map_err(|reason| StoreError::Corrupt {
                    key: key.to_string(),
                    reason,
                })?;
            job.id = key.to_string();
            snap.jobs.push(job);
        }
        let mut arrays = HashMap::new();
        for row in tx
            .open_table(SPECS)
            .map_err(backend)?
            .iter()
            .map_err(backend)?
        {
            let (k, v) = row.map_err(backend)?;
            let row = StoredArray::decode(v.value()).map_err(|e| StoreError::Corrupt {
                key: format!("the row of array {}", JobKey::single(k.value())),
                reason: e.to_string(),
            })?;
            arrays.insert(k.value(), row);
        }
        let elements = tx.open_table(ELEMENTS).map_err(backend)?;
        for row in elements.iter().map_err(backend)? {
            let (k, v) = row.map_err(backend)?;
            let (number, index) = k.value();
            let key = JobKey::element(number, index);
            snap.jobs
                .push(decode_element(key, v.value(), arrays.get(&number))?);
        }
        // The order of the ids, as when every job was in `jobs`.
        snap.jobs.sort_unstable_by(|a, b| a.id.cmp(&b.id));
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
            // Opened when a write needs them: opening a table costs every
            // commit, and most commits hold only plain jobs.
            let mut plain = None;
            let mut jobs = None;
            let mut elements = None;
            let mut specs = None;
            let mut nodes = None;
            let mut meta = None;
            // One encoding buffer for the whole commit.
            let mut buf = Vec::new();
            // The arrays met in this commit, their rows.
            let mut arrays: HashMap<u64, ArrayRow> = HashMap::new();
            // Arrays that lost an element of `elements`: their row goes
            // with the last one.
            let mut emptied = Vec::new();
            for w in last_writes(writes) {
                match w {
                    Write::PutJob(job) if job.key().is_single() => {
                        // Keyed by its number: fixed width, and a new job
                        // appends at the tree's right edge (its id text
                        // sorts `j-10000 < j-100000 < j-10001`).
                        let number = job.key().number();
                        let had = self.plain_lengths.remove(&number).unwrap_or(0) as usize;
                        plain_value(job, had, &mut buf);
                        if buf.len() > had && !is_terminal_state(job.state) {
                            buf.resize(buf.len() + PLAIN_ROOM, 0);
                        }
                        opened(&tx, &mut plain, PLAIN)?
                            .insert(number, buf.as_slice())
                            .map_err(backend)?;
                        if !is_terminal_state(job.state) {
                            self.plain_lengths.insert(number, buf.len() as u32);
                        }
                    }
                    Write::PutJob(job) => {
                        let key = job.key();
                        let mut apart = false;
                        if let (Some(proto), Some(spec)) = (job.element_proto(), &job.spec) {
                            let row = match arrays.entry(key.number()) {
                                Entry::Occupied(e) => e.into_mut(),
                                Entry::Vacant(e) => {
                                    let specs = opened(&tx, &mut specs, SPECS)?;
                                    e.insert(array_row(specs, key.number(), spec)?)
                                }
                            };
                            if row
                                .spec
                                .as_ref()
                                .is_some_and(|s| Arc::ptr_eq(s, spec) || **s == **spec)
                            {
                                encode_element(row, proto, &mut buf)?;
                                apart = true;
                            }
                        }
                        if apart {
                            opened(&tx, &mut elements, ELEMENTS)?
                                .insert((key.number(), key.index()), buf.as_slice())
                                .map_err(backend)?;
                            opened(&tx, &mut jobs, JOBS)?
                                .remove(job.id().as_str())
                                .map_err(backend)?;
                        } else {
                            buf.clear();
                            job.encode_proto(&mut buf);
                            opened(&tx, &mut jobs, JOBS)?
                                .insert(job.id().as_str(), buf.as_slice())
                                .map_err(backend)?;
                            if !key.is_single()
                                && opened(&tx, &mut elements, ELEMENTS)?
                                    .remove((key.number(), key.index()))
                                    .map_err(backend)?
                                    .is_some()
                            {
                                emptied.push(key.number());
                            }
                        }
                    }
                    // A plain job is in `plain` only (moved there at
                    // open); an element in `elements`, or whole in `jobs`.
                    Write::DeleteJob(key) if key.is_single() => {
                        opened(&tx, &mut plain, PLAIN)?
                            .remove(key.number())
                            .map_err(backend)?;
                        self.plain_lengths.remove(&key.number());
                    }
                    Write::DeleteJob(key) => {
                        opened(&tx, &mut jobs, JOBS)?
                            .remove(key.to_string().as_str())
                            .map_err(backend)?;
                        if opened(&tx, &mut elements, ELEMENTS)?
                            .remove((key.number(), key.index()))
                            .map_err(backend)?
                            .is_some()
                        {
                            emptied.push(key.number());
                        }
                    }
                    Write::PutNodeAdmin(name, admin) => {
                        opened(&tx, &mut nodes, NODES)?
                            .insert(name.as_str(), admin.to_u8())
                            .map_err(backend)?;
                    }
                    Write::PutNextJob(n) => {
                        opened(&tx, &mut meta, META)?
                            .insert("next_job", *n)
                            .map_err(backend)?;
                    }
                }
            }
            for (n, row) in &arrays {
                if row.changed {
                    buf.clear();
                    row.row.encode(&mut buf).map_err(backend)?;
                    opened(&tx, &mut specs, SPECS)?
                        .insert(*n, buf.as_slice())
                        .map_err(backend)?;
                }
            }
            emptied.sort_unstable();
            emptied.dedup();
            for n in emptied {
                let left = opened(&tx, &mut elements, ELEMENTS)?
                    .range((n, 0)..=(n, u32::MAX))
                    .map_err(backend)?
                    .next()
                    .is_some();
                if !left {
                    opened(&tx, &mut specs, SPECS)?.remove(n).map_err(backend)?;
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
    NodeAdmin(&'a str),
    NextJob,
}

fn record_of(w: &Write) -> Record<'_> {
    match w {
        Write::PutJob(job) => Record::Job(job.key()),
        Write::DeleteJob(key) => Record::Job(*key),
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
    // FxHash: every write of every commit is looked up here once, and
    // SipHash was 4.5% of the store thread's instructions.
    let mut seen: std::collections::HashSet<
        Record<'_>,
        std::hash::BuildHasherDefault<sched::idhash::IdHasher>,
    > = std::collections::HashSet::with_capacity_and_hasher(writes.len(), Default::default());
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
    use crate::record::Text;
    use proto::v1::JobState;
    use redb::ReadableTableMetadata;

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
                Write::DeleteJob(JobKey::single(2)),
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

    /// Every write applied in order to a plain map, the oracle of a commit:
    /// the jobs (their whole proto records), node states, next number.
    type Image = (
        std::collections::BTreeMap<String, Job>,
        std::collections::BTreeMap<String, u8>,
        Option<u64>,
    );

    fn apply<'a>(writes: impl IntoIterator<Item = &'a Write>) -> Image {
        let mut image = Image::default();
        for w in writes {
            match w {
                Write::PutJob(j) => {
                    image.0.insert(j.id(), j.to_proto());
                }
                Write::DeleteJob(key) => {
                    image.0.remove(&key.to_string());
                }
                Write::PutNodeAdmin(n, a) => {
                    image.1.insert(n.clone(), a.to_u8());
                }
                Write::PutNextJob(n) => image.2 = Some(*n),
            }
        }
        image
    }

    /// Spec `v` of array `n`: 0 none, 1 the array's (a node selector of
    /// three labels, whose encoding follows its map's order), 2 another.
    fn spec_of(n: u64, v: u8) -> Option<JobSpec> {
        let labels = |x: &str| {
            ["a", "b", "c"]
                .iter()
                .map(|k| (k.to_string(), format!("{x}{n}")))
                .collect()
        };
        match v {
            0 => None,
            1 => Some(JobSpec {
                name: format!("array-{n}"),
                command: vec!["true".into()],
                node_selector: labels("x"),
                ..Default::default()
            }),
            _ => Some(JobSpec {
                name: "other".into(),
                node_selector: labels("y"),
                ..Default::default()
            }),
        }
    }

    /// A job write: plain jobs `j-0`..`j-5`, elements `j-10.0`..`j-12.3`
    /// (array elements or gang members, with a gang size or not), with
    /// their array's spec, another or none, in any state.
    fn arb_job() -> impl proptest::strategy::Strategy<Value = Job> {
        use proptest::prelude::*;
        let plain = (0..6u64, 0..3u8).prop_map(|(n, v)| (n, None, v));
        let element = (10..13u64, 0..4u32, 0..6u8).prop_map(|(n, i, v)| (n, Some(i), v));
        (
            prop_oneof![plain, element],
            1..7i32,
            any::<bool>(),
            0..3u32,
            prop_oneof![
                Just(String::new()),
                Just("submitted".to_string()),
                Just("no node matches".to_string()),
                "[a-z ]{0,12}",
            ],
        )
            .prop_map(|((n, i, v), state, gang, size, reason)| {
                // Elements: mostly their array's spec.
                let v = match (i, v) {
                    (None, v) => v,
                    (Some(_), 0) => 0,
                    (Some(_), 5) => 2,
                    _ => 1,
                };
                let key = i.map_or(JobKey::single(n), |i| JobKey::element(n, i));
                let array = key.array().to_string();
                let (gang, index) = (gang && i.is_some(), i.unwrap_or(0));
                Job {
                    id: key.to_string(),
                    spec: spec_of(n, v),
                    state,
                    reason,
                    attempt: 1,
                    array_id: if i.is_some() && !gang {
                        array.clone()
                    } else {
                        String::new()
                    },
                    array_index: if gang { 0 } else { index },
                    gang_id: if gang { array } else { String::new() },
                    gang_index: if gang { index } else { 0 },
                    // Mostly a gang size exactly for gang members.
                    gang_size: match (gang, size) {
                        (true, 0) | (false, 2) => size,
                        (true, _) => size + 1,
                        (false, _) => 0,
                    },
                    submit_time_ms: i64::from(state) * 1000,
                    ..Default::default()
                }
            })
    }

    fn arb_write() -> impl proptest::strategy::Strategy<Value = Write> {
        use proptest::prelude::*;
        prop_oneof![
            arb_job().prop_map(|j| Write::put_job(j).unwrap()),
            (0..6u64).prop_map(|n| Write::DeleteJob(JobKey::single(n))),
            (10..13u64, 0..4u32).prop_map(|(n, i)| Write::DeleteJob(JobKey::element(n, i))),
            (0..3u8, 0..3u8)
                .prop_map(|(n, a)| Write::PutNodeAdmin(format!("n{n}"), NodeAdmin::from_u8(a))),
            (0..100u64).prop_map(Write::PutNextJob),
        ]
    }

    /// The writes with their equal specs in one `Arc`, as the job table
    /// shares an array's.
    fn shared(writes: &[Write]) -> Vec<Write> {
        let mut seen: Vec<Arc<JobSpec>> = Vec::new();
        writes
            .iter()
            .map(|w| match w {
                Write::PutJob(j) => {
                    let mut j = JobRecord::clone(j);
                    if let Some(s) = &j.spec {
                        match seen.iter().find(|x| **x == *s) {
                            Some(x) => j.spec = Some(x.clone()),
                            None => seen.push(s.clone()),
                        }
                    }
                    Write::PutJob(Arc::new(j))
                }
                w => w.clone(),
            })
            .collect()
    }

    /// Array numbers with a stored spec and no element in `elements`.
    fn orphan_specs(s: &EmbeddedStore) -> Vec<u64> {
        let tx = s.db.begin_read().unwrap();
        let elements = tx.open_table(ELEMENTS).unwrap();
        let specs = tx.open_table(SPECS).unwrap();
        specs
            .iter()
            .unwrap()
            .map(|r| r.unwrap().0.value())
            .filter(|n| {
                elements
                    .range((*n, 0)..=(*n, u32::MAX))
                    .unwrap()
                    .next()
                    .is_none()
            })
            .collect()
    }

    fn rows(s: &EmbeddedStore) -> (u64, u64, u64) {
        let tx = s.db.begin_read().unwrap();
        (
            tx.open_table(JOBS).unwrap().len().unwrap(),
            tx.open_table(ELEMENTS).unwrap().len().unwrap(),
            tx.open_table(SPECS).unwrap().len().unwrap(),
        )
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(128))]
        /// Only the last write of each record is applied, and that leaves
        /// what every write in order leaves, in a map and in the store:
        /// every job's whole record comes back (elements kept without
        /// their spec included), and no spec outlives its array's last
        /// element.
        #[test]
        fn the_last_writes_leave_what_all_writes_leave(
            before in proptest::collection::vec(arb_write(), 0..20),
            writes in proptest::collection::vec(arb_write(), 0..40),
            after in proptest::collection::vec(arb_write(), 0..20),
            share in proptest::prelude::any::<bool>(),
        ) {
            // Shared across the commits too, as the job table keeps a
            // job's spec from its submission on.
            let (before, writes, after) = if share {
                let all = shared(&[before.as_slice(), &writes, &after].concat());
                let (b, rest) = all.split_at(before.len());
                let (w, a) = rest.split_at(writes.len());
                (b.to_vec(), w.to_vec(), a.to_vec())
            } else {
                (before, writes, after)
            };
            let last = last_writes(&writes);
            let mut records: Vec<_> = last.iter().map(|w| record_of(w)).collect();
            let n = records.len();
            records.dedup();
            proptest::prop_assert_eq!(records.len(), n);
            let all: Vec<&Write> = before.iter().chain(&writes).chain(&after).collect();
            let compacted: Vec<&Write> = before.iter().chain(last).chain(&after).collect();
            proptest::prop_assert_eq!(apply(compacted), apply(all.clone()));
            let dir = tempfile::tempdir().unwrap();
            let mut s = EmbeddedStore::open(dir.path()).unwrap();
            s.commit(&before).unwrap();
            s.commit(&writes).unwrap();
            s.commit(&after).unwrap();
            let snap = s.load().unwrap();
            let want = apply(all);
            let ids: Vec<&String> = snap.jobs.iter().map(|j| &j.id).collect();
            let want_ids: Vec<&String> = want.0.keys().collect();
            proptest::prop_assert_eq!(ids, want_ids);
            let jobs: std::collections::BTreeMap<String, Job> =
                snap.jobs.iter().map(|j| (j.id.clone(), j.clone())).collect();
            proptest::prop_assert_eq!(jobs, want.0);
            let admin: std::collections::BTreeMap<String, u8> =
                snap.node_admin.iter().map(|(n, a)| (n.clone(), a.to_u8())).collect();
            proptest::prop_assert_eq!(admin, want.1);
            proptest::prop_assert_eq!(snap.next_job, want.2.unwrap_or(1));
            proptest::prop_assert_eq!(orphan_specs(&s), Vec::<u64>::new());
        }
    }

    /// An array's elements keep its spec once; it goes with the last one.
    #[test]
    fn an_arrays_spec_is_stored_once() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = EmbeddedStore::open(dir.path()).unwrap();
        let spec = Arc::new(spec_of(7, 1).unwrap());
        let element = |i| {
            let mut r = JobRecord::new(JobKey::element(7, i), spec.clone(), Arc::from("u"), 0, 5);
            r.state = JobState::Pending as i32;
            r.reason = Text::from(if i % 10 == 5 { "its own" } else { "waiting" });
            Write::PutJob(Arc::new(r))
        };
        let put: Vec<Write> = (0..100).map(element).collect();
        s.commit(&put).unwrap();
        assert_eq!(rows(&s), (0, 100, 1));
        let row = {
            let tx = s.db.begin_read().unwrap();
            let specs = tx.open_table(SPECS).unwrap();
            let value = specs.get(7).unwrap().unwrap();
            StoredArray::decode(value.value()).unwrap()
        };
        assert_eq!(row.spec.as_ref(), Some(&*spec));
        assert_eq!(row.texts, ["waiting", "its own"]);
        // Every element names its text in the row, none holds it.
        let named: Vec<u8> = {
            let tx = s.db.begin_read().unwrap();
            let elements = tx.open_table(ELEMENTS).unwrap();
            elements
                .iter()
                .unwrap()
                .map(|r| r.unwrap().1.value()[0])
                .collect()
        };
        let want: Vec<u8> = (0..100u32)
            .map(|i| JobKey::element(7, i))
            .map(|k| if k.index() % 10 == 5 { 2 } else { 1 })
            .collect();
        assert_eq!(named, want);
        let snap = s.load().unwrap();
        assert_eq!(snap.jobs.len(), 100);
        let loaded: HashMap<&str, &Job> = snap.jobs.iter().map(|j| (j.id.as_str(), j)).collect();
        for w in &put {
            let Write::PutJob(r) = w else { unreachable!() };
            assert_eq!(loaded[r.id().as_str()], &r.to_proto());
        }
        let gone: Vec<Write> = (0..99)
            .map(|i| Write::DeleteJob(JobKey::element(7, i)))
            .collect();
        s.commit(&gone).unwrap();
        assert_eq!(rows(&s), (0, 1, 1));
        s.commit(&[Write::DeleteJob(JobKey::element(7, 99))])
            .unwrap();
        assert_eq!(rows(&s), (0, 0, 0));
    }

    /// A file written before elements were kept apart (every job whole in
    /// `jobs`) reads as it was, and an element written again moves.
    #[test]
    fn elements_stored_whole_before_read_and_move() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = EmbeddedStore::open(dir.path()).unwrap();
        let spec = Arc::new(spec_of(3, 1).unwrap());
        let records: Vec<JobRecord> = (0..3)
            .map(|i| JobRecord::new(JobKey::element(3, i), spec.clone(), Arc::from(""), 0, 1))
            .collect();
        let tx = s.db.begin_write().unwrap();
        {
            let mut jobs = tx.open_table(JOBS).unwrap();
            for r in &records {
                jobs.insert(r.id().as_str(), r.to_proto().encode_to_vec().as_slice())
                    .unwrap();
            }
        }
        tx.commit().unwrap();
        let want: Vec<Job> = records.iter().map(JobRecord::to_proto).collect();
        assert_eq!(s.load().unwrap().jobs, want);
        s.commit(&[Write::PutJob(Arc::new(records[1].clone()))])
            .unwrap();
        assert_eq!(rows(&s), (2, 1, 1));
        assert_eq!(s.load().unwrap().jobs, want);
        s.commit(&[Write::DeleteJob(JobKey::element(3, 1))])
            .unwrap();
        assert_eq!(rows(&s), (2, 0, 0));
    }

    /// Rows of a table keyed by number.
    fn numbered(s: &EmbeddedStore, table: TableDefinition<u64, &[u8]>) -> Vec<(u64, Vec<u8>)> {
        let tx = s.db.begin_read().unwrap();
        let t = tx.open_table(table).unwrap();
        t.iter()
            .unwrap()
            .map(|r| {
                let (k, v) = r.unwrap();
                (k.value(), v.value().to_vec())
            })
            .collect()
    }

    /// A file written before `plain` (every job whole in `jobs`, keyed by
    /// its id) reads as it was; its plain jobs move to `plain` at open
    /// and are written and deleted there since.
    #[test]
    fn plain_jobs_stored_by_id_before_move_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let spec = |n| Arc::new(spec_of(n, 1).unwrap());
        let mut old: Vec<JobRecord> = [1, 2, 10, 100, 11]
            .into_iter()
            .map(|n| {
                let mut r = JobRecord::new(JobKey::single(n), spec(n), Arc::from("u"), 0, 5);
                r.state = JobState::Running as i32;
                r.node = "n1".into();
                r
            })
            .collect();
        old.push(JobRecord::new(
            JobKey::element(3, 0),
            spec(3),
            Arc::from("u"),
            0,
            5,
        ));
        // An id the dispatcher does not write, as it was.
        let odd = Job {
            id: "j-07".into(),
            state: JobState::Pending as i32,
            ..Default::default()
        };
        {
            // The layout of the build before: written with redb directly.
            let db = Database::create(dir.path().join("dispatch.redb")).unwrap();
            let tx = db.begin_write().unwrap();
            {
                let mut jobs = tx.open_table(JOBS).unwrap();
                for r in &old {
                    jobs.insert(r.id().as_str(), r.to_proto().encode_to_vec().as_slice())
                        .unwrap();
                }
                jobs.insert("j-07", odd.encode_to_vec().as_slice()).unwrap();
                tx.open_table(META)
                    .unwrap()
                    .insert("next_job", 101)
                    .unwrap();
            }
            tx.commit().unwrap();
        }
        let mut want: Vec<Job> = old.iter().map(JobRecord::to_proto).collect();
        want.push(odd.clone());
        want.sort_by(|a, b| a.id.cmp(&b.id));
        let mut s = EmbeddedStore::open(dir.path()).unwrap();
        assert_eq!(rows(&s), (2, 0, 0));
        assert_eq!(
            numbered(&s, PLAIN).iter().map(|r| r.0).collect::<Vec<_>>(),
            [1, 2, 10, 11, 100]
        );
        let snap = s.load().unwrap();
        assert_eq!(snap.jobs, want);
        assert_eq!(snap.next_job, 101);
        // Written again, deleted, and a new one: all in `plain`.
        old[1].state = JobState::Succeeded as i32;
        let new = JobRecord::new(JobKey::single(101), spec(101), Arc::from("u"), 0, 6);
        s.commit(&[
            Write::PutJob(Arc::new(old[1].clone())),
            Write::DeleteJob(JobKey::single(10)),
            Write::PutJob(Arc::new(new.clone())),
            // The key the odd row reads back as: a plain job's, whose
            // row is in `plain`; the odd row stays as it was.
            Write::DeleteJob(JobKey::single(7)),
        ])
        .unwrap();
        let mut want: Vec<Job> = old
            .iter()
            .chain([&new])
            .filter(|r| r.id() != "j-10")
            .map(JobRecord::to_proto)
            .chain([odd])
            .collect();
        want.sort_by(|a, b| a.id.cmp(&b.id));
        assert_eq!(s.load().unwrap().jobs, want);
        assert_eq!(rows(&s), (2, 0, 0));
        drop(s);
        // Opened again: nothing left to move, the same jobs.
        let s = EmbeddedStore::open(dir.path()).unwrap();
        assert_eq!(s.load().unwrap().jobs, want);
    }

    /// A plain job written again keeps the length of its value while its
    /// record fits (padded), and reads back exactly as written; a record
    /// that outgrows it is stored whole.
    #[test]
    fn a_plain_jobs_value_keeps_its_length_while_its_record_fits() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = EmbeddedStore::open(dir.path()).unwrap();
        let spec = Arc::new(spec_of(1, 1).unwrap());
        let mut r = JobRecord::new(JobKey::single(1), spec, Arc::from("u"), 0, 5);
        let value = |s: &EmbeddedStore| numbered(s, PLAIN)[0].1.clone();
        let put = |s: &mut EmbeddedStore, r: &JobRecord| {
            s.commit(&[Write::PutJob(Arc::new(r.clone()))]).unwrap();
            assert_eq!(s.load().unwrap().jobs, vec![r.to_proto()]);
        };
        r.state = JobState::Pending as i32;
        r.reason = Text::from("submitted");
        put(&mut s, &r);
        let pending = value(&s);
        let mut unpadded = Vec::new();
        plain_value(&r, 0, &mut unpadded);
        assert_eq!(pending.len(), unpadded.len() + PLAIN_ROOM);
        assert_eq!(&pending[..unpadded.len()], unpadded.as_slice());
        // Started, then finished: longer records, one length.
        r.state = JobState::Running as i32;
        r.node = "node-1".into();
        r.cpus = vec![0, 1].into();
        r.start_time_ms = 1_733_000_000_000;
        put(&mut s, &r);
        assert_eq!(value(&s).len(), pending.len());
        r.state = JobState::Succeeded as i32;
        r.reason = Text::default();
        r.end_time_ms = 1_733_000_000_100;
        put(&mut s, &r);
        assert_eq!(value(&s).len(), pending.len());
        // Finished, it is not remembered; a record that does not fit is
        // stored as it is.
        assert!(s.plain_lengths.is_empty());
        r.reason = Text::from("x".repeat(100));
        put(&mut s, &r);
        plain_value(&r, 0, &mut unpadded);
        assert_eq!(value(&s), unpadded);
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

    #[test]
    fn an_element_without_its_arrays_spec_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let s = EmbeddedStore::open(dir.path()).unwrap();
        let tx = s.db.begin_write().unwrap();
        {
            let mut elements = tx.open_table(ELEMENTS).unwrap();
            // Its reason in the record (0), an empty record.
            elements.insert((4, 0), [0u8].as_slice()).unwrap();
        }
        tx.commit().unwrap();
        match s.load() {
            Err(StoreError::Corrupt { key, reason }) => {
                assert_eq!(key, "j-4.0");
                assert!(reason.contains("no spec"), "{reason}");
            }
            r => panic!("{r:?}"),
        }
    }
}
