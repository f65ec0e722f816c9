//! One function per command. Each takes a connected [`Client`], its
//! parsed arguments and where to write ([`Io`]), and returns the process
//! exit code. The pure parts (building the job spec, tables, detail views,
//! the `--wait` exit-code mapping) are separate functions so they can be
//! tested on hand-built messages.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use proto::v1 as pb;

use crate::cli::{
    AlignArg, CancelArgs, Command, ConfigArgs, GangRetryArg, GetArgs, LogsArgs, LsArgs, NodeAction,
    NodeArgs, NodesArgs, PolicyArg, StateArg, SubmitArgs, WatchArgs, WatchFormat, WithinArg,
};
use crate::client::{Client, NodeOp, describe_status, is_disconnect, status_cause};
use crate::config::Server;
use crate::output::{
    Column, Format, Table, cpu_list, human_age_ms, human_duration_ms, human_size, sanitize,
    shell_join, to_json, to_yaml, utc_time,
};
use crate::view::{
    AlignmentView, DeviceView, JobEventView, JobListView, JobStateView, JobView, NodeListView,
    NodeStateView, NodeView, PolicyView, WithinView, node_cpus,
};
use crate::{EXIT_ERROR, EXIT_OK, Error, Io, Result};

/// How long `watch`, `--wait`, `--follow` and `logs -f` look for a leader
/// (the same dispatcher restarting, or another replica taking over) after
/// their stream breaks, before giving up with exit code 2.
pub const RESUME_PATIENCE: Duration = Duration::from_secs(30);
/// Exit code of a `--wait`ed job that was lost with its node.
pub const EXIT_JOB_LOST: u8 = 3;
/// Exit code of a `--wait`ed job that timed out without a signal (as
/// `timeout(1)`).
pub const EXIT_JOB_TIMEOUT: u8 = 124;
/// Exit code of a `--wait`ed job that was cancelled without a signal
/// (128 + SIGINT, "interrupted").
pub const EXIT_JOB_CANCELLED: u8 = 130;

/// Runs one command on a connected client.
pub async fn dispatch(
    client: &mut Client,
    server: &Server,
    command: Command,
    io: &mut Io<'_>,
) -> Result<u8> {
    match command {
        Command::Submit(a) => submit(client, &a, io).await,
        Command::Get(a) => get(client, &a, io).await,
        Command::Ls(a) => ls(client, &a, io).await,
        Command::Cancel(a) => cancel(client, &a, io).await,
        Command::Logs(a) => logs(client, &a, io).await,
        Command::Watch(a) => watch(client, &a, io).await,
        Command::Nodes(a) => nodes(client, &a, io).await,
        Command::Node(a) => node(client, &a, io).await,
        Command::Top(a) => crate::top::top(client, &a, io).await,
        Command::Config(a) => config(server, &a, io),
    }
}

/// Now, in Unix milliseconds.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

fn print_structured<T: serde::Serialize>(format: Format, value: &T, io: &mut Io<'_>) -> Result<()> {
    let text = match format {
        Format::Yaml => to_yaml(value)?,
        _ => to_json(value)?,
    };
    io.out.write_all(text.as_bytes())?;
    Ok(())
}

fn is_structured(f: Format) -> bool {
    matches!(f, Format::Json | Format::Yaml)
}

// ---------------------------------------------------------------- config

/// `dispatchctl config`: the resolved address and its source.
pub fn config(server: &Server, a: &ConfigArgs, io: &mut Io<'_>) -> Result<u8> {
    if is_structured(a.output.format) {
        print_structured(a.output.format, server, io)?;
    } else {
        writeln!(io.out, "server: {}", server.url)?;
        writeln!(io.out, "source: {}", server.source)?;
    }
    Ok(EXIT_OK)
}

// ---------------------------------------------------------------- submit

fn align_to_pb(a: AlignArg) -> pb::Alignment {
    match a {
        AlignArg::Core => pb::Alignment::Core,
        AlignArg::Llc => pb::Alignment::Llc,
        AlignArg::Numa => pb::Alignment::Numa,
        AlignArg::Package => pb::Alignment::Package,
        AlignArg::Any => pb::Alignment::Any,
    }
}

fn policy_to_pb(p: PolicyArg) -> pb::PlacementPolicy {
    match p {
        PolicyArg::Spread => pb::PlacementPolicy::Spread,
        PolicyArg::Pack => pb::PlacementPolicy::Pack,
    }
}

/// The job spec `submit` sends. Without `--name`, the job is named after
/// its program (`/usr/bin/make` -> `make`), as Slurm does. For repeated
/// keys in `--env` / `--selector` the last one wins.
pub fn job_spec(a: &SubmitArgs) -> pb::JobSpec {
    let name = a.name.clone().unwrap_or_else(|| {
        a.command
            .first()
            .map(|p| p.rsplit('/').next().unwrap_or(p).to_string())
            .unwrap_or_default()
    });
    pb::JobSpec {
        name,
        command: a.command.clone(),
        env: a
            .env
            .iter()
            .map(|kv| (kv.key.clone(), kv.value.clone()))
            .collect(),
        cwd: a.cwd.clone().unwrap_or_default(),
        cpus: a.cpus,
        memory_bytes: a.memory.unwrap_or(0),
        alignment: align_to_pb(a.align.unwrap_or(AlignArg::Any)) as i32,
        policy: policy_to_pb(a.policy.unwrap_or(PolicyArg::Spread)) as i32,
        node_selector: a
            .selector
            .iter()
            .map(|kv| (kv.key.clone(), kv.value.clone()))
            .collect(),
        latency_nice: a.latency_nice.unwrap_or(0),
        nice: a.nice.unwrap_or(0),
        waker: a.waker.clone().unwrap_or_default(),
        group: a.group.clone().unwrap_or_default(),
        retries: a.retries.unwrap_or(0),
        timeout_ms: a
            .timeout
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0),
        array_count: a.array.unwrap_or(0),
        nodes: a.nodes.unwrap_or(0),
        within: a.within.map_or(pb::Within::Unspecified, within_to_pb) as i32,
        within_preferred: a.preferred,
        relax_after_ms: a
            .relax_after
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0),
        gang_retry: a
            .gang_retry
            .map_or(pb::GangRetry::Unspecified, gang_retry_to_pb) as i32,
        gpus: a.gpus,
    }
}

/// A preferred gang's wait before it relaxes: 0 is the dispatcher's
/// default (`JobSpec.relax_after_ms`).
fn effective_relax_ms(ms: u64) -> i64 {
    match ms {
        0 => 300_000,
        ms => i64::try_from(ms).unwrap_or(i64::MAX),
    }
}

fn within_to_pb(w: WithinArg) -> pb::Within {
    match w {
        WithinArg::Rack => pb::Within::Rack,
        WithinArg::Zone => pb::Within::Zone,
        WithinArg::Any => pb::Within::Any,
    }
}

fn gang_retry_to_pb(r: GangRetryArg) -> pb::GangRetry {
    match r {
        GangRetryArg::Restart => pb::GangRetry::RestartAll,
        GangRetryArg::Replace => pb::GangRetry::ReplaceMember,
    }
}

