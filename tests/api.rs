//! The public API end to end, against real `dispatcher` (and `agent`)
//! processes: refusals of bad input that name the field and create
//! nothing, unknown ids, health checking and server reflection, WatchJobs,
//! every `dispatchctl` command, the one-command `dispatcher --dev`, and job
//! arrays with their cancel.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use e2e::{
    Agent, Dispatcher, all_jobs, dispatchctl, dispatchctl_timeout, eventually, is_terminal,
    wait_nodes,
};
use proto::v1::job_service_client::JobServiceClient;
use proto::v1::{
    CancelJobRequest, GetJobRequest, GetNodeRequest, Job, JobEvent, JobSpec, JobState,
    ListJobsRequest, NodeActionRequest, StreamLogsRequest, SubmitJobRequest, SubmitJobsRequest,
    WatchJobsRequest,
};
use tonic::transport::Channel;
use tonic::{Code, Status, Streaming};

/// How long anything may take before a test gives up (generous: the suite
/// runs on 2 busy cores).
const T: Duration = Duration::from_secs(60);

fn ok_spec() -> JobSpec {
    JobSpec {
        command: vec!["true".into()],
        ..Default::default()
    }
}

/// SubmitJob with `spec`: the jobs it created.
async fn submit(c: &mut JobServiceClient<Channel>, spec: JobSpec) -> Result<Vec<Job>> {
    Ok(c.submit_job(SubmitJobRequest { spec: Some(spec) })
        .await?
        .into_inner()
        .jobs)
}

fn sh(script: &str) -> JobSpec {
    JobSpec {
        command: vec!["sh".into(), "-c".into(), script.into()],
        ..Default::default()
    }
}

/// Run `dispatchctl` off the async workers, failing if it does not exit
/// within [`T`].
async fn ctl(url: &str, args: &[&str]) -> Result<(i32, String, String)> {
    let url = url.to_string();
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        dispatchctl_timeout(&url, &a, T)
    })
    .await?
}

async fn get(c: &mut JobServiceClient<Channel>, id: &str) -> Result<Job> {
    Ok(c.get_job(GetJobRequest { id: id.into() })
        .await?
        .into_inner())
}

/// Wait until job `id` satisfies `pred`; returns it.
async fn wait_job(
    c: &JobServiceClient<Channel>,
    id: &str,
    what: &str,
    pred: impl Fn(&Job) -> bool,
) -> Result<Job> {
    let pred = &pred;
    eventually(T, &format!("{id} {what}"), || {
        let mut c = c.clone();
        async move {
            let j = get(&mut c, id).await.ok()?;
            pred(&j).then_some(j)
        }
    })
    .await
}

fn state(j: &Job) -> JobState {
    JobState::try_from(j.state).unwrap_or(JobState::Unspecified)
}

/// The status must be `code` with a message starting with `prefix`.
fn expect_status<T: std::fmt::Debug>(
    r: Result<T, Status>,
    code: Code,
    prefix: &str,
    what: &str,
) -> Status {
    match r {
        Ok(v) => panic!("{what}: expected {code:?} \"{prefix}...\", got success {v:?}"),
        Err(s) => {
            assert_eq!(s.code(), code, "{what}: {s:?}");
            assert!(
                s.message().starts_with(prefix),
                "{what}: message {:?} should start with {prefix:?}",
                s.message()
            );
            s
        }
    }
}

// ------------------------------------------------------------------
// 1. Bad input for every JobSpec field

