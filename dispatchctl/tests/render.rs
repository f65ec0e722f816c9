//! What users read, from hand-built API messages: the `ls` and `nodes`
//! tables (alignment, truncation, placeholders), the `get` and `node show`
//! detail views, the JSON / YAML views (stable snake_case names, lower-case
//! enums, nulls for unset values), and `top`'s text snapshot and
//! full-screen frame.

use std::collections::HashMap;

use dispatchctl::commands::{job_detail, jobs_table, node_detail, nodes_table};
use dispatchctl::output::{to_json, to_yaml};
use dispatchctl::top::{Snapshot, View, draw, render_text};
use dispatchctl::view::{JobListView, JobView, NodeListView, NodeView};
use proto::v1 as pb;
use ratatui::Terminal;
use ratatui::backend::TestBackend;

/// 2026-01-01 00:10:00Z.
const NOW: i64 = 1_767_226_200_000;
const MIN: i64 = 60_000;

fn spec(name: &str, cpus: u32, latency_nice: i32) -> pb::JobSpec {
    pb::JobSpec {
        name: name.to_string(),
        command: vec![
            "python".into(),
            "train.py".into(),
            "--lr".into(),
            "0.1 0.2".into(),
        ],
        cpus,
        latency_nice,
        alignment: pb::Alignment::Llc as i32,
        env: HashMap::from([("B".into(), "2".into()), ("A".into(), "1".into())]),
        node_selector: HashMap::from([("zone".into(), "z1".into())]),
        memory_bytes: 4 << 30,
        timeout_ms: 3_600_000,
        ..Default::default()
    }
}

fn jobs() -> Vec<pb::Job> {
    vec![
        pb::Job {
            id: "j-12".into(),
            spec: Some(spec("train", 8, -5)),
            state: pb::JobState::Running as i32,
            node: "node-2".into(),
            cpus: vec![0, 1, 2, 3, 32, 33, 34, 35],
            gpus: vec![4, 5],
            reason: "wake_affine: near waker j-3 on node-2".into(),
            attempt: 1,
            submit_time_ms: NOW - 5 * MIN,
            start_time_ms: NOW - 4 * MIN - 30_000,
            ..Default::default()
        },
        pb::Job {
            id: "j-11".into(),
            spec: Some(spec("", 64, 0)),
            state: pb::JobState::Pending as i32,
            reason: "busy: no node has 64 free CPUs on one llc".into(),
            pending_reason: Some(pb::PendingReason {
                kind: pb::PendingReasonKind::Reservation as i32,
                node: "node-2".into(),
                jobs_ahead: 1,
                until_ms: NOW + 90_000,
                message: "64 CPUs are free on node-2, but starting it would delay the \
                          reservation of j-7"
                    .into(),
            }),
            attempt: 1,
            submit_time_ms: NOW - 42_000,
            ..Default::default()
        },
        pb::Job {
            id: "j-10.3".into(),
            spec: Some(spec(
                "a-very-long-job-name-that-will-not-fit-in-the-column",
                1,
                0,
            )),
            state: pb::JobState::Failed as i32,
            node: "node-1".into(),
            cpus: vec![5],
            exit_code: 0,
            signal: 9,
            reason: "timeout".into(),
            attempt: 2,
            submit_time_ms: NOW - 3 * 60 * MIN,
            start_time_ms: NOW - 3 * 60 * MIN + 1000,
            end_time_ms: NOW - 2 * 60 * MIN,
            array_id: "j-10".into(),
            array_index: 3,
            owner: "alice".into(),
            ..Default::default()
        },
        pb::Job {
            id: "j-9".into(),
            spec: Some(spec("etl", 2, 0)),
            state: pb::JobState::Succeeded as i32,
            node: "node-1".into(),
            cpus: vec![6, 7],
            reason: "steal: from node-4 (same rack), then ran to completion without any trouble"
                .into(),
            attempt: 1,
            submit_time_ms: NOW - 2 * 86_400_000,
            start_time_ms: NOW - 2 * 86_400_000 + 2000,
            end_time_ms: NOW - 2 * 86_400_000 + 2000 + 850,
            ..Default::default()
        },
    ]
}

