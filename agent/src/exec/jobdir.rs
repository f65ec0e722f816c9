//! The job directory `<state_dir>/jobs/<id>/`: its file names, and atomic
//! writes (temporary file, fsync, rename, fsync of the directory) so a
//! reader (the agent, possibly restarted) never sees a half-written file.
//!
//! | file | writer | when |
//! |---|---|---|
//! | `spec.json` | agent | before the shim starts |
//! | `shim.pid` | shim | first thing |
//! | `starttime` | shim | with `pid`: the job's start in `/proc/<pid>/stat` ticks, its identity against pid reuse |
//! | `pid` | shim | once the job runs (its pid = its process group) |
//! | `stdout`, `stderr` | shim | while the job runs, up to the cap |
//! | `stdout.truncated`, `stderr.truncated` | shim | when the cap is hit |
//! | `cpus` | agent | on every re-pin |
//! | `cancel` | agent | before it sends SIGUSR1 to the shim |
//! | `status.json` | shim (agent if the shim vanished) | last |
//! | `acked` | agent | the exit was consumed: `readopt` skips the job |
//! | `shim.log` | shim (stderr) | diagnostics |

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::error::{ExecError, Result};

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
    pub fn spec(&self) -> PathBuf {
        self.path.join("spec.json")
    }
    pub fn status(&self) -> PathBuf {
        self.path.join("status.json")
    }
    pub fn pid(&self) -> PathBuf {
        self.path.join("pid")
    }
    pub fn starttime(&self) -> PathBuf {
        self.path.join("starttime")
    }
    pub fn shim_pid(&self) -> PathBuf {
        self.path.join("shim.pid")
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
    pub fn cpus(&self) -> PathBuf {
        self.path.join("cpus")
    }
    pub fn cancel(&self) -> PathBuf {
        self.path.join("cancel")
    }
    pub fn acked(&self) -> PathBuf {
        self.path.join("acked")
    }
    pub fn shim_log(&self) -> PathBuf {
        self.path.join("shim.log")
    }
}

/// Write `bytes` to `path` atomically and durably.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let tmp = dir.join(format!(".{}.tmp", name.as_deref().unwrap_or("file")));
    let write = || -> io::Result<()> {
        let mut file = File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()
    };
    write().map_err(|e| ExecError::io("write", &tmp, e))?;
    fs::rename(&tmp, path).map_err(|e| ExecError::io("rename into place", path, e))?;
    // The rename is durable once the directory is synced; a failure here
    // loses durability, not correctness, so it is not an error.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Serialise `value` as pretty JSON into `path`, atomically.
pub(crate) fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let mut text = serde_json::to_vec_pretty(value).map_err(|e| ExecError::Json {
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

/// Read a pid file (a positive decimal number); `Ok(None)` if missing.
pub(crate) fn read_pid(path: &Path) -> Result<Option<i32>> {
    let text = match fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(ExecError::io("read", path, e)),
    };
    match text.trim().parse::<i32>() {
        Ok(pid) if pid > 0 => Ok(Some(pid)),
        _ => Err(ExecError::io(
            "parse pid in",
            path,
            io::Error::new(io::ErrorKind::InvalidData, format!("{text:?} is not a pid")),
        )),
    }
}

/// Write a pid file atomically.
pub(crate) fn write_pid(path: &Path, pid: i32) -> Result<()> {
    write_atomic(path, format!("{pid}\n").as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_json_and_pid_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let jd = JobDir::new(dir.path());
        write_pid(&jd.pid(), 42).unwrap();
        assert_eq!(read_pid(&jd.pid()).unwrap(), Some(42));
        assert_eq!(read_pid(&jd.shim_pid()).unwrap(), None);
        fs::write(jd.shim_pid(), "zero\n").unwrap();
        assert!(read_pid(&jd.shim_pid()).is_err());
        write_json(&jd.cpus(), &vec![1u32, 3]).unwrap();
        assert_eq!(read_json::<Vec<u32>>(&jd.cpus()).unwrap(), Some(vec![1, 3]));
        // No temporary file is left behind.
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(names.iter().all(|n| !n.to_string_lossy().ends_with(".tmp")));
    }
}