/// One bad value per rule of every validated field, with the field path
/// the refusal must start with.
fn bad_specs() -> Vec<(&'static str, JobSpec)> {
    let m = |f: &dyn Fn(&mut JobSpec)| {
        let mut s = ok_spec();
        f(&mut s);
        s
    };
    vec![
        ("spec.cpus", m(&|s| s.cpus = 4097)),
        ("spec.cpus", m(&|s| s.cpus = u32::MAX)),
        ("spec.command", m(&|s| s.command.clear())),
        ("spec.command", m(&|s| s.command = vec!["x".into(); 4097])),
        (
            "spec.command[0]",
            m(&|s| s.command = vec!["x".repeat(2 << 20)]),
        ),
        (
            "spec.command[0]",
            m(&|s| s.command = vec![String::new(), "arg".into()]),
        ),
        (
            "spec.command[2]",
            m(&|s| s.command = vec!["echo".into(), "a".into(), "b\0c".into()]),
        ),
        (
            "spec.env",
            m(&|s| {
                s.env.insert(String::new(), "v".into());
            }),
        ),
        (
            "spec.env[\"A=B\"]",
            m(&|s| {
                s.env.insert("A=B".into(), "v".into());
            }),
        ),
        (
            "spec.env[\"K\"]",
            m(&|s| {
                s.env.insert("K".into(), "a\0b".into());
            }),
        ),
        ("spec.cwd", m(&|s| s.cwd = "relative/dir".into())),
        ("spec.cwd", m(&|s| s.cwd = "/tmp/a\0b".into())),
        ("spec.alignment", m(&|s| s.alignment = 99)),
        ("spec.alignment", m(&|s| s.alignment = -1)),
        ("spec.policy", m(&|s| s.policy = 7)),
        (
            "spec.node_selector",
            m(&|s| {
                s.node_selector.insert(String::new(), "x".into());
            }),
        ),
        ("spec.latency_nice", m(&|s| s.latency_nice = -21)),
        ("spec.latency_nice", m(&|s| s.latency_nice = 20)),
        ("spec.latency_nice", m(&|s| s.latency_nice = 99)),
        ("spec.nice", m(&|s| s.nice = -21)),
        ("spec.nice", m(&|s| s.nice = 20)),
        ("spec.waker", m(&|s| s.waker = "j-424242".into())),
        ("spec.waker", m(&|s| s.waker = "not-a-job".into())),
        ("spec.retries", m(&|s| s.retries = 101)),
        ("spec.array_count", m(&|s| s.array_count = 100_001)),
        ("spec.timeout_ms", m(&|s| s.timeout_ms = u64::MAX)),
        ("spec.name", m(&|s| s.name = "n".repeat(257))),
        ("spec.group", m(&|s| s.group = "g".repeat(257))),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_spec_fields_are_refused_by_name_and_create_nothing() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let d = Dispatcher::start(dir.path(), &[])?;
    let mut c = d.jobs().await?;
    // One accepted job, so "nothing new" is measured against a non-empty
    // store.
    let first = submit(&mut c, ok_spec()).await?;
    assert_eq!(first.len(), 1);
    let before: Vec<String> = all_jobs(&mut c).await?.into_iter().map(|j| j.id).collect();
    assert_eq!(before, [first[0].id.clone()]);
    let unchanged = |c: JobServiceClient<Channel>, what: String| {
        let before = before.clone();
        async move {
            let mut c = c;
            let now: Vec<String> = all_jobs(&mut c).await?.into_iter().map(|j| j.id).collect();
            assert_eq!(now, before, "{what}: a refused submission created jobs");
            anyhow::Ok(())
        }
    };

    for (field, spec) in bad_specs() {
        let what = format!("SubmitJob with a bad {field}");
        let r = c
            .submit_job(SubmitJobRequest {
                spec: Some(spec.clone()),
            })
            .await;
        expect_status(r, Code::InvalidArgument, &format!("{field}: "), &what);
        unchanged(c.clone(), what).await?;

        // In a batch, the bad spec among good ones is named by its index,
        // and none of the good ones is created.
        let batched = field.replacen("spec", "specs[1]", 1);
        let what = format!("SubmitJobs with a bad {batched}");
        let r = c
            .submit_jobs(SubmitJobsRequest {
                specs: vec![ok_spec(), spec, sh("echo good")],
            })
            .await;
        expect_status(r, Code::InvalidArgument, &format!("{batched}: "), &what);
        unchanged(c.clone(), what).await?;
    }

    // A bad spec first or last in a batch is named too.
    let mut bad = ok_spec();
    bad.cpus = 5000;
    let r = c
        .submit_jobs(SubmitJobsRequest {
            specs: vec![bad.clone(), ok_spec()],
        })
        .await;
    expect_status(r, Code::InvalidArgument, "specs[0].cpus: ", "first of two");
    let mut specs = vec![ok_spec(); 4];
    specs.push(bad);
    let r = c.submit_jobs(SubmitJobsRequest { specs }).await;
    expect_status(r, Code::InvalidArgument, "specs[4].cpus: ", "last of five");
    unchanged(c.clone(), "bad spec first/last".into()).await?;

    // A missing spec, an empty batch, a batch too long, and arrays whose
    // total is too large although each is valid.
    let r = c.submit_job(SubmitJobRequest { spec: None }).await;
    expect_status(r, Code::InvalidArgument, "spec: ", "missing spec");
    let r = c.submit_jobs(SubmitJobsRequest { specs: vec![] }).await;
    expect_status(r, Code::InvalidArgument, "specs: ", "empty batch");
    let r = c
        .submit_jobs(SubmitJobsRequest {
            specs: vec![ok_spec(); 10_001],
        })
        .await;
    expect_status(r, Code::InvalidArgument, "specs: ", "10001 specs");
    let mut big = ok_spec();
    big.array_count = 60_000;
    let r = c
        .submit_jobs(SubmitJobsRequest {
            specs: vec![big.clone(), big],
        })
        .await;
    expect_status(r, Code::InvalidArgument, "specs: ", "120000 array elements");
    unchanged(c.clone(), "batch-level refusals".into()).await?;

    // No id was used up by the refusals either: the next job gets the id
    // right after the first one.
    let next = submit(&mut c, ok_spec()).await?;
    assert_eq!(next.len(), 1);
    assert_eq!(next[0].id, "j-2", "a refused submission used up a job id");

    // The limits are inclusive: values at the edge of each range are
    // accepted (validation is not stricter than documented), and a known
    // waker is fine.
    let mut edge = ok_spec();
    edge.cpus = 4096;
    edge.latency_nice = -20;
    edge.nice = 19;
    edge.retries = 100;
    edge.name = "n".repeat(256);
    edge.group = "g".repeat(256);
    edge.cwd = "/tmp".into();
    edge.alignment = proto::v1::Alignment::Package as i32;
    edge.policy = proto::v1::PlacementPolicy::Pack as i32;
    edge.timeout_ms = 3_600_000;
    edge.waker = first[0].id.clone();
    edge.env.insert("K".into(), "v=with=equals".into());
    edge.node_selector.insert("rack".into(), String::new());
    let mut other = edge.clone();
    other.latency_nice = 19;
    other.nice = -20;
    let ok = c
        .submit_jobs(SubmitJobsRequest {
            specs: vec![edge, other],
        })
        .await?
        .into_inner()
        .jobs;
    assert_eq!(ok.len(), 2);
    assert_eq!(all_jobs(&mut c).await?.len(), 4);
    Ok(())
}

// ------------------------------------------------------------------
// 2. Unknown ids and bad requests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_ids_are_not_found_and_bad_requests_invalid() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let d = Dispatcher::start(dir.path(), &[])?;
    let mut c = d.jobs().await?;
    let mut n = d.nodes().await?;

    for id in ["j-424242", "j-424242.7", "no-such-job", ""] {
        let named = |s: Status, what: &str| {
            assert!(
                s.message().contains(&format!("{id:?}"))
                    || (!id.is_empty() && s.message().contains(id)),
                "{what} {id:?}: the message should name the id: {s:?}"
            );
        };
        let r = c.get_job(GetJobRequest { id: id.into() }).await;
        named(expect_status(r, Code::NotFound, "id: ", "GetJob"), "GetJob");
        let r = c.cancel_job(CancelJobRequest { id: id.into() }).await;
        named(
            expect_status(r, Code::NotFound, "id: ", "CancelJob"),
            "CancelJob",
        );
        let r = c
            .stream_logs(StreamLogsRequest {
                id: id.into(),
                ..Default::default()
            })
            .await
            .map(|_| ());
        named(
            expect_status(r, Code::NotFound, "id: ", "StreamLogs"),
            "StreamLogs",
        );
    }

    for name in ["ghost-node", "n1"] {
        let named = |s: Status| {
            assert!(s.message().contains(name), "should name {name}: {s:?}");
        };
        named(expect_status(
            n.get_node(GetNodeRequest { name: name.into() }).await,
            Code::NotFound,
            "name: ",
            "GetNode",
        ));
        let req = || NodeActionRequest { name: name.into() };
        named(expect_status(
            n.drain_node(req()).await,
            Code::NotFound,
            "name: ",
            "DrainNode",
        ));
        named(expect_status(
            n.cordon_node(req()).await,
            Code::NotFound,
            "name: ",
            "CordonNode",
        ));
        named(expect_status(
            n.uncordon_node(req()).await,
            Code::NotFound,
            "name: ",
            "UncordonNode",
        ));
    }

    // With no agent, jobs stay PENDING: their logs do not exist yet.
    let jobs = c
        .submit_jobs(SubmitJobsRequest {
            specs: vec![ok_spec(); 5],
        })
        .await?
        .into_inner()
        .jobs;
    assert!(
        jobs.iter().all(|j| state(j) == JobState::Pending),
        "{jobs:?}"
    );
    for follow in [false, true] {
        let r = c
            .stream_logs(StreamLogsRequest {
                id: jobs[0].id.clone(),
                follow,
                ..Default::default()
            })
            .await
            .map(|_| ());
        let s = expect_status(r, Code::FailedPrecondition, "id: ", "StreamLogs of PENDING");
        assert!(s.message().contains(&jobs[0].id), "{s:?}");
    }

    // Pagination: bad tokens and sizes are refused; good pages chain.
    for token in ["garbage", "j-", "j-x.1", "12"] {
        let r = c
            .list_jobs(ListJobsRequest {
                page_token: token.into(),
                ..Default::default()
            })
            .await;
        expect_status(r, Code::InvalidArgument, "page_token: ", token);
    }
    for size in [10_001, u32::MAX] {
        let r = c
            .list_jobs(ListJobsRequest {
                page_size: size,
                ..Default::default()
            })
            .await;
        expect_status(r, Code::InvalidArgument, "page_size: ", "page_size");
    }
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let page = c
            .list_jobs(ListJobsRequest {
                page_size: 2,
                page_token: token.clone(),
                ..Default::default()
            })
            .await?
            .into_inner();
        assert!(page.jobs.len() <= 2);
        seen.extend(page.jobs.into_iter().map(|j| j.id));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    let newest_first: Vec<String> = jobs.iter().rev().map(|j| j.id.clone()).collect();
    assert_eq!(seen, newest_first);
    let big = c
        .list_jobs(ListJobsRequest {
            page_size: 10_000,
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(big.jobs.len(), 5);
    assert!(big.next_page_token.is_empty());
    Ok(())
}

// ------------------------------------------------------------------
// 3. Health checking and server reflection

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_reflection_v1_and_v1alpha() -> Result<()> {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;

    let dir = tempfile::tempdir()?;
    let d = Dispatcher::start(dir.path(), &[])?;
    let ch = Channel::from_shared(d.url.clone())?.connect().await?;

    let mut health = HealthClient::new(ch.clone());
    for service in [
        "",
        "dispatch.v1.JobService",
        "dispatch.v1.NodeService",
        "dispatch.v1.AgentService",
    ] {
        let r = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .with_context(|| format!("health of {service:?}"))?
            .into_inner();
        assert_eq!(r.status, ServingStatus::Serving as i32, "{service:?}");
    }
    let r = health
        .check(HealthCheckRequest {
            service: "no.such.Service".into(),
        })
        .await;
    assert_eq!(r.map(|_| ()).unwrap_err().code(), Code::NotFound);
    // Watch answers with the current status first.
    let mut w = health
        .watch(HealthCheckRequest {
            service: "dispatch.v1.JobService".into(),
        })
        .await?
        .into_inner();
    let first = tokio::time::timeout(T, w.message()).await??;
    assert_eq!(first.map(|r| r.status), Some(ServingStatus::Serving as i32));

    // The same questions through both reflection protocols.
    macro_rules! reflect {
        ($pb:path) => {{
            use $pb as r;
            use r::server_reflection_client::ServerReflectionClient;
            use r::server_reflection_request::MessageRequest as Req;
            use r::server_reflection_response::MessageResponse as Resp;
            let mut client = ServerReflectionClient::new(ch.clone());
            let requests = vec![
                Req::ListServices(String::new()),
                Req::FileContainingSymbol("dispatch.v1.JobService".into()),
                Req::FileContainingSymbol("dispatch.v1.NodeService".into()),
                Req::FileContainingSymbol("dispatch.v1.JobSpec".into()),
                Req::FileByFilename("dispatch/v1/common.proto".into()),
                // What `grpcurl ... grpc.health.v1.Health/Check` asks first.
                Req::FileContainingSymbol("grpc.health.v1.Health".into()),
            ];
            let n = requests.len();
            let stream = tokio_stream::iter(requests.into_iter().map(|m| {
                r::ServerReflectionRequest {
                    host: String::new(),
                    message_request: Some(m),
                }
            }));
            let mut responses = client.server_reflection_info(stream).await?.into_inner();
            let mut out: Vec<Resp> = Vec::new();
            while out.len() < n {
                match tokio::time::timeout(T, responses.message()).await?? {
                    Some(m) => out.push(m.message_response.context("empty response")?),
                    None => break,
                }
            }
            assert_eq!(out.len(), n, "one answer per request");
            let services: BTreeSet<String> = match &out[0] {
                Resp::ListServicesResponse(l) => l.service.iter().map(|s| s.name.clone()).collect(),
                other => bail!("ListServices answered {other:?}"),
            };
            let files = |i: usize| -> Result<Vec<prost_types::FileDescriptorProto>> {
                match &out[i] {
                    Resp::FileDescriptorResponse(f) => f
                        .file_descriptor_proto
                        .iter()
                        .map(|b| {
                            <prost_types::FileDescriptorProto as prost::Message>::decode(&b[..])
                                .map_err(anyhow::Error::from)
                        })
                        .collect(),
                    other => bail!("request {i} answered {other:?}"),
                }
            };
            // An unknown symbol is NOT_FOUND: in the stream as an error
            // response, or (tonic's way) as the stream's status.
            let unknown = tokio_stream::iter([r::ServerReflectionRequest {
                host: String::new(),
                message_request: Some(Req::FileContainingSymbol(
                    "dispatch.v1.NoSuchThing".into(),
                )),
            }]);
            let not_found = match client.server_reflection_info(unknown).await {
                Err(s) => s.code() == Code::NotFound,
                Ok(resp) => match tokio::time::timeout(T, resp.into_inner().message()).await? {
                    Ok(Some(m)) => matches!(
                        m.message_response,
                        Some(Resp::ErrorResponse(e)) if e.error_code == Code::NotFound as i32
                    ),
                    Err(s) => s.code() == Code::NotFound,
                    Ok(None) => false,
                },
            };
            (
                services,
                files(1)?,
                files(2)?,
                files(3)?,
                files(4)?,
                files(5)?,
                not_found,
            )
        }};
    }

    for (version, (services, job_svc, node_svc, job_spec, common, health, unknown_is_error)) in [
        ("v1", reflect!(tonic_reflection::pb::v1)),
        ("v1alpha", reflect!(tonic_reflection::pb::v1alpha)),
    ] {
        for s in [
            "dispatch.v1.JobService",
            "dispatch.v1.NodeService",
            "dispatch.v1.AgentService",
            "grpc.health.v1.Health",
        ] {
            assert!(services.contains(s), "{version}: {s} not in {services:?}");
        }
        // The health service is described too, with its methods.
        let health_svc = health
            .iter()
            .flat_map(|f| f.service.iter().map(move |s| (f.package(), s)))
            .find(|(pkg, s)| *pkg == "grpc.health.v1" && s.name() == "Health")
            .with_context(|| format!("{version}: no descriptor of grpc.health.v1.Health"))?
            .1;
        let health_methods: BTreeSet<&str> = health_svc.method.iter().map(|m| m.name()).collect();
        assert!(
            health_methods.contains("Check") && health_methods.contains("Watch"),
            "{version}: {health_methods:?}"
        );
        // The file defining JobService, with every method, and what it
        // imports, so a client can build requests without the .proto.
        let jobs_file = job_svc
            .iter()
            .find(|f| f.service.iter().any(|s| s.name() == "JobService"))
            .with_context(|| format!("{version}: no file with JobService"))?;
        assert_eq!(jobs_file.name(), "dispatch/v1/jobs.proto", "{version}");
        assert_eq!(jobs_file.package(), "dispatch.v1", "{version}");
        let svc = jobs_file
            .service
            .iter()
            .find(|s| s.name() == "JobService")
            .context("JobService")?;
        let methods: BTreeSet<&str> = svc.method.iter().map(|m| m.name()).collect();
        for m in [
            "SubmitJob",
            "SubmitJobs",
            "GetJob",
            "ListJobs",
            "CancelJob",
            "WatchJobs",
            "StreamLogs",
        ] {
            assert!(methods.contains(m), "{version}: JobService lacks {m}");
        }
        let watch = svc
            .method
            .iter()
            .find(|m| m.name() == "WatchJobs")
            .context("WatchJobs")?;
        assert!(watch.server_streaming(), "{version}: WatchJobs streams");
        assert_eq!(watch.input_type(), ".dispatch.v1.WatchJobsRequest");
        let job_spec_msg = jobs_file
            .message_type
            .iter()
            .find(|m| m.name() == "JobSpec")
            .context("JobSpec")?;
        assert!(
            job_spec_msg
                .field
                .iter()
                .any(|f| f.name() == "latency_nice"),
            "{version}"
        );
        assert_eq!(
            jobs_file.dependency,
            ["dispatch/v1/common.proto"],
            "{version}"
        );
        // tonic answers with the one file; a client fetches the imports by
        // name (below, common.proto), which is all reflection clients need.
        assert!(
            node_svc
                .iter()
                .any(|f| f.name() == "dispatch/v1/nodes.proto"
                    && f.service.iter().any(|s| s.name() == "NodeService")),
            "{version}"
        );
        assert!(
            job_spec
                .iter()
                .any(|f| f.name() == "dispatch/v1/jobs.proto"),
            "{version}"
        );
        assert!(
            common.iter().any(|f| f.name() == "dispatch/v1/common.proto"
                && f.enum_type.iter().any(|e| e.name() == "Alignment")),
            "{version}"
        );
        assert!(unknown_is_error, "{version}: unknown symbol -> NOT_FOUND");
    }
    Ok(())
}

// ------------------------------------------------------------------
// 4. WatchJobs

async fn next_event(s: &mut Streaming<JobEvent>) -> Result<JobEvent> {
    match tokio::time::timeout(T, s.message()).await {
        Ok(Ok(Some(ev))) => Ok(ev),
        Ok(Ok(None)) => bail!("the watch ended"),
        Ok(Err(st)) => bail!("the watch failed: {st:?}"),
        Err(_) => bail!("no event within {T:?}"),
    }
}

fn ev_state(ev: &JobEvent) -> (String, JobState, JobState) {
    let j = ev.job.clone().unwrap_or_default();
    (
        j.id.clone(),
        JobState::try_from(ev.previous_state).unwrap_or(JobState::Unspecified),
        state(&j),
    )
}

/// Read events until every id of `ids` reached a terminal state; returns
/// them in order.
async fn until_terminal(s: &mut Streaming<JobEvent>, ids: &[String]) -> Result<Vec<JobEvent>> {
    let mut left: BTreeSet<&str> = ids.iter().map(String::as_str).collect();
    let mut out = Vec::new();
    while !left.is_empty() {
        let ev = next_event(s).await?;
        if let Some(j) = &ev.job
            && is_terminal(j.state)
        {
            left.remove(j.id.as_str());
        }
        out.push(ev);
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_jobs_sends_current_states_then_changes_in_order() -> Result<()> {
    use JobState::*;
    let dir = tempfile::tempdir()?;
    let d = Dispatcher::start(dir.path(), &[])?;
    let _a = Agent::start(dir.path(), &d.url, "w1", "1s:2c:2t", &[], &[])?;
    wait_nodes(&d, 1, T).await?;
    let mut c = d.jobs().await?;
    let mut n = d.nodes().await?;

    let a = submit(&mut c, ok_spec()).await?.remove(0);
    wait_job(&c, &a.id, "succeeded", |j| state(j) == Succeeded).await?;

    // With the node cordoned, new jobs wait in PENDING until we let them go.
    n.cordon_node(NodeActionRequest { name: "w1".into() })
        .await?;
    let mut all = c
        .watch_jobs(WatchJobsRequest {
            ids: vec![],
            include_current: true,
        })
        .await?
        .into_inner();
    let current = next_event(&mut all).await?;
    assert_eq!(
        ev_state(&current),
        (a.id.clone(), Unspecified, Succeeded),
        "current state first, with no previous state"
    );

    let b = submit(&mut c, sh("sleep 0.3; echo b")).await?.remove(0);
    let other = submit(&mut c, ok_spec()).await?.remove(0);
    let mut arr_spec = ok_spec();
    arr_spec.array_count = 3;
    let arr = submit(&mut c, arr_spec).await?;
    assert_eq!(arr.len(), 3);
    let array_id = arr[0].array_id.clone();
    let arr_ids: Vec<String> = arr.iter().map(|j| j.id.clone()).collect();
    for j in std::iter::once(&b)
        .chain(std::iter::once(&other))
        .chain(&arr)
    {
        assert_eq!(state(j), Pending, "{j:?}");
    }

    // Filtered watches, by a job id and by an array id: the current state
    // of exactly the matching jobs first.
    let mut only_b = c
        .watch_jobs(WatchJobsRequest {
            ids: vec![b.id.clone()],
            include_current: true,
        })
        .await?
        .into_inner();
    assert_eq!(
        ev_state(&next_event(&mut only_b).await?),
        (b.id.clone(), Unspecified, Pending)
    );
    let mut only_arr = c
        .watch_jobs(WatchJobsRequest {
            ids: vec![array_id.clone()],
            include_current: true,
        })
        .await?
        .into_inner();
    let mut cur = Vec::new();
    for _ in 0..3 {
        cur.push(ev_state(&next_event(&mut only_arr).await?));
    }
    cur.sort();
    let want: Vec<_> = arr_ids
        .iter()
        .map(|id| (id.clone(), Unspecified, Pending))
        .collect();
    assert_eq!(cur, want, "the array's elements' current states");

    n.uncordon_node(NodeActionRequest { name: "w1".into() })
        .await?;

    // B's own stream: its changes in lifecycle order, nothing else.
    let evs = until_terminal(&mut only_b, std::slice::from_ref(&b.id)).await?;
    let seq: Vec<_> = evs.iter().map(ev_state).collect();
    assert_eq!(
        seq,
        [
            (b.id.clone(), Pending, Assigned),
            (b.id.clone(), Assigned, Running),
            (b.id.clone(), Running, Succeeded),
        ]
    );
    let last = evs.last().and_then(|e| e.job.clone()).unwrap_or_default();
    assert_eq!(last.node, "w1");
    assert!(!last.cpus.is_empty());
    assert!(evs.iter().all(|e| e.time_ms > 0));

    // The array's stream: only its elements, each in order, to the end.
    let evs = until_terminal(&mut only_arr, &arr_ids).await?;
    for e in &evs {
        let j = e.job.clone().unwrap_or_default();
        assert_eq!(j.array_id, array_id, "{e:?}");
    }
    for id in &arr_ids {
        let seq: Vec<(JobState, JobState)> = evs
            .iter()
            .map(ev_state)
            .filter(|(i, _, _)| i == id)
            .map(|(_, p, s)| (p, s))
            .collect();
        assert_eq!(
            seq,
            [
                (Pending, Assigned),
                (Assigned, Running),
                (Running, Succeeded)
            ],
            "{id}"
        );
    }

    // The unfiltered stream saw every job created, then each one's changes
    // in order, chained by previous_state.
    let mut wanted = vec![b.id.clone(), other.id.clone()];
    wanted.extend(arr_ids.iter().cloned());
    let evs = until_terminal(&mut all, &wanted).await?;
    let mut per_job: BTreeMap<String, Vec<(JobState, JobState)>> = BTreeMap::new();
    for e in &evs {
        let (id, p, s) = ev_state(e);
        per_job.entry(id).or_default().push((p, s));
    }
    assert_eq!(
        per_job.get(&b.id).map(Vec::as_slice),
        Some(
            &[
                (Unspecified, Pending),
                (Pending, Assigned),
                (Assigned, Running),
                (Running, Succeeded)
            ][..]
        )
    );
    for id in &wanted {
        let seq = per_job
            .get(id)
            .with_context(|| format!("no events for {id}"))?;
        assert_eq!(seq[0], (Unspecified, Pending), "{id} created");
        for w in seq.windows(2) {
            assert_eq!(w[0].1, w[1].0, "{id}: events out of order: {seq:?}");
        }
        assert_eq!(seq.last().map(|x| x.1), Some(Succeeded), "{id}");
    }

    // Once everything ended, the filtered streams have nothing more.
    for s in [&mut only_b, &mut only_arr] {
        let extra = tokio::time::timeout(Duration::from_millis(300), s.message()).await;
        assert!(extra.is_err(), "unexpected event: {extra:?}");
    }
    Ok(())
}

// ------------------------------------------------------------------
// 5. dispatchctl against the real dispatcher

/// A job's view from `dispatchctl get ID -o json`.
async fn ctl_job(url: &str, id: &str) -> Result<serde_json::Value> {
    let (code, out, err) = ctl(url, &["get", id, "-o", "json"]).await?;
    assert_eq!(code, 0, "get {id}: {err}");
    Ok(serde_json::from_str(&out)?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatchctl_submit_wait_follow_ls_get_logs_watch() -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir()?;
    let d = Dispatcher::start(dir.path(), &[])?;
    let _a = Agent::start(dir.path(), &d.url, "c1", "1s:2c:2t", &[], &[])?;
    wait_nodes(&d, 1, T).await?;
    let url = d.url.as_str();

    // --wait: the job's exit code; the id on stdout.
    let (code, out, err) = ctl(url, &["submit", "--wait", "--", "true"]).await?;
    assert_eq!(code, 0, "{out} {err}");
    let ok_id = out.trim().to_string();
    assert!(ok_id.starts_with("j-"), "{out}");
    let (code, _, err) = ctl(url, &["submit", "--wait", "--", "sh", "-c", "exit 3"]).await?;
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("exit 3"), "{err}");
    let (code, out, err) = ctl(
        url,
        &[
            "submit",
            "--name",
            "suicide",
            "--wait",
            "--",
            "sh",
            "-c",
            "kill -9 $$",
        ],
    )
    .await?;
    assert_eq!(code, 128 + 9, "{out} {err}");
    let killed_id = out.trim().to_string();
    assert!(err.contains("signal 9"), "{err}");

    // --follow: the job's stdout streams to stdout while it runs (the
    // first line arrives while the job still waits on its gate), the id
    // goes to stderr.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
    let gate = dir.path().join("gate-follow");
    let script = format!(
        "echo hello; while [ ! -e {} ]; do sleep 0.05; done; echo world; echo oops >&2",
        gate.display()
    );
    let mut follow = Live::spawn(url, &["submit", "--follow", "--", "sh", "-c", &script])?;
    assert_eq!(follow.line()?, "hello");
    let followed_id = follow.err_line()?;
    assert!(followed_id.starts_with("j-"), "{followed_id}");
    let c = d.jobs().await?;
    assert_eq!(
        state(&get(&mut c.clone(), &followed_id).await?),
        JobState::Running
    );
    std::fs::write(&gate, b"")?;
    let (code, rest, err) = follow.finish()?;
    assert_eq!((code, rest.as_str()), (0, "world\n"), "{err}");

    // ls -o json parses and holds every job; the table lists them too.
    let (code, out, err) = ctl(url, &["ls", "-o", "json"]).await?;
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out)?;
    let listed: HashMap<String, serde_json::Value> = v["jobs"]
        .as_array()
        .context("jobs array")?
        .iter()
        .map(|j| (j["id"].as_str().unwrap_or_default().to_string(), j.clone()))
        .collect();
    assert_eq!(listed.len(), 4, "{out}");
    for id in [&ok_id, &killed_id, &followed_id] {
        assert!(listed.contains_key(id.as_str()), "{id} not in {out}");
    }
    assert_eq!(listed[&ok_id]["state"], "succeeded");
    assert_eq!(listed[&killed_id]["state"], "failed");
    assert_eq!(listed[&killed_id]["signal"], 9);
    assert_eq!(listed[&killed_id]["name"], "suicide");
    let (code, out, _) = ctl(url, &["ls", "--state", "failed"]).await?;
    assert_eq!(code, 0);
    assert!(out.starts_with("ID "), "{out}");
    assert_eq!(out.lines().count(), 3, "header + 2 failed: {out}");
    assert!(
        out.contains(&killed_id) && !out.contains(&format!("{ok_id} ")),
        "{out}"
    );

    // get -o yaml: the job as YAML.
    let (code, out, err) = ctl(url, &["get", &killed_id, "-o", "yaml"]).await?;
    assert_eq!(code, 0, "{err}");
    let y: serde_yaml::Value = serde_yaml::from_str(&out)?;
    assert_eq!(y["id"].as_str(), Some(killed_id.as_str()), "{out}");
    assert_eq!(y["state"].as_str(), Some("failed"));
    assert_eq!(y["node"].as_str(), Some("c1"));
    assert_eq!(y["signal"].as_i64(), Some(9));
    assert_eq!(y["spec"]["command"][2].as_str(), Some("kill -9 $$"));
    let (code, out, _) = ctl(url, &["get", &ok_id]).await?;
    assert_eq!(code, 0);
    assert!(out.contains("State:") && out.contains("succeeded"), "{out}");

    // logs: stdout, --stderr.
    let (code, out, _) = ctl(url, &["logs", &followed_id]).await?;
    assert_eq!((code, out.as_str()), (0, "hello\nworld\n"));
    let (code, out, _) = ctl(url, &["logs", "--stderr", &followed_id]).await?;
    assert_eq!((code, out.as_str()), (0, "oops\n"));

    // logs -f and watch ID on a running job: both print as it goes and
    // exit by themselves when it ends.
    let gate = dir.path().join("gate-logs");
    let script = format!(
        "echo one; while [ ! -e {} ]; do sleep 0.05; done; echo two",
        gate.display()
    );
    let (code, out, err) = ctl(url, &["submit", "--", "sh", "-c", &script]).await?;
    assert_eq!(code, 0, "{err}");
    let id = out.trim().to_string();
    wait_job(&c, &id, "running", |j| state(j) == JobState::Running).await?;
    let mut follow = Live::spawn(url, &["logs", "-f", &id])?;
    let mut watch = Live::spawn(url, &["watch", &id])?;
    assert_eq!(follow.line()?, "one");
    let first = watch.line()?;
    assert!(
        first.contains(&id) && first.contains("- -> running"),
        "{first}"
    );
    std::fs::write(&gate, b"")?;
    let (code, rest, err) = follow.finish()?;
    assert_eq!((code, rest.as_str()), (0, "two\n"), "{err}");
    let (code, rest, err) = watch.finish()?;
    assert_eq!(code, 0, "{err}");
    assert!(
        rest.lines().count() == 1 && rest.contains("running -> succeeded"),
        "{rest}"
    );
    // watch of a job that already ended prints its state and exits.
    let (code, out, _) = ctl(url, &["watch", &ok_id]).await?;
    assert_eq!(code, 0);
    assert!(out.contains("-> succeeded"), "{out}");
    Ok(())
}

/// A `dispatchctl` process whose output is read as it comes; killed on
/// drop.
struct Live {
    child: std::process::Child,
    out: std::sync::mpsc::Receiver<String>,
    err: std::sync::mpsc::Receiver<String>,
}

impl Live {
    fn spawn(url: &str, args: &[&str]) -> Result<Self> {
        use std::io::BufRead;
        let mut child = std::process::Command::new(e2e::binary("dispatchctl"))
            .arg("--server")
            .arg(url)
            .args(args)
            .env_remove("DISPATCH_SERVER")
            .env("DISPATCH_CONFIG", "/nonexistent/dispatch-config.json")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        let lines = |r: Box<dyn std::io::Read + Send>| {
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(r).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
            rx
        };
        let out = lines(Box::new(child.stdout.take().context("stdout")?));
        let err = lines(Box::new(child.stderr.take().context("stderr")?));
        Ok(Self { child, out, err })
    }

    /// The next stdout line, waiting up to [`T`].
    fn line(&mut self) -> Result<String> {
        self.out
            .recv_timeout(T)
            .context("no stdout line from dispatchctl")
    }

    /// The next stderr line, waiting up to [`T`].
    fn err_line(&mut self) -> Result<String> {
        self.err
            .recv_timeout(T)
            .context("no stderr line from dispatchctl")
    }

    /// Wait (up to [`T`]) for it to exit; its exit code and the rest of
    /// stdout and stderr.
    fn finish(mut self) -> Result<(i32, String, String)> {
        let deadline = std::time::Instant::now() + T;
        let status = loop {
            if let Some(st) = self.child.try_wait()? {
                break st;
            }
            if std::time::Instant::now() > deadline {
                bail!("dispatchctl did not exit within {T:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let rest = |rx: &std::sync::mpsc::Receiver<String>| {
            let mut s = String::new();
            while let Ok(l) = rx.recv_timeout(Duration::from_secs(5)) {
                s.push_str(&l);
                s.push('\n');
            }
            s
        };
        Ok((
            status.code().unwrap_or(-1),
            rest(&self.out),
            rest(&self.err),
        ))
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `dispatchctl nodes`' row for `name`, split on whitespace.
async fn nodes_row(url: &str, name: &str) -> Result<Vec<String>> {
    let (code, out, err) = ctl(url, &["nodes"]).await?;
    assert_eq!(code, 0, "{err}");
    let header: Vec<&str> = out
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        [
            "NAME",
            "STATE",
            "ZONE",
            "RACK",
            "SOCKETS",
            "NUMA",
            "LLC",
            "CORES",
            "T/C",
            "CPUS",
            "GPUS",
            "GANGS",
            "BUSY",
            "FREE:CORE",
            "LLC",
            "NUMA",
            "PKG",
            "ANY",
            "RUN",
            "WAIT"
        ],
        "{out}"
    );
    out.lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .with_context(|| format!("no row for {name} in\n{out}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatchctl_cancel_nodes_node_admin_top() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let d = Dispatcher::start(dir.path(), &[])?;
    let zone = "topology.kubernetes.io/zone";
    let _big = Agent::start(
        dir.path(),
        &d.url,
        "big",
        "2s:8c:2t:numa=2:llc=2",
        &[&format!("{zone}=z1"), "dispatch.io/rack=r1"],
        &[],
    )?;
    let _small = Agent::start(
        dir.path(),
        &d.url,
        "small",
        "1s:2c:1t",
        &[&format!("{zone}=z2"), "dispatch.io/rack=r9"],
        &[],
    )?;
    wait_nodes(&d, 2, T).await?;
    let url = d.url.as_str();

    // nodes: the topology counts and the free CPUs per level, once the
    // agents have reported their load.
    let idle_big = [
        "big", "ready", "z1", "r1", "2", "4", "8", "16", "2", "32", "-", "-", "0", "2", "4", "8",
        "16", "32", "0", "0",
    ];
    let idle_small = [
        "small", "ready", "z2", "r9", "1", "1", "1", "2", "1", "2", "-", "-", "0", "1", "2", "2",
        "2", "2", "0", "0",
    ];
    for want in [&idle_big[..], &idle_small[..]] {
        eventually(T, &format!("nodes row {want:?}"), || async move {
            (nodes_row(url, want[0]).await.ok()? == want).then_some(())
        })
        .await?;
    }

    // cancel: a running job ends CANCELLED and its processes are gone.
    let (code, out, err) = ctl(
        url,
        &[
            "submit",
            "--cpus",
            "4",
            "--align",
            "llc",
            "-l",
            "dispatch.io/rack=r1",
            "--",
            "sh",
            "-c",
            "sleep 30 & echo $$ $!; wait",
        ],
    )
    .await?;
    assert_eq!(code, 0, "{err}");
    let id = out.trim().to_string();
    let c = d.jobs().await?;
    let running = wait_job(&c, &id, "running", |j| state(j) == JobState::Running).await?;
    assert_eq!(running.node, "big");
    assert_eq!(running.cpus.len(), 4);
    let pids: Vec<i32> = eventually(T, "the job's pids in its log", || async {
        let (_, out, _) = ctl(url, &["logs", &id]).await.ok()?;
        let pids: Vec<i32> = out
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect();
        (pids.len() == 2).then_some(pids)
    })
    .await?;
    for &p in &pids {
        assert!(alive(p), "pid {p} of {id} should run");
    }
    // While it runs, `nodes` shows its 4 CPUs taken from one LLC.
    eventually(T, "busy CPUs in nodes", || async {
        let row = nodes_row(url, "big").await.ok()?;
        (row[12..18] == ["4", "2", "4", "8", "16", "28"] && row[18] == "1").then_some(())
    })
    .await?;
    let (code, out, err) = ctl(url, &["cancel", &id]).await?;
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with(&id), "{out}");
    let j = wait_job(&c, &id, "cancelled", |j| is_terminal(j.state)).await?;
    assert_eq!(state(&j), JobState::Cancelled, "{j:?}");
    eventually(T, "the cancelled job's processes to exit", || async {
        pids.iter().all(|&p| !alive(p)).then_some(())
    })
    .await?;
    let v = ctl_job(url, &id).await?;
    assert_eq!(v["state"], "cancelled");
    // Cancelling it again is not an error and changes nothing.
    let (code, out, _) = ctl(url, &["cancel", &id]).await?;
    assert_eq!((code, out.trim()), (0, format!("{id} cancelled").as_str()));
    eventually(T, "big idle again", || async {
        (nodes_row(url, "big").await.ok()? == idle_big).then_some(())
    })
    .await?;

    // node cordon | uncordon | drain change the state `nodes` shows.
    for (action, shown) in [
        ("cordon", "cordoned"),
        ("uncordon", "ready"),
        ("drain", "draining"),
        ("uncordon", "ready"),
    ] {
        let (code, out, err) = ctl(url, &["node", action, "small"]).await?;
        assert_eq!(code, 0, "{action}: {err}");
        assert_eq!(out.trim(), format!("small {shown}"));
        let row = nodes_row(url, "small").await?;
        assert_eq!(row[1], shown, "after {action}");
        assert_eq!(nodes_row(url, "big").await?[1], "ready");
    }
    let (code, _, err) = ctl(url, &["node", "cordon", "nope"]).await?;
    assert_eq!(code, 1);
    assert!(err.contains("nope") && err.contains("not_found"), "{err}");
    let (code, out, _) = ctl(url, &["node", "show", "big"]).await?;
    assert_eq!(code, 0);
    assert!(
        out.contains("2 sockets, 4 NUMA nodes, 8 LLCs, 16 cores x 2 threads, 32 CPUs"),
        "{out}"
    );

    // top --once: one snapshot of nodes and queues.
    let (code, out, err) = ctl(url, &["top", "--once"]).await?;
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("dispatchctl top"), "{out}");
    for s in ["big", "small", "QUEUE", "LATENCY(<0)", "pending", "running"] {
        assert!(out.contains(s), "top --once lacks {s}:\n{out}");
    }
    Ok(())
}

/// The process exists and is not a zombie.
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|s| s != "Z" && s != "X"),
        Err(_) => false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatchctl_errors_refusals_and_unreachable() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let d = Dispatcher::start(dir.path(), &[])?;
    let url = d.url.as_str();

    // Values dispatchctl can check itself are refused before any request
    // as usage errors (exit 64) naming the flag and its range.
    let (code, _, err) = dispatchctl(url, &["submit", "--latency-nice", "99", "--", "true"])?;
    assert_eq!(code, 64, "{err}");
    assert!(
        err.contains("--latency-nice") && err.contains("-20..=19"),
        "{err}"
    );

    // What only the dispatcher checks comes back as its refusal naming the
    // field: exit 1, and no job.
    for (args, field) in [
        (&["--retries", "101"][..], "spec.retries: "),
        (&["--cwd", "relative"][..], "spec.cwd: "),
        (&["--waker", "j-999"][..], "spec.waker: "),
        (&["--array", "100001"][..], "spec.array_count: "),
        (&["--cpus", "5000"][..], "spec.cpus: "),
        (&["--name", &"n".repeat(300)][..], "spec.name: "),
    ] {
        let mut a = vec!["submit"];
        a.extend_from_slice(args);
        a.extend_from_slice(&["--wait", "--", "true"]);
        let (code, out, err) = dispatchctl(url, &a)?;
        assert_eq!(code, 1, "{args:?}: {out} {err}");
        assert!(
            err.starts_with(&format!("error: {field}")) && err.contains("[invalid_argument]"),
            "{args:?}: {err}"
        );
        assert!(out.is_empty(), "{out}");
    }
    let mut c = d.jobs().await?;
    assert!(all_jobs(&mut c).await?.is_empty());

    // Unknown ids: exit 1 with the dispatcher's message naming the id.
    for args in [
        &["get", "j-77"][..],
        &["logs", "j-77"],
        &["logs", "-f", "j-77"],
        &["cancel", "j-77"],
        &["watch", "j-77"],
    ] {
        let (code, _, err) = ctl(url, args).await?;
        assert_eq!(code, 1, "{args:?}: {err}");
        assert!(
            err.contains("j-77") && err.contains("not_found"),
            "{args:?}: {err}"
        );
    }

    // An unreachable dispatcher: exit 2 and a clear message. Nothing can
    // listen on port 0, so a connection there is always refused.
    let dead = "http://127.0.0.1:0".to_string();
    for args in [&["ls"][..], &["submit", "--wait", "--", "true"], &["nodes"]] {
        let (code, out, err) = dispatchctl(&dead, args)?;
        assert_eq!(code, 2, "{args:?}: {out} {err}");
        assert!(
            err.contains(&format!("cannot reach the dispatcher at {dead}"))
                && err.contains("connection refused")
                && err.contains("dispatcher --dev"),
            "{err}"
        );
    }
    Ok(())
}

// ------------------------------------------------------------------
// 6. The one-command default

/// This process's allowed CPUs, from /proc/self/status.
fn cpus_allowed_list(status: &str) -> Option<String> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(|s| s.trim().to_string())
}

/// Expand a CPU list such as `0-3,8`.
fn expand_cpu_list(s: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<u32>(), b.parse::<u32>()) {
                    out.extend(a..=b);
                }
            }
            None => out.extend(part.parse::<u32>().ok()),
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_mode_is_one_command_to_a_working_system() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let d = Dispatcher::start_dev(dir.path(), &[])?;
    let url = d.url.as_str();

    // It says how to point dispatchctl at it.
    let hint = format!("export DISPATCH_SERVER={url}");
    eventually(T, "the dispatchctl hint", || async {
        d.proc.log_text().contains(&hint).then_some(())
    })
    .await
    .with_context(|| d.proc.log_text())?;

    // A node for this machine registers, with this machine's CPUs.
    wait_nodes(&d, 1, T).await?;
    let nodes = d
        .nodes()
        .await?
        .list_nodes(proto::v1::ListNodesRequest::default())
        .await?
        .into_inner()
        .nodes;
    assert_eq!(nodes.len(), 1, "{nodes:?}");
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")?
        .trim()
        .to_string();
    assert_eq!(nodes[0].name, host);
    let mine = cpus_allowed_list(&std::fs::read_to_string("/proc/self/status")?)
        .context("Cpus_allowed_list")?;
    let machine_cpus = expand_cpu_list(&mine);
    let topo = nodes[0].topology.clone().unwrap_or_default();
    assert_eq!(topo.cpus, machine_cpus);

    // The README's first job.
    let cmd = ["sh", "-c", "grep Cpus_allowed_list /proc/self/status"];
    let mut args = vec!["submit", "--wait", "--"];
    args.extend_from_slice(&cmd);
    let (code, out, err) = ctl(url, &args).await?;
    assert_eq!(code, 0, "{out} {err}\n{}", d.proc.log_text());
    let id = out.trim().to_string();
    let job = ctl_job(url, &id).await?;
    assert_eq!(job["state"], "succeeded");
    assert_eq!(job["node"].as_str(), Some(host.as_str()));
    let recorded: Vec<u32> = job["cpus"]
        .as_array()
        .context("cpus")?
        .iter()
        .filter_map(|c| c.as_u64().map(|c| c as u32))
        .collect();
    assert!(!recorded.is_empty(), "{job}");
    assert!(recorded.iter().all(|c| machine_cpus.contains(c)), "{job}");
    // The job saw exactly the CPUs the dispatcher recorded for it.
    let (code, log, _) = ctl(url, &["logs", &id]).await?;
    assert_eq!(code, 0);
    let seen = cpus_allowed_list(&log).with_context(|| format!("no CPU list in {log:?}"))?;
    assert_eq!(expand_cpu_list(&seen), recorded, "{log}");
    // And with --follow the same line is printed directly.
    let mut args = vec!["submit", "--follow", "--"];
    args.extend_from_slice(&cmd);
    let (code, out, err) = ctl(url, &args).await?;
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("Cpus_allowed_list:"), "{out}");
    Ok(())
}

