//! Unit tests of the web snapshot: aggregates equal brute-force sums over
//! nodes and jobs, the top-level JSON stays per rack at 10,000 nodes, and
//! placements, queues and steals show up.

use std::time::{Duration, Instant};

use proto::v1::{CpuLoad, JobSpec, NodeLoad};

use super::*;
use crate::cluster::tests::register_node;
use crate::cluster::{ClusterConfig, Effects, RECENT_MOVES};
use crate::store::NodeAdmin;

fn register(c: &mut Cluster, name: &str, spec: &str, zone: &str, rack: &str, fx: &mut Effects) {
    register_node(c, name, spec, (zone, rack), 0, fx);
}

fn job(cpus: u32, latency_nice: i32) -> JobSpec {
    JobSpec {
        command: vec!["true".into()],
        cpus,
        latency_nice,
        ..Default::default()
    }
}

/// Jobs by (state, class), counted over every job (what the metrics keep
/// incrementally).
fn job_counts(c: &Cluster) -> Vec<(JobState, &'static str, i64)> {
    let mut by: BTreeMap<(JobState, &'static str), i64> = BTreeMap::new();
    for j in c.jobs_matching(&[]) {
        let class = if j.spec.as_ref().is_some_and(|s| s.latency_nice < 0) {
            "latency"
        } else {
            "normal"
        };
        *by.entry((JobState::try_from(j.state).unwrap(), class))
            .or_default() += 1;
    }
    by.into_iter().map(|((s, c), n)| (s, c, n)).collect()
}

/// `zones` zones of `racks` racks of `per_rack` nodes ("2s:2c:1t": 4 CPUs in
/// 2 LLCs), with jobs on about a third of the CPUs, some nodes cordoned,
/// some disconnected and some reporting overloaded CPUs.
fn big_cluster(zones: usize, racks: usize, per_rack: usize) -> Cluster {
    let mut c = Cluster::new(ClusterConfig::default());
    let mut fx = Effects::default();
    let mut names = Vec::new();
    for z in 0..zones {
        for r in 0..racks {
            for n in 0..per_rack {
                let name = format!("node-z{z}-r{r}-{n:05}");
                register(
                    &mut c,
                    &name,
                    "2s:2c:1t",
                    &format!("zone-{z}"),
                    &format!("rack-{r:02}"),
                    &mut fx,
                );
                names.push(name);
            }
        }
    }
    c.settle(0, &mut fx);
    let nodes = names.len();
    let specs: Vec<JobSpec> = (0..nodes)
        .map(|i| job(1 + (i % 3) as u32, if i % 4 == 0 { -5 } else { 0 }))
        .collect();
    let mut fx = Effects::default();
    c.submit(specs, true, 1, &mut fx).unwrap();
    for (i, name) in names.iter().enumerate() {
        if i % 97 == 0 {
            c.set_node_admin(name, NodeAdmin::Cordoned, 2, &mut fx)
                .unwrap();
        } else if i % 89 == 0 {
            c.disconnected(name);
        } else if i % 13 == 0 {
            let load = NodeLoad {
                cpus: (0..4)
                    .map(|cpu| CpuLoad {
                        cpu,
                        busy: true,
                        runnable: 2,
                    })
                    .collect(),
                overloaded: vec![0, 1],
                running_jobs: 3,
                ..Default::default()
            };
            c.load_report(name, load, 3, &mut fx);
        }
    }
    c.settle(3, &mut fx);
    c
}

/// The same counts, recomputed node by node from the cluster's state.
fn brute_force(c: &Cluster) -> BTreeMap<(String, String), (Totals, u32)> {
    let mut out: BTreeMap<(String, String), (Totals, u32)> = BTreeMap::new();
    for n in c.nodes() {
        let e = out
            .entry((n.zone().to_string(), n.rack().to_string()))
            .or_default();
        let busy = u64::from(n.busy_cpus());
        let cpus = n.topology.cpus.len() as u64;
        let ready = !n.down && n.connected && n.admin == NodeAdmin::Ready;
        let rq = c
            .engine_leaf(&n.name)
            .map(|leaf| c.engine().unwrap().rq(leaf));
        let overloaded =
            rq.is_some_and(|rq| rq.is_overloaded()) || !n.load.to_proto().overloaded.is_empty();
        e.0.nodes += 1;
        e.0.down += u32::from(n.down || !n.connected);
        e.0.cordoned += u32::from(!n.down && n.connected && n.admin != NodeAdmin::Ready);
        e.0.cpus += cpus;
        e.0.busy_cpus += busy;
        e.0.free_cpus += if ready { cpus - busy } else { 0 };
        e.0.overloaded_nodes += u32::from(overloaded);
        e.0.queued_jobs += rq.map_or(0, |rq| rq.nr_waiting() as u64);
        e.0.running_jobs += u64::from(n.load.to_proto().running_jobs);
        e.0.gpus += u64::from(n.gpus);
        e.0.free_gpus += if ready {
            u64::from(c.gpus_free(&n.name))
        } else {
            0
        };
        if ready {
            // Free CPUs per LLC from the reported groups of CPU ids.
            for group in &n.topology.llc {
                let free = group
                    .cpus
                    .iter()
                    .filter(|&&id| {
                        let leaf = (0..n.cpu_topo().nr_leaves())
                            .find(|&l| n.cpu_topo().os_id(l) == u64::from(id))
                            .unwrap();
                        !n.is_busy(leaf)
                    })
                    .count() as u32;
                e.1 = e.1.max(free);
            }
        }
    }
    out
}

/// The aggregate's JSON without the (bounded) recent-moves lists.
fn aggregate_json_len(view: &ClusterView) -> usize {
    let mut v = view.clone();
    v.recent_placements.clear();
    v.recent_steals.clear();
    serde_json::to_vec(&v).unwrap().len()
}

#[test]
fn ten_thousand_nodes_aggregate_per_rack_and_equal_brute_force() {
    let (zones, racks, per_rack) = (4, 25, 100);
    let c = big_cluster(zones, racks, per_rack);
    assert_eq!(c.nodes().count(), 10_000);
    let counts = job_counts(&c);
    // The core's cost per publish (reported, not asserted: the machine is
    // shared); the best of a few runs.
    let mut best = Duration::MAX;
    for _ in 0..5 {
        let started = Instant::now();
        let _ = build(&c, &counts, 10);
        best = best.min(started.elapsed());
    }
    eprintln!("snapshot of 10,000 nodes built in {best:?} (best of 5)");
    // Of which the core's part, the copy (the rest is assembled off it).
    let mut copy = Duration::MAX;
    for _ in 0..5 {
        let started = Instant::now();
        let c = capture(&c, counts.clone(), 10);
        copy = copy.min(started.elapsed());
        assert_eq!(c.nodes(), 10_000);
    }
    eprintln!("of which copied on the core in {copy:?} (best of 5)");
    let snap = build(&c, &counts, 10);
    let view = &snap.cluster;

    // Every rack's totals and best LLC equal the brute-force sums.
    let expected = brute_force(&c);
    let got: BTreeMap<(String, String), (Totals, u32)> = view
        .zones
        .iter()
        .flat_map(|z| {
            z.racks.iter().map(|r| {
                (
                    (z.name.clone(), r.name.clone()),
                    (r.totals.clone(), r.max_free_llc),
                )
            })
        })
        .collect();
    assert_eq!(got, expected);
    // Zones and the cluster are the sums of their racks.
    let mut all = Totals::default();
    for z in &view.zones {
        let mut sum = Totals::default();
        for r in &z.racks {
            sum.add(&r.totals);
        }
        assert_eq!(z.totals, sum, "zone {}", z.name);
        all.add(&sum);
    }
    assert_eq!(view.totals, all);
    assert_eq!(view.totals.nodes, 10_000);
    // Busy CPUs equal the CPUs of the jobs on nodes.
    let held: u64 = c
        .jobs_matching(&[])
        .iter()
        .filter(|j| j.state == JobState::Assigned as i32 || j.state == JobState::Running as i32)
        .map(|j| u64::from(j.spec.as_ref().unwrap().cpus))
        .sum();
    assert!(held > 0);
    assert_eq!(view.totals.busy_cpus, held);
    assert!(view.totals.overloaded_nodes > 0 && view.totals.down > 0 && view.totals.cordoned > 0);
    // Queue depth by class from the job counts.
    let latency = view.queue.iter().find(|q| q.class == "latency").unwrap();
    let normal = view.queue.iter().find(|q| q.class == "normal").unwrap();
    assert_eq!(
        latency.assigned + normal.assigned,
        c.jobs_matching(&[])
            .iter()
            .filter(|j| j.state == JobState::Assigned as i32)
            .count() as i64
    );
    assert_eq!(latency.assigned + latency.pending, 2_500);
    assert!(view.recent_placements.len() == RECENT_MOVES);

    // Bounded: the aggregate is per rack, never per node.
    let nr_racks = zones * racks;
    let len = aggregate_json_len(view);
    assert!(
        len < 400 * nr_racks + 2048,
        "aggregate JSON of {len} bytes for {nr_racks} racks"
    );
    let text = serde_json::to_string(view).unwrap();
    let full = text.len();
    assert!(full < len + 2 * RECENT_MOVES * 400, "{full} bytes");
    let placed: std::collections::HashSet<&str> = view
        .recent_placements
        .iter()
        .map(|m| m.to.as_str())
        .collect();
    let named = c
        .nodes()
        .filter(|n| text.contains(&format!("\"{}\"", n.name)))
        .count();
    assert_eq!(named, placed.len(), "only recent moves name nodes");
    // Independent of the node count: the same racks with a tenth of the
    // nodes give (nearly) the same size; only numbers get shorter.
    let small = big_cluster(zones, racks, per_rack / 10);
    let small_len = aggregate_json_len(&build(&small, &job_counts(&small), 10).cluster);
    eprintln!(
        "aggregate JSON: {len} bytes at 10,000 nodes, {small_len} at 1,000 ({nr_racks} racks); \
         with the recent moves {full}"
    );
    assert!(
        len < small_len + small_len / 5,
        "10,000 nodes: {len} bytes; 1,000 nodes: {small_len} bytes"
    );

    // Drill down: one rack holds exactly its nodes.
    let key = ("zone-2".to_string(), "rack-07".to_string());
    let rack = &snap.racks[&key];
    assert_eq!(rack.nodes.len(), per_rack);
    assert!(rack.nodes.iter().all(|n| n.name.starts_with("node-z2-r7-")));
    assert_eq!(rack.totals, expected[&key].0);
    for n in &rack.nodes {
        assert_eq!(n.llc_cpus, vec![2, 2]);
        let free: u32 = n.llc_free.iter().sum();
        assert_eq!(free, n.cpus - n.busy_cpus, "{}", n.name);
    }
    let rack_len = serde_json::to_vec(rack).unwrap().len();
    eprintln!("one rack of {per_rack} nodes: {rack_len} bytes");
    assert!(rack_len < 400 * per_rack + 512, "{rack_len} bytes");
}

#[test]
fn queued_jobs_overload_and_steals_show_up() {
    let mut c = Cluster::new(ClusterConfig::default());
    let mut fx = Effects::default();
    register(&mut c, "a", "1s:2c:1t", "z1", "r1", &mut fx);
    register(&mut c, "b", "1s:2c:1t", "z1", "r1", &mut fx);
    c.settle(0, &mut fx);
    c.set_node_admin("b", NodeAdmin::Cordoned, 0, &mut fx)
        .unwrap();
    // Only a takes jobs: one runs, two queue on it (one latency-class).
    let mut fx = Effects::default();
    c.submit(vec![job(2, 0), job(2, -10), job(2, 0)], true, 1, &mut fx)
        .unwrap();
    let snap = build(&c, &job_counts(&c), 1);
    let rack = &snap.racks[&("z1".to_string(), "r1".to_string())];
    let a = rack.nodes.iter().find(|n| n.name == "a").unwrap();
    assert_eq!((a.busy_cpus, a.queued_jobs, a.overloaded), (2, 2, true));
    assert_eq!(a.llc_free, vec![0]);
    let b = rack.nodes.iter().find(|n| n.name == "b").unwrap();
    assert_eq!((b.state, b.llc_free.clone()), ("cordoned", vec![2]));
    assert_eq!(rack.totals.overloaded_nodes, 1);
    assert_eq!(rack.totals.queued_jobs, 2);
    assert_eq!(rack.totals.free_cpus, 0, "b takes no jobs");
    let pending: Vec<(&str, i64)> = snap
        .cluster
        .queue
        .iter()
        .map(|q| (q.class, q.pending))
        .collect();
    assert_eq!(pending, vec![("latency", 1), ("normal", 1)]);
    assert_eq!(snap.cluster.recent_placements.len(), 1);
    assert_eq!(snap.cluster.recent_placements[0].to, "a");
    assert!(snap.cluster.recent_steals.is_empty());
    // b comes back: it steals a queued job from a, its rack peer.
    let mut fx = Effects::default();
    c.set_node_admin("b", NodeAdmin::Ready, 2, &mut fx).unwrap();
    let snap = build(&c, &job_counts(&c), 2);
    let steals = &snap.cluster.recent_steals;
    assert_eq!(steals.len(), 1, "{steals:?}");
    assert_eq!(
        (
            steals[0].from.as_str(),
            steals[0].to.as_str(),
            steals[0].why.as_str()
        ),
        ("a", "b", "same rack")
    );
    assert_eq!(steals[0].at_ms, 2);
    let newest = &snap.cluster.recent_placements[0];
    assert_eq!(
        (newest.job.as_str(), newest.to.as_str()),
        (steals[0].job.as_str(), "b")
    );
    assert!(newest.why.starts_with("steal: b took it"), "{}", newest.why);
    assert_eq!(snap.cluster.engine_steals, 1);
    let rack = &snap.racks[&("z1".to_string(), "r1".to_string())];
    assert_eq!(rack.totals.busy_cpus, 4);
    assert_eq!(rack.totals.queued_jobs, 1);
}

/// The aggregate lists the PENDING jobs waiting longest, oldest first, each
/// with the reason the API gives for it, and never more than
/// [`WAITING_SHOWN`] of them.
#[test]
fn the_longest_waiting_jobs_say_why() {
    let mut c = Cluster::new(ClusterConfig::default());
    let mut fx = Effects::default();
    register(&mut c, "a", "1s:2c:1t", "z1", "r1", &mut fx);
    c.settle(0, &mut fx);
    // j-1 runs; j-2 (latency class) is next; j-3 waits behind it; j-4
    // fits no node.
    let mut fx = Effects::default();
    c.submit(
        vec![job(2, 0), job(2, -10), job(2, 0), job(16, 0)],
        true,
        1_000,
        &mut fx,
    )
    .unwrap();
    let snap = build(&c, &job_counts(&c), 5_000);
    let seen: Vec<(&str, &str, &str, u32, i64)> = snap
        .cluster
        .waiting
        .iter()
        .map(|w| {
            (
                w.job.as_str(),
                w.kind.as_str(),
                w.node.as_str(),
                w.jobs_ahead,
                w.waiting_ms,
            )
        })
        .collect();
    assert_eq!(
        seen,
        vec![
            ("j-2", "resources", "a", 0, 4_000),
            ("j-3", "queued_behind", "a", 1, 4_000),
            ("j-4", "no_match_cpus", "", 0, 4_000),
        ]
    );
    for w in &snap.cluster.waiting {
        let api = c.pending_reason(&w.job, 5_000).unwrap();
        assert_eq!((&w.message, w.until_ms), (&api.message, api.until_ms));
    }
    // Many waiting: the oldest WAITING_SHOWN.
    c.submit((0..30).map(|_| job(2, 0)).collect(), true, 6_000, &mut fx)
        .unwrap();
    let snap = build(&c, &job_counts(&c), 7_000);
    let ids: Vec<&str> = snap
        .cluster
        .waiting
        .iter()
        .map(|w| w.job.as_str())
        .collect();
    assert_eq!(ids.len(), WAITING_SHOWN);
    assert_eq!(&ids[..4], ["j-2", "j-3", "j-4", "j-5"]);
    assert_eq!(ids[WAITING_SHOWN - 1], format!("j-{}", WAITING_SHOWN + 1));
}

#[test]
fn publish_rebuilds_at_most_once_per_period() {
    let metrics = Arc::new(Metrics::new().unwrap());
    let web = Web::new(metrics);
    assert_eq!(web.snapshot().cluster.generated_ms, 0);
    let mut c = Cluster::new(ClusterConfig::default());
    let mut fx = Effects::default();
    register(&mut c, "a", "1s:2c:1t", "z1", "r1", &mut fx);
    c.settle(0, &mut fx);
    web.publish(&c, 5_000);
    web.wait_built();
    assert_eq!(web.snapshot().cluster.generated_ms, 5_000);
    assert_eq!(web.snapshot().cluster.totals.nodes, 1);
    web.publish(&c, 5_000 + PUBLISH_EVERY_MS - 1);
    web.wait_built();
    assert_eq!(web.snapshot().cluster.generated_ms, 5_000);
    web.publish(&c, 5_000 + PUBLISH_EVERY_MS);
    web.wait_built();
    assert_eq!(
        web.snapshot().cluster.generated_ms,
        5_000 + PUBLISH_EVERY_MS
    );
    // A clock that went back rebuilds at once.
    web.publish(&c, 1_000);
    web.wait_built();
    assert_eq!(web.snapshot().cluster.generated_ms, 1_000);
}

#[test]
fn the_page_is_self_contained() {
    assert!(PAGE.starts_with("<!doctype html>"));
    for external in ["http://", "https://", "<script src", "<link "] {
        assert!(!PAGE.contains(external), "the page loads {external}");
    }
    for api in ["/api/v1/cluster", "/api/v1/racks/"] {
        assert!(PAGE.contains(api), "the page uses {api}");
    }
}

#[test]
fn a_follower_names_the_leader_instead_of_a_stale_snapshot() {
    use crate::gate::{Gate, Role};
    let metrics = Arc::new(Metrics::new().unwrap());
    let web = Web::new(metrics);
    let mut c = Cluster::new(ClusterConfig::default());
    let mut fx = Effects::default();
    register(&mut c, "a", "1s:2c:1t", "z1", "r1", &mut fx);
    c.settle(0, &mut fx);
    web.publish(&c, 5_000);
    web.wait_built();
    // A single dispatcher (no gate) always leads.
    assert_eq!(web.not_leading(), None);
    let (tx, rx) = tokio::sync::watch::channel(Role::Starting);
    web.follow_role(Gate::new(rx));
    let starting = web.not_leading().unwrap();
    assert_eq!(starting.role, "starting");
    tx.send(Role::Follower {
        leader: Some("http://d2:50051".into()),
        leader_http: Some("http://d2:9100".into()),
    })
    .unwrap();
    let view = web.not_leading().unwrap();
    assert_eq!(view.role, "follower");
    assert_eq!(view.leader.as_deref(), Some("http://d2:9100"));
    assert_eq!(view.leader_grpc.as_deref(), Some("http://d2:50051"));
    assert_eq!(
        view.error,
        "this replica is a follower; the leader is at http://d2:9100"
    );
    let json = serde_json::to_value(&view).unwrap();
    assert_eq!(json["role"], "follower");
    assert_eq!(json["leader"], "http://d2:9100");
    // A leader without a web URL: the gRPC URL, and how to fix it.
    tx.send(Role::Follower {
        leader: Some("http://d2:50051".into()),
        leader_http: None,
    })
    .unwrap();
    let view = web.not_leading().unwrap();
    assert_eq!(view.leader, None);
    assert!(
        view.error.contains("--advertise-http-url"),
        "{}",
        view.error
    );
    // Stepping down clears what the old term published.
    web.clear();
    assert_eq!(web.snapshot().cluster.generated_ms, 0);
    assert_eq!(web.snapshot().cluster.totals.nodes, 0);
    web.publish(&c, 5_000);
    web.wait_built();
    assert_eq!(web.snapshot().cluster.totals.nodes, 1);
}
