//! The end-to-end harness: starts real `dispatcher` and `agent` processes
//! on loopback, gives tests gRPC clients and the
//! `dispatchctl` binary, and kills and reaps everything on drop (a process
//! group per child, so shims and jobs go too).
//!
//! Dispatchers and etcd listen on port 0: the kernel picks a free port and
//! the process logs the address it bound, which the harness reads from its
//! log. Nothing binds a port, releases it and hopes it stays free. (The
//! 3-member etcd of the fault tests must name its peers before any starts:
//! `faults::EtcdCluster` gives them unix-domain sockets in the test's
//! directory.)
//!
//! Binaries come from the workspace's target directory; when one is
//! missing (a `cargo test -p e2e` on a clean tree) the harness builds it
//! with the same cargo.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Once;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use proto::v1::job_service_client::JobServiceClient;
use proto::v1::node_service_client::NodeServiceClient;
use proto::v1::{GetJobRequest, Job, JobState};
use tonic::transport::Channel;

#[path = "faults_harness.rs"]
pub mod faults;

#[path = "procstat.rs"]
pub mod procstat;

/// The directory holding the workspace's binaries.
pub fn bin_dir() -> PathBuf {
    // target/<profile>/deps/<test-exe>, or target/<profile>/<bin> for this
    // crate's own binaries (the benchmarks in bin/).
    let exe = std::env::current_exe().unwrap_or_default();
    let dir = exe.parent().unwrap_or(Path::new(""));
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.parent().unwrap_or(dir).to_path_buf()
    } else {
        dir.to_path_buf()
    }
}

static BUILD: Once = Once::new();

/// Path of a workspace binary, built if missing.
pub fn binary(name: &str) -> PathBuf {
    BUILD.call_once(|| {
        let missing = ["dispatcher", "agent", "dispatchctl"]
            .iter()
            .any(|b| !bin_dir().join(b).exists());
        if missing {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let status = Command::new(cargo)
                .args([
                    "build",
                    "-p",
                    "dispatcher",
                    "-p",
                    "agent",
                    "-p",
                    "dispatchctl",
                    "--bins",
                ])
                // A benchmark run with --release needs release binaries.
                .args(bin_dir().ends_with("release").then_some("--release"))
                .status();
            assert!(
                status.is_ok_and(|s| s.success()),
                "building the binaries for the end-to-end tests failed"
            );
        }
    });
    bin_dir().join(name)
}

/// A child process in its own process group, killed with its group on
/// drop.
pub struct Proc {
    child: Option<Child>,
    /// What it is, for messages.
    pub name: String,
    /// Its stderr log file.
    pub log: PathBuf,
}

impl Proc {
    fn spawn(name: &str, mut cmd: Command, log: PathBuf) -> Result<Self> {
        use std::os::unix::process::CommandExt;
        let file =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        cmd.stdout(Stdio::from(file.try_clone()?))
            .stderr(Stdio::from(file))
            .stdin(Stdio::null());
        cmd.process_group(0);
        let child = cmd.spawn().with_context(|| format!("starting {name}"))?;
        Ok(Self {
            child: Some(child),
            name: name.to_string(),
            log,
        })
    }

    /// Start `cmd` (its own process group), stdout and stderr to `log`.
    pub fn spawn_logged(name: &str, cmd: Command, log: PathBuf) -> Result<Self> {
        Self::spawn(name, cmd, log)
    }

    /// Process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Send a signal to the process only.
    pub fn signal(&self, sig: Signal) {
        let _ = nix::sys::signal::kill(Pid::from_raw(self.pid() as i32), sig);
    }

    /// SIGKILL the process only (not its group: jobs under shims live on)
    /// and reap it.
    pub fn kill9(&mut self) {
        self.signal(Signal::SIGKILL);
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
    }

