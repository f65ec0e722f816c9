//! Work conservation at cluster level: the idle-balance pass and EASY
//! backfill as the dispatcher drives them (register, submit, finish,
//! tick), each checked on the jobs' phases, the `Assign`s sent and the
//! `Move`s recorded.

use super::tests::{
    assigns, finish_on as finish, job_with_limit as job, node_in_rack as node, node_of,
};
use super::*;

fn cluster(steal: bool, idle_balance: bool, backfill: bool) -> Cluster {
    let mut cfg = ClusterConfig::default();
    cfg.engine.steal = steal;
    cfg.engine.steal_cross_llc = true;
    cfg.engine.idle_balance = idle_balance;
    cfg.engine.backfill = backfill;
    Cluster::new(cfg)
}

/// Rack r1 holds a 4-CPU node, rack r2 a 2-CPU one. j-1 (4 CPUs) fills
/// the big node, j-2 (2) the small one, j-3 (2) finds no room and waits
/// on the least-loaded node (a tie, the first: the big node, rack r1).
/// Returns the cluster with j-3 waiting there.
fn j3_waiting_on_r1(c: &mut Cluster) {
    node(c, "big", "1s:4c:1t", "r1");
    node(c, "small", "1s:2c:1t", "r2");
    let mut fx = Effects::default();
    c.submit(vec![job(4, 0), job(2, 0), job(2, 0)], true, 1, &mut fx)
        .unwrap();
    assert_eq!(node_of(c, "j-1"), "big");
    assert_eq!(node_of(c, "j-2"), "small");
    assert!(matches!(
        c.phase("j-3"),
        Some(Phase::Queued { node, waiting: true, .. }) if node == "big"
    ));
}

/// The idle-balance pass run by a finish: the small node's job ends,
/// newidle stealing is off, and the pass pulls j-3 from the other rack
/// of the zone (a `Balanced` move, same zone), which is then sent there.
#[test]
fn idle_balance_on_finish_pulls_from_another_rack_of_the_zone() {
    let mut c = cluster(false, true, false);
    j3_waiting_on_r1(&mut c);
    let mut fx = finish(&mut c, "small", "j-2", 10);
    assert_eq!(assigns(&fx), vec![("small".to_string(), "j-3".to_string())]);
    let pulls: Vec<&Move> = fx.moves.iter().filter(|m| m.is_steal()).collect();
    assert_eq!(pulls.len(), 1, "{:?}", fx.moves);
    assert_eq!(pulls[0].kind, MoveKind::Balanced(StealLevel::SameZone));
    assert_eq!(
        (pulls[0].from.as_str(), pulls[0].to.as_str()),
        ("big", "small")
    );
    assert_eq!(c.recent_steals().count(), 1);
    assert!(matches!(
        c.phase("j-3"),
        Some(Phase::Assigned { node, via: Via::Stolen { from, level: StealLevel::SameZone }, .. })
            if node == "small" && from == "big"
    ));
    // Persisted like a steal: the assignment is written.
    c.write_back(&mut fx);
    assert!(fx.writes.iter().any(|w| matches!(
        w, crate::store::Write::PutJob(j) if j.id() == "j-3" && j.node == "small"
    )));
    c.check().unwrap();
}

/// Without the pass (and without newidle stealing) the same finish
/// leaves j-3 waiting on the busy node while the small one idles.
#[test]
fn without_idle_balance_the_job_stays_behind() {
    let mut c = cluster(false, false, false);
    j3_waiting_on_r1(&mut c);
    let fx = finish(&mut c, "small", "j-2", 10);
    assert!(assigns(&fx).is_empty());
    assert_eq!(node_of(&c, "j-3"), "big");
}

/// The newidle steal across racks: the small node goes idle and steals
/// j-3 from the other rack of its zone at once (a `Stolen` move).
#[test]
fn idle_node_steals_from_another_rack_of_the_zone() {
    let mut c = cluster(true, false, false);
    j3_waiting_on_r1(&mut c);
    let fx = finish(&mut c, "small", "j-2", 10);
    assert_eq!(assigns(&fx), vec![("small".to_string(), "j-3".to_string())]);
    assert!(
        fx.moves
            .iter()
            .any(|m| m.kind == MoveKind::Stolen(StealLevel::SameZone))
    );
}

/// EASY backfill on one node: j-1 (2 of 4 CPUs, 100 s limit) runs, j-2
/// (4 CPUs) waits with a reservation at j-1's limit; j-3 (2 CPUs, 50 s)
/// cannot delay it and starts now; j-4 (2 CPUs, 500 s) would, and waits.
#[test]
fn backfill_starts_what_cannot_delay_the_head_and_refuses_what_would() {
    let mut c = cluster(true, true, true);
    node(&mut c, "n", "1s:4c:1t", "r1");
    let mut fx = Effects::default();
    c.submit(vec![job(2, 100), job(4, 1000)], true, 1_000, &mut fx)
        .unwrap();
    assert_eq!(assigns(&fx), vec![("n".to_string(), "j-1".to_string())]);
    let res = c
        .engine()
        .and_then(|e| e.reservation(0, super::engine::engine_ns(1_000)))
        .unwrap();
    assert_eq!(res.start, Some(super::engine::engine_ns(101_000)));
    let mut fx = Effects::default();
    c.submit(vec![job(2, 50)], false, 2_000, &mut fx).unwrap();
    assert_eq!(assigns(&fx), vec![("n".to_string(), "j-3".to_string())]);
    let mut fx = Effects::default();
    c.submit(vec![job(2, 500)], false, 3_000, &mut fx).unwrap();
    assert!(assigns(&fx).is_empty(), "{:?}", assigns(&fx));
    assert!(matches!(
        c.phase("j-4"),
        Some(Phase::Queued { waiting: true, .. })
    ));
    // The head starts when j-1 and j-3 end, before j-4.
    finish(&mut c, "n", "j-3", 40_000);
    let fx = finish(&mut c, "n", "j-1", 60_000);
    assert_eq!(assigns(&fx), vec![("n".to_string(), "j-2".to_string())]);
    c.check().unwrap();
}

/// A job without a time limit can never be shown to end before the
/// head's reservation: it does not backfill.
#[test]
fn backfill_needs_a_time_limit() {
    let mut c = cluster(true, true, true);
    node(&mut c, "n", "1s:4c:1t", "r1");
    let mut fx = Effects::default();
    c.submit(
        vec![job(2, 100), job(4, 0), job(2, 0)],
        true,
        1_000,
        &mut fx,
    )
    .unwrap();
    assert_eq!(assigns(&fx), vec![("n".to_string(), "j-1".to_string())]);
}
