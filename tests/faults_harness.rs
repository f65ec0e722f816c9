//! The fault tests' harness (`e2e::faults`): jobs that leave a marker
//! outside the dispatcher, the exactly-once check over those markers, a
//! TCP proxy on loopback that the test can cut, and a three-member etcd
//! cluster whose leader the test can find and kill.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use proto::v1::{Job, JobSpec, JobState};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::Proc;

/// A directory every job may append its marker to (jobs run as an
/// unprivileged user when the agent is root).
pub struct Markers {
    file: PathBuf,
}

impl Markers {
    /// Markers under `dir` (made world-writable).
    pub fn new(dir: &Path) -> Result<Self> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
        let marks = dir.join("marks");
        std::fs::create_dir_all(&marks)?;
        std::fs::set_permissions(&marks, std::fs::Permissions::from_mode(0o777))?;
        Ok(Self {
            file: marks.join("ended.txt"),
        })
    }

    /// A job that sleeps `sleep` seconds (a decimal string, "0" for none),
    /// then appends `token` to the marker file as its last act: a copy
    /// stopped or killed before its end leaves no marker.
    pub fn spec(&self, token: &str, sleep: &str, retries: u32) -> JobSpec {
        let script = if sleep == "0" {
            "echo \"$1\" >> \"$2\"".to_string()
        } else {
            format!("sleep {sleep}; echo \"$1\" >> \"$2\"")
        };
        JobSpec {
            name: token.to_string(),
            command: vec![
                "/bin/sh".into(),
                "-c".into(),
                script,
                "sh".into(),
                token.into(),
                self.file.display().to_string(),
            ],
            cpus: 1,
            retries,
            ..Default::default()
        }
    }

    /// How many markers each token left.
    pub fn counts(&self) -> HashMap<String, usize> {
        let text = std::fs::read_to_string(&self.file).unwrap_or_default();
        let mut out = HashMap::new();
        for line in text.lines().filter(|l| !l.is_empty()) {
            *out.entry(line.to_string()).or_insert(0) += 1;
        }
        out
    }
}

/// The token a job of [`Markers::spec`] writes.
pub fn token_of(job: &Job) -> Option<&str> {
    job.spec
        .as_ref()
        .and_then(|s| s.command.get(4))
        .map(String::as_str)
}

/// Exactly once: every acknowledged job (by token) is SUCCEEDED in the
/// dispatcher and left exactly one marker, and no other token left more
/// than one. Returns the problems found (with what the dispatcher says of
/// each job concerned), empty when none.
pub fn exactly_once(acknowledged: &[String], jobs: &[Job], markers: &Markers) -> Vec<String> {
    let counts = markers.counts();
    let mut by_token: BTreeMap<&str, Vec<&Job>> = BTreeMap::new();
    for j in jobs {
        if let Some(t) = token_of(j) {
            by_token.entry(t).or_default().push(j);
        }
    }
    let mut problems = Vec::new();
    for token in acknowledged {
        match by_token.get(token.as_str()).map(Vec::as_slice) {
            None | Some([]) => problems.push(format!("{token}: acknowledged, then lost")),
            Some([j]) if j.state != JobState::Succeeded as i32 => problems.push(format!(
                "{token}: {} ({}), attempt {}",
                JobState::try_from(j.state).map_or("?", |s| s.as_str_name()),
                j.reason,
                j.attempt
            )),
            Some([_]) => {}
            Some(many) => problems.push(format!("{token}: {} jobs", many.len())),
        }
        match counts.get(token).copied().unwrap_or(0) {
            1 => {}
            n => problems.push(format!("{token}: {n} markers")),
        }
    }
    for (token, n) in &counts {
        if *n > 1 && !acknowledged.contains(token) {
            problems.push(format!("{token} (not acknowledged): {n} markers"));
        }
    }
    // What the dispatcher says of each job with a problem.
    for p in problems.iter_mut() {
        let token = p.split([':', ' ']).next().unwrap_or_default();
        for j in by_token.get(token).into_iter().flatten() {
            p.push_str(&format!(
                " [job {} {} attempt {} on {:?}: {}]",
                j.id,
                JobState::try_from(j.state).map_or("?", |s| s.as_str_name()),
                j.attempt,
                j.node,
                j.reason
            ));
        }
    }
    problems
}

/// A TCP proxy on loopback in front of `target`, which the test can cut:
/// [`TcpProxy::cut`] drops every connection and refuses (accepts and
/// closes at once) new ones until [`TcpProxy::restore`].
pub struct TcpProxy {
    /// `127.0.0.1:PORT` to connect to instead of the target.
    pub addr: std::net::SocketAddr,
    cut: Arc<AtomicBool>,
    generation: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
    /// Connections accepted and forwarded so far.
    pub forwarded: Arc<std::sync::atomic::AtomicU64>,
}