    /// True while it runs.
    pub fn alive(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Its log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Proc {
    /// SIGTERM its group, SIGKILL it after 5 s, and reap it (what its
    /// drop does; nothing if it is no longer running).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let pgid = Pid::from_raw(c.id() as i32);
            let _ = killpg(pgid, Signal::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if matches!(c.try_wait(), Ok(Some(_))) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = killpg(pgid, Signal::SIGKILL);
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A dispatcher process.
pub struct Dispatcher {
    /// The process.
    pub proc: Proc,
    /// Its address, `http://127.0.0.1:PORT`.
    pub url: String,
    /// Its port.
    pub port: u16,
    /// Its data directory.
    pub data_dir: PathBuf,
    extra: Vec<String>,
    env: Vec<(String, String)>,
}

impl Dispatcher {
    /// Start a dispatcher with its data under `dir`; `extra` flags are
    /// appended (e.g. `--heartbeat-ms 200`).
    pub fn start(dir: &Path, extra: &[&str]) -> Result<Self> {
        Self::start_env(dir, extra, &[])
    }

    /// [`Dispatcher::start`] with these environment variables set (kept
    /// across [`Dispatcher::kill9_and_restart`]).
    pub fn start_env(dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> Result<Self> {
        let env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Self::start_on(dir, 0, extra.iter().map(|s| s.to_string()).collect(), env)
    }

    /// Start on `port`; 0 lets the kernel choose (the port is then read
    /// from what the dispatcher prints).
    fn start_on(
        dir: &Path,
        port: u16,
        extra: Vec<String>,
        env: Vec<(String, String)>,
    ) -> Result<Self> {
        let data_dir = dir.join("dispatcher");
        let mut cmd = Command::new(binary("dispatcher"));
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        cmd.arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--data-dir")
            .arg(&data_dir)
            .args(&extra)
            .env(
                "RUST_LOG",
                std::env::var("E2E_RUST_LOG").unwrap_or_else(|_| "info".into()),
            );
        let log = dir.join(format!("dispatcher-{port}-{}.log", now_nanos()));
        let proc = Proc::spawn("dispatcher", cmd, log)?;
        let mut d = Self {
            proc,
            url: String::new(),
            port,
            data_dir,
            extra,
            env,
        };
        d.wait_ready(Duration::from_secs(30))?;
        Ok(d)
    }

    /// Wait until it prints the address it bound (every mode prints
    /// `export DISPATCH_SERVER=URL`) and accepts connections there; sets
    /// [`Dispatcher::port`] and [`Dispatcher::url`] from it.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if !self.proc.alive() {
                bail!("the dispatcher exited:\n{}", self.proc.log_text());
            }
            if let Some(port) = printed_port(&self.proc.log_text()) {
                self.port = port;
                self.url = format!("http://127.0.0.1:{port}");
                if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    return Ok(());
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!(
            "the dispatcher did not listen within {timeout:?}:\n{}",
            self.proc.log_text()
        )
    }

    /// The port of its web page and /metrics, started with `--http-listen
    /// 127.0.0.1:0` (or `--dev`): read from the `web page on http://ADDR/`
    /// line it prints once bound.
    pub fn web_port(&self, timeout: Duration) -> Result<u16> {
        let deadline = Instant::now() + timeout;
        loop {
            let log = self.proc.log_text();
            let port = log.lines().find_map(|l| {
                let rest = l.split("web page on http://").nth(1)?;
                let addr = rest.split('/').next()?;
                addr.rsplit(':').next()?.parse().ok()
            });
            if let Some(port) = port {
                return Ok(port);
            }
            if Instant::now() > deadline {
                bail!("the dispatcher printed no web page address:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILL it and start it again on the same port and data.
    pub fn kill9_and_restart(&mut self, dir: &Path) -> Result<()> {
        self.proc.kill9();
        let fresh = Self::start_on(dir, self.port, self.extra.clone(), self.env.clone())?;
        *self = fresh;
        Ok(())
    }

    /// A job client.
    pub async fn jobs(&self) -> Result<JobServiceClient<Channel>> {
        let ch = Channel::from_shared(self.url.clone())?.connect().await?;
        Ok(JobServiceClient::new(ch).max_decoding_message_size(256 << 20))
    }

    /// A node client.
    pub async fn nodes(&self) -> Result<NodeServiceClient<Channel>> {
        let ch = Channel::from_shared(self.url.clone())?.connect().await?;
        Ok(NodeServiceClient::new(ch))
    }
}

/// The port of `export DISPATCH_SERVER=SCHEME://HOST:PORT`, the line every
/// dispatcher prints once it has bound its gRPC listener (for tests that
/// start a dispatcher themselves).
pub fn printed_port(log: &str) -> Option<u16> {
    log.lines().find_map(|l| {
        let url = l.split("export DISPATCH_SERVER=").nth(1)?.trim();
        url.rsplit(':').next()?.parse().ok()
    })
}

fn now_nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// An agent process.
pub struct Agent {
    /// The process.
    pub proc: Proc,
    /// Its node name.
    pub node: String,
    /// Its `--state-dir` (the job directories its shims run from).
    pub state_dir: PathBuf,
}

impl Drop for Agent {
    /// A live agent stops its jobs when its group gets SIGTERM
    /// ([`Proc::stop`]); the shims and the supervisor of a SIGKILLed one
    /// (or of one that did not stop in time) run on by design, each its
    /// own session, their jobs stopped once the lease ran out: end every
    /// process of that state directory's shims. Then the cgroups the
    /// agent made for its jobs go, the root with them
    /// (`cgroup::state_dir_root` of its state directory: the agents
    /// here get no `--cgroup-root`): an agent killed with jobs left
    /// their cgroups behind, since only the next agent on the same state
    /// directory removes them, and none comes in a test (each run of
    /// the suite left four roots and eight slots). So an agent is
    /// dropped after any other agent of its state directory that was
    /// started later (as declared in the test, later values drop
    /// first).
    fn drop(&mut self) {
        self.proc.stop();
        kill_shims_under(&self.state_dir);
        if let Some(root) = agent::exec::cgroup::state_dir_root(&self.state_dir)
            && let Err(e) = agent::exec::cgroup::remove_tree(&root, Duration::from_secs(5))
        {
            eprintln!(
                "agent {}: its cgroups {} stay: {e}",
                self.node,
                root.display()
            );
        }
    }
}

/// SIGKILL each `agent shim --job-dir DIR` with `DIR` under `state_dir`,
/// and every process descended from it (its job, and what the job forked).
fn kill_shims_under(state_dir: &Path) {
    use std::os::unix::ffi::OsStrExt as _;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    // (pid, parent) of every process, and the shims to end.
    let mut parents: Vec<(i32, i32)> = Vec::new();
    let mut doomed: Vec<i32> = Vec::new();
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        // Fields after the command's closing parenthesis: state, ppid.
        if let Some(ppid) = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse().ok())
        {
            parents.push((pid, ppid));
        }
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
        // A job's shim (`--job-dir` under the state dir) or the agent's
        // supervisor of them all (`--state-dir`, agent::exec::supervisor).
        let is_ours = args.windows(2).any(|w| {
            (w[0] == b"--job-dir" || w[0] == b"--state-dir")
                && Path::new(std::ffi::OsStr::from_bytes(w[1])).starts_with(state_dir)
        });
        if args.get(1) == Some(&&b"shim"[..]) && is_ours {
            doomed.push(pid);
        }
    }
    let mut i = 0;
    while i < doomed.len() {
        let parent = doomed[i];
        for &(pid, ppid) in &parents {
            if ppid == parent && !doomed.contains(&pid) {
                doomed.push(pid);
            }
        }
        i += 1;
    }
    for pid in doomed {
        let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL);
    }
}

impl Agent {
    /// Start an agent named `node` with a synthetic `topology`, `labels`
    /// (KEY=VALUE) and `extra` flags, attached to `dispatcher_url`.
    pub fn start(
        dir: &Path,
        dispatcher_url: &str,
        node: &str,
        topology: &str,
        labels: &[&str],
        extra: &[&str],
    ) -> Result<Self> {
        let machine = [OsStr::new("--topology"), OsStr::new(topology)];
        Self::start_machine(dir, dispatcher_url, node, &machine, labels, extra, &[])
    }

    /// [`Agent::start`] with `env` (NAME, VALUE) added to its environment.
    pub fn start_with_env(
        dir: &Path,
        dispatcher_url: &str,
        node: &str,
        topology: &str,
        env: &[(&str, String)],
    ) -> Result<Self> {
        let machine = [OsStr::new("--topology"), OsStr::new(topology)];
        Self::start_machine(dir, dispatcher_url, node, &machine, &[], &[], env)
    }

    /// [`Agent::start`] on the machine captured under `root` (its
    /// `--sysfs-root`, e.g. `agent/tests/fixtures/x6-2-8gpu`: the CPUs and
    /// PCI devices of another machine, mapped onto the real CPUs).
    pub fn start_sysfs(
        dir: &Path,
        dispatcher_url: &str,
        node: &str,
        root: &Path,
        labels: &[&str],
        extra: &[&str],
    ) -> Result<Self> {
        let machine = [OsStr::new("--sysfs-root"), root.as_os_str()];
        Self::start_machine(dir, dispatcher_url, node, &machine, labels, extra, &[])
    }

    fn start_machine(
        dir: &Path,
        dispatcher_url: &str,
        node: &str,
        machine: &[&OsStr],
        labels: &[&str],
        extra: &[&str],
        env: &[(&str, String)],
    ) -> Result<Self> {
        let mut cmd = Command::new(binary("agent"));
        cmd.arg("run")
            .arg("--dispatcher")
            .arg(dispatcher_url)
            .arg("--node-name")
            .arg(node)
            .arg("--state-dir")
            .arg(dir.join(format!("agent-{node}")))
            .args(machine)
            .env(
                "RUST_LOG",
                std::env::var("E2E_RUST_LOG").unwrap_or_else(|_| "info".into()),
            );
        for l in labels {
            cmd.arg("--label").arg(l);
        }
        cmd.args(extra);
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        let log = dir.join(format!("agent-{node}-{}.log", now_nanos()));
        let proc = Proc::spawn(&format!("agent {node}"), cmd, log)?;
        Ok(Self {
            proc,
            node: node.to_string(),
            state_dir: dir.join(format!("agent-{node}")),
        })
    }
}

impl Agent {
    /// The port of its /metrics, started with `--metrics-listen
    /// 127.0.0.1:0`: read from the `bound=ADDR` it logs once bound.
    pub fn metrics_port(&self, timeout: Duration) -> Result<u16> {
        let deadline = Instant::now() + timeout;
        loop {
            let log = strip_ansi(&self.proc.log_text());
            let port = log.lines().find_map(|l| {
                if !l.contains("serving Prometheus metrics") {
                    return None;
                }
                let addr = l.split("bound=").nth(1)?.split_whitespace().next()?;
                addr.rsplit(':').next()?.parse().ok()
            });
            if let Some(port) = port {
                return Ok(port);
            }
            if Instant::now() > deadline {
                bail!("agent {} logged no metrics address:\n{log}", self.node);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// `text` without terminal colour sequences (`ESC [ ... m`).
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Run `dispatchctl` against `url`; returns (exit code, stdout, stderr).
pub fn dispatchctl(url: &str, args: &[&str]) -> Result<(i32, String, String)> {
    let out = Command::new(binary("dispatchctl"))
        .arg("--server")
        .arg(url)
        .args(args)
        .env_remove("DISPATCH_SERVER")
        .env("DISPATCH_CONFIG", "/nonexistent/dispatch-config.json")
        .output()
        .context("running dispatchctl")?;
    Ok((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// Poll `f` every 50 ms until it returns `Some`, or fail after `timeout`.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    eventually_every(timeout, Duration::from_millis(50), what, f).await
}

/// [`eventually`], trying every `every`.
pub async fn eventually_every<T, F, Fut>(
    timeout: Duration,
    every: Duration,
    what: &str,
    mut f: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(every).await;
    }
}

/// Job `id` as GetJob answers it.
pub async fn get_job(c: &mut JobServiceClient<Channel>, id: &str) -> Result<Job> {
    Ok(c.get_job(GetJobRequest { id: id.into() })
        .await?
        .into_inner())
}

/// Wait until job `id` is in `state` (failing after `timeout`): the job as
/// then read.
pub async fn job_in_state(
    c: &JobServiceClient<Channel>,
    id: &str,
    state: JobState,
    timeout: Duration,
) -> Result<Job> {
    eventually(timeout, &format!("{id} {state:?}"), || {
        let mut c = c.clone();
        let id = id.to_string();
        async move {
            let j = get_job(&mut c, &id).await.ok()?;
            (j.state == state as i32).then_some(j)
        }
    })
    .await
}

/// One GetJob("") on a fresh connection to `url`, bounded in time: `None`
/// when the replica does not answer (dead or paused).
pub async fn probe_job_service(
    url: &str,
    tls: &proto::client_security::ClientTls,
) -> Option<Result<(), tonic::Status>> {
    tokio::time::timeout(Duration::from_secs(2), async {
        let ch = proto::endpoints::endpoint(url, tls)
            .ok()?
            .connect()
            .await
            .ok()?;
        let r = JobServiceClient::new(ch)
            .get_job(GetJobRequest { id: String::new() })
            .await;
        Some(r.map(|_| ()))
    })
    .await
    .ok()
    .flatten()
}

/// The replica at `url` answers a JobService call as the leader (any
/// answer but UNAVAILABLE, which a follower gives with its leader hint;
/// an empty id is simply not found on the leader).
pub async fn answers_as_leader(url: &str, tls: &proto::client_security::ClientTls) -> bool {
    probe_job_service(url, tls)
        .await
        .is_some_and(|r| r.err().is_none_or(|s| s.code() != tonic::Code::Unavailable))
}

/// Wait until `n` nodes are READY.
pub async fn wait_nodes(d: &Dispatcher, n: usize, timeout: Duration) -> Result<()> {
    let mut client = d.nodes().await?;
    eventually(timeout, &format!("{n} ready nodes"), || {
        let mut c = client.clone();
        async move {
            let nodes = c
                .list_nodes(proto::v1::ListNodesRequest::default())
                .await
                .ok()?
                .into_inner()
                .nodes;
            let ready = nodes
                .iter()
                .filter(|x| x.state == proto::v1::NodeState::Ready as i32)
                .count();
            (ready >= n).then_some(())
        }
    })
    .await?;
    client = d.nodes().await?;
    drop(client);
    Ok(())
}

/// Every job, all pages.
pub async fn all_jobs(client: &mut JobServiceClient<Channel>) -> Result<Vec<proto::v1::Job>> {
    job_pages(async |req| Ok(client.list_jobs(req).await?.into_inner())).await
}

/// Every job, page after page of ListJobs through `page`.
async fn job_pages(
    mut page: impl AsyncFnMut(proto::v1::ListJobsRequest) -> Result<proto::v1::ListJobsResponse>,
) -> Result<Vec<proto::v1::Job>> {
    let mut out = Vec::new();
    let mut token = String::new();
    loop {
        let got = page(proto::v1::ListJobsRequest {
            page_size: 10_000,
            page_token: token.clone(),
            ..Default::default()
        })
        .await?;
        out.extend(got.jobs);
        if got.next_page_token.is_empty() {
            return Ok(out);
        }
        token = got.next_page_token;
    }
}

/// True for the terminal states.
pub fn is_terminal(state: i32) -> bool {
    use proto::v1::JobState;
    matches!(
        JobState::try_from(state),
        Ok(JobState::Succeeded | JobState::Failed | JobState::Cancelled | JobState::Lost)
    )
}

impl Dispatcher {
    /// Start the one-command default, `dispatcher --dev --listen
    /// 127.0.0.1:PORT --data-dir DIR/dispatcher` (an in-process agent for
    /// this machine). Its stdout goes to the log with stderr, so
    /// [`Proc::log_text`] shows what it printed.
    pub fn start_dev(dir: &Path, extra: &[&str]) -> Result<Self> {
        let data_dir = dir.join("dispatcher");
        let mut cmd = Command::new(binary("dispatcher"));
        cmd.arg("--dev")
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--data-dir")
            .arg(&data_dir)
            .args(extra)
            .env(
                "RUST_LOG",
                std::env::var("E2E_RUST_LOG").unwrap_or_else(|_| "info".into()),
            );
        let log = dir.join(format!("dispatcher-dev-{}.log", now_nanos()));
        let proc = Proc::spawn("dispatcher --dev", cmd, log)?;
        let mut d = Self {
            proc,
            url: String::new(),
            port: 0,
            data_dir,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            env: Vec::new(),
        };
        d.wait_ready(Duration::from_secs(30))?;
        Ok(d)
    }
}

/// `dispatchctl ARGS` from async code, within `timeout`: its stdout, or an
/// error with its stderr when it exits non-zero.
pub async fn dispatchctl_ok(url: &str, args: &[&str], timeout: Duration) -> Result<String> {
    let url = url.to_string();
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let (code, out, err) = tokio::task::spawn_blocking(move || {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        dispatchctl_timeout(&url, &a, timeout)
    })
    .await??;
    if code != 0 {
        bail!("dispatchctl exited {code}: {err}");
    }
    Ok(out)
}

/// Like [`dispatchctl`], but kills it and fails if it has not exited
/// within `timeout` (for commands that must end on their own: `watch ID`,
/// `logs -f`, `submit --wait`).
pub fn dispatchctl_timeout(
    url: &str,
    args: &[&str],
    timeout: Duration,
) -> Result<(i32, String, String)> {
    use std::io::Read;
    let mut child = Command::new(binary("dispatchctl"))
        .arg("--server")
        .arg(url)
        .args(args)
        .env_remove("DISPATCH_SERVER")
        .env("DISPATCH_CONFIG", "/nonexistent/dispatch-config.json")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running dispatchctl")?;
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = r.read_to_end(&mut buf);
            String::from_utf8_lossy(&buf).into_owned()
        })
    };
    let out = child.stdout.take().map(|s| drain(Box::new(s)));
    let err = child.stderr.take().map(|s| drain(Box::new(s)));
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break Some(st);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = out.and_then(|h| h.join().ok()).unwrap_or_default();
    let err = err.and_then(|h| h.join().ok()).unwrap_or_default();
    match status {
        Some(st) => Ok((st.code().unwrap_or(-1), out, err)),
        None => bail!(
            "dispatchctl {args:?} did not exit within {timeout:?}\nstdout: {out}\nstderr: {err}"
        ),
    }
}

/// `GET http://127.0.0.1:PORT{path}` with a plain HTTP/1.1 request;
/// returns (status code, body).
pub fn http_get(port: u16, path: &str) -> Result<(u16, String)> {
    let (status, _, body) = http_get_typed(port, path)?;
    Ok((status, body))
}

/// [`http_get`] that also returns the Content-Type (empty when absent);
/// chunked bodies are decoded.
pub fn http_get_typed(port: u16, path: &str) -> Result<(u16, String, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))
        .with_context(|| format!("connecting to 127.0.0.1:{port}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let raw = String::from_utf8(raw).context("the response is not UTF-8")?;
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .context("no end of HTTP headers")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("no status in {head:?}"))?;
    let header = |name: &str| {
        head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    };
    let content_type = header("content-type").unwrap_or_default();
    let body = if header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        dechunk(body).with_context(|| format!("GET {path}: bad chunked body"))?
    } else {
        body.to_string()
    };
    Ok((status, content_type, body))
}

/// Decodes an HTTP/1.1 chunked body.
fn dechunk(mut s: &str) -> Result<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = s.split_once("\r\n").context("chunk size")?;
        let n = usize::from_str_radix(size.trim(), 16).context("chunk size")?;
        if n == 0 {
            return Ok(out);
        }
        out.push_str(rest.get(..n).context("short chunk")?);
        s = rest.get(n + 2..).context("chunk end")?;
    }
}

/// What tells one etcd member from another: its name, data, URLs and
/// the cluster it starts in (`name=peer_url,...`).
pub struct EtcdMemberConfig<'a> {
    /// `--name`.
    pub name: &'a str,
    /// `--data-dir`.
    pub data_dir: &'a Path,
    /// Listened on and advertised to clients.
    pub client_url: &'a str,
    /// Listened on and advertised to peers.
    pub peer_url: &'a str,
    /// Port of `/metrics` and `/health`.
    pub metrics_port: u16,
    /// `--initial-cluster`.
    pub initial_cluster: &'a str,
}

/// The command that runs etcd member `m` on loopback (a new cluster),
/// logging to stderr; callers add tuning flags.
pub fn etcd_command(m: &EtcdMemberConfig<'_>) -> Command {
    let mut cmd = Command::new("etcd");
    cmd.args(["--name", m.name])
        .arg("--data-dir")
        .arg(m.data_dir)
        .args(["--listen-client-urls", m.client_url])
        .args(["--advertise-client-urls", m.client_url])
        .args(["--listen-peer-urls", m.peer_url])
        .args(["--initial-advertise-peer-urls", m.peer_url])
        .args(["--initial-cluster", m.initial_cluster])
        .args(["--initial-cluster-state", "new"])
        .arg(format!(
            "--listen-metrics-urls=http://127.0.0.1:{}",
            m.metrics_port
        ))
        .args(["--logger=zap", "--log-outputs=stderr"]);
    cmd
}

/// Whether the etcd member with metrics (or clients) on `metrics_port`
/// answers `GET /health` with `"health":"true"`.
pub fn etcd_healthy(metrics_port: u16) -> bool {
    http_get(metrics_port, "/health")
        .is_ok_and(|(code, body)| code == 200 && body.contains("\"health\":\"true\""))
}

/// The client port an etcd started with `--logger=zap` reports binding
/// ("serving client traffic ...", `"address":"127.0.0.1:PORT"`).
fn etcd_client_port(log: &str) -> Option<u16> {
    log.lines()
        .filter(|l| l.contains("\"msg\":\"serving client traffic"))
        .find_map(|l| {
            let rest = l.split("\"address\":\"").nth(1)?;
            rest.split('"').next()?.rsplit(':').next()?.parse().ok()
        })
}

/// Run `dispatcher gen-certs ARGS` (the operators' code path for the
/// cluster CA and its certificates).
pub fn gen_certs(args: &[&str]) -> Result<()> {
    let out = Command::new(binary("dispatcher"))
        .arg("gen-certs")
        .args(args)
        .output()
        .context("running dispatcher gen-certs")?;
    anyhow::ensure!(
        out.status.success(),
        "gen-certs {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// Every job, all pages, through the leader `c` finds.
pub async fn leader_jobs(c: &mut proto::endpoints::LeaderChannel) -> Result<Vec<proto::v1::Job>> {
    job_pages(async |req| {
        let page = c
            .call(|ch| {
                let req = req.clone();
                async move {
                    JobServiceClient::new(ch)
                        .max_decoding_message_size(256 << 20)
                        .list_jobs(req)
                        .await
                }
            })
            .await?;
        Ok(page.into_inner())
    })
    .await
}

/// A real etcd server (Debian's `etcd-server`) on loopback ports the
/// kernel picks (port 0) with its data in a directory it keeps across
/// restarts; killed on drop.
pub struct Etcd {
    /// The process (None between [`Etcd::kill9`] and [`Etcd::restart`]).
    pub proc: Option<Proc>,
    /// Client URL, `http://127.0.0.1:PORT`.
    pub url: String,
    /// The client port (`/health` is served there too).
    port: u16,
    dir: PathBuf,
}

impl Etcd {
    /// Start etcd with its data under `dir/etcd` and wait until healthy.
    /// Every port is 0: etcd binds what the kernel gives it and logs the
    /// client address, which this reads (a single member needs no peer to
    /// know its peer URL).
    pub fn start(dir: &Path) -> Result<Self> {
        let any = "http://127.0.0.1:0";
        let cmd = etcd_command(&EtcdMemberConfig {
            name: "t",
            data_dir: &dir.join("etcd"),
            client_url: any,
            peer_url: any,
            metrics_port: 0,
            initial_cluster: &format!("t={any}"),
        });
        let log = dir.join(format!("etcd-{}.log", now_nanos()));
        let mut proc = Proc::spawn("etcd", cmd, log)?;
        let deadline = Instant::now() + Duration::from_secs(30);
        let port = loop {
            if let Some(port) = etcd_client_port(&proc.log_text()) {
                break port;
            }
            if !proc.alive() || Instant::now() > deadline {
                bail!(
                    "etcd did not serve clients (is etcd-server installed?):\n{}",
                    proc.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut e = Self {
            proc: Some(proc),
            url: format!("http://127.0.0.1:{port}"),
            port,
            dir: dir.to_path_buf(),
        };
        e.wait_healthy()?;
        Ok(e)
    }

    /// Restart on the same client URL (the dispatchers were given it) and
    /// data directory; waits for /health. The client port is the one etcd
    /// held until it was killed: nothing else on loopback binds it in
    /// between unless it asks for that number (the kernel hands out port
    /// 0 requests from the whole ephemeral range).
    pub fn restart(&mut self) -> Result<()> {
        let any = "http://127.0.0.1:0";
        let cmd = etcd_command(&EtcdMemberConfig {
            name: "t",
            data_dir: &self.dir.join("etcd"),
            client_url: &self.url,
            peer_url: any,
            metrics_port: 0,
            initial_cluster: &format!("t={any}"),
        });
        let log = self.dir.join(format!("etcd-{}.log", now_nanos()));
        self.proc = Some(Proc::spawn("etcd", cmd, log)?);
        self.wait_healthy()
    }

    fn wait_healthy(&mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if self.healthy() {
                return Ok(());
            }
            let alive = self.proc.as_mut().is_some_and(Proc::alive);
            if !alive || Instant::now() > deadline {
                let log = self.proc.as_ref().map(Proc::log_text).unwrap_or_default();
                bail!("etcd did not become healthy (is etcd-server installed?):\n{log}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// True when `GET /health` answers `"health":"true"`.
    pub fn healthy(&self) -> bool {
        etcd_healthy(self.port)
    }

    /// SIGKILL it (the data directory stays for [`Etcd::restart`]).
    pub fn kill9(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill9();
        }
    }
}

impl Dispatcher {
    /// Start a dispatcher replica on etcd (`--store etcd`) with its own
    /// data directory under `dir`; returns as soon as it listens (it may
    /// be a follower).
    pub fn start_replica(dir: &Path, etcd_url: &str, extra: &[&str]) -> Result<Self> {
        // Port 0; the replica advertises the address it bound.
        let own = dir.join(format!("replica-{}", now_nanos()));
        std::fs::create_dir_all(&own)?;
        let mut flags: Vec<String> = vec![
            "--store".into(),
            "etcd".into(),
            "--etcd-endpoints".into(),
            etcd_url.into(),
        ];
        flags.extend(extra.iter().map(|s| s.to_string()));
        Self::start_on(&own, 0, flags, Vec::new())
    }
}

/// Debian's headless Chromium, which the web page tests drive.
pub const CHROMIUM: &str = "/usr/bin/chromium";

/// Run headless Chromium with `args` and a fresh profile; kills it (and
/// its helper processes) after `timeout`. Returns its stdout.
pub fn chromium(args: &[String], timeout: Duration) -> Result<String> {
    use std::os::unix::process::CommandExt;
    anyhow::ensure!(
        Path::new(CHROMIUM).exists(),
        "this test needs headless Chromium at {CHROMIUM} (Debian package `chromium`; \
         .ci/run installs it): apt-get install -y chromium"
    );
    let profile = tempfile::tempdir()?;
    let out_path = profile.path().join("stdout");
    let err_path = profile.path().join("stderr");
    let mut child = Command::new(CHROMIUM)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
        ])
        .arg(format!(
            "--user-data-dir={}",
            profile.path().join("profile").display()
        ))
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path)?)
        .stderr(std::fs::File::create(&err_path)?)
        .process_group(0)
        .spawn()
        .context("starting chromium")?;
    let group = Pid::from_raw(child.id() as i32);
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break Some(st);
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // Its zygote and renderers share the group: none may outlive the test.
    let _ = killpg(group, Signal::SIGKILL);
    let _ = child.kill();
    let _ = child.wait();
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    match status {
        Some(st) if st.success() => Ok(std::fs::read_to_string(&out_path)?),
        Some(st) => bail!("chromium {args:?} failed ({st}):\n{stderr}"),
        None => bail!("chromium {args:?} did not finish within {timeout:?}:\n{stderr}"),
    }
}

/// The page rendered after its scripts ran (and refreshed a few times).
pub fn rendered_dom(url: &str) -> Result<String> {
    chromium(
        &[
            "--virtual-time-budget=5000".into(),
            "--dump-dom".into(),
            url.into(),
        ],
        Duration::from_secs(120),
    )
}
