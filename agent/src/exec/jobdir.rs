//! The job directory `<state_dir>/jobs/<id>/`: its file names, the
//! append-only `record` that carries everything a restarted agent needs,
//! and the small writes around it.
//!
//! Few files, few syncs: per trivial job the directory holds `record`
//! alone (one inode besides the directory), nothing else unless the job
//! writes output, the shim has a diagnostic or the job is cancelled. Nothing here is fsynced: the directory describes live
//! processes, which a power loss ends anyway, while an agent crash or
//! restart (what re-adoption is for) keeps the page cache, so every byte
//! written before it is seen by the next agent.
//!
//! | file | writer | when |
//! |---|---|---|
//! | `record` | agent, shim | append-only lines, see below |
//! | `stdout`, `stderr` | shim | created on the job's first byte of output, up to the cap |
//! | `stdout.truncated`, `stderr.truncated` | shim | when the cap is hit |
//! | `cancel` | agent | before it sends SIGUSR1 to the shim |
//! | `shim.log` | shim | created on its first diagnostic |
//!
//! `record` lines, each appended by one `write(2)` on an `O_APPEND` file
//! and complete only with its final newline (a reader ignores a torn last
//! line):
//! - `spec {JSON}`: the agent creates the file with it, before the shim
//!   starts: everything the shim needs ([`ShimSpec`]); a record without
//!   it means the shim never started (`readopt` skips it);
//! - `shim PID`: the shim, first thing;
//! - `job PID STARTTIME`: once the job runs; its pid is its process
//!   group, the start time (ticks, `/proc/PID/stat`) its identity against
//!   pid reuse;
//! - `cpus [..]`: the agent, on every re-pin (the last one holds);
//! - `exit {JSON}`: the exit ([`JobExit`]), by the shim, or by the agent
//!   when the shim vanished without one; the first one holds;
//! - `acked`: the agent consumed the exit, `readopt` skips the job.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::error::{ExecError, Result};
use super::spec::{JobExit, ShimSpec};

/// Paths of one job directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct JobDir {
    path: PathBuf,
}

impl JobDir {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        JobDir { path: path.into() }
    }
    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn record(&self) -> PathBuf {
        self.path.join("record")
    }
    pub fn stdout(&self) -> PathBuf {
        self.path.join("stdout")
    }
    pub fn stderr(&self) -> PathBuf {
        self.path.join("stderr")
    }
    pub fn truncated_marker(&self, stream: &str) -> PathBuf {
        self.path.join(format!("{stream}.truncated"))
    }
    pub fn cancel(&self) -> PathBuf {
        self.path.join("cancel")
    }
    pub fn shim_log(&self) -> PathBuf {
        self.path.join("shim.log")
    }

    /// What `record` says so far (all `None` when it does not exist).
    pub fn read_record(&self) -> Result<Record> {
        self.read_record_with(true)
    }

    /// [`JobDir::read_record`] without the `spec` line's JSON (`spec`
    /// stays `None`): a finished job's exit, read on every job's end.
    pub fn read_record_without_spec(&self) -> Result<Record> {
        self.read_record_with(false)
    }

    fn read_record_with(&self, spec: bool) -> Result<Record> {
        let path = self.record();
        match fs::read(&path) {
            Ok(text) => Ok(Record::parse_with(&text, spec)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Record::default()),
            Err(e) => Err(ExecError::io("read", &path, e)),
        }
    }

    /// Append one line to `record` in a single `write(2)`.
    pub fn append(&self, line: &str) -> Result<()> {
        let path = self.record();
        let mut bytes = Vec::with_capacity(line.len() + 1);
        bytes.extend_from_slice(line.as_bytes());
        bytes.push(b'\n');
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(&bytes))
            .map_err(|e| ExecError::io("append to", &path, e))
    }

    /// Start `record` with its `spec` line: a new file, or the last
    /// job's record of a recycled directory (`spares.rs`) written over.
    ///
    /// The old record is emptied by an open that writes nothing, and the
    /// spec written by a second open without `O_TRUNC`. ext4 (its default
    /// `auto_da_alloc`) takes a truncation to 0 followed by writes on the
    /// same open file for a file being replaced, and on its close starts
    /// the writeback of the new data at once (`filemap_flush`): a block
    /// write on every start, 0.7 ms of the start task at the median and
    /// several ms at its tail. Closed with nothing written, the truncated
    /// file has nothing to write back, and the spec's bytes stay in the
    /// page cache like every other line of the record (nothing here is
    /// synced, see the module documentation).
    pub fn create_record(&self, spec: &ShimSpec) -> Result<()> {
        let path = self.record();
        let mut bytes = b"spec ".to_vec();
        serde_json::to_writer(&mut bytes, spec).map_err(|e| ExecError::Json {
            path: path.clone(),
            source: e,
        })?;
        bytes.push(b'\n');
        match OpenOptions::new().write(true).truncate(true).open(&path) {
            Ok(emptied) => drop(emptied),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(ExecError::io("empty", &path, e)),
        }
        // Empty by now: no truncation on this open (see above).
        OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .and_then(|mut f| f.write_all(&bytes))
            .map_err(|e| ExecError::io("create", &path, e))
    }

    /// Append `shim PID`.
    pub fn record_shim(&self, pid: i32) -> Result<()> {
        self.append(&format!("shim {pid}"))
    }

    /// Append `job PID STARTTIME` (start time 0: the job was already gone).
    pub fn record_job(&self, pid: i32, starttime: u64) -> Result<()> {
        self.append(&format!("job {pid} {starttime}"))
    }

    /// Append `cpus [..]`.
    pub fn record_cpus(&self, cpus: &[u32]) -> Result<()> {
        self.append(&format!("cpus {}", json_line(&self.record(), &cpus)?))
    }

    /// Append `exit {..}`.
    pub fn record_exit(&self, exit: &JobExit) -> Result<()> {
        self.append(&format!("exit {}", json_line(&self.record(), exit)?))
    }

    /// Append `acked`.
    pub fn record_acked(&self) -> Result<()> {
        self.append("acked")
    }

    /// Open `record` for reading it once and appending to it (the
    /// supervisor, for the whole of a job: one `open` instead of one per
    /// line).
    pub fn open_record(&self) -> Result<RecordFile> {
        let path = self.record();
        OpenOptions::new()
            .read(true)
            .append(true)
            .open(&path)
            .map(|file| RecordFile {
                file,
                path: path.clone(),
            })
            .map_err(|e| ExecError::io("open", &path, e))
    }
}