impl TcpProxy {
    /// Listen on a fresh loopback port, forwarding to `target`.
    pub async fn start(target: std::net::SocketAddr) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let cut = Arc::new(AtomicBool::new(false));
        let (generation, gen_rx) = watch::channel(0u64);
        let forwarded = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (cut2, fwd2) = (cut.clone(), forwarded.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    continue;
                };
                if cut2.load(Ordering::SeqCst) {
                    drop(inbound); // refused
                    continue;
                }
                fwd2.fetch_add(1, Ordering::Relaxed);
                let mut gen_rx = gen_rx.clone();
                let born = *gen_rx.borrow_and_update();
                tokio::spawn(async move {
                    let Ok(outbound) = TcpStream::connect(target).await else {
                        return;
                    };
                    let _ = inbound.set_nodelay(true);
                    let _ = outbound.set_nodelay(true);
                    let (mut ri, mut wi) = inbound.into_split();
                    let (mut ro, mut wo) = outbound.into_split();
                    let pump = async {
                        tokio::select! {
                            _ = tokio::io::copy(&mut ri, &mut wo) => {}
                            _ = tokio::io::copy(&mut ro, &mut wi) => {}
                        }
                    };
                    // A cut ends every connection born before it: both
                    // halves drop, so both ends see the connection reset.
                    let cut = async {
                        while gen_rx.changed().await.is_ok() {
                            if *gen_rx.borrow() != born {
                                return;
                            }
                        }
                        std::future::pending::<()>().await
                    };
                    tokio::select! {
                        _ = pump => {}
                        _ = cut => {}
                    }
                });
            }
        });
        Ok(Self {
            addr,
            cut,
            generation,
            task,
            forwarded,
        })
    }

    /// Drop every connection and refuse new ones.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        self.generation.send_modify(|g| *g += 1);
    }

    /// Accept and forward again.
    pub fn restore(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.cut();
        self.task.abort();
    }
}

/// The election timeout of an [`EtcdCluster`]'s members, ms (for the
/// dispatcher's `--etcd-election-timeout-ms`).
pub const ETCD_ELECTION_TIMEOUT_MS: u64 = 500;

/// One member of an [`EtcdCluster`].
pub struct EtcdMember {
    /// Its name (`m0`, `m1`, ...).
    pub name: String,
    /// `http://127.0.0.1:PORT` for clients.
    pub client_url: String,
    /// The client port, which also serves `/metrics` and `/health`.
    pub port: u16,
    /// The process (`None` once killed).
    pub proc: Option<Proc>,
}

/// An etcd cluster of `n` members on loopback, started by the test.
///
/// Nothing is bound and released for it to race with parallel tests: the
/// members reach each other over unix-domain sockets in the test's
/// directory (a static `--initial-cluster` must name every peer URL before
/// any member starts, and a socket's name can be chosen without asking
/// the kernel), and serve clients on port 0, whose bound address each
/// member logs ("serving client traffic").
pub struct EtcdCluster {
    /// The members.
    pub members: Vec<EtcdMember>,
}

/// Member `i`'s peer URL: etcd takes a `unix://` URL's `host:port` as the
/// socket's file name, relative to the member's working directory.
fn peer_url(i: usize) -> String {
    format!("unix://etcd-m{i}-peer:1")
}

