//! One reservation and one queue per steal domain
//! (`SchedConfig::domain_reservation`, `SchedConfig::domain_fifo`) as the
//! dispatcher drives them (register, submit, finish), checked on the
//! jobs' phases and the `Assign`s sent.

use super::tests::{
    assigns, finish_on as finish, job_with_limit as job, node_in_rack as node, node_of,
};
use super::*;

fn cluster(domain_reservation: bool, domain_fifo: bool) -> Cluster {
    let shortest = ClusterConfig::default().engine.shortest_limit_first;
    cluster_ordered(domain_reservation, domain_fifo, shortest)
}

/// With the domain's queue in arrival order or shortest limit first
/// (`SchedConfig::shortest_limit_first`).
fn cluster_ordered(domain_reservation: bool, domain_fifo: bool, shortest: bool) -> Cluster {
    let mut cfg = ClusterConfig::default();
    cfg.engine.backfill = true;
    cfg.engine.domain_reservation = domain_reservation;
    cfg.engine.domain_fifo = domain_fifo;
    cfg.engine.shortest_limit_first = shortest;
    Cluster::new(cfg)
}

fn running_on(c: &Cluster, id: &str) -> Option<String> {
    match c.phase(id) {
        Some(Phase::Assigned { node, .. }) | Some(Phase::Running { node, .. }) => {
            Some(node.to_string())
        }
        _ => None,
    }
}

/// Nodes a and b (4 CPUs, one rack) each run a 3-CPU job to 100 s; two
/// whole-node jobs wait, the older on one node, the younger on the other.
/// Returns (node of the older head, node of the younger).
fn two_blocked_heads(c: &mut Cluster) -> (String, String) {
    node(c, "a", "1s:4c:1t", "r1");
    node(c, "b", "1s:4c:1t", "r1");
    let mut fx = Effects::default();
    c.submit(vec![job(3, 100), job(3, 100)], true, 1, &mut fx)
        .unwrap();
    c.submit(vec![job(4, 10)], false, 2, &mut fx).unwrap();
    c.submit(vec![job(4, 10)], false, 3, &mut fx).unwrap();
    let (old, young) = (node_of(c, "j-3"), node_of(c, "j-4"));
    assert_ne!(old, young, "the heads wait on different nodes");
    assert!(running_on(c, "j-3").is_none() && running_on(c, "j-4").is_none());
    (old, young)
}

/// Per-node EASY protects both heads, so a 1-CPU job that runs past
/// their reservations waits; with one reservation per domain only the
/// older head (j-3) is protected, and the job starts on the younger
/// head's node at once, past j-4.
#[test]
fn a_long_small_job_passes_the_younger_head_of_the_domain() {
    for domain_reservation in [false, true] {
        let mut c = cluster(domain_reservation, false);
        let (_, young) = two_blocked_heads(&mut c);
        let mut fx = Effects::default();
        c.submit(vec![job(1, 500)], false, 4, &mut fx).unwrap();
        if domain_reservation {
            assert_eq!(running_on(&c, "j-5"), Some(young.clone()));
            assert_eq!(assigns(&fx), vec![(young, "j-5".to_string())]);
        } else {
            assert_eq!(running_on(&c, "j-5"), None);
            assert!(assigns(&fx).is_empty());
        }
        c.check().unwrap();
    }
}

/// One queue per domain in arrival order: when the younger head's node
/// frees first, it starts the older job waiting on the other node (a
/// steal in the same rack); without it, its own younger head. (With
/// per-node EASY and shortest limit first, each node's own head keeps
/// its room: the two heads have equal limits.)
#[test]
fn a_freed_node_starts_the_oldest_job_of_its_rack() {
    for domain_fifo in [false, true] {
        let mut c = cluster_ordered(false, domain_fifo, false);
        let (old, young) = two_blocked_heads(&mut c);
        let running = if young == "a" { "j-1" } else { "j-2" };
        let fx = finish(&mut c, &young, running, 100_000);
        let started = if domain_fifo { "j-3" } else { "j-4" };
        assert_eq!(assigns(&fx), vec![(young.clone(), started.to_string())]);
        if domain_fifo {
            assert!(fx.moves.iter().any(|m| m.is_steal() && m.from == old));
            assert_eq!(node_of(&c, "j-4"), young);
        }
        c.check().unwrap();
    }
}

