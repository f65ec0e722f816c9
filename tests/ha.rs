//! High availability on a real etcd (Debian's `etcd-server`, started by
//! the harness on loopback): three dispatcher replicas with
//! `--store etcd`, agents and the test's client given all three URLs and
//! following the leader (`proto::endpoints`).
//!
//! - [`leader_sigkill_mid_run_loses_and_doubles_nothing`]: 1,000 jobs;
//!   SIGKILL the leader while they run; another replica takes over and
//!   every job ends SUCCEEDED, its command having run exactly once.
//! - [`paused_leader_steps_down_without_writing`]: SIGSTOP the leader past
//!   its lease; a follower takes over; SIGCONT: the old leader steps down
//!   (it logs the step-down, answers with the redirect to the new leader)
//!   and no job is lost or run twice. A submission it reads on waking is
//!   stored, if at all, only under a later term it won after the flapping
//!   a loaded machine can cause: checked in etcd (the leader key as it was
//!   at the job key's create revision), never the deposed term.
//! - [`etcd_restart_mid_run_loses_nothing`]: SIGKILL etcd mid-run and
//!   restart it on the same data directory: every job still finishes
//!   exactly once.
//! - [`replicas_over_tls_fail_over_for_agents_and_dispatchctl`]: the same
//!   redirects and failover with `https://` replicas, an agent with a
//!   client certificate, and dispatchctl with `--tls-ca`.
//! - [`dispatchctl_streams_resume_and_followers_point_to_the_leader`]:
//!   `submit --wait` and `watch` running across a leader SIGKILL end
//!   normally (the job's success once, no duplicate end event); a
//!   follower's web API names the leader's page and its `/metrics` says
//!   `dispatch_leader 0` with no stale cluster gauges.
//!
//! "Exactly once" is checked outside the dispatcher: each job's command
//! appends its own marker to a file, and each marker must appear once.
//! Nothing asserts wall-clock timings; the time to a new leader is printed.
//!
//! The replicas hold 3 s leases. Two of these clusters at once (cargo runs
//! tests in parallel) on a 2-CPU machine starve each other's lease
//! renewals into spurious failovers, so every test takes [`serial`] first
//! and holds it until its processes are gone. Waits are for events (a
//! leader answering, jobs ending under the new leader), never sleeps.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use e2e::{Agent, Dispatcher, Etcd, is_terminal};
use proto::client_security::ClientTls;
use proto::endpoints::{Endpoints, LeaderChannel};
use proto::v1::job_service_client::JobServiceClient;
use proto::v1::node_service_client::NodeServiceClient;
use proto::v1::{Job, JobSpec, JobState, ListNodesRequest, NodeState, SubmitJobsRequest};
use tonic::Code;

/// The generous bound for anything that should take seconds.
const LONG: Duration = Duration::from_secs(180);
/// Generous bound for a new leader to be elected (the lease TTL is 3 s).
const ELECTION: Duration = Duration::from_secs(30);

/// One HA cluster at a time in this test binary (see the module
/// documentation). A test that failed while holding it does not block the
/// others.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Three replicas on one etcd, agents attached through the list of URLs.
struct Ha {
    dir: tempfile::TempDir,
    etcd: Etcd,
    replicas: Vec<Dispatcher>,
    agents: Vec<Agent>,
    urls: Vec<String>,
    /// Each replica's web port (`--http-listen`), when started with one.
    http: Vec<u16>,
    /// Held until every process above is gone (fields drop in order).
    _serial: std::sync::MutexGuard<'static, ()>,
}

impl Ha {
    fn start(agents: &[(&str, &str)]) -> Result<Self> {
        Self::start_opts(agents, false)
    }