impl EtcdCluster {
    /// Start `n` members under `dir` and wait until every one serves
    /// clients and is healthy.
    pub fn start(dir: &Path, n: usize) -> Result<Self> {
        let initial: Vec<String> = (0..n).map(|i| format!("m{i}={}", peer_url(i))).collect();
        let initial = initial.join(",");
        let any = "http://127.0.0.1:0";
        let mut procs = Vec::new();
        for i in 0..n {
            let name = format!("m{i}");
            let mut cmd = crate::etcd_command(&crate::EtcdMemberConfig {
                name: &name,
                data_dir: &dir.join(format!("etcd-{name}")),
                client_url: any,
                peer_url: &peer_url(i),
                metrics_port: 0,
                initial_cluster: &initial,
            });
            cmd.current_dir(dir)
                .args(["--initial-cluster-token", "faults"])
                // Loopback round trips are ~0.1 ms: etcd's tuning guide
                // sets the heartbeat near the round trip and the election
                // timeout at ten heartbeats or more; 50/500 ms keeps that
                // with room for a loaded CI machine.
                .args(["--heartbeat-interval", "50"])
                .arg(format!("--election-timeout={ETCD_ELECTION_TIMEOUT_MS}"));
            let log = dir.join(format!("etcd-{name}.log"));
            procs.push((
                name.clone(),
                Proc::spawn(&format!("etcd {name}"), cmd, log)?,
            ));
        }
        // A member serves clients once the cluster has a leader.
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut members = Vec::new();
        for (name, mut proc) in procs {
            let port = loop {
                if let Some(port) = crate::etcd_client_port(&proc.log_text()) {
                    break port;
                }
                if !proc.alive() || Instant::now() > deadline {
                    bail!(
                        "etcd {name} did not serve clients within 30 s:\n{}",
                        proc.log_text()
                    );
                }
                std::thread::sleep(Duration::from_millis(50));
            };
            members.push(EtcdMember {
                name,
                client_url: format!("http://127.0.0.1:{port}"),
                port,
                proc: Some(proc),
            });
        }
        let cluster = Self { members };
        while !cluster.members.iter().all(|m| m.healthy()) {
            if Instant::now() > deadline {
                bail!("the etcd cluster did not become healthy in 30 s");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(cluster)
    }

    /// Every member's client URL, comma-separated (for `--etcd-endpoints`).
    pub fn endpoints(&self) -> String {
        let urls: Vec<&str> = self.members.iter().map(|m| m.client_url.as_str()).collect();
        urls.join(",")
    }

    /// The member that is leader now, from each live member's
    /// `etcd_server_is_leader` metric.
    pub fn leader(&self) -> Option<usize> {
        self.members
            .iter()
            .position(|m| m.proc.is_some() && m.metric("etcd_server_is_leader") == Some(1.0))
    }

    /// SIGKILL member `i`.
    pub fn kill9(&mut self, i: usize) {
        if let Some(mut p) = self.members[i].proc.take() {
            p.kill9();
        }
    }
}

impl EtcdMember {
    /// `/health` answers `"health":"true"`.
    pub fn healthy(&self) -> bool {
        crate::etcd_healthy(self.port)
    }

    /// One unlabelled metric's value.
    pub fn metric(&self, name: &str) -> Option<f64> {
        let (code, body) = crate::http_get(self.port, "/metrics").ok()?;
        if code != 200 {
            return None;
        }
        body.lines()
            .filter_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .find_map(|v| v.trim().parse().ok())
    }
}

/// A seeded xorshift64* generator: the fault schedule of a run is
/// printed as its seed and replayed with `FAULTS_SEED=...`.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// From `FAULTS_SEED` when set, else from the clock; prints the seed.
    pub fn from_env(what: &str) -> Self {
        let seed = std::env::var("FAULTS_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64)
            });
        println!("{what}: seed {seed} (replay with FAULTS_SEED={seed})");
        Self::new(seed)
    }

    /// From a seed.
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `lo..hi` (`lo` when empty).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.next_u64() % (hi - lo)
    }
}

/// The job's process state letter (`R`, `S`, `T`...) from
/// `/proc/PID/stat`, where PID is read from an agent's job directory (the
/// `job PID STARTTIME` line of its `record`).
pub fn job_proc_state(job_dir: &Path) -> Option<char> {
    let pid = record_line(job_dir, "job")?;
    let pid = pid.split(' ').next()?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = stat.rsplit_once(')')?.1;
    after.trim_start().chars().next()
}

/// The rest of the first complete `KEY ...` line of a job directory's
/// `record` (the agent executor's append-only file: `shim PID`,
/// `job PID STARTTIME`, `exit {JSON}`, ...).
pub fn record_line(job_dir: &Path, key: &str) -> Option<String> {
    let text = std::fs::read_to_string(job_dir.join("record")).ok()?;
    let complete = &text[..text.rfind('\n')?];
    complete.lines().find_map(|l| {
        l.strip_prefix(key)
            .and_then(|rest| rest.strip_prefix(' '))
            .map(str::to_owned)
    })
}

/// An agent's directory for one attempt of a job.
pub fn attempt_dir(agent_state: &Path, job_id: &str, attempt: u32) -> PathBuf {
    agent_state
        .join("jobs")
        .join(format!("{job_id}_a{attempt}"))
}

/// Wait for `path` to exist, up to `timeout`.
pub fn wait_file(path: &Path, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while !path.exists() {
        if Instant::now() > deadline {
            bail!("{} did not appear within {timeout:?}", path.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// The text of `path`, with context on failure.
pub fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}