/// Shortest-job-first backfilling (`SchedConfig::shortest_limit_first`,
/// the default): behind the two blocked heads (10 s each) a long job
/// (1,000 s) and then a short one (5 s) wait. When the younger head's
/// node frees, it starts the short one, ahead of both heads and the long
/// job; in arrival order it starts the older head (j-3).
#[test]
fn a_freed_node_starts_the_shortest_job_of_its_rack() {
    for shortest in [false, true] {
        let mut c = cluster_ordered(true, true, shortest);
        let (old, young) = two_blocked_heads(&mut c);
        let mut fx = Effects::default();
        c.submit(vec![job(4, 1_000)], false, 4, &mut fx).unwrap();
        c.submit(vec![job(4, 5)], false, 5, &mut fx).unwrap();
        let running = if young == "a" { "j-1" } else { "j-2" };
        let fx = finish(&mut c, &young, running, 100_000);
        let started: Vec<String> = assigns(&fx).into_iter().map(|(_, j)| j).collect();
        if shortest {
            assert_eq!(started, vec!["j-6".to_string()], "{old} {young}");
            assert_eq!(running_on(&c, "j-6"), Some(young.clone()));
            assert!(running_on(&c, "j-5").is_none());
        } else {
            assert_eq!(started, vec!["j-3".to_string()], "{old} {young}");
        }
        c.check().unwrap();
    }
}

/// Nodes a and b (4 CPUs, one rack) each run a whole-node job (j-1,
/// j-2); the `waiting` jobs (CPUs, time limit in s, submitted at ms)
/// queue behind them as j-3, j-4, ..., j-3 holding the domain's
/// reservation.
/// At 500 s the node j-3 does not wait on frees: returns the `Assign`s
/// sent then and the one expected for `started` on that node.
#[allow(clippy::type_complexity)]
fn assigned_when_the_other_node_frees(
    shortest: bool,
    deadline: bool,
    aging: bool,
    widest: sched::WidestFirst,
    waiting: &[(u32, u64, i64)],
    started: &str,
) -> (Vec<(String, String)>, Vec<(String, String)>) {
    let mut cfg = ClusterConfig::default();
    cfg.engine.backfill = true;
    cfg.engine.domain_reservation = true;
    cfg.engine.domain_fifo = true;
    cfg.engine.shortest_limit_first = shortest;
    cfg.engine.deadline_order = deadline;
    cfg.engine.limit_aging = aging;
    cfg.engine.widest_first = widest;
    let mut c = Cluster::new(cfg);
    node(&mut c, "a", "1s:4c:1t", "r1");
    node(&mut c, "b", "1s:4c:1t", "r1");
    let mut fx = Effects::default();
    c.submit(vec![job(4, 100), job(4, 100)], true, 0, &mut fx)
        .unwrap();
    for &(cpus, limit, at) in waiting {
        c.submit(vec![job(cpus, limit)], false, at, &mut fx)
            .unwrap();
    }
    for n in 0..waiting.len() {
        let j = format!("j-{}", n + 3);
        assert!(running_on(&c, &j).is_none(), "{j} waits");
    }
    let held = node_of(&c, "j-3");
    let other = if held == "a" { "b" } else { "a" };
    let leaf = c.engine.leaf(&held);
    assert_eq!(
        c.engine.sched().and_then(|s| s.domain_protected(leaf?)),
        leaf,
        "j-3 holds the reservation"
    );
    let running = if running_on(&c, "j-1").as_deref() == Some(other) {
        "j-1"
    } else {
        "j-2"
    };
    let fx = finish(&mut c, other, running, 500_000);
    c.check().unwrap();
    (assigns(&fx), vec![(other.to_string(), started.to_string())])
}

/// The domain's queue by deadline (`SchedConfig::deadline_order`:
/// `queued_at` + remaining limit), against shortest limit first and
/// arrival order (aging off). j-3 (1,000 s) waits from 1 s; j-4 (300 s)
/// waits from 2 s; j-5 (50 s) arrives at 400 s. At 500 s it starts, by
/// deadline, j-4 (302 s, before j-5's 450 s and j-3's 1,001 s): a long
/// job passed over while shorter ones arrive later than its deadline
/// starts ahead of them; shortest first, j-5 (the shortest limit) and
/// j-4 keeps waiting; in arrival order, j-3 (moved from its node as a
/// steal).
#[test]
fn by_deadline_a_long_job_starts_before_a_shorter_later_one() {
    for (shortest, deadline, started) in [
        (true, true, "j-4"),
        (true, false, "j-5"),
        (false, false, "j-3"),
    ] {
        let waiting = [(4, 1_000, 1_000), (4, 300, 2_000), (4, 50, 400_000)];
        let (got, want) = assigned_when_the_other_node_frees(
            shortest,
            deadline,
            false,
            sched::WidestFirst::Never,
            &waiting,
            started,
        );
        assert_eq!(got, want, "shortest {shortest} deadline {deadline}");
    }
}