/// `dispatchctl submit`.
pub async fn submit(client: &mut Client, a: &SubmitArgs, io: &mut Io<'_>) -> Result<u8> {
    if a.follow && is_structured(a.output.format) {
        return Err(Error::Usage(
            "--follow writes the job's output to stdout and cannot be combined with -o json/yaml; \
             use --wait -o json"
                .to_string(),
        ));
    }
    let jobs = client.submit(job_spec(a)).await?;
    if jobs.is_empty() {
        return Err(Error::Protocol("SubmitJob returned no job".to_string()));
    }
    let wait = a.wait || a.follow;
    let structured = is_structured(a.output.format);
    if !structured {
        // With --follow, stdout carries the job's output: ids go to stderr.
        let w: &mut dyn std::io::Write = if a.follow { io.err } else { io.out };
        // A gang: its id first (what `get`, `ls --gang` and `cancel`
        // take), then its members'.
        if let Some(gang) = jobs.first().map(|j| &j.gang_id).filter(|g| !g.is_empty()) {
            writeln!(w, "{gang}")?;
        }
        for j in &jobs {
            writeln!(w, "{}", j.id)?;
        }
        w.flush()?;
    } else if !wait {
        let view = JobListView {
            jobs: jobs.iter().map(JobView::from).collect(),
        };
        print_structured(a.output.format, &view, io)?;
    }
    if !wait {
        return Ok(EXIT_OK);
    }
    let ids: Vec<String> = jobs.iter().map(|j| j.id.clone()).collect();
    if a.follow {
        for id in &ids {
            match follow_log(client, id, pb::LogStream::Stdout, io).await {
                // No log (the job never started, or the agent lost it):
                // say so and still report how the job ended.
                Err(Error::Rpc(s)) => {
                    writeln!(
                        io.err,
                        "dispatchctl: no log for {id}: {}",
                        describe_status(&s)
                    )?;
                }
                other => other?,
            }
        }
    }
    let finals = wait_for(client, &ids, JobStateView::is_terminal).await?;
    if structured {
        let view = JobListView {
            jobs: finals.iter().map(JobView::from).collect(),
        };
        print_structured(a.output.format, &view, io)?;
    }
    let code = wait_exit_code(&finals);
    if code != EXIT_OK {
        writeln!(io.err, "{}", outcome_summary(&finals))?;
    }
    Ok(code)
}

/// The exit code `submit --wait` returns for one ended job:
/// 0 succeeded; the exit status (low 8 bits, never 0) if it exited
/// non-zero; 128 + S if signal S killed it (a timeout's kill included);
/// 124 if it timed out without a signal; 130 if cancelled without a signal;
/// 3 if lost; 1 for any other failure (e.g. it could not start) and for a
/// job that has not ended.
pub fn job_exit_code(job: &pb::Job) -> u8 {
    let by_signal = |s: i32| u8::try_from(128 + s.clamp(1, 127)).unwrap_or(255);
    match JobStateView::from_i32(job.state) {
        JobStateView::Succeeded => EXIT_OK,
        JobStateView::Failed if job.signal > 0 => by_signal(job.signal),
        JobStateView::Failed if job.exit_code != 0 => match (job.exit_code & 0xff) as u8 {
            0 => EXIT_ERROR,
            c => c,
        },
        JobStateView::Failed if job.reason.starts_with("timeout") => EXIT_JOB_TIMEOUT,
        JobStateView::Cancelled if job.signal > 0 => by_signal(job.signal),
        JobStateView::Cancelled => EXIT_JOB_CANCELLED,
        JobStateView::Lost => EXIT_JOB_LOST,
        _ => EXIT_ERROR,
    }
}

/// The exit code for several jobs (an array): that of the first job, in
/// the given order (index order), that did not succeed; 0 if all did.
pub fn wait_exit_code(jobs: &[pb::Job]) -> u8 {
    jobs.iter()
        .map(job_exit_code)
        .find(|&c| c != EXIT_OK)
        .unwrap_or(EXIT_OK)
}

/// How one job ended, for stderr: `j-3 failed: exit 1 (reason)`.
pub fn job_outcome(job: &pb::Job) -> String {
    let state = JobStateView::from_i32(job.state);
    let mut s = format!("{} {state}", job.id);
    if job.signal > 0 {
        s.push_str(&format!(": killed by signal {}", job.signal));
    } else if state.is_terminal() && state != JobStateView::Succeeded && job.exit_code != 0 {
        s.push_str(&format!(": exit {}", job.exit_code));
    }
    if !job.reason.is_empty() {
        s.push_str(&format!(" ({})", sanitize(&job.reason)));
    }
    s
}

/// A one-line summary of ended jobs: the job's outcome, or for several
/// jobs the counts per state and the first one that did not succeed.
pub fn outcome_summary(jobs: &[pb::Job]) -> String {
    if let [one] = jobs {
        return job_outcome(one);
    }
    let mut counts: Vec<(JobStateView, usize)> = Vec::new();
    for j in jobs {
        let st = JobStateView::from_i32(j.state);
        match counts.iter_mut().find(|(s, _)| *s == st) {
            Some((_, n)) => *n += 1,
            None => counts.push((st, 1)),
        }
    }
    counts.sort();
    let parts: Vec<String> = counts.iter().map(|(s, n)| format!("{n} {s}")).collect();
    let mut s = format!("{} jobs: {}", jobs.len(), parts.join(", "));
    if let Some(first) = jobs.iter().find(|j| job_exit_code(j) != EXIT_OK) {
        s.push_str(&format!("; first: {}", job_outcome(first)));
    }
    s
}

/// Watches `ids` (with their current state first) until `done` holds for
/// every one; returns their last known states in the order of `ids`.
/// When the stream breaks it finds the leader again and re-watches (the
/// current states come first again), for up to [`RESUME_PATIENCE`].
pub async fn wait_for(
    client: &mut Client,
    ids: &[String],
    done: impl Fn(JobStateView) -> bool,
) -> Result<Vec<pb::Job>> {
    let wanted: HashSet<&str> = ids.iter().map(String::as_str).collect();
    let mut latest: HashMap<String, pb::Job> = HashMap::new();
    let mut remaining = wanted.len();
    let mut broken = Resume::default();
    loop {
        let req = pb::WatchJobsRequest {
            ids: ids.to_vec(),
            include_current: true,
        };
        let cause = match client.jobs.watch_jobs(req).await {
            Ok(resp) => {
                let mut stream = resp.into_inner();
                loop {
                    match stream.message().await {
                        Ok(Some(ev)) => {
                            broken.healed();
                            let Some(job) = ev.job else { continue };
                            if !wanted.contains(job.id.as_str()) {
                                continue;
                            }
                            let now_done = done(JobStateView::from_i32(job.state));
                            let was_done = latest
                                .get(&job.id)
                                .is_some_and(|j| done(JobStateView::from_i32(j.state)));
                            match (was_done, now_done) {
                                (false, true) => remaining -= 1,
                                (true, false) => remaining += 1,
                                _ => {}
                            }
                            latest.insert(job.id.clone(), job);
                            if remaining == 0 {
                                return Ok(ids
                                    .iter()
                                    .filter_map(|id| latest.get(id).cloned())
                                    .collect());
                            }
                        }
                        Ok(None) => break "the dispatcher ended the job watch".to_string(),
                        Err(s) if is_disconnect(&s) => break status_cause(&s),
                        Err(s) => return Err(client.error(s)),
                    }
                }
            }
            Err(s) if is_disconnect(&s) => status_cause(&s),
            Err(s) => return Err(client.error(s)),
        };
        broken.reconnect(client, cause).await?;
    }
}

