//! The retention of terminal jobs (`Retention`, `Cluster::retire_done`)
//! through the real embedded store: a terminal job stays readable for
//! its retention, then is gone from memory and from the store, and a
//! restart reloads exactly the jobs kept, with the end times their
//! retention counts from.

use proto::v1::{JobSpec, NodeLoad};

use super::tests::{finish_on, node_in_rack};
use super::*;
use crate::store::Store;
use crate::store::embedded::EmbeddedStore;

fn cfg() -> ClusterConfig {
    ClusterConfig {
        retention: Retention {
            min_age_ms: 10_000,
            max_done_jobs: 100,
        },
        ..ClusterConfig::default()
    }
}

fn one_cpu() -> JobSpec {
    JobSpec {
        command: vec!["true".into()],
        cpus: 1,
        ..Default::default()
    }
}

/// Commit `fx` as the core does: the changed jobs' records join its
/// writes first.
fn commit(store: &mut EmbeddedStore, c: &Cluster, mut fx: Effects) {
    c.write_back(&mut fx);
    store.commit(&fx.writes).unwrap();
}

/// The ids of the jobs `fx` deletes from the store, in its order.
fn deleted(fx: &Effects) -> Vec<String> {
    fx.writes
        .iter()
        .filter_map(|w| match w {
            Write::DeleteJob(key) => Some(key.to_string()),
            _ => None,
        })
        .collect()
}

fn found(c: &Cluster, id: &str) -> Option<JobState> {
    c.get_job(id)
        .ok()
        .map(|j| JobState::try_from(j.state).unwrap())
}

#[test]
fn terminal_jobs_are_kept_for_their_retention_then_forgotten_here_and_in_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = EmbeddedStore::open(dir.path()).unwrap();
    let mut c = Cluster::new(cfg());
    node_in_rack(&mut c, "a", "1s:4c:1t", "r1");
    let mut fx = Effects::default();
    c.submit(vec![one_cpu(), one_cpu(), one_cpu()], false, 1, &mut fx)
        .unwrap();
    commit(&mut store, &c, fx);
    let fx = finish_on(&mut c, "a", "j-1", 100);
    commit(&mut store, &c, fx);
    let fx = finish_on(&mut c, "a", "j-2", 200);
    commit(&mut store, &c, fx);

    // Young: kept, and every transition readable.
    let mut fx = Effects::default();
    c.load_report("a", NodeLoad::default(), 5_000, &mut fx);
    c.tick(5_000, &mut fx);
    assert!(!fx.writes.iter().any(|w| matches!(w, Write::DeleteJob(_))));
    commit(&mut store, &c, fx);
    assert_eq!(found(&c, "j-1"), Some(JobState::Succeeded));

    // j-1 ended 10 s ago: gone, in the same commit as the tick's changes.
    let mut fx = Effects::default();
    c.load_report("a", NodeLoad::default(), 10_150, &mut fx);
    c.tick(10_150, &mut fx);
    let deletes: Vec<&Write> = fx
        .writes
        .iter()
        .filter(|w| matches!(w, Write::DeleteJob(_)))
        .collect();
    assert!(
        matches!(deletes[..], [Write::DeleteJob(key)] if key.to_string() == "j-1"),
        "{deletes:?}"
    );
    commit(&mut store, &c, fx);
    assert_eq!(found(&c, "j-1"), None);
    assert_eq!(found(&c, "j-2"), Some(JobState::Succeeded));
    assert_eq!(found(&c, "j-3"), Some(JobState::Assigned));
    assert_eq!(c.nr_jobs(), 2);
    c.check().unwrap();

    // A restart (or a new leader) reloads what was kept, not what was
    // deleted, and counts the kept job's retention from its end time.
    let snap = store.load().unwrap();
    let mut ids: Vec<String> = snap.jobs.iter().map(|j| j.id.clone()).collect();
    ids.sort();
    assert_eq!(ids, ["j-2", "j-3"]);
    let mut d = Cluster::new(cfg());
    d.restore(snap, 10_160, 60_000);
    let mut fx = Effects::default();
    d.tick(10_180, &mut fx);
    assert!(!fx.writes.iter().any(|w| matches!(w, Write::DeleteJob(_))));
    assert_eq!(found(&d, "j-1"), None);
    assert_eq!(found(&d, "j-2"), Some(JobState::Succeeded));
    let mut fx = Effects::default();
    d.tick(10_250, &mut fx);
    assert!(
        fx.writes
            .iter()
            .any(|w| matches!(w, Write::DeleteJob(key) if key.to_string() == "j-2"))
    );
    commit(&mut store, &c, fx);
    assert_eq!(found(&d, "j-2"), None);
    assert_eq!(
        found(&d, "j-3"),
        Some(JobState::Assigned),
        "not terminal: kept"
    );
    d.check().unwrap();
    let ids: Vec<String> = store
        .load()
        .unwrap()
        .jobs
        .into_iter()
        .map(|j| j.id)
        .collect();
    assert_eq!(ids, ["j-3"]);
}

