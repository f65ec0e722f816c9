//! The Alibaba GPU trace format (`cluster-trace-gpu-v2023`): the parser on
//! good and bad rows, the mapping to jobs on the committed GENERATED
//! sample (`tests/data/gen_alibaba_sample.py`, fixed seed), and GPU
//! placement by least-loaded and the dispatcher on it: every job
//! finishes, and no node ever holds more GPUs (or CPUs) than it has.

mod common;

use std::process::Command;

use sim::alibaba::{self, AlibabaStats};
use sim::engine::{SimConfig, simulate};
use sim::gpufrag;
use sim::policy::PolicySpec;

const NODES: &str = "sn,cpu_milli,memory_mib,gpu,model\n";
const PODS: &str = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n";

#[test]
fn good_rows_map_to_jobs() {
    let nodes = alibaba::parse_nodes(
        &format!("{NODES}a,32000,1024,0,nan\nb,96000,4096,8,V100M32\n"),
        "n.csv",
    )
    .unwrap();
    assert_eq!(nodes.len(), 2);
    assert_eq!((nodes[1].gpu, nodes[1].model.as_str()), (8, "V100M32"));
    let pods = alibaba::parse_pods(
        &format!(
            "{PODS}\
             p0,88000,327680,8,1000,nan,Burstable,Succeeded,100,1432,100\n\
             p1,4000,15258,1,220,nan,BE,Running,50,345,50\n\
             p2,1500,32768,1,1000,V100M16|V100M32,LS,Running,60,80,65\n\
             p3,2000,100,0,0,nan,Guaranteed,Pending,70,,\n\
             p4,2000,100,0,0,,Guaranteed,Succeeded,70,90,\n\
             p5,1000,100,9,1000,nan,BE,Succeeded,200,300,200\n"
        ),
        "p.csv",
    )
    .unwrap();
    assert_eq!(pods[2].gpu_spec, "V100M16|V100M32");
    assert_eq!(pods[3].deletion_time, None);
    let layout = alibaba::to_layout(&nodes).unwrap();
    assert_eq!((layout.cpus(0), layout.gpus(0)), (32, 0));
    assert_eq!((layout.cpus(1), layout.gpus(1)), (96, 8));
    let (w, st) = alibaba::to_workload(&pods, &layout, "t").unwrap();
    assert_eq!(
        st,
        AlibabaStats {
            pods: 6,
            used: 4,
            no_end: 1,
            too_large: 1, // p5: 9 GPUs, no node has as many
            gpu_jobs: 3,
            shared_rounded: 1,
            cpu_rounded: 1,
            gpu_spec_ignored: 1,
            latency: 2,
            gpus_asked: 10,
        }
    );
    // In creation order: p1 (50), p2 (60), p4 (70), p0 (100).
    let s = sim::US_PER_S;
    assert_eq!(w.jobs[0].submit_us, 0);
    assert_eq!(w.jobs[0].duration_us, 295 * s);
    assert_eq!(
        (w.jobs[0].cpus, w.gpus_of(0), w.jobs[0].latency),
        (4, 1, false)
    );
    assert_eq!(w.jobs[1].submit_us, 10 * s);
    assert_eq!(w.jobs[1].duration_us, 15 * s, "from scheduled_time");
    assert_eq!(
        (w.jobs[1].cpus, w.gpus_of(1), w.jobs[1].latency),
        (2, 1, true)
    );
    assert_eq!(w.jobs[2].duration_us, 20 * s, "from creation_time");
    assert_eq!(w.gpus_of(2), 0);
    assert_eq!((w.jobs[3].cpus, w.gpus_of(3)), (88, 8));
}

/// Each bad row is refused with its line and column named.
#[test]
fn bad_rows_name_line_and_column() {
    let cases: [(&str, &str); 7] = [
        (
            "p,x,1,0,0,nan,LS,Running,1,2,1",
            "p.csv:2: column cpu_milli: \"x\"",
        ),
        (
            "p,1000,1,-1,0,nan,LS,Running,1,2,1",
            "p.csv:2: column num_gpu",
        ),
        (
            "p,1000,1,1,1500,nan,LS,Running,1,2,1",
            "p.csv:2: column gpu_milli",
        ),
        (
            "p,1000,1,1,500,nan,Gold,Running,1,2,1",
            "p.csv:2: column qos",
        ),
        (
            "p,1000,1,1,500,nan,LS,Running,10,2,10",
            "p.csv:2: column deletion_time",
        ),
        (
            "p,1000,1,1,500,nan,LS,Running,10,20,5",
            "p.csv:2: column scheduled_time",
        ),
        ("p,1000,1,1,500", "p.csv:2: column gpu_spec: missing"),
    ];
    for (row, want) in cases {
        let e = alibaba::parse_pods(&format!("{PODS}{row}\n"), "p.csv").unwrap_err();
        assert!(e.to_string().starts_with(want), "{row}: {e}");
    }
    // The line number counts the header and the good rows before it.
    let e = alibaba::parse_pods(
        &format!(
            "{PODS}a,1000,1,0,0,nan,BE,Running,1,2,1\n\nb,1000,1,0,0,nan,BE,Running,1,2,1.5\n"
        ),
        "p.csv",
    )
    .unwrap_err();
    assert!(
        e.to_string().starts_with("p.csv:4: column scheduled_time"),
        "{e}"
    );
    let e = alibaba::parse_pods("name,cpu_milli\n", "p.csv").unwrap_err();
    assert!(
        e.to_string()
            .starts_with("p.csv:1: column memory_mib: missing from the header"),
        "{e}"
    );
    for (row, want) in [
        ("a,500,1,0,nan", "n.csv:2: column cpu_milli"),
        (",32000,1,0,nan", "n.csv:2: column sn"),
        ("a,32000,1,many,nan", "n.csv:2: column gpu"),
    ] {
        let e = alibaba::parse_nodes(&format!("{NODES}{row}\n"), "n.csv").unwrap_err();
        assert!(e.to_string().starts_with(want), "{row}: {e}");
    }
}