/// A job's `record`, open for appending (`O_APPEND`: each line is still
/// one `write(2)` at the end, whoever else appends).
#[derive(Debug)]
pub(crate) struct RecordFile {
    file: File,
    path: PathBuf,
}

impl RecordFile {
    /// What `record` says (read from its start: only before any append).
    pub fn read(&mut self) -> Result<Record> {
        // Room for a usual spec line: one read, then the one saying EOF.
        let text = super::read_to_end_plain(&mut self.file, 4096, false)
            .map_err(|e| ExecError::io("read", &self.path, e))?;
        Ok(Record::parse(&text))
    }

    /// Append one line in a single `write(2)`.
    pub fn append(&self, line: &str) -> Result<()> {
        let mut bytes = Vec::with_capacity(line.len() + 1);
        bytes.extend_from_slice(line.as_bytes());
        bytes.push(b'\n');
        (&self.file)
            .write_all(&bytes)
            .map_err(|e| ExecError::io("append to", &self.path, e))
    }

    /// Append `shim PID`.
    pub fn record_shim(&self, pid: i32) -> Result<()> {
        self.append(&format!("shim {pid}"))
    }

    /// Append `job PID STARTTIME`.
    pub fn record_job(&self, pid: i32, starttime: u64) -> Result<()> {
        self.append(&format!("job {pid} {starttime}"))
    }

    /// Append `exit {..}`; the JSON appended is returned.
    pub fn record_exit(&self, exit: &JobExit) -> Result<String> {
        let json = json_line(&self.path, exit)?;
        self.append(&format!("exit {json}"))?;
        Ok(json)
    }
}

fn json_line<T: Serialize + ?Sized>(path: &Path, value: &T) -> Result<String> {
    serde_json::to_string(value).map_err(|e| ExecError::Json {
        path: path.to_owned(),
        source: e,
    })
}