fn group(cpus: &[u32]) -> pb::CpuGroup {
    pb::CpuGroup {
        cpus: cpus.to_vec(),
    }
}

fn nodes() -> Vec<pb::Node> {
    let topo = pb::Topology {
        cpus: (0..8).collect(),
        smt: vec![
            group(&[0, 4]),
            group(&[1, 5]),
            group(&[2, 6]),
            group(&[3, 7]),
        ],
        llc: vec![group(&[0, 1, 4, 5]), group(&[2, 3, 6, 7])],
        numa: vec![group(&(0..8).collect::<Vec<_>>())],
        package: vec![group(&(0..8).collect::<Vec<_>>())],
    };
    let cpu = |c: u32, busy: bool| pb::CpuLoad {
        cpu: c,
        busy,
        runnable: u32::from(busy),
    };
    vec![
        pb::Node {
            name: "node-1".into(),
            labels: HashMap::from([
                ("topology.kubernetes.io/zone".into(), "z1".into()),
                ("dispatch/rack".into(), "r1".into()),
            ]),
            topology: Some(topo.clone()),
            load: Some(pb::NodeLoad {
                cpus: (0..8).map(|c| cpu(c, c == 5 || c == 6 || c == 7)).collect(),
                overloaded: vec![7],
                avg_idle_ns: 12_500,
                free: Some(pb::FreeSummary {
                    core: 2,
                    llc: 4,
                    numa: 5,
                    package: 5,
                    any: 5,
                }),
                running_jobs: 2,
                waiting_jobs: 1,
                schedstats: HashMap::from([("steals".into(), 3), ("failed_steals".into(), 1)]),
            }),
            state: pb::NodeState::Ready as i32,
            last_heartbeat_ms: NOW - 1500,
            sockets: 1,
            numa_nodes: 1,
            llcs: 2,
            cores: 4,
            threads_per_core: 2,
            zone: "z1".into(),
            rack: "r1".into(),
            gpus: 2,
            gpus_free: 1,
            gangs: vec!["j-7".into()],
            devices: vec![
                pb::Device {
                    kind: pb::DeviceKind::Gpu as i32,
                    index: 0,
                    pci_address: "0000:1a:00.0".into(),
                    numa_node: Some(0),
                    vendor: "nvidia".into(),
                    model: "10de:20b0".into(),
                    nvidia_minor: Some(2),
                    locality: vec![0, 0, 0, 0],
                    ..Default::default()
                },
                pb::Device {
                    kind: pb::DeviceKind::Gpu as i32,
                    index: 1,
                    pci_address: "0000:1b:00.0".into(),
                    vendor: "nvidia".into(),
                    model: "10de:20b0".into(),
                    ..Default::default()
                },
            ],
        },
        pb::Node {
            name: "node-2".into(),
            topology: Some(pb::Topology {
                cpus: (0..64).collect(),
                ..Default::default()
            }),
            load: Some(pb::NodeLoad {
                cpus: (0..64).map(|c| cpu(c, c < 8)).collect(),
                free: Some(pb::FreeSummary {
                    core: 2,
                    llc: 8,
                    numa: 24,
                    package: 24,
                    any: 56,
                }),
                running_jobs: 1,
                ..Default::default()
            }),
            state: pb::NodeState::Draining as i32,
            sockets: 2,
            numa_nodes: 2,
            llcs: 4,
            cores: 32,
            threads_per_core: 2,
            zone: "z1".into(),
            rack: "r2".into(),
            ..Default::default()
        },
        pb::Node {
            name: "node-3".into(),
            state: pb::NodeState::Down as i32,
            sockets: 1,
            numa_nodes: 1,
            llcs: 1,
            cores: 4,
            threads_per_core: 1,
            zone: "z2".into(),
            ..Default::default()
        },
    ]
}