/// Resuming a stream after it broke: the time of the first break since the
/// last message, so that the patience ([`RESUME_PATIENCE`]) bounds the
/// whole search.
struct Resume {
    since: Option<Instant>,
    patience: Duration,
}

impl Default for Resume {
    fn default() -> Self {
        Self {
            since: None,
            patience: RESUME_PATIENCE,
        }
    }
}

impl Resume {
    /// A message arrived: the stream works.
    fn healed(&mut self) {
        self.since = None;
    }

    /// The stream broke (`cause`): find the leader (proto::endpoints, via
    /// [`Client::find_leader`]) within what is left of the patience, or
    /// fail with exit code 2 naming the URLs tried.
    async fn reconnect(&mut self, client: &mut Client, cause: String) -> Result<()> {
        let since = *self.since.get_or_insert_with(Instant::now);
        let left = self.patience.saturating_sub(since.elapsed());
        let found = if left.is_zero() {
            Err(None)
        } else {
            client.find_leader(left).await.map_err(Some)
        };
        found.map_err(|last| Error::Unreachable {
            addr: client.servers().to_string(),
            cause: match last {
                Some(s) => format!(
                    "{cause}; no leader answered within {:?}: {}",
                    self.patience,
                    status_cause(&s)
                ),
                None => format!("{cause}; no leader answered within {:?}", self.patience),
            },
        })
    }
}

/// Streams a job's log once it has started, following it to the end.
pub async fn follow_log(
    client: &mut Client,
    id: &str,
    stream: pb::LogStream,
    io: &mut Io<'_>,
) -> Result<()> {
    // Fix: waiting on an unknown id never ended (the watch simply has no
    // events for it); ask for the job first so a typo fails with NOT_FOUND.
    client.get_job(id).await?;
    let ids = [id.to_string()];
    wait_for(client, &ids, |s| {
        s == JobStateView::Running || s.is_terminal()
    })
    .await?;
    stream_log(client, id, stream, true, io).await
}

/// Copies a job's log to `io.out` from the start; with `follow`, until the
/// job ends, resuming at the last offset printed when the stream breaks
/// (on the leader found again, for up to [`RESUME_PATIENCE`]).
pub async fn stream_log(
    client: &mut Client,
    id: &str,
    stream: pb::LogStream,
    follow: bool,
    io: &mut Io<'_>,
) -> Result<()> {
    let mut offset = 0u64;
    let mut broken = Resume::default();
    let mut warned_truncated = false;
    loop {
        let req = pb::StreamLogsRequest {
            id: id.to_string(),
            stream: stream as i32,
            offset,
            follow,
        };
        let cause = match client.jobs.stream_logs(req).await {
            Ok(resp) => {
                let mut chunks = resp.into_inner();
                loop {
                    match chunks.message().await {
                        Ok(Some(chunk)) => {
                            broken.healed();
                            // Skip what was already printed if the
                            // dispatcher resent from an earlier offset.
                            let skip = offset.saturating_sub(chunk.offset);
                            let data = usize::try_from(skip)
                                .ok()
                                .and_then(|s| chunk.data.get(s..))
                                .unwrap_or(&[]);
                            io.out.write_all(data)?;
                            io.out.flush()?;
                            offset = offset.max(chunk.offset + chunk.data.len() as u64);
                            if chunk.truncated && !warned_truncated {
                                warned_truncated = true;
                                writeln!(
                                    io.err,
                                    "dispatchctl: the log of {id} was cut at the agent's size cap"
                                )?;
                            }
                        }
                        Ok(None) => return Ok(()),
                        Err(s) if follow && is_disconnect(&s) => break status_cause(&s),
                        Err(s) => return Err(client.error(s)),
                    }
                }
            }
            Err(s) if follow && is_disconnect(&s) => status_cause(&s),
            Err(s) => return Err(client.error(s)),
        };
        // Resume from the byte after the last one printed.
        broken.reconnect(client, cause).await?;
    }
}

// ---------------------------------------------------------------- get

/// `dispatchctl get`.
pub async fn get(client: &mut Client, a: &GetArgs, io: &mut Io<'_>) -> Result<u8> {
    let job = client.get_job(&a.id).await?;
    if is_structured(a.output.format) {
        print_structured(a.output.format, &JobView::from(&job), io)?;
    } else {
        io.out.write_all(job_detail(&job, now_ms()).as_bytes())?;
    }
    Ok(EXIT_OK)
}

/// A time ahead: `2026-12-01 20:05:00 UTC (in 1m 30s)`, or `(passed)`.
fn until_text(ms: i64, now: i64) -> String {
    if ms > now {
        format!("{} (in {})", utc_time(ms), human_duration_ms(ms - now))
    } else {
        format!("{} (passed)", utc_time(ms))
    }
}

/// The REASON cell of `ls` and the text of `watch`: why a waiting job
/// waits (`kind: message`), else the last decision's text.
fn reason_text(job: &pb::Job) -> String {
    match &job.pending_reason {
        Some(r) => sanitize(&proto::pending::one_line(r)),
        None => sanitize(&job.reason),
    }
}

fn or_dash(s: &str) -> String {
    if s.is_empty() {
        "-".to_string()
    } else {
        sanitize(s)
    }
}

fn time_and_age(ms: i64, now: i64) -> String {
    if ms == 0 {
        "-".to_string()
    } else {
        format!("{} ({} ago)", utc_time(ms), human_duration_ms(now - ms))
    }
}

/// How a job's exit reads in tables: `0`, `1`, `sig 9`, or `-` before it
/// ends.
pub fn exit_text(job: &pb::Job) -> String {
    if job.signal > 0 {
        format!("sig {}", job.signal)
    } else if JobStateView::from_i32(job.state).is_terminal() {
        job.exit_code.to_string()
    } else {
        "-".to_string()
    }
}

/// Run time: end (or now) minus start, `-` before it starts.
fn run_time(job: &pb::Job, now: i64) -> String {
    if job.start_time_ms == 0 {
        return "-".to_string();
    }
    let end = if job.end_time_ms != 0 {
        job.end_time_ms
    } else if JobStateView::from_i32(job.state).is_terminal() {
        return "-".to_string();
    } else {
        now
    };
    human_duration_ms(end - job.start_time_ms)
}

fn kv_list(m: &HashMap<String, String>) -> String {
    let mut v: Vec<String> = m.iter().map(|(k, v)| format!("{k}={v}")).collect();
    v.sort();
    if v.is_empty() {
        "-".to_string()
    } else {
        sanitize(&v.join(" "))
    }
}