/// Replay the records: no node ever holds more GPUs or CPUs than it has.
fn never_overcommitted(
    layout: &sim::layout::Layout,
    w: &sim::workload::Workload,
    out: &sim::engine::RunOutput,
) {
    let mut ev: Vec<(u64, i64, i64, u32)> = Vec::new();
    for (i, (j, r)) in w.jobs.iter().zip(&out.records).enumerate() {
        let g = w.gpus_of(i as u32) as i64;
        ev.push((r.start, j.cpus as i64, g, r.node));
        ev.push((r.end, -(j.cpus as i64), -g, r.node));
    }
    ev.sort_by_key(|&(t, c, _, _)| (t, c));
    let mut cpu = vec![0i64; layout.nr_nodes()];
    let mut gpu = vec![0i64; layout.nr_nodes()];
    for (t, c, g, n) in ev {
        cpu[n as usize] += c;
        gpu[n as usize] += g;
        assert!(
            cpu[n as usize] <= layout.cpus(n) as i64,
            "{} t={t}",
            out.policy
        );
        assert!(
            gpu[n as usize] <= layout.gpus(n) as i64,
            "{} t={t}: GPUs",
            out.policy
        );
    }
}

#[test]
fn the_sample_runs_with_gpus_under_least_loaded_and_ours() {
    let nodes = alibaba::read_nodes(&common::data("alibaba_nodes.sample.csv")).unwrap();
    let pods = alibaba::read_pods(&common::data("alibaba_pods.sample.csv")).unwrap();
    let layout = alibaba::to_layout(&nodes).unwrap();
    let (w, st) = alibaba::to_workload(&pods, &layout, "sample").unwrap();
    assert_eq!((st.pods, nodes.len()), (1500, 48));
    assert!(st.shared_rounded > 0 && st.no_end > 0 && st.gpu_jobs > 0);
    let cfg = SimConfig::default();
    for policy in ["least-loaded", "ours"] {
        let spec = PolicySpec::parse(policy).unwrap();
        let out = simulate(&layout, &w, &spec, &cfg, &mut |_| {}).unwrap();
        assert_eq!(out.unfinished, 0, "{policy}");
        never_overcommitted(&layout, &w, &out);
        let g = gpufrag::measure(&layout, &w, &out, 200);
        assert_eq!(g.gpus, 282);
        assert_eq!(g.gpu_jobs as usize, st.gpu_jobs, "{policy}");
        assert!(
            g.alloc_peak_pct > 50.0 && g.alloc_peak_pct <= 100.0,
            "{policy}: {g:?}"
        );
        assert!((0.0..=100.0).contains(&g.frag_mean_pct), "{policy}");
    }
    // The sampling baselines place no GPU jobs: refused, not ignored.
    let e = simulate(
        &layout,
        &w,
        &PolicySpec::parse("random").unwrap(),
        &cfg,
        &mut |_| {},
    )
    .unwrap_err();
    assert!(e.to_string().contains("GPU"), "{e}");
}

/// The generator is deterministic and the committed sample is its output.
#[test]
fn the_committed_sample_is_the_generators() {
    let dir = std::env::temp_dir().join(format!("alibaba-sample-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let status = Command::new("python3")
        .arg(common::data("gen_alibaba_sample.py"))
        .arg(&dir)
        .status();
    let Ok(status) = status else {
        assert!(std::env::var_os("CI").is_none(), "python3 missing in CI");
        eprintln!("python3 not found: generator not re-run");
        return;
    };
    assert!(status.success());
    for f in ["alibaba_nodes.sample.csv", "alibaba_pods.sample.csv"] {
        let a = std::fs::read(dir.join(f)).unwrap();
        let b = std::fs::read(common::data(f)).unwrap();
        assert!(a == b, "{f} differs from the generator's output");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `dispatch-sim alibaba` end to end: the GPU table, and a bad file's
/// error names its line and column.
#[test]
fn the_subcommand_reports_gpus_and_bad_rows() {
    let bin = env!("CARGO_BIN_EXE_dispatch-sim");
    let out = Command::new(bin)
        .args(["alibaba", "--no-progress", "--nodes"])
        .arg(common::data("alibaba_nodes.sample.csv"))
        .arg("--pods")
        .arg(common::data("alibaba_pods.sample.csv"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("GPU frag mean %"), "{text}");
    assert!(
        text.contains("| least-loaded | 282 |") && text.contains("| ours | 282 |"),
        "{text}"
    );
    let dir = std::env::temp_dir().join(format!("alibaba-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("pods.csv");
    std::fs::write(
        &bad,
        format!("{PODS}p,1000,1,1,500,nan,LS,Running,1,2,1\np,1000,1,z,0,nan,LS,Running,1,2,1\n"),
    )
    .unwrap();
    let out = Command::new(bin)
        .args(["alibaba", "--no-progress", "--nodes"])
        .arg(common::data("alibaba_nodes.sample.csv"))
        .arg("--pods")
        .arg(&bad)
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("pods.csv:3: column num_gpu"), "{err}");
}