/// Aging bounded by each job's own limit (`SchedConfig::limit_aging`),
/// against the deadline order, shortest limit first and arrival order.
/// j-3 (1,000 s) waits from 1 s, j-4 (300 s) from 2 s, j-5 (200 s) from
/// 150 s, j-6 (50 s) from 480 s. At 500 s, j-4 and j-5 have waited
/// longer than their limits (overdue), j-6 and j-3 have not: with aging
/// the shortest overdue job, j-5, starts; by deadline j-4 (302 s, before
/// j-5's 350 s); shortest first j-6; in arrival order j-3.
#[test]
fn with_aging_an_overdue_job_starts_before_a_shorter_fresh_one() {
    for (deadline, aging, shortest, started) in [
        (false, true, true, "j-5"),
        (true, false, true, "j-4"),
        (false, false, true, "j-6"),
        (false, false, false, "j-3"),
    ] {
        let waiting = [
            (4, 1_000, 1_000),
            (4, 300, 2_000),
            (4, 200, 150_000),
            (4, 50, 480_000),
        ];
        let (got, want) = assigned_when_the_other_node_frees(
            shortest,
            deadline,
            aging,
            sched::WidestFirst::Never,
            &waiting,
            started,
        );
        assert_eq!(
            got, want,
            "deadline {deadline} aging {aging} shortest {shortest}"
        );
    }
}

/// The widest job that fits first (`SchedConfig::widest_first`), among
/// overdue jobs and among fresh ones, against shortest limit first. j-3
/// (4 CPUs, 1,000 s) waits from 1 s and holds the reservation. Overdue:
/// j-4 (4 CPUs, 300 s) from 2 s and j-5 (1 CPU, 200 s) from 150 s have
/// both waited past their limits at 500 s. Fresh: j-4 (4 CPUs, 300 s)
/// from 400 s and j-5 (1 CPU, 50 s) from 480 s have not. At 500 s a whole
/// node frees: widest first it goes to j-4, whose four CPUs seldom free at
/// once; shortest first to j-5, which leaves three CPUs no waiting job
/// fits.
#[test]
fn a_freed_node_goes_to_the_widest_job() {
    use sched::WidestFirst::{Always, Never, Overdue};
    let overdue = [(4, 1_000, 1_000), (4, 300, 2_000), (1, 200, 150_000)];
    let fresh = [(4, 1_000, 1_000), (4, 300, 400_000), (1, 50, 480_000)];
    for (waiting, widest, started) in [
        (overdue, Always, "j-4"),
        (overdue, Overdue, "j-4"),
        (overdue, Never, "j-5"),
        (fresh, Always, "j-4"),
        (fresh, Overdue, "j-5"),
        (fresh, Never, "j-5"),
    ] {
        let (got, want) =
            assigned_when_the_other_node_frees(true, false, true, widest, &waiting, started);
        assert_eq!(got, want, "{waiting:?} {widest:?}");
    }
}

/// The pending reason follows the protection: with one reservation per
/// domain the older head (j-3) is told when running jobs' timeouts free
/// its CPUs, the younger (j-4) that it holds no reservation, and by whom
/// it is held; per-node EASY gives both a start time.
#[test]
fn the_unprotected_head_is_told_it_holds_no_reservation() {
    use proto::v1::PendingReasonKind as Kind;
    for domain_reservation in [false, true] {
        let mut c = cluster(domain_reservation, false);
        let (old, young) = two_blocked_heads(&mut c);
        let r3 = c.pending_reason("j-3", 10).expect("j-3 waits");
        assert_eq!(
            (r3.kind, r3.node.as_str()),
            (Kind::Resources as i32, old.as_str())
        );
        assert!(r3.until_ms > 0, "{r3:?}");
        let r4 = c.pending_reason("j-4", 10).expect("j-4 waits");
        assert_eq!(
            (r4.kind, r4.node.as_str()),
            (Kind::Resources as i32, young.as_str())
        );
        if domain_reservation {
            assert_eq!(r4.until_ms, 0, "{r4:?}");
            assert!(
                r4.message.contains(&format!("held by j-3 on {old}")),
                "{}",
                r4.message
            );
        } else {
            assert!(r4.until_ms > 0, "{r4:?}");
            assert!(!r4.message.contains("not reserved"), "{}", r4.message);
        }
    }
}
