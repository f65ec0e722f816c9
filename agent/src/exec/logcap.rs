//! Size-capped job logs. The shim reads the job's stdout and stderr pipes
//! and appends to `stdout` / `stderr` in the job directory through a
//! [`CappedLog`]: the file is created on the first byte (a job without
//! output costs no inode; readers take a missing file as empty), bytes go
//! straight to it (readable while the job runs) until the cap, the rest is read and dropped (the job never blocks
//! on a full pipe), and the first dropped byte creates a `<stream>.truncated`
//! marker so readers see the truncation before the job ends.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;

use super::shim::diag;

/// Counters of one stream, shared with the shim's supervisor so they
/// survive the pump task.
#[derive(Debug, Default)]
pub(crate) struct LogStats {
    pub written: AtomicU64,
    pub truncated: AtomicBool,
}

/// An append-only file that accepts at most `cap` bytes.
#[derive(Debug)]
pub(crate) struct CappedLog {
    /// Opened on the first byte.
    file: Option<File>,
    path: PathBuf,
    cap: u64,
    marker: PathBuf,
    stats: Arc<LogStats>,
}

impl CappedLog {
    /// A log into `path`, created (truncated) on the first byte; `marker`
    /// is created on the first byte past the cap.
    pub fn lazy(path: &Path, cap: u64, marker: PathBuf) -> Self {
        CappedLog {
            file: None,
            path: path.to_owned(),
            cap,
            marker,
            stats: Arc::default(),
        }
    }

    pub fn stats(&self) -> Arc<LogStats> {
        Arc::clone(&self.stats)
    }

    /// Append what fits under the cap; note truncation of the rest.
    pub fn append(&mut self, buf: &[u8]) -> io::Result<()> {
        let written = self.stats.written.load(Ordering::Relaxed);
        let room = self.cap.saturating_sub(written);
        let take = usize::try_from(room).unwrap_or(usize::MAX).min(buf.len());
        if take > 0 {
            let file = match &mut self.file {
                Some(f) => f,
                None => self.file.insert(
                    OpenOptions::new()
                        .write(true)
                        .create(true)
                        .truncate(true)
                        .open(&self.path)?,
                ),
            };
            file.write_all(&buf[..take])?;
            self.stats
                .written
                .store(written + take as u64, Ordering::Relaxed);
        }
        if take < buf.len() && !self.stats.truncated.swap(true, Ordering::Relaxed) {
            File::create(&self.marker)?;
        }
        Ok(())
    }

    /// Copy `pipe` into the log until EOF. Write errors (disk full) stop
    /// the copy into the file but the pipe keeps being drained.
    ///
    /// The 64 KiB buffer is allocated at the first byte: most jobs write
    /// nothing, and zeroing two of them per job was a twentieth of the
    /// supervisor's time with trivial jobs.
    pub async fn pump(mut self, mut pipe: pipe::Receiver) {
        let mut first = [0u8; 512];
        let mut big: Vec<u8> = Vec::new();
        let mut failed = false;
        loop {
            let buf: &mut [u8] = if big.is_empty() { &mut first } else { &mut big };
            let n = match pipe.read(buf).await {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    diag(format_args!(
                        "reading the job's pipe for {}: {e}",
                        self.path.display()
                    ));
                    break;
                }
            };
            if !failed && let Err(e) = self.append(&buf[..n]) {
                diag(format_args!(
                    "writing {}: {e}; dropping further output",
                    self.path.display()
                ));
                failed = true;
            }
            if big.is_empty() {
                big = vec![0u8; 64 * 1024];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn keeps_exactly_the_prefix_under_the_cap(
            cap in 0u64..300,
            chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..80), 0..10),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("out");
            let marker = dir.path().join("out.truncated");
            let mut log = CappedLog::lazy(&path, cap, marker.clone());
            let stats = log.stats();
            let all: Vec<u8> = chunks.concat();
            for c in &chunks {
                log.append(c).unwrap();
            }
            let kept = std::fs::read(&path).unwrap_or_default();
            prop_assert_eq!(path.exists(), cap > 0 && !all.is_empty(), "created on the first byte");
            let want = &all[..all.len().min(cap as usize)];
            prop_assert_eq!(&kept[..], want);
            let truncated = all.len() as u64 > cap;
            prop_assert_eq!(stats.truncated.load(Ordering::Relaxed), truncated);
            prop_assert_eq!(marker.exists(), truncated);
            prop_assert_eq!(stats.written.load(Ordering::Relaxed), want.len() as u64);
        }
    }
}
