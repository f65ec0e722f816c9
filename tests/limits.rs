//! End-to-end tests of the dispatcher's limits against a real dispatcher
//! process: an oversize message, oversize spec fields, an oversize batch,
//! and the per-client submission rate. Every refusal is a clear gRPC
//! status and creates nothing (checked with ListJobs).

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use anyhow::Result;
use e2e::{Dispatcher, all_jobs, eventually};
use proto::v1::job_service_client::JobServiceClient;
use proto::v1::{JobSpec, SubmitJobRequest, SubmitJobsRequest};
use tonic::Code;
use tonic::transport::{Channel, Endpoint};

fn spec() -> JobSpec {
    JobSpec {
        command: vec!["true".into()],
        ..Default::default()
    }
}

/// A job client connecting from `source` (a loopback address), so tests
/// can be different clients for the per-peer rate limit.
async fn client_from(d: &Dispatcher, source: IpAddr) -> Result<JobServiceClient<Channel>> {
    let ch = Endpoint::from_shared(d.url.clone())?
        .local_address(Some(source))
        .connect()
        .await?;
    Ok(JobServiceClient::new(ch).max_decoding_message_size(256 << 20))
}

fn expect_refusal<T: std::fmt::Debug>(
    r: Result<tonic::Response<T>, tonic::Status>,
    codes: &[Code],
    starts: &str,
    what: &str,
) -> tonic::Status {
    match r {
        Ok(ok) => panic!("{what}: accepted: {ok:?}"),
        Err(s) => {
            assert!(
                codes.contains(&s.code()),
                "{what}: {:?} {:?}, expected one of {codes:?}",
                s.code(),
                s.message()
            );
            assert!(
                s.message().starts_with(starts),
                "{what}: message {:?} does not start with {starts:?}",
                s.message()
            );
            s
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversize_messages_fields_and_batches_are_refused_and_create_nothing() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let d = Dispatcher::start(
        dir.path(),
        &["--max-message-bytes", "1048576", "--submit-rate", "0"],
    )?;
    let mut c = d.jobs().await?;

    // A message over --max-message-bytes: tonic refuses it before the
    // handler decodes it.
    let mut huge = spec();
    huge.command.push("x".repeat(2 << 20));
    let s = expect_refusal(
        c.submit_job(SubmitJobRequest { spec: Some(huge) }).await,
        &[Code::OutOfRange, Code::ResourceExhausted],
        "",
        "a 2 MiB message",
    );
    assert!(
        s.message().contains("1048576"),
        "the refusal names the limit: {s:?}"
    );

    // Oversize spec fields, each named with its size and its limit.
    let mut env = spec();
    for i in 0..1025 {
        env.env.insert(format!("V{i}"), "1".into());
    }
    expect_refusal(
        c.submit_job(SubmitJobRequest { spec: Some(env) }).await,
        &[Code::InvalidArgument],
        "spec.env: 1025 entries, at most 1024",
        "1025 env entries",
    );
    let mut arg = spec();
    arg.command.push("a".repeat(200 << 10));
    expect_refusal(
        c.submit_job(SubmitJobRequest { spec: Some(arg) }).await,
        &[Code::InvalidArgument],
        "spec.command[1]: 204800 bytes, at most 131072",
        "a 200 KiB argument",
    );
    let mut cwd = spec();
    cwd.cwd = format!("/{}", "d".repeat(5000));
    expect_refusal(
        c.submit_job(SubmitJobRequest { spec: Some(cwd) }).await,
        &[Code::InvalidArgument],
        "spec.cwd: 5001 bytes, at most 4096",
        "a 5001-byte cwd",
    );
    let mut sel = spec();
    for i in 0..65 {
        sel.node_selector.insert(format!("l{i}"), "v".into());
    }
    let mut batch = vec![spec(); 3];
    batch.push(sel);
    expect_refusal(
        c.submit_jobs(SubmitJobsRequest { specs: batch }).await,
        &[Code::InvalidArgument],
        "specs[3].node_selector: 65 entries, at most 64",
        "65 selector labels in the 4th spec of a batch",
    );

    // Oversize batches: too many specs, and too many bytes of jobs (a
    // small message whose array would store 100 MB).
    expect_refusal(
        c.submit_jobs(SubmitJobsRequest {
            specs: vec![spec(); 10_001],
        })
        .await,
        &[Code::InvalidArgument],
        "specs: 10001 specs in one call, at most 10000 per call",
        "10001 specs",
    );
    let mut wide = spec();
    wide.command.push("w".repeat(100_000));
    wide.array_count = 1000;
    expect_refusal(
        c.submit_job(SubmitJobRequest { spec: Some(wide) }).await,
        &[Code::InvalidArgument],
        "specs: the jobs of this call total 1000",
        "1000 elements of a 100 KB spec",
    );

    let jobs = all_jobs(&mut c).await?;
    assert!(jobs.is_empty(), "refusals created jobs: {jobs:?}");
    // The connection is still good and no id was used up.
    let ok = c
        .submit_job(SubmitJobRequest { spec: Some(spec()) })
        .await?
        .into_inner()
        .jobs;
    assert_eq!(ok[0].id, "j-1");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_submission_rate_is_limited_per_client() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let d = Dispatcher::start(dir.path(), &["--submit-rate", "2", "--submit-burst", "5"])?;
    let me = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let mut c = client_from(&d, me).await?;

    // No wall-clock threshold: on a stalled machine tokens refill while the
    // test runs, so every bound below is the rate applied to the time the
    // test itself measured, and the job count is the test's own tally of
    // accepted specs.
    let t0 = std::time::Instant::now();
    // Most specs a 2/s bucket of 5 can have let through since t0.
    let allowed_by =
        |t: std::time::Instant| 5 + (2.0 * t.duration_since(t0).as_secs_f64()) as usize;
    // The burst passes: 3 single submissions and a batch of 2.
    for _ in 0..3 {
        c.submit_job(SubmitJobRequest { spec: Some(spec()) })
            .await?;
    }
    c.submit_jobs(SubmitJobsRequest {
        specs: vec![spec(); 2],
    })
    .await?;
    let mut accepted = 5;
    // Then the rate applies: single submissions until the first refusal,
    // which says the rate and when to retry; never more accepted than the
    // rate allows for the time that passed.
    let s = loop {
        match c.submit_job(SubmitJobRequest { spec: Some(spec()) }).await {
            Ok(_) => {
                accepted += 1;
                assert!(
                    accepted <= allowed_by(std::time::Instant::now()),
                    "{accepted} specs accepted within {:?} at 2/s, bursts of 5",
                    t0.elapsed()
                );
            }
            r => {
                break expect_refusal(
                    r,
                    &[Code::ResourceExhausted],
                    "submission rate limit: client 127.0.0.1 may submit 2 specs per second, bursts of 5",
                    "a submission over the burst",
                );
            }
        }
    };
    let refused_at = std::time::Instant::now();
    assert!(s.message().contains("retry in "), "{s:?}");
    let pushback: u64 = s
        .metadata()
        .get("grpc-retry-pushback-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    // The next token of a 2/s bucket is at most 500 ms away, whenever asked.
    assert!(
        (1..=500).contains(&pushback),
        "pushback {pushback} ms at 2/s"
    );
    // A batch of 3 needs 3 tokens: less than one was left at the refusal,
    // so it passes only if 1 s of refill passed since.
    match c
        .submit_jobs(SubmitJobsRequest {
            specs: vec![spec(); 3],
        })
        .await
    {
        Ok(_) => {
            assert!(
                refused_at.elapsed() >= Duration::from_secs(1),
                "a batch of 3 accepted {:?} after a refusal at 2/s",
                refused_at.elapsed()
            );
            accepted += 3;
        }
        r => {
            expect_refusal(
                r,
                &[Code::ResourceExhausted],
                "submission rate limit",
                "a batch over the rate",
            );
        }
    }
    // Nothing was created for the refused calls.
    assert_eq!(all_jobs(&mut c).await?.len(), accepted);

    // Another client (another loopback address) has its own bucket.
    let mut other = client_from(&d, IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2))).await?;
    other
        .submit_jobs(SubmitJobsRequest {
            specs: vec![spec(); 5],
        })
        .await?;
    accepted += 5;
    assert_eq!(all_jobs(&mut c).await?.len(), accepted);

    // After the wait it was told, the first client may submit again.
    let after_wait = eventually(
        Duration::from_secs(30),
        "a submission after the wait",
        || {
            let mut c = c.clone();
            async move {
                match c.submit_job(SubmitJobRequest { spec: Some(spec()) }).await {
                    Ok(r) => Some(r.into_inner().jobs),
                    Err(s) if s.code() == Code::ResourceExhausted => None,
                    Err(s) => panic!("unexpected refusal {s:?}"),
                }
            }
        },
    )
    .await?;
    assert_eq!(after_wait.len(), 1);
    assert_eq!(all_jobs(&mut c).await?.len(), accepted + 1);
    // Reads are never rate limited.
    for _ in 0..20 {
        all_jobs(&mut c).await?;
    }
    Ok(())
}

/// With bearer tokens, the rate is per authenticated user: two users on
/// the same address have their own buckets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_tokens_the_rate_is_per_user() -> Result<()> {
    const ALICE: &str = "alice-token-0123456789abcdef";
    const BOB: &str = "bob-token-0123456789abcdef";
    let dir = tempfile::tempdir()?;
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, format!("{ALICE} user alice\n{BOB} user bob\n"))?;
    let d = Dispatcher::start(
        dir.path(),
        &[
            "--tokens",
            &tokens.display().to_string(),
            "--submit-rate",
            "0.01",
            "--submit-burst",
            "2",
        ],
    )?;
    let ch = Endpoint::from_shared(d.url.clone())?.connect().await?;
    let as_user = |token: &'static str| {
        JobServiceClient::with_interceptor(ch.clone(), move |mut req: tonic::Request<()>| {
            let value = format!("Bearer {token}")
                .parse()
                .map_err(|_| tonic::Status::internal("bad header"))?;
            req.metadata_mut().insert("authorization", value);
            Ok(req)
        })
    };
    let (mut alice, mut bob) = (as_user(ALICE), as_user(BOB));
    alice
        .submit_jobs(SubmitJobsRequest {
            specs: vec![spec(); 2],
        })
        .await?;
    expect_refusal(
        alice
            .submit_job(SubmitJobRequest { spec: Some(spec()) })
            .await,
        &[Code::ResourceExhausted],
        "submission rate limit: client alice may submit 0.01 specs per second, bursts of 2",
        "alice's 3rd submission",
    );
    // Bob, from the same address, still has his burst.
    let jobs = bob
        .submit_jobs(SubmitJobsRequest {
            specs: vec![spec(); 2],
        })
        .await?
        .into_inner()
        .jobs;
    assert_eq!(jobs.len(), 2);
    expect_refusal(
        bob.submit_job(SubmitJobRequest { spec: Some(spec()) })
            .await,
        &[Code::ResourceExhausted],
        "submission rate limit: client bob",
        "bob's 3rd submission",
    );
    Ok(())
}