#[test]
fn beyond_the_cap_the_jobs_that_ended_first_go_first() {
    let mut c = Cluster::new(ClusterConfig {
        retention: Retention {
            min_age_ms: 1_000_000,
            max_done_jobs: 2,
        },
        ..ClusterConfig::default()
    });
    node_in_rack(&mut c, "a", "1s:4c:1t", "r1");
    let mut fx = Effects::default();
    c.submit(vec![one_cpu(), one_cpu(), one_cpu()], false, 1, &mut fx)
        .unwrap();
    // Ended in the order j-2, j-3, j-1.
    finish_on(&mut c, "a", "j-2", 100);
    finish_on(&mut c, "a", "j-3", 200);
    finish_on(&mut c, "a", "j-1", 300);
    let mut fx = Effects::default();
    c.tick(400, &mut fx);
    assert_eq!(deleted(&fx), ["j-2"]);
    assert_eq!(found(&c, "j-3"), Some(JobState::Succeeded));
    assert_eq!(found(&c, "j-1"), Some(JobState::Succeeded));
    c.check().unwrap();
}

/// One tick forgets more jobs than [`jobs::PREFETCH_WINDOW`], in windows
/// (the loads of one issued while the one before is dropped): every job
/// beyond the cap goes, once, and none other, whatever the order they
/// ended in (not their keys').
#[test]
fn a_tick_forgets_all_its_jobs_across_the_prefetch_windows() {
    let kept = 5;
    let mut c = Cluster::new(ClusterConfig {
        retention: Retention {
            min_age_ms: 1_000_000,
            max_done_jobs: kept,
        },
        ..ClusterConfig::default()
    });
    // 80 CPUs: every job runs.
    node_in_rack(&mut c, "a", "2s:20c:2t", "r1");
    let n = 2 * jobs::PREFETCH_WINDOW + 13;
    let mut fx = Effects::default();
    c.submit(vec![one_cpu(); n], false, 1, &mut fx).unwrap();
    // Ended in an order unlike their keys': j-6, j-11, ... (5 is prime
    // to n, so each job once).
    assert_ne!(n % 5, 0);
    let order: Vec<usize> = (1..=n).map(|i| i * 5 % n + 1).collect();
    for (t, &j) in order.iter().enumerate() {
        finish_on(&mut c, "a", &format!("j-{j}"), 100 + t as i64);
    }
    let mut fx = Effects::default();
    c.tick(10_000, &mut fx);
    let mut deleted = deleted(&fx);
    // The first to end go; the last `kept` to end stay.
    let mut expected: Vec<String> = order[..n - kept].iter().map(|j| format!("j-{j}")).collect();
    deleted.sort();
    expected.sort();
    assert_eq!(deleted, expected);
    for &j in &order[..n - kept] {
        assert_eq!(found(&c, &format!("j-{j}")), None, "j-{j}");
    }
    for &j in &order[n - kept..] {
        assert_eq!(
            found(&c, &format!("j-{j}")),
            Some(JobState::Succeeded),
            "j-{j}"
        );
    }
    assert_eq!(c.nr_jobs(), kept);
    c.check().unwrap();
}

#[test]
fn keep_all_keeps_every_job_and_tracks_none() {
    let mut c = Cluster::new(ClusterConfig {
        retention: Retention::KEEP_ALL,
        ..ClusterConfig::default()
    });
    node_in_rack(&mut c, "a", "1s:4c:1t", "r1");
    let mut fx = Effects::default();
    c.submit(vec![one_cpu()], false, 1, &mut fx).unwrap();
    finish_on(&mut c, "a", "j-1", 100);
    let mut fx = Effects::default();
    c.tick(1_000_000_000, &mut fx);
    assert!(!fx.writes.iter().any(|w| matches!(w, Write::DeleteJob(_))));
    assert_eq!(found(&c, "j-1"), Some(JobState::Succeeded));
    assert_eq!(
        c.jobs.expired(i64::MAX, 0, 0),
        Vec::<JobKey>::new(),
        "nothing queued"
    );
}

/// An array's elements share one spec after a restart too (the store
/// keeps it once; each element of the snapshot gets a copy), and every
/// element reads back with its spec and state.
#[test]
fn a_restored_arrays_elements_share_its_spec() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = EmbeddedStore::open(dir.path()).unwrap();
    let mut c = Cluster::new(cfg());
    let mut fx = Effects::default();
    let array = JobSpec {
        array_count: 5,
        node_selector: [("pool".to_string(), "none".to_string())].into(),
        ..one_cpu()
    };
    c.submit(vec![array, one_cpu()], false, 1, &mut fx).unwrap();
    commit(&mut store, &c, fx);
    let before: Vec<Job> = (0..5)
        .map(|i| c.get_job(&format!("j-1.{i}")).unwrap())
        .collect();

    let mut back = Cluster::new(cfg());
    back.restore(store.load().unwrap(), 2, 60_000);
    let specs: Vec<Arc<JobSpec>> = back
        .jobs
        .iter()
        .filter(|(k, _)| k.number() == 1)
        .map(|(_, e)| e.job().spec.clone().unwrap())
        .collect();
    assert_eq!(specs.len(), 5);
    assert!(specs.iter().all(|s| Arc::ptr_eq(s, &specs[0])));
    let plain = back.jobs.get(JobKey::single(2)).unwrap().job().spec.clone();
    assert!(!Arc::ptr_eq(plain.as_ref().unwrap(), &specs[0]));
    for (i, want) in before.iter().enumerate() {
        let got = back.get_job(&format!("j-1.{i}")).unwrap();
        assert_eq!(got.spec, want.spec);
        assert_eq!(got.state, want.state);
    }
}