    /// With `web`, every replica also serves its page and /metrics on a
    /// port of its own, advertised with `--advertise-http-url`.
    fn start_opts(agents: &[(&str, &str)], web: bool) -> Result<Self> {
        use std::os::unix::fs::PermissionsExt;
        let serial = serial();
        let dir = tempfile::tempdir()?;
        // Jobs run as an unprivileged user when the agent is root: they
        // must be able to reach and append to the marker file.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
        let marks = dir.path().join("marks");
        std::fs::create_dir(&marks)?;
        std::fs::set_permissions(&marks, std::fs::Permissions::from_mode(0o777))?;
        let etcd = Etcd::start(dir.path())?;
        let replicas = (0..3)
            .map(|_| {
                let mut flags = vec!["--lease-ttl-secs", "3"];
                if web {
                    // Port 0: each replica advertises the page it bound.
                    flags.extend(["--http-listen", "127.0.0.1:0"]);
                }
                Dispatcher::start_replica(dir.path(), &etcd.url, &flags)
            })
            .collect::<Result<Vec<_>>>()?;
        let http: Vec<u16> = if web {
            replicas
                .iter()
                .map(|d| d.web_port(Duration::from_secs(30)))
                .collect::<Result<_>>()?
        } else {
            Vec::new()
        };
        let urls: Vec<String> = replicas.iter().map(|d| d.url.clone()).collect();
        let all = urls.join(",");
        let agents = agents
            .iter()
            .map(|(node, topo)| Agent::start(dir.path(), &all, node, topo, &[], &[]))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            dir,
            etcd,
            replicas,
            agents,
            urls,
            http,
            _serial: serial,
        })
    }

    /// The file every job appends its marker to.
    fn marks(&self) -> PathBuf {
        self.dir.path().join("marks").join("ran.txt")
    }

    /// A client that follows the leader.
    fn client(&self) -> Result<LeaderChannel> {
        Ok(LeaderChannel::new(
            Endpoints::new(self.urls.clone())?,
            Duration::from_secs(60),
        ))
    }

    /// Tails of every log, for failure messages.
    fn logs(&self) -> String {
        let mut out = String::new();
        for d in &self.replicas {
            out += &format!(
                "---- replica {} ----\n{}\n",
                d.url,
                tail(&d.proc.log_text(), 30)
            );
        }
        for a in &self.agents {
            out += &format!(
                "---- agent {} ----\n{}\n",
                a.node,
                tail(&a.proc.log_text(), 15)
            );
        }
        if let Some(p) = &self.etcd.proc {
            out += &format!("---- etcd ----\n{}\n", tail(&p.log_text(), 10));
        }
        out
    }

    /// The index of the replica that answers as leader (skipping
    /// `except`), waiting up to `timeout`.
    async fn wait_leader(&self, except: Option<usize>, timeout: Duration) -> Result<usize> {
        let deadline = Instant::now() + timeout;
        loop {
            for (i, url) in self.urls.iter().enumerate() {
                if Some(i) != except && answers_as_leader(url).await {
                    return Ok(i);
                }
            }
            if Instant::now() > deadline {
                bail!("no leader within {timeout:?}\n{}", self.logs());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn wait_nodes(&self, n: usize) -> Result<()> {
        let mut c = self.client()?;
        let deadline = Instant::now() + LONG;
        loop {
            let nodes = c
                .call(|ch| async move {
                    NodeServiceClient::new(ch)
                        .list_nodes(ListNodesRequest::default())
                        .await
                })
                .await
                .map(|r| r.into_inner().nodes)
                .unwrap_or_default();
            let ready = nodes
                .iter()
                .filter(|x| x.state == NodeState::Ready as i32)
                .count();
            if ready >= n {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("{n} nodes did not become ready\n{}", self.logs());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Submits `n` jobs, each appending `m<i>` to `ran.txt` then sleeping
    /// `sleep`, in SubmitJobs calls of `batch` (large batches go through
    /// the etcd store's redo log). All are submitted before any fault.
    async fn submit(&self, n: usize, batch: usize, sleep: &str) -> Result<Vec<String>> {
        let marks = self.marks();
        let specs: Vec<JobSpec> = (0..n)
            .map(|i| JobSpec {
                command: vec![
                    "sh".into(),
                    "-c".into(),
                    format!("echo m{i} >> {} && sleep {sleep}", marks.display()),
                ],
                ..Default::default()
            })
            .collect();
        let mut c = self.client()?;
        let mut ids = Vec::new();
        for chunk in specs.chunks(batch) {
            let req = SubmitJobsRequest {
                specs: chunk.to_vec(),
            };
            let got = c
                .call(|ch| {
                    let req = req.clone();
                    async move { JobServiceClient::new(ch).submit_jobs(req).await }
                })
                .await
                .context("SubmitJobs")?
                .into_inner()
                .jobs;
            ensure!(got.len() == chunk.len(), "a batch was acknowledged short");
            ids.extend(got.into_iter().map(|j| j.id));
        }
        Ok(ids)
    }

    async fn jobs(&self) -> Result<Vec<Job>> {
        e2e::leader_jobs(&mut self.client()?).await
    }

    /// Waits until `pred` holds for the job list.
    async fn wait_jobs(&self, what: &str, pred: impl Fn(&[Job]) -> bool) -> Result<Vec<Job>> {
        let deadline = Instant::now() + LONG;
        loop {
            if let Ok(all) = self.jobs().await
                && pred(&all)
            {
                return Ok(all);
            }
            if Instant::now() > deadline {
                let all = self.jobs().await.unwrap_or_default();
                let open: Vec<String> = all
                    .iter()
                    .filter(|j| !is_terminal(j.state))
                    .take(20)
                    .map(describe)
                    .collect();
                bail!(
                    "timed out waiting for {what}; open jobs:\n{}\n{}",
                    open.join("\n"),
                    self.logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Every submitted job is SUCCEEDED and its marker was written exactly
    /// once; nothing else was written.
    async fn check_exactly_once(&self, ids: &[String]) -> Result<()> {
        let all = self
            .wait_jobs("every job terminal", |all| {
                all.len() >= ids.len() && all.iter().all(|j| is_terminal(j.state))
            })
            .await?;
        if all.len() != ids.len() {
            let extra: Vec<String> = all
                .iter()
                .filter(|j| !ids.contains(&j.id))
                .map(|j| format!("{}{:?}", describe(j), j.spec.as_ref().map(|s| &s.command)))
                .collect();
            bail!(
                "{} jobs listed, {} submitted; not submitted:\n{}\n{}",
                all.len(),
                ids.len(),
                extra.join("\n"),
                self.logs()
            );
        }
        let bad: Vec<String> = all
            .iter()
            .filter(|j| j.state != JobState::Succeeded as i32)
            .take(20)
            .map(describe)
            .collect();
        ensure!(
            bad.is_empty(),
            "jobs not SUCCEEDED:\n{}\n{}",
            bad.join("\n"),
            self.logs()
        );
        let text = std::fs::read_to_string(self.marks())?;
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for line in text.lines() {
            *seen.entry(line.trim()).or_default() += 1;
        }
        let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
        ensure!(twice.is_empty(), "commands ran more than once: {twice:?}");
        ensure!(
            seen.len() == ids.len(),
            "{} distinct commands ran for {} jobs",
            seen.len(),
            ids.len()
        );
        Ok(())
    }
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn describe(j: &Job) -> String {
    format!(
        "  {} {} node={:?} attempt={} reason={:?}",
        j.id,
        JobState::try_from(j.state).map_or("?", |s| s.as_str_name()),
        j.node,
        j.attempt,
        j.reason
    )
}

/// The replica at `url` answers a JobService call as the leader (any
/// answer but UNAVAILABLE: an empty id is simply not found there).
async fn answers_as_leader(url: &str) -> bool {
    answers_as_leader_tls(url, &ClientTls::default()).await
}

async fn answers_as_leader_tls(url: &str, tls: &ClientTls) -> bool {
    e2e::answers_as_leader(url, tls).await
}

/// One GetJob("") on a fresh connection, bounded in time; None when the
/// replica does not answer (dead or paused).
async fn probe(url: &str) -> Option<Result<(), tonic::Status>> {
    e2e::probe_job_service(url, &ClientTls::default()).await
}

const AGENTS: &[(&str, &str)] = &[("a1", "1s:4c:1t"), ("a2", "1s:4c:1t"), ("a3", "1s:4c:1t")];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_sigkill_mid_run_loses_and_doubles_nothing() -> Result<()> {
    const JOBS: usize = 1000;
    let mut ha = Ha::start(AGENTS)?;
    let leader = ha.wait_leader(None, ELECTION).await?;
    // Followers redirect to it, by message and metadata.
    for (i, url) in ha.urls.iter().enumerate() {
        if i == leader {
            continue;
        }
        let status = probe(url)
            .await
            .and_then(Result::err)
            .context("a follower answered GetJob")?;
        ensure!(status.code() == Code::Unavailable, "{status:?}");
        ensure!(
            status.message() == format!("not the leader; the leader is at {}", ha.urls[leader]),
            "{status:?}"
        );
        ensure!(
            proto::endpoints::leader_hint(&status).as_deref() == Some(ha.urls[leader].as_str()),
            "{status:?}"
        );
    }
    // A spec too large for one etcd record is refused up front, naming
    // the field (here through a node selector value, which the spec's own
    // size limits do not bound), and the leader stays.
    let huge = JobSpec {
        command: vec!["true".into()],
        node_selector: [("big".to_string(), "x".repeat(2 << 20))].into(),
        ..Default::default()
    };
    let refused = ha
        .client()?
        .call(|ch| {
            let req = SubmitJobsRequest {
                specs: vec![huge.clone()],
            };
            async move {
                JobServiceClient::new(ch)
                    .max_encoding_message_size(64 << 20)
                    .submit_jobs(req)
                    .await
            }
        })
        .await
        .err()
        .context("a 2 MiB spec was accepted")?;
    ensure!(
        refused.code() == Code::InvalidArgument
            && refused.message().starts_with("specs[0]: ")
            && refused.message().ends_with("with the etcd store"),
        "{refused:?}"
    );
    ensure!(
        ha.wait_leader(None, ELECTION).await? == leader,
        "the leader changed after a refused submission\n{}",
        ha.logs()
    );
    ha.wait_nodes(AGENTS.len()).await?;
    // Batches of 250 exceed etcd's 128 operations per transaction: they
    // are committed through the store's redo log.
    let ids = ha.submit(JOBS, 250, "0.05").await?;
    ensure!(ids.len() == JOBS);
    ha.wait_jobs("some jobs finished and many still open", |all| {
        let done = all.iter().filter(|j| is_terminal(j.state)).count();
        (20..JOBS - 200).contains(&done)
    })
    .await?;
    let killed_at = Instant::now();
    ha.replicas[leader].proc.kill9();
    let next = ha.wait_leader(Some(leader), ELECTION).await?;
    eprintln!(
        "new leader {} answering {:?} after the SIGKILL of {}",
        ha.urls[next],
        killed_at.elapsed(),
        ha.urls[leader]
    );
    ha.check_exactly_once(&ids).await?;

    // dispatchctl finds the new leader: from a follower's URL alone (the
    // redirect hint), and from the full list that starts with the dead one.
    let follower = (0..3)
        .find(|&i| i != leader && i != next)
        .context("three replicas")?;
    let dead_first = format!(
        "{},{},{}",
        ha.urls[leader], ha.urls[follower], ha.urls[next]
    );
    for server in [ha.urls[follower].as_str(), dead_first.as_str()] {
        let (code, out, err) = e2e::dispatchctl(server, &["get", &ids[0], "-o", "json"])?;
        ensure!(
            code == 0 && out.to_lowercase().contains("succeeded"),
            "dispatchctl --server {server} get: exit {code}\n{out}\n{err}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_leader_steps_down_without_writing() -> Result<()> {
    const JOBS: usize = 300;
    let ha = Ha::start(&AGENTS[..2])?;
    let leader = ha.wait_leader(None, ELECTION).await?;
    ha.wait_nodes(2).await?;
    let ids = ha.submit(JOBS, 100, "0.1").await?;
    ha.wait_jobs("some jobs finished", |all| {
        all.iter().filter(|j| is_terminal(j.state)).count() >= 20
    })
    .await?;
    let old = &ha.replicas[leader];
    // A client connected to the leader before the pause sends a
    // submission while it is stopped: the request waits in the socket and
    // reaches the old leader when it resumes, after it lost the lease.
    let to_old = tonic::transport::Channel::from_shared(old.url.clone())?
        .connect()
        .await?;
    // The deposed term, as etcd holds it: the leader key's lease and
    // create revision (the fence every write of that term compares).
    let etcd = etcd_client(&ha.etcd.url).await?;
    let deposed = leader_at(&etcd, 0)
        .await?
        .context("no leader key while a replica leads")?;
    ensure!(deposed.url == old.url, "the leader key names {deposed:?}");
    old.proc.signal(nix::sys::signal::Signal::SIGSTOP);
    let stopped_at = Instant::now();
    let marks = ha.marks();
    let late = tokio::spawn(async move {
        let spec = JobSpec {
            command: vec![
                "sh".into(),
                "-c".into(),
                format!("echo late >> {}", marks.display()),
            ],
            ..Default::default()
        };
        JobServiceClient::new(to_old)
            .submit_jobs(SubmitJobsRequest { specs: vec![spec] })
            .await
    });
    let next = ha.wait_leader(Some(leader), ELECTION).await;
    // Resume it whatever happened, so a failure leaves no stopped process.
    let next = match next {
        Ok(n) => n,
        Err(e) => {
            old.proc.signal(nix::sys::signal::Signal::SIGCONT);
            return Err(e);
        }
    };
    eprintln!(
        "new leader {} answering {:?} after the SIGSTOP",
        ha.urls[next],
        stopped_at.elapsed()
    );
    // The new leader works before the old one wakes up: a job ends under
    // it (an event, not a pause of some length).
    let done_at_takeover = ha
        .jobs()
        .await?
        .iter()
        .filter(|j| is_terminal(j.state))
        .count();
    let progressed = ha
        .wait_jobs("a job to end under the new leader", |all| {
            all.iter().filter(|j| is_terminal(j.state)).count() > done_at_takeover
        })
        .await;
    if let Err(e) = progressed {
        old.proc.signal(nix::sys::signal::Signal::SIGCONT);
        return Err(e);
    }
    old.proc.signal(nix::sys::signal::Signal::SIGCONT);
    // The submission it received after waking up: the deposed term must
    // not have written it. Under load the leadership may flap (a renewal
    // starved past the 3 s TTL) and the old replica may legitimately win
    // a later term before it reads the request; then it may accept it
    // (or time out on etcd after storing it). So whether the job exists is
    // not the test: *which term wrote it* is. etcd tells: the job key's
    // create revision, and the leader key as it was at that revision.
    // Checked in etcd itself as soon as the answer is in (no leader's view
    // in between), and again at the end (a write that etcd applied after
    // the replica gave up waiting for it).
    let late = tokio::time::timeout(ELECTION, late)
        .await
        .context("the submission to the paused leader never returned")??;
    match &late {
        Ok(_) => eprintln!("the resumed old replica accepted the submission (a later term?)"),
        Err(s) if s.code() == Code::Unavailable => {
            eprintln!("submission to the resumed old leader: {}", s.message())
        }
        Err(other) => bail!(
            "the deposed leader answered a submission with {other:?}\n{}",
            ha.logs()
        ),
    }
    let stored = late_jobs_of_later_terms(&etcd, &old.url, &deposed)
        .await
        .with_context(|| ha.logs())?;
    if let Ok(resp) = &late {
        let id = resp.get_ref().jobs.first().map(|j| j.id.clone());
        ensure!(
            id.is_some() && stored == id.into_iter().collect::<Vec<_>>(),
            "the late submission was acknowledged ({:?}) but etcd holds {stored:?}",
            resp.get_ref().jobs
        );
    }
    // It steps down on its own and redirects to the new leader.
    let deadline = Instant::now() + ELECTION;
    loop {
        let redirected = probe(&old.url)
            .await
            .and_then(Result::err)
            .and_then(|s| proto::endpoints::leader_hint(&s));
        let log = old.proc.log_text();
        if redirected.as_deref() == Some(ha.urls[next].as_str()) && log.contains("stepped down") {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "the resumed leader did not step down (redirect {redirected:?})\n{}",
                ha.logs()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The old replica cannot take the leader key from a live leader: if
    // leadership moved again, the new leader stepped down on its own first.
    let now = ha.wait_leader(None, ELECTION).await?;
    if now != next {
        ensure!(
            ha.replicas[next].proc.log_text().contains("stepped down"),
            "{} answers as leader while {} never stepped down\n{}",
            ha.urls[now],
            ha.urls[next],
            ha.logs()
        );
        eprintln!(
            "leadership moved again under load: {} -> {}",
            ha.urls[next], ha.urls[now]
        );
    }
    let mut expected = ids.clone();
    expected.extend(
        late_jobs_of_later_terms(&etcd, &old.url, &deposed)
            .await
            .with_context(|| ha.logs())?,
    );
    ha.check_exactly_once(&expected).await
}

/// The late submission's jobs as etcd holds them (at most one), each
/// checked to have been written under a term of `writer` later than
/// `deposed`: the job key's create revision, and the leader key at that
/// revision. A job written while the leader key named another replica,
/// or still `deposed`, is the fence failing.
async fn late_jobs_of_later_terms(
    etcd: &etcd::Client,
    writer: &str,
    deposed: &Term,
) -> Result<Vec<String>> {
    use prost::Message as _;
    let key = b"/dispatch/jobs/".to_vec();
    let resp = etcd
        .range(etcd::RangeRequest {
            range_end: etcd::prefix_end(&key),
            key,
            ..Default::default()
        })
        .await?;
    let mut late = Vec::new();
    for kv in &resp.kvs {
        let job = Job::decode(kv.value.as_slice())?;
        let is_late = job
            .spec
            .as_ref()
            .is_some_and(|s| s.command.iter().any(|a| a.contains("echo late")));
        if !is_late {
            continue;
        }
        let written = kv.create_revision;
        let term = leader_at(etcd, written)
            .await?
            .context("no leader key when the late job was written")?;
        eprintln!(
            "the late job {} was written at revision {written} under {term:?} (the deposed term: {deposed:?})",
            job.id
        );
        ensure!(
            term.url == writer
                && term.create_revision > deposed.create_revision
                && term.lease != deposed.lease,
            "the late job {} was written at revision {written} while the leader key was \
             {term:?}: not a later term of {writer} (its deposed term was {deposed:?}); \
             the fence let a deposed leader write",
            job.id,
        );
        late.push(job.id);
    }
    ensure!(
        late.len() <= 1,
        "the late submission was stored as {late:?}"
    );
    Ok(late)
}

/// The leader key (`/dispatch/leader`) as etcd held it at `revision` (0:
/// now).
#[derive(Debug)]
struct Term {
    url: String,
    lease: i64,
    create_revision: i64,
}

async fn etcd_client(url: &str) -> Result<etcd::Client> {
    Ok(etcd::Client::connect([url], &etcd::ConnectOptions::new()).await?)
}

async fn leader_at(etcd: &etcd::Client, revision: i64) -> Result<Option<Term>> {
    let resp = etcd
        .range(etcd::RangeRequest {
            key: b"/dispatch/leader".to_vec(),
            revision,
            ..Default::default()
        })
        .await?;
    Ok(resp.kvs.first().map(|kv| Term {
        url: String::from_utf8_lossy(&kv.value).into_owned(),
        lease: kv.lease,
        create_revision: kv.create_revision,
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_restart_mid_run_loses_nothing() -> Result<()> {
    const JOBS: usize = 300;
    let mut ha = Ha::start(&AGENTS[..2])?;
    ha.wait_leader(None, ELECTION).await?;
    ha.wait_nodes(2).await?;
    let ids = ha.submit(JOBS, 100, "0.1").await?;
    ha.wait_jobs("some jobs finished", |all| {
        all.iter().filter(|j| is_terminal(j.state)).count() >= 20
    })
    .await?;
    ha.etcd.kill9();
    // The length of the outage (the fault itself, not a wait for an event:
    // every wait below is for one).
    tokio::time::sleep(Duration::from_secs(1)).await;
    ha.etcd.restart()?;
    let next = ha.wait_leader(None, ELECTION).await?;
    let result = ha.check_exactly_once(&ids).await;
    let step_downs: usize = ha
        .replicas
        .iter()
        .map(|d| d.proc.log_text().matches("stepped down").count())
        .sum();
    eprintln!(
        "leader after the etcd restart: {}; step-downs during the outage: {step_downs}",
        ha.urls[next]
    );
    result
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[expect(
    clippy::await_holding_lock,
    reason = "serial() orders whole tests, each on its own runtime: a test waiting for it blocks its own thread, never a task of this runtime"
)]
async fn replicas_over_tls_fail_over_for_agents_and_dispatchctl() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let ca_dir = dir.path().join("ca");
    let ca_dir_s = ca_dir.display().to_string();
    let out = std::process::Command::new(e2e::binary("dispatcher"))
        .args(["gen-certs", "--ca-dir", &ca_dir_s])
        .args(["--server-name", "localhost", "--server-name", "127.0.0.1"])
        .args(["--agent", "n1"])
        .output()
        .context("running dispatcher gen-certs")?;
    ensure!(out.status.success(), "gen-certs: {out:?}");
    let file = |name: &str| ca_dir.join(name).display().to_string();
    let (ca, cert, key) = (file("ca.pem"), file("server.pem"), file("server.key"));
    let _serial = serial();
    let etcd = Etcd::start(dir.path())?;
    let tls_flags = [
        "--tls-cert",
        cert.as_str(),
        "--tls-key",
        key.as_str(),
        "--tls-client-ca",
        ca.as_str(),
    ];
    let mut replicas = (0..3)
        .map(|_| {
            // Port 0: each replica advertises https://127.0.0.1:PORT, the
            // address it bound (a name of the server certificate).
            Dispatcher::start_replica(dir.path(), &etcd.url, &tls_flags)
        })
        .collect::<Result<Vec<_>>>()?;
    let urls: Vec<String> = replicas
        .iter()
        .map(|d| format!("https://127.0.0.1:{}", d.port))
        .collect();
    let all = urls.join(",");
    let (agent_cert, agent_key) = (file("agent-n1.pem"), file("agent-n1.key"));
    let agent = Agent::start(
        dir.path(),
        &all,
        "n1",
        "1s:2c:1t",
        &[],
        &[
            "--tls-ca",
            &ca,
            "--tls-cert",
            &agent_cert,
            "--tls-key",
            &agent_key,
        ],
    )?;
    let tls = ClientTls {
        ca: Some(ca_dir.join("ca.pem")),
        ..Default::default()
    };
    let logs = |replicas: &[Dispatcher]| {
        let mut s: String = replicas
            .iter()
            .map(|d| tail(&d.proc.log_text(), 20))
            .collect::<Vec<_>>()
            .join("\n----\n");
        s += &format!("\n---- agent ----\n{}", tail(&agent.proc.log_text(), 20));
        s
    };
    let wait_leader = async |except: Option<usize>| -> Result<usize> {
        let deadline = Instant::now() + ELECTION;
        loop {
            for (i, url) in urls.iter().enumerate() {
                if Some(i) != except && answers_as_leader_tls(url, &tls).await {
                    return Ok(i);
                }
            }
            ensure!(Instant::now() < deadline, "no leader over TLS");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let leader = wait_leader(None).await.with_context(|| logs(&replicas))?;
    // dispatchctl over TLS, given only a follower's URL, reaches the
    // leader, and the agent (client certificate) runs the job.
    let follower = (leader + 1) % 3;
    let submit = |server: &str| {
        e2e::dispatchctl_timeout(
            server,
            &["--tls-ca", &ca, "submit", "--wait", "--", "true"],
            LONG,
        )
    };
    let (code, out, err) = submit(&urls[follower])?;
    ensure!(
        code == 0,
        "submit via a follower: {code}\n{out}\n{err}\n{}",
        logs(&replicas)
    );
    replicas[leader].proc.kill9();
    let next = wait_leader(Some(leader))
        .await
        .with_context(|| logs(&replicas))?;
    let (code, out, err) = submit(&all)?;
    ensure!(
        code == 0,
        "submit after the failover to {}: {code}\n{out}\n{err}\n{}",
        urls[next],
        logs(&replicas)
    );
    Ok(())
}

/// Polls `f` every 100 ms until it succeeds; fails after `timeout` with
/// its last error.
async fn until<T, F, Fut>(timeout: Duration, what: &str, mut f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        let last = match f().await {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}: {last:#}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A long-running `dispatchctl` (e.g. `watch`) with its stdout and stderr
/// in files; killed on drop.
struct Background {
    child: std::process::Child,
    out: PathBuf,
    err: PathBuf,
}

impl Background {
    fn spawn(dir: &std::path::Path, name: &str, server: &str, args: &[&str]) -> Result<Self> {
        let out = dir.join(format!("{name}.out"));
        let err = dir.join(format!("{name}.err"));
        let child = std::process::Command::new(e2e::binary("dispatchctl"))
            .arg("--server")
            .arg(server)
            .args(args)
            .env_remove("DISPATCH_SERVER")
            .env("DISPATCH_CONFIG", "/nonexistent/dispatch-config.json")
            .stdin(std::process::Stdio::null())
            .stdout(std::fs::File::create(&out)?)
            .stderr(std::fs::File::create(&err)?)
            .spawn()
            .context("starting dispatchctl")?;
        Ok(Self { child, out, err })
    }

    fn stdout(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    /// `watch -o json` lines for `id` as (previous state, state).
    fn events_of(&self, id: &str) -> Vec<(Option<String>, String)> {
        self.stdout()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["job"]["id"] == id)
            .map(|v| {
                (
                    v["previous_state"].as_str().map(str::to_string),
                    v["job"]["state"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect()
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// GET `path` on a replica's web port, parsed as JSON.
fn web_json(port: u16, path: &str) -> Result<(u16, serde_json::Value)> {
    let (code, body) = e2e::http_get(port, path)?;
    let json = serde_json::from_str(&body).with_context(|| format!("GET {path}: {body}"))?;
    Ok((code, json))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatchctl_streams_resume_and_followers_point_to_the_leader() -> Result<()> {
    let mut ha = Ha::start_opts(&AGENTS[..1], true)?;
    let leader = ha.wait_leader(None, ELECTION).await?;
    ha.wait_nodes(1).await?;
    let page = |i: usize| format!("http://127.0.0.1:{}", ha.http[i]);

    // A follower's web API names the leader (its page) with a 503, and
    // its /metrics has no cluster gauges; the leader's has.
    let follower = (leader + 1) % 3;
    let (code, view) = until(ELECTION, "the follower knows the leader", || async {
        let (code, view) = web_json(ha.http[follower], "/api/v1/cluster")?;
        ensure!(view["leader"].is_string(), "{code} {view}");
        Ok((code, view))
    })
    .await?;
    ensure!(
        code == 503,
        "follower /api/v1/cluster answered {code}: {view}"
    );
    ensure!(view["role"] == "follower", "{view}");
    ensure!(view["leader"] == page(leader).as_str(), "{view}");
    ensure!(view["leader_grpc"] == ha.urls[leader].as_str(), "{view}");
    let (code, rack) = web_json(ha.http[follower], "/api/v1/racks/default/default")?;
    ensure!(code == 503 && rack["role"] == "follower", "{code} {rack}");
    let (_, metrics) = e2e::http_get(ha.http[follower], "/metrics")?;
    ensure!(
        metrics.lines().any(|l| l == "dispatch_leader 0"),
        "{metrics}"
    );
    ensure!(
        !metrics.contains("dispatch_nodes{"),
        "stale gauges: {metrics}"
    );
    // The follower's page, rendered by headless Chromium, says so and
    // links to the leader's page; the cluster sections are hidden.
    let follower_page = format!("{}/", page(follower));
    let dom = tokio::task::spawn_blocking(move || e2e::rendered_dom(&follower_page)).await??;
    ensure!(
        dom.contains(r#"data-role="follower""#)
            && dom.contains("This replica is a follower")
            && dom.contains(&format!(r#"href="{}""#, page(leader)))
            && dom.contains("<main hidden"),
        "the follower's page has no banner linking to the leader:\n{dom}"
    );
    let (code, _) = web_json(ha.http[leader], "/api/v1/cluster")?;
    ensure!(code == 200, "the leader's /api/v1/cluster answered {code}");
    let (_, metrics) = e2e::http_get(ha.http[leader], "/metrics")?;
    ensure!(
        metrics.lines().any(|l| l == "dispatch_leader 1"),
        "{metrics}"
    );

    // A watch of every job, through the full list of URLs; a first job
    // seen ending shows it is subscribed.
    let all = ha.urls.join(",");
    // The watch subscribes some time after its process starts (it looks
    // for the leader first), and without --current it prints only what
    // happens after that: submit short jobs until one is seen ending.
    let watch = Background::spawn(ha.dir.path(), "watch", &all, &["watch", "-o", "json"])?;
    let first = until(LONG, "the watch shows a first job", || async {
        let (code, out, err) =
            e2e::dispatchctl_timeout(&all, &["submit", "--wait", "--", "true"], LONG)?;
        ensure!(code == 0, "submit --wait true: {code}\n{out}\n{err}");
        let id = out.trim().to_string();
        for _ in 0..30 {
            if watch.events_of(&id).iter().any(|(_, s)| s == "succeeded") {
                return Ok(id);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!("{id} not seen ending\n{}", watch.stderr())
    })
    .await?;

    // Every job the watch has shown so far (the first job and any earlier
    // try), so the next running event is the sleeper's.
    let earlier: std::collections::HashSet<String> = watch
        .stdout()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["job"]["id"].as_str().map(str::to_string))
        .collect();
    // submit --wait of a job that outlives the leader.
    let waiter = {
        let all = all.clone();
        std::thread::spawn(move || {
            e2e::dispatchctl_timeout(&all, &["submit", "--wait", "--", "sleep", "4"], LONG)
        })
    };
    let id = until(LONG, "the job runs", || async {
        let out = watch.stdout();
        out.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| {
                v["job"]["state"] == "running"
                    && v["job"]["id"]
                        .as_str()
                        .is_some_and(|j| !earlier.contains(j))
            })
            .and_then(|v| v["job"]["id"].as_str().map(str::to_string))
            .context("no running event yet")
    })
    .await?;
    ha.replicas[leader].proc.kill9();
    let next = ha.wait_leader(Some(leader), ELECTION).await?;
    let waited = tokio::task::spawn_blocking(move || waiter.join())
        .await?
        .map_err(|_| anyhow::anyhow!("the submit thread panicked"))??;
    let (code, out, err) = waited;
    ensure!(
        code == 0 && out.trim() == id,
        "submit --wait across the failover: exit {code}\n{out}\n{err}\n{}",
        ha.logs()
    );
    // The watch carried on: the job's end appears, exactly once.
    until(LONG, "the watch shows the job ending", || async {
        let evs = watch.events_of(&id);
        ensure!(
            evs.iter().any(|(_, s)| s == "succeeded"),
            "{evs:?}\n{}",
            watch.stderr()
        );
        Ok(())
    })
    .await?;
    // Another job after the failover, so a duplicate end event of the first
    // one (re-listed by the resumed watch) would be out by then.
    let (code, out, err) =
        e2e::dispatchctl_timeout(&all, &["submit", "--wait", "--", "true"], LONG)?;
    ensure!(code == 0, "submit after the failover: {code}\n{out}\n{err}");
    let last = out.trim().to_string();
    until(LONG, "the watch shows a job after the failover", || async {
        ensure!(watch.events_of(&last).iter().any(|(_, s)| s == "succeeded"));
        Ok(())
    })
    .await?;
    let ends = watch
        .events_of(&id)
        .into_iter()
        .filter(|(_, s)| s == "succeeded")
        .count();
    ensure!(
        ends == 1,
        "the job's end was printed {ends} times:\n{}\n{}",
        watch.stdout(),
        watch.stderr()
    );
    ensure!(
        watch
            .events_of(&first)
            .iter()
            .filter(|(_, s)| s == "succeeded")
            .count()
            == 1,
        "the first job's end was printed again after the failover:\n{}",
        watch.stdout()
    );
    ensure!(
        watch.stderr().contains("looking for the leader"),
        "the watch never saw the stream break:\n{}",
        watch.stderr()
    );

    eprintln!("watch across the failover:\n{}", watch.stderr());
    // The surviving follower now points at the new leader's page.
    let other = (0..3)
        .find(|&i| i != leader && i != next)
        .context("three replicas")?;
    until(ELECTION, "the follower names the new leader", || async {
        let (code, view) = web_json(ha.http[other], "/api/v1/cluster")?;
        ensure!(
            code == 503 && view["leader"] == page(next).as_str(),
            "{code} {view}"
        );
        Ok(())
    })
    .await?;
    let (_, metrics) = e2e::http_get(ha.http[next], "/metrics")?;
    ensure!(
        metrics.lines().any(|l| l == "dispatch_leader 1"),
        "{metrics}"
    );
    Ok(())
}