/// The parsed `record` of one job.
#[derive(Debug, Clone, Default)]
pub(crate) struct Record {
    pub spec: Option<ShimSpec>,
    pub shim_pid: Option<i32>,
    pub pid: Option<i32>,
    /// The job's start time in `/proc/PID/stat` ticks (`None`: unknown).
    pub starttime: Option<u64>,
    pub cpus: Option<Vec<u32>>,
    pub exit: Option<JobExit>,
    pub acked: bool,
}

impl Record {
    /// Parse every complete line; unknown or malformed lines are skipped
    /// (a newer writer's, or a torn last line).
    pub fn parse(text: &[u8]) -> Record {
        Record::parse_with(text, true)
    }

    /// [`Record::parse`], the `spec` line's JSON parsed only if `spec`.
    pub fn parse_with(text: &[u8], spec: bool) -> Record {
        let mut rec = Record::default();
        let complete = match text.iter().rposition(|&b| b == b'\n') {
            Some(end) => &text[..end],
            None => return rec,
        };
        let pid = |s: &str| s.parse::<i32>().ok().filter(|&p| p > 0);
        for line in complete.split(|&b| b == b'\n') {
            let Ok(line) = std::str::from_utf8(line) else {
                continue;
            };
            let (key, rest) = line.split_once(' ').unwrap_or((line, ""));
            match key {
                "spec" if spec && rec.spec.is_none() => rec.spec = serde_json::from_str(rest).ok(),
                "shim" => rec.shim_pid = rec.shim_pid.or(pid(rest)),
                "job" => {
                    let mut it = rest.split(' ');
                    if let Some(p) = it.next().and_then(pid) {
                        rec.pid = Some(p);
                        rec.starttime = it
                            .next()
                            .and_then(|t| t.parse::<u64>().ok())
                            .filter(|&t| t > 0);
                    }
                }
                "cpus" => {
                    if let Ok(cpus) = serde_json::from_str(rest) {
                        rec.cpus = Some(cpus);
                    }
                }
                "exit" if rec.exit.is_none() => rec.exit = serde_json::from_str(rest).ok(),
                "acked" => rec.acked = true,
                _ => {}
            }
        }
        rec
    }
}

/// Write `bytes` to `path` atomically (temporary file, rename) so a reader
/// never sees half of it; not synced (see the module documentation).
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let tmp = dir.join(format!(".{}.tmp", name.as_deref().unwrap_or("file")));
    let write = || -> io::Result<()> { File::create(&tmp)?.write_all(bytes) };
    write().map_err(|e| ExecError::io("write", &tmp, e))?;
    fs::rename(&tmp, path).map_err(|e| ExecError::io("rename into place", path, e))
}

/// Serialise `value` as JSON into `path`, atomically.
pub(crate) fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let mut text = serde_json::to_vec(value).map_err(|e| ExecError::Json {
        path: path.to_owned(),
        source: e,
    })?;
    text.push(b'\n');
    write_atomic(path, &text)
}