/// `get`'s detail view: one `Field: value` line per field, values aligned.
pub fn job_detail(job: &pb::Job, now: i64) -> String {
    let state = JobStateView::from_i32(job.state);
    let spec = job.spec.clone().unwrap_or_default();
    let mut rows: Vec<(&str, String)> = vec![
        ("ID", job.id.clone()),
        ("Name", or_dash(&spec.name)),
        ("State", state.to_string()),
        ("Reason", or_dash(&job.reason)),
    ];
    if let Some(r) = &job.pending_reason {
        rows.push(("Waiting", sanitize(&proto::pending::one_line(r))));
        if !r.node.is_empty() {
            rows.push(("Waiting on", sanitize(&r.node)));
        }
        if r.jobs_ahead > 0 {
            rows.push(("Jobs ahead", r.jobs_ahead.to_string()));
        }
        if r.until_ms != 0 {
            rows.push(("Until", until_text(r.until_ms, now)));
        }
    }
    rows.extend([
        ("Node", or_dash(&job.node)),
        (
            "CPUs",
            if job.cpus.is_empty() {
                "-".to_string()
            } else {
                format!("{} ({})", cpu_list(&job.cpus), job.cpus.len())
            },
        ),
        (
            "GPUs",
            if job.gpus.is_empty() {
                "-".to_string()
            } else {
                format!("{} ({})", cpu_list(&job.gpus), job.gpus.len())
            },
        ),
        ("Attempt", job.attempt.to_string()),
        ("Exit", exit_text(job)),
        ("Submitted", time_and_age(job.submit_time_ms, now)),
        ("Started", time_and_age(job.start_time_ms, now)),
        ("Ended", time_and_age(job.end_time_ms, now)),
        ("Run time", run_time(job, now)),
    ]);
    if !job.array_id.is_empty() {
        rows.push((
            "Array",
            format!("{} (element {})", job.array_id, job.array_index),
        ));
    }
    if !job.gang_id.is_empty() {
        rows.push((
            "Gang",
            format!(
                "{} (member {} of {}, within {}{})",
                job.gang_id,
                job.gang_index,
                job.gang_size,
                WithinView::of_spec(&spec),
                if spec.within_preferred {
                    format!(
                        ", preferred: relaxed after {}",
                        human_age_ms(effective_relax_ms(spec.relax_after_ms))
                    )
                } else {
                    String::new()
                }
            ),
        ));
    }
    rows.extend([
        ("Command", sanitize(&shell_join(&spec.command))),
        ("CPUs wanted", spec.cpus.max(1).to_string()),
        ("GPUs wanted", spec.gpus.to_string()),
        (
            "Memory",
            if spec.memory_bytes == 0 {
                "no limit".to_string()
            } else {
                human_size(spec.memory_bytes)
            },
        ),
        (
            "Alignment",
            AlignmentView::from_i32(spec.alignment).to_string(),
        ),
        ("Policy", PolicyView::from_i32(spec.policy).to_string()),
        ("Selector", kv_list(&spec.node_selector)),
        ("Latency-nice", spec.latency_nice.to_string()),
        ("Nice", spec.nice.to_string()),
        ("Waker", or_dash(&spec.waker)),
        ("Group", or_dash(&spec.group)),
        ("Retries", spec.retries.to_string()),
        (
            "Timeout",
            if spec.timeout_ms == 0 {
                "none".to_string()
            } else {
                human_duration_ms(i64::try_from(spec.timeout_ms).unwrap_or(i64::MAX))
            },
        ),
        ("Cwd", or_dash(&spec.cwd)),
        ("Env", kv_list(&spec.env)),
    ]);
    detail_lines(&rows)
}

fn detail_lines(rows: &[(&str, String)]) -> String {
    let w = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 1;
    let mut out = String::new();
    for (k, v) in rows {
        let key = format!("{k}:");
        out.push_str(format!("{key:<w$}  {v}").trim_end());
        out.push('\n');
    }
    out
}

// ---------------------------------------------------------------- ls

fn state_to_pb(s: StateArg) -> pb::JobState {
    match s {
        StateArg::Pending => pb::JobState::Pending,
        StateArg::Assigned => pb::JobState::Assigned,
        StateArg::Running => pb::JobState::Running,
        StateArg::Succeeded => pb::JobState::Succeeded,
        StateArg::Failed => pb::JobState::Failed,
        StateArg::Cancelled => pb::JobState::Cancelled,
        StateArg::Lost => pb::JobState::Lost,
    }
}

/// The ListJobs filter for `ls`'s flags (duplicated states removed).
pub fn list_request(a: &LsArgs) -> pb::ListJobsRequest {
    let mut states: Vec<i32> = a.state.iter().map(|s| state_to_pb(*s) as i32).collect();
    states.sort_unstable();
    states.dedup();
    pb::ListJobsRequest {
        states,
        node: a.node.clone().unwrap_or_default(),
        group: a.group.clone().unwrap_or_default(),
        array_id: a.array.clone().unwrap_or_default(),
        gang_id: a.gang.clone().unwrap_or_default(),
        page_size: 0,
        page_token: String::new(),
        owner: String::new(),
    }
}

/// `dispatchctl ls`.
pub async fn ls(client: &mut Client, a: &LsArgs, io: &mut Io<'_>) -> Result<u8> {
    let jobs = client.list_all_jobs(&list_request(a), a.limit).await?;
    if is_structured(a.output.format) {
        let view = JobListView {
            jobs: jobs.iter().map(JobView::from).collect(),
        };
        print_structured(a.output.format, &view, io)?;
    } else if jobs.is_empty() {
        writeln!(io.err, "No jobs found.")?;
    } else {
        let wide = a.output.format == Format::Wide;
        io.out
            .write_all(jobs_table(&jobs, now_ms(), wide).as_bytes())?;
    }
    Ok(EXIT_OK)
}

/// `ls`'s table: ID, NAME, STATE, NODE, CPUS, AGE (since submit),
/// DURATION (run time), EXIT, REASON (cut at 48 columns unless `wide`):
/// for a waiting job its pending reason (`kind: message`, like squeue's
/// REASON), else the text of the last decision.
pub fn jobs_table(jobs: &[pb::Job], now: i64, wide: bool) -> String {
    let mut t = Table::new(vec![
        Column::left("ID"),
        Column::left("NAME").max(24),
        Column::left("STATE"),
        Column::left("NODE"),
        Column::right("CPUS"),
        Column::right("AGE"),
        Column::right("DURATION"),
        Column::right("EXIT"),
        Column::left("REASON").max(48),
    ]);
    t.wide = wide;
    for j in jobs {
        let spec = j.spec.clone().unwrap_or_default();
        t.row(vec![
            j.id.clone(),
            or_dash(&spec.name),
            JobStateView::from_i32(j.state).to_string(),
            or_dash(&j.node),
            spec.cpus.max(1).to_string(),
            if j.submit_time_ms == 0 {
                "-".to_string()
            } else {
                human_age_ms(now - j.submit_time_ms)
            },
            run_time(j, now),
            exit_text(j),
            reason_text(j),
        ]);
    }
    t.render()
}