// ------------------------------------------------------------------
// 7. Arrays and their cancel

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arrays_expand_list_and_cancel_as_one() -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir()?;
    let d = Dispatcher::start(dir.path(), &[])?;
    let _a = Agent::start(dir.path(), &d.url, "a1", "1s:2c:2t", &[], &[])?;
    wait_nodes(&d, 1, T).await?;
    let url = d.url.as_str();

    // Jobs run as an unprivileged user: give them a directory to race in.
    // The first two elements to get there succeed, every other one sleeps.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
    let gate = dir.path().join("slots");
    std::fs::create_dir(&gate)?;
    std::fs::set_permissions(&gate, std::fs::Permissions::from_mode(0o777))?;
    let g = gate.display();
    let script = format!("mkdir {g}/a 2>/dev/null || mkdir {g}/b 2>/dev/null || exec sleep 60");
    let (code, out, err) = ctl(
        url,
        &[
            "submit", "--array", "50", "--group", "sweep", "--", "sh", "-c", &script,
        ],
    )
    .await?;
    assert_eq!(code, 0, "{err}");
    let ids: Vec<&str> = out.lines().collect();
    assert_eq!(ids.len(), 50, "{out}");
    let array_id = ids[0]
        .rsplit_once('.')
        .map(|x| x.0)
        .context("array id")?
        .to_string();
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(*id, format!("{array_id}.{i}"));
    }

    // ListJobs by array id: every element, with its array id and index.
    let mut c = d.jobs().await?;
    let els = c
        .list_jobs(ListJobsRequest {
            array_id: array_id.clone(),
            page_size: 100,
            ..Default::default()
        })
        .await?
        .into_inner()
        .jobs;
    assert_eq!(els.len(), 50);
    let mut idx: Vec<u32> = els.iter().map(|j| j.array_index).collect();
    idx.sort_unstable();
    assert_eq!(idx, (0..50).collect::<Vec<_>>());
    assert!(els.iter().all(|j| j.array_id == array_id
        && j.id == format!("{array_id}.{}", j.array_index)
        && j.spec.as_ref().is_some_and(|s| s.array_count == 50)));
    // The array id itself is not a job, and the error says what it is.
    let r = c
        .get_job(GetJobRequest {
            id: array_id.clone(),
        })
        .await;
    let s = expect_status(r, Code::NotFound, "id: ", "GetJob of an array id");
    assert!(s.message().contains("array"), "{s:?}");

    // Two elements finish, the node's 4 CPUs run four more.
    let count = |jobs: &[Job], s: JobState| jobs.iter().filter(|j| state(j) == s).count();
    let snapshot = eventually(T, "2 succeeded and 4 running", || {
        let mut c = c.clone();
        let array_id = array_id.clone();
        async move {
            let jobs = c
                .list_jobs(ListJobsRequest {
                    array_id,
                    page_size: 100,
                    ..Default::default()
                })
                .await
                .ok()?
                .into_inner()
                .jobs;
            (count(&jobs, JobState::Succeeded) == 2 && count(&jobs, JobState::Running) == 4)
                .then_some(jobs)
        }
    })
    .await?;
    let finished: BTreeSet<String> = snapshot
        .iter()
        .filter(|j| state(j) == JobState::Succeeded)
        .map(|j| j.id.clone())
        .collect();

    // ls --array: the elements only, as a table and as JSON.
    let other = submit(&mut c, ok_spec()).await?.remove(0);
    let (code, out, _) = ctl(url, &["ls", "--array", &array_id]).await?;
    assert_eq!(code, 0);
    assert_eq!(out.lines().count(), 51, "{out}");
    assert!(!out.contains(&format!("{} ", other.id)), "{out}");
    let (code, out, _) = ctl(url, &["ls", "--array", &array_id, "-o", "json"]).await?;
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out)?;
    let jobs = v["jobs"].as_array().context("jobs")?;
    assert_eq!(jobs.len(), 50);
    assert!(
        jobs.iter().all(|j| j["array_id"] == array_id.as_str()
            && j["array_index"].as_u64().is_some_and(|i| i < 50))
    );
    let (code, out, _) = ctl(url, &["ls", "--group", "sweep", "--limit", "7"]).await?;
    assert_eq!(code, 0);
    assert_eq!(out.lines().count(), 8, "{out}");

    // `watch ARRAY_ID` follows the elements until the last one ends.
    let watch = {
        let (url, id) = (url.to_string(), array_id.clone());
        std::thread::spawn(move || dispatchctl_timeout(&url, &["watch", &id], T))
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!watch.is_finished(), "watch of a running array ended early");

    // Cancelling the array id cancels every element not yet finished:
    // the running ones are killed, the pending ones never start.
    let (code, out, err) = ctl(url, &["cancel", &array_id]).await?;
    assert_eq!(code, 0, "{out} {err}");
    let end = eventually(T, "every element terminal", || {
        let mut c = c.clone();
        async move {
            let all = all_jobs(&mut c).await.ok()?;
            let els: Vec<Job> = all.into_iter().filter(|j| !j.array_id.is_empty()).collect();
            els.iter().all(|j| is_terminal(j.state)).then_some(els)
        }
    })
    .await?;
    assert_eq!(end.len(), 50);
    for j in &end {
        if finished.contains(&j.id) {
            assert_eq!(state(j), JobState::Succeeded, "{j:?}");
        } else {
            assert_eq!(state(j), JobState::Cancelled, "{j:?}");
        }
    }
    let never_started = end
        .iter()
        .filter(|j| j.start_time_ms == 0 && state(j) == JobState::Cancelled)
        .count();
    assert!(
        never_started >= 40,
        "{never_started} pending elements cancelled"
    );
    let (code, out, err) = watch.join().map_err(|_| anyhow::anyhow!("join"))??;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.matches("-> cancelled").count(), 48, "{out}");
    // The job outside the array was not touched.
    let o = wait_job(&c, &other.id, "ended", |j| is_terminal(j.state)).await?;
    assert_eq!(state(&o), JobState::Succeeded);
    Ok(())
}