/// Read a JSON file; `Ok(None)` if it does not exist.
pub(crate) fn read_json<T: DeserializeOwned>(path: &Path) -> Result<Option<T>> {
    let text = match fs::read(path) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(ExecError::io("read", path, e)),
    };
    serde_json::from_slice(&text)
        .map(Some)
        .map_err(|e| ExecError::Json {
            path: path.to_owned(),
            source: e,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::JobOutcome;
    use proptest::prelude::*;

    /// The spec of a job `j` running `true` on CPU 0, as the tests write it.
    fn test_spec(supervised: bool) -> ShimSpec {
        ShimSpec {
            version: crate::exec::spec::SPEC_VERSION,
            job: crate::exec::JobExec::new("j", "true", vec![0]),
            run_as: None,
            log_cap_bytes: 10,
            cgroup: None,
            lease: None,
            supervised,
        }
    }

    /// A recycled record written over is not written back at once: its
    /// page stays dirty in the page cache, as a new record's does (on
    /// ext4 an `O_TRUNC` open that writes started the writeback on close,
    /// a block write per start).
    #[test]
    fn a_rewritten_record_is_not_flushed() {
        let dir = tempfile::tempdir().unwrap();
        let jd = JobDir::new(dir.path());
        let spec = test_spec(true);
        // A new record first: on a file system that keeps no dirty pages
        // (tmpfs) or a kernel without cachestat(2) there is nothing to see.
        jd.create_record(&spec).unwrap();
        if crate::exec::page_states(&jd.record()).is_none_or(|(dirty, _)| dirty == 0) {
            eprintln!("no dirty pages to see here (tmpfs, or no cachestat(2)): not checked");
            return;
        }
        for round in 0..20 {
            jd.record_shim(7).unwrap();
            jd.record_exit(&JobExit::bare("j", JobOutcome::Exited(0)))
                .unwrap();
            jd.create_record(&spec).unwrap();
            let (dirty, writeback) = crate::exec::page_states(&jd.record()).unwrap_or_default();
            assert!(
                dirty > 0 && writeback == 0,
                "round {round}: the record was written back at once (dirty {dirty}, writeback {writeback})"
            );
        }
        let rec = jd.read_record().unwrap();
        assert!(rec.spec.is_some() && rec.exit.is_none() && rec.shim_pid.is_none());
    }

    #[test]
    fn record_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let jd = JobDir::new(dir.path());
        let empty = jd.read_record().unwrap();
        assert!(empty.spec.is_none() && empty.shim_pid.is_none() && empty.exit.is_none());
        let spec = test_spec(false);
        // A recycled directory's last record is written over.
        jd.create_record(&spec).unwrap();
        jd.record_exit(&JobExit::bare("old", JobOutcome::Exited(9)))
            .unwrap();
        jd.record_acked().unwrap();
        jd.create_record(&spec).unwrap();
        let restarted = jd.read_record().unwrap();
        assert!(restarted.spec.is_some() && restarted.exit.is_none() && !restarted.acked);
        jd.record_shim(7).unwrap();
        jd.record_job(42, 1234).unwrap();
        jd.record_cpus(&[1, 3]).unwrap();
        jd.record_cpus(&[2]).unwrap();
        let first = JobExit::bare("j", JobOutcome::Exited(3));
        jd.record_exit(&first).unwrap();
        jd.record_exit(&JobExit::bare("j", JobOutcome::Lost("late".into())))
            .unwrap();
        let rec = jd.read_record().unwrap();
        assert_eq!(rec.spec.map(|s| s.job.id), Some("j".to_owned()));
        assert_eq!(rec.shim_pid, Some(7));
        assert_eq!((rec.pid, rec.starttime), (Some(42), Some(1234)));
        assert_eq!(rec.cpus, Some(vec![2]), "the last re-pin holds");
        assert_eq!(rec.exit, Some(first), "the first exit holds");
        assert!(!rec.acked);
        jd.record_acked().unwrap();
        assert!(jd.read_record().unwrap().acked);
        write_json(&jd.cancel(), &vec![1u32]).unwrap();
        assert_eq!(read_json::<Vec<u32>>(&jd.cancel()).unwrap(), Some(vec![1]));
        // No temporary file is left behind.
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(names.iter().all(|n| !n.to_string_lossy().ends_with(".tmp")));
    }

    /// The oracle: a line counts once its newline is there; the parse of a
    /// torn record equals the parse of its complete lines alone.
    fn oracle_lines(text: &[u8]) -> Vec<&[u8]> {
        let mut lines: Vec<&[u8]> = text.split(|&b| b == b'\n').collect();
        lines.pop(); // after the last newline: incomplete (or empty)
        lines
    }

    proptest! {
        #[test]
        fn a_torn_record_reads_as_its_complete_lines(cut in 0usize..400, shim in 1i32..1000, pid in 1i32..100000, t in 1u64..1_000_000) {
            let exit = JobExit::bare("j", JobOutcome::Exited(1));
            let text = format!(
                "shim {shim}\njob {pid} {t}\ncpus [0,1]\nexit {}\nacked\n",
                serde_json::to_string(&exit).unwrap()
            );
            let cut = cut.min(text.len());
            let torn = &text.as_bytes()[..cut];
            let lines = oracle_lines(torn);
            let rec = Record::parse(torn);
            prop_assert_eq!(rec.shim_pid.is_some(), !lines.is_empty());
            prop_assert_eq!(rec.pid.is_some(), lines.len() >= 2);
            prop_assert_eq!(rec.cpus.is_some(), lines.len() >= 3);
            prop_assert_eq!(rec.exit.is_some(), lines.len() >= 4);
            prop_assert_eq!(rec.acked, lines.len() >= 5);
            if lines.len() >= 2 {
                prop_assert_eq!((rec.pid, rec.starttime), (Some(pid), Some(t)));
            }
        }
    }
}