// ---------------------------------------------------------------- cancel

/// `dispatchctl cancel`: tries every id; exit 1 if any failed.
pub async fn cancel(client: &mut Client, a: &CancelArgs, io: &mut Io<'_>) -> Result<u8> {
    let mut code = EXIT_OK;
    let mut done = Vec::new();
    for id in &a.ids {
        match client.cancel_job(id).await {
            Ok(job) => {
                if !is_structured(a.output.format) {
                    writeln!(io.out, "{}", cancel_line(&job))?;
                }
                done.push(job);
            }
            Err(Error::Rpc(s)) => {
                writeln!(io.err, "error: {id}: {}", describe_status(&s))?;
                code = EXIT_ERROR;
            }
            Err(e) => return Err(e),
        }
    }
    if is_structured(a.output.format) {
        let view = JobListView {
            jobs: done.iter().map(JobView::from).collect(),
        };
        print_structured(a.output.format, &view, io)?;
    }
    Ok(code)
}

/// `j-3 cancelled`, `j-3 already succeeded`, `j-3 cancelling (running)`.
pub fn cancel_line(job: &pb::Job) -> String {
    match JobStateView::from_i32(job.state) {
        JobStateView::Cancelled => format!("{} cancelled", job.id),
        s if s.is_terminal() => format!("{} already {s}", job.id),
        s => format!("{} cancelling ({s})", job.id),
    }
}

// ---------------------------------------------------------------- logs

/// `dispatchctl logs`.
pub async fn logs(client: &mut Client, a: &LogsArgs, io: &mut Io<'_>) -> Result<u8> {
    let stream = if a.stderr {
        pb::LogStream::Stderr
    } else {
        pb::LogStream::Stdout
    };
    if a.follow {
        follow_log(client, &a.id, stream, io).await?;
    } else {
        stream_log(client, &a.id, stream, false, io).await?;
    }
    Ok(EXIT_OK)
}

// ---------------------------------------------------------------- watch

/// `dispatchctl watch`. When the stream breaks (a failover, a restart) it
/// finds the leader again, re-watches with the current states and
/// continues, printing only what changed meanwhile ([`WatchDedup`]); it
/// gives up with exit code 2 after [`RESUME_PATIENCE`] without a leader.
pub async fn watch(client: &mut Client, a: &WatchArgs, io: &mut Io<'_>) -> Result<u8> {
    let targeted = !a.ids.is_empty();
    // Fix: `watch ID` waited forever for an unknown id, and for an array's
    // id (its events carry the elements' ids, so the array id was never
    // seen ending). Resolve each id to the jobs to wait for first.
    let mut pending: HashSet<String> = HashSet::new();
    for id in &a.ids {
        pending.extend(jobs_of(client, id).await?);
    }
    let mut dedup = WatchDedup::new(targeted || a.current, now_ms());
    let mut broken = Resume::default();
    loop {
        let req = pb::WatchJobsRequest {
            ids: a.ids.clone(),
            include_current: targeted || a.current || dedup.resumed,
        };
        let cause = match client.jobs.watch_jobs(req).await {
            Ok(resp) => {
                let mut stream = resp.into_inner();
                loop {
                    let ev = match stream.message().await {
                        Ok(Some(ev)) => ev,
                        // Only a dispatcher going away ends a watch.
                        Ok(None) => break "the dispatcher ended the job watch".to_string(),
                        Err(s) if is_disconnect(&s) => break status_cause(&s),
                        Err(s) => return Err(client.error(s)),
                    };
                    broken.healed();
                    if !dedup.admit(&ev) {
                        continue;
                    }
                    match a.format {
                        WatchFormat::Json => {
                            let line = serde_json::to_string(&JobEventView::from(&ev))
                                .map_err(crate::output::OutputError::from)?;
                            writeln!(io.out, "{line}")?;
                        }
                        WatchFormat::Text => writeln!(io.out, "{}", event_line(&ev, now_ms()))?,
                    }
                    io.out.flush()?;
                    if targeted
                        && let Some(job) = &ev.job
                        && JobStateView::from_i32(job.state).is_terminal()
                    {
                        pending.remove(&job.id);
                        if pending.is_empty() {
                            return Ok(EXIT_OK);
                        }
                    }
                }
            }
            Err(s) if is_disconnect(&s) => status_cause(&s),
            Err(s) => return Err(client.error(s)),
        };
        writeln!(
            io.err,
            "dispatchctl: the watch broke ({cause}); looking for the leader"
        )?;
        broken.reconnect(client, cause).await?;
        dedup.resumed = true;
    }
}

/// Which events a resumed `watch` prints. A re-watch starts with every
/// job's current state (`previous_state` UNSPECIFIED); of those it prints
/// only the jobs whose state changed since it last printed them, and jobs
/// it never printed that were submitted after the watch began (or all of
/// them when the watch showed current states from the start). A terminal
/// state already printed for a job is never printed again.
#[derive(Debug)]
pub struct WatchDedup {
    /// The last state printed per job.
    printed: HashMap<String, i32>,
    /// The watch printed every job's current state when it began.
    from_current: bool,
    /// When the watch began (Unix ms, this machine's clock).
    started_ms: i64,
    /// The watch has been re-opened at least once.
    pub resumed: bool,
}

impl WatchDedup {
    /// A watch that began at `started_ms`; `from_current` when it asked
    /// for current states (`--current` or ids).
    pub fn new(from_current: bool, started_ms: i64) -> Self {
        Self {
            printed: HashMap::new(),
            from_current,
            started_ms,
            resumed: false,
        }
    }

    /// Whether to print `ev`; remembers it when so.
    pub fn admit(&mut self, ev: &pb::JobEvent) -> bool {
        let Some(job) = &ev.job else {
            return true;
        };
        let last = self.printed.get(&job.id).copied();
        let terminal = |s: i32| JobStateView::from_i32(s).is_terminal();
        let print = if last.is_some_and(|l| l == job.state && terminal(l)) {
            false
        } else if self.resumed && ev.previous_state == pb::JobState::Unspecified as i32 {
            match last {
                Some(l) => l != job.state,
                None => self.from_current || job.submit_time_ms >= self.started_ms,
            }
        } else {
            true
        };
        if print {
            self.printed.insert(job.id.clone(), job.state);
        }
        print
    }
}

/// The job ids `id` stands for: itself, or for an array's (a gang's) id
/// its elements (members); the dispatcher's NOT_FOUND when it is neither.
async fn jobs_of(client: &mut Client, id: &str) -> Result<Vec<String>> {
    match client.get_job(id).await {
        Ok(job) => Ok(vec![job.id]),
        Err(Error::Rpc(s)) if s.code() == tonic::Code::NotFound => {
            let arrays = pb::ListJobsRequest {
                array_id: id.to_string(),
                ..Default::default()
            };
            let gangs = pb::ListJobsRequest {
                gang_id: id.to_string(),
                ..Default::default()
            };
            for filter in [arrays, gangs] {
                let elements = client.list_all_jobs(&filter, None).await?;
                if !elements.is_empty() {
                    return Ok(elements.into_iter().map(|j| j.id).collect());
                }
            }
            Err(Error::Rpc(s))
        }
        Err(e) => Err(e),
    }
}