#[test]
fn ls_table() {
    let out = jobs_table(&jobs(), NOW, false);
    let expected = "\
ID       NAME                       STATE       NODE     CPUS   AGE   DURATION    EXIT   REASON
j-12     train                      running     node-2      8    5m      4m30s       -   wake_affine: near waker j-3 on node-2
j-11     -                          pending     -          64   42s          -       -   reservation: 64 CPUs are free on node-2, but st…
j-10.3   a-very-long-job-name-th…   failed      node-1      1    3h     59m59s   sig 9   timeout
j-9      etl                        succeeded   node-1      2    2d      850ms       0   steal: from node-4 (same rack), then ran to com…
";
    assert_eq!(out, expected, "\n{out}");
    // Every line's columns start at the same offsets as the header's.
    let header = out.lines().next().expect("header");
    let reason_at = header.find("REASON").expect("REASON");
    for line in out.lines().skip(1) {
        // Count characters, not bytes: `…` is one column but three bytes.
        let chars: Vec<char> = line.chars().collect();
        assert_eq!(chars[reason_at - 3..reason_at], [' '; 3], "{line}");
        assert_ne!(chars[reason_at], ' ', "{line}");
        assert!(!line.ends_with(' '));
    }
    // -o wide keeps long cells whole.
    let wide = jobs_table(&jobs(), NOW, true);
    assert!(wide.contains("a-very-long-job-name-that-will-not-fit-in-the-column"));
    assert!(wide.contains("without any trouble"));
}

#[test]
fn nodes_table_shows_topology_and_free_cpus_per_level() {
    let out = nodes_table(&nodes(), false);
    let expected = "\
NAME     STATE      ZONE   RACK   SOCKETS   NUMA   LLC   CORES   T/C   CPUS   GPUS   GANGS   BUSY   FREE:CORE   LLC   NUMA   PKG   ANY   RUN   WAIT
node-1   ready      z1     r1           1      1     2       4     2      8    1/2   j-7        3           2     4      5     5     5     2      1
node-2   draining   z1     r2           2      2     4      32     2     64      -   -          8           2     8     24    24    56     1      0
node-3   down       z2     -            1      1     1       4     1      4      -   -          -           -     -      -     -     -     -      -
";
    assert_eq!(out, expected, "\n{out}");
}

#[test]
fn get_detail_view() {
    let out = job_detail(&jobs()[0], NOW);
    for line in [
        "ID:            j-12",
        "State:         running",
        "Reason:        wake_affine: near waker j-3 on node-2",
        "Node:          node-2",
        "CPUs:          0-3,32-35 (8)",
        "GPUs:          4-5 (2)",
        "Exit:          -",
        "Submitted:     2026-01-01 00:05:00Z (5m ago)",
        "Ended:         -",
        "Run time:      4m30s",
        "Command:       python train.py --lr '0.1 0.2'",
        "Memory:        4GiB",
        "Alignment:     llc",
        "Policy:        spread",
        "Selector:      zone=z1",
        "Latency-nice:  -5",
        "Timeout:       1h",
        "Env:           A=1 B=2",
    ] {
        assert!(out.lines().any(|l| l == line), "missing {line:?} in\n{out}");
    }
    assert!(
        !out.contains("Waiting"),
        "a running job does not wait:\n{out}"
    );
    let pending = job_detail(&jobs()[1], NOW);
    for line in [
        "Reason:        busy: no node has 64 free CPUs on one llc",
        "Waiting:       reservation: 64 CPUs are free on node-2, but starting it would delay the reservation of j-7",
        "Waiting on:    node-2",
        "Jobs ahead:    1",
        "Until:         2026-01-01 00:11:30Z (in 1m30s)",
    ] {
        assert!(
            pending.lines().any(|l| l == line),
            "missing {line:?} in\n{pending}"
        );
    }
    let failed = job_detail(&jobs()[2], NOW);
    assert!(failed.contains("Exit:          sig 9"), "{failed}");
    assert!(
        failed.contains("Array:         j-10 (element 3)"),
        "{failed}"
    );
}

