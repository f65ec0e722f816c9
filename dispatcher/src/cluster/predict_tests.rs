//! Run-time predictions (`ClusterConfig::predict`, [`super::runtimes`]) as
//! the dispatcher drives them: a user's finished jobs give its next jobs
//! without a time limit a predicted end, so a node held for a waiting
//! whole-node job starts a short job past it, until a prediction fails.

use proto::v1::{JobSpec, JobStatus};

use super::runtimes::Predict;
use super::tests::{finish_on as finish, node_in_rack as node};
use super::*;

fn cluster(predict: Predict) -> Cluster {
    Cluster::new(ClusterConfig {
        predict,
        ..ClusterConfig::default()
    })
}

/// A job without a time limit.
fn job(cpus: u32) -> JobSpec {
    JobSpec {
        command: vec!["true".into()],
        cpus,
        ..Default::default()
    }
}

fn submit(c: &mut Cluster, owner: &str, cpus: u32, now: i64) -> String {
    let mut fx = Effects::default();
    let created = c
        .submit_as(owner, vec![job(cpus)], false, now, &mut fx)
        .unwrap();
    created[0].id()
}

fn running(c: &mut Cluster, id: &str, now: i64) {
    let mut fx = Effects::default();
    let status = JobStatus {
        job_id: id.into(),
        attempt: 1,
        state: JobState::Running as i32,
        ..Default::default()
    };
    c.job_status("a", status, now, &mut fx);
}

fn started(c: &Cluster, id: &str) -> bool {
    matches!(
        c.phase(id),
        Some(Phase::Assigned { .. }) | Some(Phase::Running { .. })
    )
}

/// User `long` ran two jobs of 100 s, user `short` two of 5 s. Then one of
/// `long`'s runs on the 4-CPU node and a whole-node job (no limit, no
/// history) waits for it: the domain's protected head. One of `short`'s,
/// predicted to end in 5 s, long before `long`'s job is predicted to end,
/// starts past the head with predictions; without them the node holds its
/// free CPUs for the head, which has no date. When that job outlives its
/// prediction, the next short job waits: the head is delayed by one wrong
/// prediction, not by a stream of them.
#[test]
fn a_short_job_starts_past_an_undated_head_on_its_users_history() {
    for predict in [Predict::Off, Predict::Unlimited] {
        let mut c = cluster(predict);
        node(&mut c, "a", "1s:4c:1t", "r1");
        let mut t = 1_000;
        for (owner, run_ms) in [("long", 100_000), ("short", 5_000)] {
            for _ in 0..2 {
                let id = submit(&mut c, owner, 4, t);
                running(&mut c, &id, t);
                t += run_ms;
                finish(&mut c, "a", &id, t);
            }
        }
        assert_eq!(c.runtimes().len(), 2);
        let a = submit(&mut c, "long", 1, t);
        running(&mut c, &a, t);
        let head = submit(&mut c, "other", 4, t);
        assert!(started(&c, &a) && !started(&c, &head));
        let b = submit(&mut c, "short", 1, t + 1_000);
        assert_eq!(
            started(&c, &b),
            predict == Predict::Unlimited,
            "{predict:?}"
        );
        if predict == Predict::Unlimited {
            running(&mut c, &b, t + 1_000);
            // Still within its prediction at t + 5 s: another one starts.
            let b2 = submit(&mut c, "short", 1, t + 5_000);
            assert!(started(&c, &b2));
            running(&mut c, &b2, t + 5_000);
            // b has outlived its 5 s at t + 7 s: no more past the head.
            let late = submit(&mut c, "short", 1, t + 7_000);
            assert!(!started(&c, &late));
            // When the jobs running then end, the head starts.
            finish(&mut c, "a", &a, t + 100_000);
            finish(&mut c, "a", &b, t + 100_000);
            finish(&mut c, "a", &b2, t + 100_000);
            assert!(started(&c, &head));
        }
        c.check().unwrap();
    }
}

/// The history is soft state: rebuilt from the finished jobs after a
/// restart.
#[test]
fn the_history_is_rebuilt_from_finished_jobs_after_a_restart() {
    let mut c = cluster(Predict::Unlimited);
    node(&mut c, "a", "1s:4c:1t", "r1");
    for (t, run) in [(1_000, 10_000), (20_000, 30_000)] {
        let id = submit(&mut c, "u", 1, t);
        running(&mut c, &id, t);
        finish(&mut c, "a", &id, t + run);
    }
    assert_eq!(c.runtimes().predict("u", ""), Some(20_000));
    let snap = crate::store::Snapshot {
        jobs: c.jobs_matching(&[]),
        node_admin: Default::default(),
        next_job: 10,
    };
    let mut d = cluster(Predict::Unlimited);
    d.restore(snap, 100_000, 10_000);
    assert_eq!(d.runtimes().predict("u", ""), Some(20_000));
}