/// One `watch` line: `TIME  ID  PREVIOUS -> STATE  NODE  REASON`, with the
/// exit for ended jobs. Current-state events show `-` as the previous
/// state.
pub fn event_line(ev: &pb::JobEvent, now: i64) -> String {
    let time = if ev.time_ms != 0 { ev.time_ms } else { now };
    let prev = JobStateView::from_i32(ev.previous_state);
    let prev = if prev == JobStateView::Unspecified {
        "-".to_string()
    } else {
        prev.to_string()
    };
    let Some(job) = &ev.job else {
        return format!("{}  (event without a job)", utc_time(time));
    };
    let state = JobStateView::from_i32(job.state);
    let mut line = format!(
        "{}  {:<12} {:>9} -> {:<9}  {}",
        utc_time(time),
        job.id,
        prev,
        state,
        or_dash(&job.node)
    );
    if state.is_terminal() && state != JobStateView::Succeeded {
        line.push_str(&format!("  exit={}", exit_text(job)));
    }
    let reason = reason_text(job);
    if !reason.is_empty() {
        line.push_str("  ");
        line.push_str(&reason);
    }
    line
}

// ---------------------------------------------------------------- nodes

/// `dispatchctl nodes`.
pub async fn nodes(client: &mut Client, a: &NodesArgs, io: &mut Io<'_>) -> Result<u8> {
    let nodes = client.list_nodes().await?;
    if is_structured(a.output.format) {
        let view = NodeListView {
            nodes: nodes.iter().map(NodeView::from).collect(),
        };
        print_structured(a.output.format, &view, io)?;
    } else if nodes.is_empty() {
        writeln!(
            io.err,
            "No nodes: no agent has registered with this dispatcher yet."
        )?;
    } else {
        io.out
            .write_all(nodes_table(&nodes, a.output.format == Format::Wide).as_bytes())?;
    }
    Ok(EXIT_OK)
}

/// `nodes`'s table: NAME, STATE, ZONE, RACK, SOCKETS, NUMA, LLC, CORES,
/// T/C, CPUS, GPUS (free/total, `-` without GPUs), GANGS (the gangs
/// with a member on the node, `-` for none), BUSY, the free CPUs
/// per level (CORE, LLC, NUMA, PKG, ANY under a `FREE:` prefix), RUN and
/// WAIT. Load columns are `-` for a node that has not reported load.
pub fn nodes_table(nodes: &[pb::Node], wide: bool) -> String {
    let mut t = Table::new(vec![
        Column::left("NAME").max(32),
        Column::left("STATE"),
        Column::left("ZONE").max(16),
        Column::left("RACK").max(16),
        Column::right("SOCKETS"),
        Column::right("NUMA"),
        Column::right("LLC"),
        Column::right("CORES"),
        Column::right("T/C"),
        Column::right("CPUS"),
        Column::right("GPUS"),
        Column::left("GANGS").max(24),
        Column::right("BUSY"),
        Column::right("FREE:CORE"),
        Column::right("LLC"),
        Column::right("NUMA"),
        Column::right("PKG"),
        Column::right("ANY"),
        Column::right("RUN"),
        Column::right("WAIT"),
    ]);
    t.wide = wide;
    for n in nodes {
        let v = NodeView::from(n);
        let mut row = vec![
            v.name.clone(),
            v.state.to_string(),
            or_dash(&v.zone),
            or_dash(&v.rack),
            v.sockets.to_string(),
            v.numa_nodes.to_string(),
            v.llcs.to_string(),
            v.cores.to_string(),
            v.threads_per_core.to_string(),
            node_cpus(n).to_string(),
            gpus_text(n),
            if n.gangs.is_empty() {
                "-".to_string()
            } else {
                n.gangs.join(",")
            },
        ];
        match &v.load {
            Some(l) => row.extend([
                l.busy_cpus.to_string(),
                l.free.core.to_string(),
                l.free.llc.to_string(),
                l.free.numa.to_string(),
                l.free.package.to_string(),
                l.free.any.to_string(),
                l.running_jobs.to_string(),
                l.waiting_jobs.to_string(),
            ]),
            None => row.extend(std::iter::repeat_n("-".to_string(), 8)),
        }
        t.row(row);
    }
    t.render()
}

/// A node's GPUs as `free/total`, `-` for none.
fn gpus_text(n: &pb::Node) -> String {
    if n.gpus == 0 {
        "-".to_string()
    } else {
        format!("{}/{}", n.gpus_free, n.gpus)
    }
}

/// `dispatchctl node show|drain|cordon|uncordon`.
pub async fn node(client: &mut Client, a: &NodeArgs, io: &mut Io<'_>) -> Result<u8> {
    let (op, name, output) = match &a.action {
        NodeAction::Show { name, output } => (None, name, output),
        NodeAction::Drain { name, output } => (Some(NodeOp::Drain), name, output),
        NodeAction::Cordon { name, output } => (Some(NodeOp::Cordon), name, output),
        NodeAction::Uncordon { name, output } => (Some(NodeOp::Uncordon), name, output),
    };
    let node = match op {
        None => client.get_node(name).await?,
        Some(op) => client.node_op(op, name).await?,
    };
    if is_structured(output.format) {
        print_structured(output.format, &NodeView::from(&node), io)?;
    } else if op.is_none() {
        io.out.write_all(node_detail(&node, now_ms()).as_bytes())?;
    } else {
        writeln!(
            io.out,
            "{} {}",
            node.name,
            NodeStateView::from_i32(node.state)
        )?;
    }
    Ok(EXIT_OK)
}