#[test]
fn node_detail_view() {
    let out = node_detail(&nodes()[0], NOW);
    for line in [
        "Name:        node-1",
        "Labels:      dispatch/rack=r1 topology.kubernetes.io/zone=z1",
        "Heartbeat:   1s ago",
        "Topology:    1 sockets, 1 NUMA nodes, 2 LLCs, 4 cores x 2 threads, 8 CPUs",
        "LLCs:        0-1,4-5  2-3,6-7",
        "Busy CPUs:   3 of 8",
        "Free CPUs:   core 2  llc 4  numa 5  package 5  any 5",
        "Overloaded:  7",
        "Avg idle:    12.5us",
        "Schedstats:  failed_steals=1 steals=3",
        "GPUs:        1 of 2 free",
        "Device:      gpu 0 0000:1a:00.0 nvidia 10de:20b0 numa 0 /dev/nvidia2",
        "Device:      gpu 1 0000:1b:00.0 nvidia 10de:20b0 numa -",
    ] {
        assert!(out.lines().any(|l| l == line), "missing {line:?} in\n{out}");
    }
    let down = node_detail(&nodes()[2], NOW);
    assert!(
        down.lines()
            .any(|l| l.starts_with("Load:") && l.ends_with("  not reported yet")),
        "{down}"
    );
}

#[test]
fn job_json_view_has_stable_names_and_lower_case_enums() {
    let list = JobListView {
        jobs: jobs().iter().map(JobView::from).collect(),
    };
    let v: serde_json::Value =
        serde_json::from_str(&to_json(&list).expect("json")).expect("valid json");
    let running = &v["jobs"][0];
    let mut keys: Vec<&str> = running
        .as_object()
        .expect("object")
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "array_id",
            "array_index",
            "attempt",
            "cpus",
            "end_time_ms",
            "exit_code",
            "gang_id",
            "gang_index",
            "gang_size",
            "gpus",
            "id",
            "name",
            "node",
            "owner",
            "pending_reason",
            "reason",
            "signal",
            "spec",
            "start_time_ms",
            "state",
            "submit_time_ms"
        ]
    );
    assert_eq!(running["state"], "running");
    assert_eq!(running["spec"]["alignment"], "llc");
    assert_eq!(running["spec"]["policy"], "spread");
    assert_eq!(running["spec"]["latency_nice"], -5);
    assert_eq!(running["spec"]["memory_bytes"], 4u64 << 30);
    assert_eq!(
        running["spec"]["env"],
        serde_json::json!({"A": "1", "B": "2"})
    );
    assert_eq!(
        running["cpus"],
        serde_json::json!([0, 1, 2, 3, 32, 33, 34, 35])
    );
    assert_eq!(running["gpus"], serde_json::json!([4, 5]));
    // Unset values are null, not 0 or "".
    assert!(running["exit_code"].is_null());
    assert!(running["signal"].is_null());
    assert!(running["end_time_ms"].is_null());
    assert!(running["array_id"].is_null());
    assert!(running["gang_id"].is_null() && running["gang_index"].is_null());
    assert!(
        running["spec"]["nodes"].is_null(),
        "not a gang: no gang fields"
    );
    assert!(v["jobs"][1]["node"].is_null());
    let failed = &v["jobs"][2];
    assert_eq!(failed["state"], "failed");
    assert_eq!(failed["exit_code"], 0);
    assert_eq!(failed["signal"], 9);
    assert_eq!(failed["array_id"], "j-10");
    assert_eq!(failed["array_index"], 3);
    assert_eq!(failed["owner"], "alice");
    assert!(running["owner"].is_null(), "no owner without tokens");
    // Why a job waits: the kind by name, nulls for what is not set.
    assert!(running["pending_reason"].is_null());
    assert_eq!(
        v["jobs"][1]["pending_reason"],
        serde_json::json!({
            "kind": "reservation",
            "node": "node-2",
            "jobs_ahead": 1,
            "until_ms": NOW + 90_000,
            "message": "64 CPUs are free on node-2, but starting it would delay the reservation of j-7",
        })
    );
    let mut unknown = jobs()[1].clone();
    if let Some(r) = unknown.pending_reason.as_mut() {
        r.kind = 999;
        r.node.clear();
        r.until_ms = 0;
    }
    let u: serde_json::Value =
        serde_json::from_str(&to_json(&JobView::from(&unknown)).expect("json")).expect("json");
    assert_eq!(u["pending_reason"]["kind"], "unknown");
    assert!(u["pending_reason"]["node"].is_null());
    assert!(u["pending_reason"]["until_ms"].is_null());
}