/// `node show`'s detail view: identity, labels, topology with the CPU
/// groups of each level, and load.
pub fn node_detail(n: &pb::Node, now: i64) -> String {
    let v = NodeView::from(n);
    let labels: HashMap<String, String> = n.labels.clone();
    let mut rows: Vec<(&str, String)> = vec![
        ("Name", v.name.clone()),
        ("State", v.state.to_string()),
        ("Zone", or_dash(&v.zone)),
        ("Rack", or_dash(&v.rack)),
        ("Labels", kv_list(&labels)),
        (
            "Heartbeat",
            v.last_heartbeat_ms
                .map(|t| format!("{} ago", human_duration_ms(now - t)))
                .unwrap_or_else(|| "-".to_string()),
        ),
        (
            "Topology",
            format!(
                "{} sockets, {} NUMA nodes, {} LLCs, {} cores x {} threads, {} CPUs",
                v.sockets, v.numa_nodes, v.llcs, v.cores, v.threads_per_core, v.cpus
            ),
        ),
    ];
    let groups = |g: &[pb::CpuGroup]| {
        g.iter()
            .map(|c| cpu_list(&c.cpus))
            .collect::<Vec<_>>()
            .join("  ")
    };
    if let Some(t) = &n.topology {
        rows.push(("CPUs", cpu_list(&t.cpus)));
        rows.push(("Packages", groups(&t.package)));
        rows.push(("NUMA nodes", groups(&t.numa)));
        rows.push(("LLCs", groups(&t.llc)));
    }
    if n.gpus > 0 {
        rows.push(("GPUs", format!("{} of {} free", n.gpus_free, n.gpus)));
    }
    if !n.gangs.is_empty() {
        rows.push(("Gangs", n.gangs.join(", ")));
    }
    for d in &n.devices {
        let d = DeviceView::from(d);
        let numa = d.numa_node.map_or("-".to_string(), |x| x.to_string());
        let minor = d
            .nvidia_minor
            .map_or(String::new(), |m| format!(" /dev/nvidia{m}"));
        rows.push((
            "Device",
            format!(
                "{} {} {} {} {} numa {numa}{minor}",
                d.kind,
                d.index,
                sanitize(&d.pci_address),
                sanitize(&d.vendor),
                sanitize(&d.model)
            ),
        ));
    }
    match &v.load {
        Some(l) => {
            rows.push(("Busy CPUs", format!("{} of {}", l.busy_cpus, v.cpus)));
            rows.push((
                "Free CPUs",
                format!(
                    "core {}  llc {}  numa {}  package {}  any {}",
                    l.free.core, l.free.llc, l.free.numa, l.free.package, l.free.any
                ),
            ));
            rows.push((
                "Jobs",
                format!("{} running, {} waiting", l.running_jobs, l.waiting_jobs),
            ));
            rows.push((
                "Overloaded",
                if l.overloaded.is_empty() {
                    "-".to_string()
                } else {
                    cpu_list(&l.overloaded)
                },
            ));
            rows.push((
                "Avg idle",
                format!("{:.1}us", l.avg_idle_ns as f64 / 1000.0),
            ));
            if !l.schedstats.is_empty() {
                let s: Vec<String> = l
                    .schedstats
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect();
                rows.push(("Schedstats", s.join(" ")));
            }
        }
        None => rows.push(("Load", "not reported yet".to_string())),
    }
    detail_lines(&rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn job(state: pb::JobState, exit_code: i32, signal: i32, reason: &str) -> pb::Job {
        pb::Job {
            id: "j-1".to_string(),
            state: state as i32,
            exit_code,
            signal,
            reason: reason.to_string(),
            ..Default::default()
        }
    }

    #[test]
    fn wait_exit_codes() {
        use pb::JobState as S;
        assert_eq!(job_exit_code(&job(S::Succeeded, 0, 0, "")), 0);
        assert_eq!(job_exit_code(&job(S::Failed, 1, 0, "")), 1);
        assert_eq!(job_exit_code(&job(S::Failed, 42, 0, "")), 42);
        // Only the low 8 bits of a status exist in a shell; never 0 for a failure.
        assert_eq!(job_exit_code(&job(S::Failed, 256, 0, "")), 1);
        assert_eq!(job_exit_code(&job(S::Failed, 257, 0, "")), 1);
        assert_eq!(job_exit_code(&job(S::Failed, -1, 0, "")), 255);
        // Killed by a signal: 128 + signal, timeouts included.
        assert_eq!(job_exit_code(&job(S::Failed, 0, 9, "timeout")), 137);
        assert_eq!(job_exit_code(&job(S::Failed, 0, 15, "")), 143);
        assert_eq!(job_exit_code(&job(S::Failed, 0, 500, "")), 255);
        assert_eq!(job_exit_code(&job(S::Failed, 0, 0, "timeout")), 124);
        // Could not start: a plain failure.
        assert_eq!(job_exit_code(&job(S::Failed, 0, 0, "exec: not found")), 1);
        assert_eq!(job_exit_code(&job(S::Cancelled, 0, 0, "")), 130);
        assert_eq!(job_exit_code(&job(S::Cancelled, 0, 15, "")), 143);
        assert_eq!(job_exit_code(&job(S::Lost, 0, 0, "node lost")), 3);
        // Not ended (cannot happen after a wait): an error, never success.
        assert_eq!(job_exit_code(&job(S::Running, 0, 0, "")), 1);
        assert_eq!(job_exit_code(&job(S::Unspecified, 0, 0, "")), 1);
    }

    #[test]
    fn array_exit_code_is_the_first_failure() {
        use pb::JobState as S;
        let ok = job(S::Succeeded, 0, 0, "");
        assert_eq!(wait_exit_code(&[]), 0);
        assert_eq!(wait_exit_code(&[ok.clone(), ok.clone()]), 0);
        let jobs = [
            ok.clone(),
            job(S::Failed, 7, 0, ""),
            job(S::Failed, 0, 9, ""),
        ];
        assert_eq!(wait_exit_code(&jobs), 7);
        let summary = outcome_summary(&jobs);
        assert_eq!(
            summary,
            "3 jobs: 1 succeeded, 2 failed; first: j-1 failed: exit 7"
        );
        assert_eq!(
            outcome_summary(&[job(S::Failed, 0, 9, "timeout")]),
            "j-1 failed: killed by signal 9 (timeout)"
        );
    }

    fn submit_args(args: &[&str]) -> SubmitArgs {
        let cli = crate::cli::Cli::try_parse_from(
            ["dispatchctl", "submit"].iter().chain(args.iter()).copied(),
        )
        .expect("parses");
        match cli.command {
            Command::Submit(a) => a,
            other => panic!("not submit: {other:?}"),
        }
    }

    #[test]
    fn spec_from_flags() {
        let a = submit_args(&[
            "--cpus",
            "8",
            "--memory",
            "512M",
            "--align",
            "numa",
            "--policy",
            "pack",
            "-l",
            "zone=z1",
            "-l",
            "zone=z2",
            "-e",
            "A=1",
            "--cwd",
            "/tmp",
            "--latency-nice",
            "-3",
            "--nice",
            "5",
            "--waker",
            "j-7",
            "--group",
            "g",
            "--retries",
            "2",
            "--timeout",
            "5m",
            "--array",
            "4",
            "--",
            "/usr/bin/make",
            "-j8",
        ]);
        let s = job_spec(&a);
        assert_eq!(s.name, "make");
        assert_eq!(s.command, ["/usr/bin/make", "-j8"]);
        assert_eq!(s.cpus, 8);
        assert_eq!(s.memory_bytes, 512 << 20);
        assert_eq!(s.alignment, pb::Alignment::Numa as i32);
        assert_eq!(s.policy, pb::PlacementPolicy::Pack as i32);
        assert_eq!(s.node_selector.get("zone").map(String::as_str), Some("z2"));
        assert_eq!(s.env.get("A").map(String::as_str), Some("1"));
        assert_eq!(s.cwd, "/tmp");
        assert_eq!((s.latency_nice, s.nice), (-3, 5));
        assert_eq!((s.waker.as_str(), s.group.as_str()), ("j-7", "g"));
        assert_eq!((s.retries, s.timeout_ms, s.array_count), (2, 300_000, 4));

        let d = job_spec(&submit_args(&["--name", "x", "--", "true"]));
        assert_eq!(d.name, "x");
        assert_eq!(d.cpus, 1);
        assert_eq!(d.alignment, pb::Alignment::Any as i32);
        assert_eq!(d.policy, pb::PlacementPolicy::Spread as i32);
        assert_eq!((d.memory_bytes, d.timeout_ms, d.array_count), (0, 0, 0));
        assert_eq!((d.nodes, d.within, d.gang_retry), (0, 0, 0));
    }

    /// The gang flags map to the spec's gang fields; the ones that only
    /// make sense with another are refused without it.
    #[test]
    fn gang_flags() {
        let s = job_spec(&submit_args(&[
            "--nodes",
            "4",
            "--within",
            "rack",
            "--preferred",
            "--relax-after",
            "10m",
            "--gang-retry",
            "replace",
            "--",
            "./train",
        ]));
        assert_eq!(s.nodes, 4);
        assert_eq!(s.within, pb::Within::Rack as i32);
        assert!(s.within_preferred);
        assert_eq!(s.relax_after_ms, 600_000);
        assert_eq!(s.gang_retry, pb::GangRetry::ReplaceMember as i32);
        let s = job_spec(&submit_args(&["-N", "2", "--within", "zone", "--", "x"]));
        assert_eq!(
            (s.within, s.within_preferred, s.relax_after_ms),
            (3, false, 0)
        );
        for bad in [
            &["--within", "rack", "--", "x"][..],
            &["--nodes", "2", "--preferred", "--", "x"],
            &[
                "--nodes",
                "2",
                "--within",
                "rack",
                "--relax-after",
                "1m",
                "--",
                "x",
            ],
            &["--gang-retry", "restart", "--", "x"],
            &["--nodes", "2", "--array", "3", "--", "x"],
            &["--nodes", "0", "--", "x"],
        ] {
            let mut argv = vec!["dispatchctl", "submit"];
            argv.extend_from_slice(bad);
            assert!(crate::cli::Cli::try_parse_from(argv).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn ls_filter() {
        let cli = crate::cli::Cli::try_parse_from([
            "dispatchctl",
            "ls",
            "-s",
            "failed,running",
            "-s",
            "failed",
            "--node",
            "n1",
            "--group",
            "g",
            "--array",
            "j-5",
        ])
        .expect("parses");
        let Command::Ls(a) = cli.command else {
            panic!("not ls")
        };
        let r = list_request(&a);
        assert_eq!(
            r.states,
            [pb::JobState::Running as i32, pb::JobState::Failed as i32]
        );
        assert_eq!(
            (r.node.as_str(), r.group.as_str(), r.array_id.as_str()),
            ("n1", "g", "j-5")
        );
    }

    #[test]
    fn cancel_and_watch_lines() {
        use pb::JobState as S;
        assert_eq!(cancel_line(&job(S::Cancelled, 0, 15, "")), "j-1 cancelled");
        assert_eq!(
            cancel_line(&job(S::Succeeded, 0, 0, "")),
            "j-1 already succeeded"
        );
        assert_eq!(
            cancel_line(&job(S::Running, 0, 0, "")),
            "j-1 cancelling (running)"
        );

        let mut j = job(S::Failed, 2, 0, "exit status 2");
        j.node = "node-2".to_string();
        let ev = pb::JobEvent {
            job: Some(j),
            previous_state: S::Running as i32,
            time_ms: 1_767_225_600_000,
        };
        assert_eq!(
            event_line(&ev, 0),
            "2026-01-01 00:00:00Z  j-1            running -> failed     node-2  exit=2  exit status 2"
        );
        let cur = pb::JobEvent {
            job: Some(job(S::Pending, 0, 0, "")),
            previous_state: 0,
            time_ms: 0,
        };
        assert_eq!(
            event_line(&cur, 1_767_225_600_000),
            "2026-01-01 00:00:00Z  j-1                  - -> pending    -"
        );
    }

    fn event(
        id: &str,
        state: pb::JobState,
        previous: pb::JobState,
        submitted: i64,
    ) -> pb::JobEvent {
        pb::JobEvent {
            job: Some(pb::Job {
                id: id.to_string(),
                state: state as i32,
                submit_time_ms: submitted,
                ..Default::default()
            }),
            previous_state: previous as i32,
            time_ms: 0,
        }
    }

    #[test]
    fn a_resumed_watch_prints_changes_once() {
        use pb::JobState as S;
        let cur = S::Unspecified;
        // A watch of new events only, begun at t=1000.
        let mut d = WatchDedup::new(false, 1000);
        assert!(d.admit(&event("j-1", S::Running, S::Assigned, 500)));
        assert!(d.admit(&event("j-2", S::Running, S::Assigned, 600)));
        assert!(d.admit(&event("j-3", S::Succeeded, S::Running, 700)));
        // The stream broke; the re-watch starts with current states.
        d.resumed = true;
        // j-1 still running: already printed.
        assert!(!d.admit(&event("j-1", S::Running, cur, 500)));
        // j-2 ended during the gap: printed once.
        assert!(d.admit(&event("j-2", S::Succeeded, cur, 600)));
        // j-3's end was printed before the break: never again.
        assert!(!d.admit(&event("j-3", S::Succeeded, cur, 700)));
        // Untouched since before the watch began: not news.
        assert!(!d.admit(&event("j-0", S::Pending, cur, 10)));
        // Submitted during the gap: news.
        assert!(d.admit(&event("j-4", S::Pending, cur, 1500)));
        // A live end event repeating a printed end (a second break, or a
        // new leader reporting it again) is dropped too.
        assert!(!d.admit(&event("j-2", S::Succeeded, S::Running, 600)));
        assert!(d.admit(&event("j-4", S::Running, S::Pending, 1500)));

        // A watch that showed current states from the start prints a job
        // it never saw whenever it shows up.
        let mut d = WatchDedup::new(true, 1000);
        d.resumed = true;
        assert!(d.admit(&event("j-9", S::Running, cur, 10)));
        assert!(!d.admit(&event("j-9", S::Running, cur, 10)));
    }

    #[tokio::test]
    async fn no_leader_within_the_patience_exits_2() {
        // Nothing listens on port 1: every attempt is refused at once,
        // until the (here short) patience runs out.
        let channel = tonic::transport::Endpoint::from_static("http://127.0.0.1:1").connect_lazy();
        let mut client = Client::from_channel(
            "http://127.0.0.1:1",
            channel,
            proto::client_security::Bearer::default(),
        );
        let mut resume = Resume {
            since: None,
            patience: Duration::from_millis(500),
        };
        let err = resume
            .reconnect(&mut client, "the job watch broke".to_string())
            .await
            .unwrap_err();
        assert_eq!(err.exit_code(), crate::EXIT_UNREACHABLE);
        let text = err.to_string();
        assert!(
            text.contains("http://127.0.0.1:1")
                && text.contains("the job watch broke; no leader answered within 500ms"),
            "{text}"
        );
    }
}