#[test]
fn yaml_view_matches_json_view() {
    let list = NodeListView {
        nodes: nodes().iter().map(NodeView::from).collect(),
    };
    let yaml = to_yaml(&list).expect("yaml");
    assert!(yaml.contains("state: draining"), "{yaml}");
    assert!(yaml.contains("threads_per_core: 2"), "{yaml}");
    let from_yaml: serde_json::Value = serde_yaml::from_str(&yaml).expect("yaml parses");
    let from_json: serde_json::Value =
        serde_json::from_str(&to_json(&list).expect("json")).expect("json parses");
    assert_eq!(from_yaml, from_json);
    let n1 = &from_json["nodes"][0];
    assert_eq!(
        n1["load"]["free"],
        serde_json::json!({"core": 2, "llc": 4, "numa": 5, "package": 5, "any": 5})
    );
    assert_eq!(n1["load"]["busy_cpus"], 3);
    assert_eq!(
        n1["topology"]["llc"],
        serde_json::json!([[0, 1, 4, 5], [2, 3, 6, 7]])
    );
    assert_eq!(n1["cpus"], 8);
    assert!(from_json["nodes"][2]["load"].is_null());
    assert_eq!(from_json["nodes"][2]["state"], "down");
}

#[test]
fn top_text_snapshot() {
    let snap = Snapshot::new("http://127.0.0.1:50051", NOW, &nodes(), &jobs());
    let out = render_text(&snap);
    let expected = "\
dispatchctl top   http://127.0.0.1:50051   2026-01-01 00:10:00Z
nodes: 3 (1 ready, 1 draining, 1 down)   cpus: 11/76 busy (14%)   jobs: 1 pending, 0 assigned, 1 running   gangs: 1 on 1 node

NODE     STATE      ZONE   RACK   BUSY                          GPUS   GANGS   FREE:CORE   LLC   NUMA   PKG   ANY   RUN   WAIT
node-1   ready      z1     r1     [||||||||            ] 3/8     1/2       1           2     4      5     5     5     2      1
node-2   draining   z1     r2     [|||                 ] 8/64      -       0           2     8     24    24    56     1      0
node-3   down       z2     -      [                    ] -/4       -       0           -     -      -     -     -     0      0

ZONE   RACK   NODES   BUSY   GPUS   GANGS
z1     r1         1    3/8    1/2       1
z1     r2         1   8/64      -       0
z2     -          1    0/4      -       0

QUEUE      LATENCY(<0)   NORMAL(>=0)   TOTAL
pending              0             1       1
assigned             0             0       0
running              1             0       1
";
    assert_eq!(out, expected, "\n{out}");
}

#[test]
fn top_frame_renders_nodes_and_queues() {
    let snap = Snapshot::new("http://127.0.0.1:50051", NOW, &nodes(), &jobs());
    let view = View {
        snapshot: Some(snap),
        error: None,
        scroll: 0,
    };
    let mut terminal = Terminal::new(TestBackend::new(120, 20)).expect("test terminal");
    terminal.draw(|f| draw(f, &view)).expect("draw");
    let buf = terminal.backend().buffer().clone();
    let text: String = (0..buf.area.height)
        .map(|y| {
            (0..buf.area.width)
                .map(|x| buf[(x, y)].symbol().to_string())
                .collect::<String>()
                + "\n"
        })
        .collect();
    for needle in [
        "dispatchctl top",
        "Nodes (3)",
        "node-1",
        "draining",
        "[||||||||            ] 3/8",
        "GPUS",
        "1/2",
        "Queues by latency class",
        "LATENCY(<0)",
        "q quit",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
}
