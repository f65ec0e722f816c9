//! `dispatch-sim`: the simulator's command line. Subcommands:
//!
//! * `synthetic`: a generated workload (arrivals, durations, sizes,
//!   fan-outs, pipelines, latency class) on a cluster, every policy side
//!   by side;
//! * `swf`: a Standard Workload Format trace (plain or .gz) replayed the
//!   same way;
//! * `alibaba`: Alibaba's GPU cluster trace (`cluster-trace-gpu-v2023`:
//!   a node list and a pod list, CSV) with GPUs, least-loaded against the
//!   dispatcher, plus GPU allocation and fragmentation;
//! * `hackbench`: seed 000's message groups at CPU level on one node;
//! * `validate`: M/M/1 and the supermarket model against their closed
//!   forms.
//!
//! Output: a table (default), `--format json` or `csv`; `--svg DIR` writes
//! plots; `--jobs-out DIR` each policy's jobs, one CSV line each
//! (`sim::jobs_csv`); a progress bar on stderr when it is a terminal.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sim::dist::{Arrivals, Choice, Durations};
use sim::engine::{SimConfig, simulate};
use sim::layout::{Layout, cluster_for};
use sim::metrics::{self, PolicyReport};
use sim::policy::PolicySpec;
use sim::report::{self, RunReport};
use sim::svg::{self, Series};
use sim::workload::{SyntheticParams, Workload, synthetic};
use sim::{US_PER_S, alibaba, gpufrag, hackbench, queueing, swf};

#[derive(Parser)]
#[command(
    name = "dispatch-sim",
    version,
    about = "Simulate the dispatcher's placement against baseline policies at cluster scale"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Simulate a generated workload under each policy.
    Synthetic(SyntheticArgs),
    /// Replay an SWF trace (plain or .gz) under each policy.
    Swf(SwfArgs),
    /// Replay Alibaba's GPU trace (node list + pod list CSVs) with GPUs.
    Alibaba(AlibabaArgs),
    /// Seed 000's hackbench message groups at CPU level on one node.
    Hackbench(HackbenchArgs),
    /// Check the simulator against M/M/1 and the supermarket model.
    Validate(ValidateArgs),
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum Format {
    Table,
    Json,
    Csv,
}

#[derive(Args)]
struct Common {
    /// Cluster: zones, racks per zone, nodes per rack (`10z:10r:100n`).
    #[arg(long)]
    cluster: Option<String>,
    /// Node topology (`2s:16c:2t`), or a weighted mix
    /// (`2s:16c:2t*3,1s:8c:2t`).
    #[arg(long)]
    node: Option<String>,
    /// Policies, comma-separated; presets `default`, `ablation`, `all`.
    #[arg(long, default_value = "default")]
    policies: String,
    /// Seed of the workload and of the baselines' probes.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Also run each node's agent local scheduler (CPU-level placement).
    #[arg(long)]
    cpu_level: bool,
    /// The dispatcher's tick period, ms.
    #[arg(long, default_value_t = 1000)]
    tick_ms: u64,
    /// Do not measure jobs submitted in the first seconds.
    #[arg(long, default_value_t = 0.0)]
    warmup_s: f64,
    /// Output format.
    #[arg(long, value_enum, default_value = "table")]
    format: Format,
    /// Write the output here instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write SVG plots into this directory.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Write each policy's jobs, one CSV line each, into this directory
    /// (`NAME.POLICY.jobs.csv`; see `sim::jobs_csv`).
    #[arg(long)]
    jobs_out: Option<PathBuf>,
    /// Name of the run in reports and SVG file names (default: from the
    /// workload).
    #[arg(long)]
    name: Option<String>,
    /// No progress bar even on a terminal.
    #[arg(long)]
    no_progress: bool,
}

#[derive(Args)]
struct SyntheticArgs {
    /// Jobs to generate (fan-out children and pipeline stages included).
    #[arg(long, default_value_t = 20_000)]
    jobs: usize,
    /// Offered load (work arriving / capacity).
    #[arg(long, default_value_t = 0.9)]
    load: f64,
    /// `poisson` or `bursty[:FACTOR[:PHASE_S]]`.
    #[arg(long, default_value = "poisson")]
    arrivals: String,
    /// `exp:MEAN`, `pareto:ALPHA:MEAN`, `bimodal:SHORT:LONG:P_LONG` or
    /// `fixed:S` (seconds).
    #[arg(long, default_value = "bimodal:30:600:0.1")]
    durations: String,
    /// CPU counts: `V[:WEIGHT],...` or a range `A-B`.
    #[arg(long, default_value = "1:4,2:2,4:2,8:1,16:1")]
    cpus: String,
    /// Fraction of jobs in the latency class (latency_nice -10).
    #[arg(long, default_value_t = 0.1)]
    latency_frac: f64,
    /// Users' overestimate of run times: each job's time limit (its
    /// `timeout_ms`, which EASY backfill reads) is its duration times a
    /// factor uniform in [1, 1 + F]; a negative F submits no limits.
    #[arg(long, default_value_t = sim::workload::LIMIT_OVERESTIMATE, allow_hyphen_values = true)]
    limit_overestimate: f64,
    /// Gangs: `PROB:MAX` (a single root job becomes a gang of 2..=MAX
    /// members with this probability; arrivals are stretched so the
    /// offered load stays `--load`).
    #[arg(long)]
    gangs: Option<String>,
    /// Fan-outs: `PROB:CHILDREN` (a root job is a parent with this
    /// probability and releases that many children when it ends).
    #[arg(long, default_value = "0.05:16")]
    fanout: String,
    /// Pipelines: `PROB:STAGES` (1:1 chains, each stage released by the
    /// previous one).
    #[arg(long, default_value = "0.05:4")]
    pipeline: String,
    #[command(flatten)]
    common: Common,
}

#[derive(Args)]
struct SwfArgs {
    /// The trace.
    #[arg(long)]
    trace: PathBuf,
    /// Copies of every job, on a cluster this many times larger.
    #[arg(long, default_value_t = 1)]
    replicas: u32,
    /// Divide inter-arrival times by this (raises the load).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Replay only the first jobs.
    #[arg(long)]
    limit: Option<usize>,
    /// Fraction of jobs put in the latency class (seeded draw).
    #[arg(long, default_value_t = 0.1)]
    latency_frac: f64,
    /// Replay a record larger than a node as one gang (all members start
    /// together on distinct nodes) instead of independent parts.
    #[arg(long)]
    gangs: bool,
    /// Submit every job anonymously instead of as its trace's user (the
    /// dispatcher then has no user history to predict run times from, and
    /// no per-user waker identity).
    #[arg(long)]
    anonymous: bool,
    #[command(flatten)]
    common: Common,
}

#[derive(Args)]
struct AlibabaArgs {
    /// The node list (`openb_node_list_*.csv`: sn, cpu_milli, memory_mib,
    /// gpu, model).
    #[arg(long)]
    nodes: PathBuf,
    /// The pod list (`openb_pod_list_*.csv`: name, cpu_milli, memory_mib,
    /// num_gpu, gpu_milli, gpu_spec, qos, pod_phase, creation_time,
    /// deletion_time, scheduled_time).
    #[arg(long)]
    pods: PathBuf,
    /// Divide inter-arrival times by this (raises the load).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// GPU samples over the run.
    #[arg(long, default_value_t = 500)]
    gpu_samples: usize,
    #[command(flatten)]
    common: Common,
}

#[derive(Args)]
struct HackbenchArgs {
    /// The node's topology.
    #[arg(long, default_value = "1s:10c:2t")]
    node: String,
    /// Group counts.
    #[arg(long, default_value = "1,2,3,4")]
    groups: String,
    /// Loops per sender.
    #[arg(long, default_value_t = 1000)]
    loops: u64,
    /// Policies (ours variants only).
    #[arg(long, default_value = "ours-steal,ours")]
    policies: String,
    /// Seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Output format.
    #[arg(long, value_enum, default_value = "table")]
    format: Format,
}

#[derive(Args)]
struct ValidateArgs {
    /// Servers of the supermarket model.
    #[arg(long, default_value_t = 1000)]
    servers: usize,
    /// Load per server (arrival rate, mu = 1).
    #[arg(long, default_value_t = 0.9)]
    load: f64,
    /// Choices d (comma-separated).
    #[arg(long, default_value = "1,2")]
    d: String,
    /// Arrivals stop after this many mean service times.
    #[arg(long, default_value_t = 2000.0)]
    horizon: f64,
    /// Jobs arriving earlier are not measured.
    #[arg(long, default_value_t = 400.0)]
    warmup: f64,
    /// M/M/1 load (0 skips M/M/1).
    #[arg(long, default_value_t = 0.7)]
    mm1_load: f64,
    /// Seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Output format.
    #[arg(long, value_enum, default_value = "table")]
    format: Format,
}

fn pair(s: &str, what: &str) -> Result<(f64, u32)> {
    let (p, k) = s
        .split_once(':')
        .with_context(|| format!("--{what} wants PROB:COUNT, got {s:?}"))?;
    let p: f64 = p
        .parse()
        .with_context(|| format!("--{what}: {p:?} is not a probability"))?;
    let k: u32 = k
        .parse()
        .with_context(|| format!("--{what}: {k:?} is not a count"))?;
    if !(0.0..=1.0).contains(&p) {
        bail!("--{what}: probability {p} is not in [0, 1]");
    }
    Ok((p, k))
}

fn emit(common: &Common, text: &str) -> Result<()> {
    match &common.out {
        Some(p) => std::fs::write(p, text).with_context(|| format!("writing {}", p.display())),
        None => {
            print!("{text}");
            Ok(())
        }
    }
}

fn progress_bar(total: u64, hidden: bool) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(
        Some(total),
        if hidden || !std::io::stderr().is_terminal() {
            ProgressDrawTarget::hidden()
        } else {
            ProgressDrawTarget::stderr()
        },
    );
    if let Ok(style) = ProgressStyle::with_template(
        "{prefix:>16} [{bar:40}] {human_pos}/{human_len} jobs {per_sec} ({eta})",
    ) {
        pb.set_style(style.progress_chars("=> "));
    }
    pb
}

fn run_policies(
    layout: &Layout,
    w: &Workload,
    common: &Common,
    name: &str,
    on_run: &mut dyn FnMut(&sim::engine::RunOutput),
) -> Result<RunReport> {
    let policies = PolicySpec::parse_list(&common.policies)?;
    let cfg = SimConfig {
        tick_us: common.tick_ms.max(1) * 1000,
        sample_us: 0,
        cpu_level: common.cpu_level,
        seed: common.seed,
    };
    let n = w.jobs.len() as u64;
    let pb = progress_bar(n * policies.len() as u64, common.no_progress);
    let mut reports: Vec<PolicyReport> = Vec::new();
    for (i, p) in policies.iter().enumerate() {
        pb.set_prefix(p.name.clone());
        let base = n * i as u64;
        let out = simulate(layout, w, p, &cfg, &mut |done| pb.set_position(base + done))
            .with_context(|| format!("policy {}", p.name))?;
        on_run(&out);
        if let Some(dir) = &common.jobs_out {
            write_jobs(dir, name, w, &out)?;
        }
        reports.push(metrics::report(
            out,
            w,
            layout,
            (common.warmup_s * US_PER_S as f64) as u64,
        ));
    }
    pb.finish_and_clear();
    let span = w
        .roots()
        .last()
        .map_or(0, |&r| w.jobs[r as usize].submit_us)
        .max(1) as f64;
    let report = RunReport {
        workload: w.name.clone(),
        cluster: layout.describe(),
        nodes: layout.nr_nodes() as u64,
        cpus: layout.capacity(),
        jobs: n,
        offered_load: w.work_cpu_us() / (layout.capacity().max(1) as f64 * span),
        seed: common.seed,
        cpu_level: common.cpu_level,
        policies: reports,
    };
    if let Some(dir) = &common.svg {
        write_svgs(dir, name, &report)?;
    }
    Ok(report)
}

/// `--jobs-out`: one run's jobs into `DIR/NAME.POLICY.jobs.csv`.
fn write_jobs(dir: &Path, name: &str, w: &Workload, out: &sim::engine::RunOutput) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("--jobs-out {}", dir.display()))?;
    let path = dir.join(format!("{name}.{}.jobs.csv", out.policy));
    let file = std::fs::File::create(&path).with_context(|| format!("{}", path.display()))?;
    let mut file = std::io::BufWriter::new(file);
    sim::jobs_csv::write(&mut file, w, &out.records)
        .and_then(|()| std::io::Write::flush(&mut file))
        .with_context(|| format!("{}", path.display()))
}

fn write_svgs(dir: &Path, name: &str, r: &RunReport) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let hours = r
        .policies
        .iter()
        .flat_map(|p| p.samples.last())
        .map(|s| s.t_us)
        .max()
        .unwrap_or(0)
        > 10 * 3600 * US_PER_S;
    let (unit, div) = if hours {
        ("hours", 3600.0 * US_PER_S as f64)
    } else {
        ("seconds", US_PER_S as f64)
    };
    let active: Vec<Series> = r
        .policies
        .iter()
        .map(|p| Series {
            name: p.policy.clone(),
            points: p
                .samples
                .iter()
                .map(|s| (s.t_us as f64 / div, s.active_nodes as f64))
                .collect(),
        })
        .collect();
    let cdf: Vec<Series> = r
        .policies
        .iter()
        .map(|p| {
            let n = p.responses.len().max(1) as f64;
            Series {
                name: p.policy.clone(),
                points: p
                    .responses
                    .iter()
                    .enumerate()
                    .map(|(i, &x)| (x.max(1e-3), (i + 1) as f64 / n))
                    .collect(),
            }
        })
        .collect();
    let bars = |f: &dyn Fn(&PolicyReport) -> f64| -> Vec<(String, f64)> {
        r.policies
            .iter()
            .map(|p| (p.policy.clone(), f(p)))
            .collect()
    };
    let files = [
        (
            "active-nodes",
            svg::line_chart(
                &format!("{name}: nodes running jobs"),
                &format!("time ({unit})"),
                "active nodes",
                &active,
                false,
            ),
        ),
        (
            "response-cdf",
            svg::line_chart(
                &format!("{name}: response time CDF"),
                "response time (s, log)",
                "fraction of jobs",
                &cdf,
                true,
            ),
        ),
        (
            "bsld",
            svg::bar_chart(
                &format!("{name}: mean bounded slowdown"),
                "bounded slowdown",
                &bars(&|p| p.bsld_mean),
            ),
        ),
        (
            "p99",
            svg::bar_chart(
                &format!("{name}: p99 response time"),
                "seconds",
                &bars(&|p| p.resp_p99_s),
            ),
        ),
    ];
    for (kind, body) in files {
        let path = dir.join(format!("{name}-{kind}.svg"));
        std::fs::write(&path, body).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn format_report(common: &Common, r: &RunReport) -> Result<String> {
    Ok(match common.format {
        Format::Table => report::text(r),
        Format::Json => serde_json::to_string_pretty(r)? + "\n",
        Format::Csv => report::csv(r),
    })
}

fn cmd_synthetic(a: SyntheticArgs) -> Result<()> {
    let c = &a.common;
    let layout = Layout::new(
        c.cluster.as_deref().unwrap_or("2z:4r:16n"),
        c.node.as_deref().unwrap_or("2s:8c:2t"),
    )?;
    let (fanout_prob, fanout_k) = pair(&a.fanout, "fanout")?;
    let (pipeline_prob, pipeline_len) = pair(&a.pipeline, "pipeline")?;
    let params = SyntheticParams {
        jobs: a.jobs,
        load: a.load,
        arrivals: Arrivals::parse(&a.arrivals)?,
        durations: Durations::parse(&a.durations)?,
        cpus: Choice::parse(&a.cpus)?,
        latency_frac: a.latency_frac,
        fanout_prob,
        fanout_k,
        pipeline_prob,
        pipeline_len,
        limit_overestimate: (a.limit_overestimate >= 0.0).then_some(a.limit_overestimate),
        seed: c.seed,
    };
    let mut w = synthetic(&params, layout.capacity(), layout.min_node_cpus())?;
    w.name = c.name.clone().unwrap_or_else(|| "synthetic".to_string());
    if let Some(g) = &a.gangs {
        let made = sim::gangmix::make_gangs(&mut w, g, layout.nr_nodes() as u32, c.seed)?;
        if c.format == Format::Table {
            eprintln!("{made} jobs made gangs ({g})");
        }
    }
    let name = w.name.clone();
    let r = run_policies(&layout, &w, c, &name, &mut |_| {})?;
    emit(c, &format_report(c, &r)?)
}

fn cmd_alibaba(mut a: AlibabaArgs) -> Result<()> {
    // The sampling baselines place no GPU jobs: the default here is the
    // two policies that do.
    if a.common.policies == "default" {
        a.common.policies = "least-loaded,ours".to_string();
    }
    let c = &a.common;
    if a.time_scale <= 0.0 || !a.time_scale.is_finite() {
        bail!("--time-scale must be positive");
    }
    let nodes = alibaba::read_nodes(&a.nodes)?;
    let pods = alibaba::read_pods(&a.pods)?;
    let layout = alibaba::to_layout(&nodes)?;
    let name = c.name.clone().unwrap_or_else(|| {
        a.pods
            .file_stem()
            .map_or("alibaba".into(), |s| s.to_string_lossy().into_owned())
    });
    let (mut w, st) = alibaba::to_workload(&pods, &layout, &name)?;
    if a.time_scale != 1.0 {
        for j in &mut w.jobs {
            j.submit_us = (j.submit_us as f64 / a.time_scale) as u64;
        }
    }
    if c.format == Format::Table {
        eprintln!(
            "{}: {} nodes, {} GPUs; {} pods: {} replayed, {} without deletion_time, {} larger than any node; {} GPU jobs asking {} GPUs, {} GPU-sharing pods rounded up to a whole GPU, {} gpu_spec constraints not honoured, {} CPU requests rounded up, {} latency class",
            a.pods.display(),
            layout.nr_nodes(),
            layout.total_gpus(),
            st.pods,
            st.used,
            st.no_end,
            st.too_large,
            st.gpu_jobs,
            st.gpus_asked,
            st.shared_rounded,
            st.gpu_spec_ignored,
            st.cpu_rounded,
            st.latency
        );
    }
    let mut gpu = Vec::new();
    let r = run_policies(&layout, &w, c, &name, &mut |out| {
        gpu.push(gpufrag::measure(&layout, &w, out, a.gpu_samples));
    })?;
    let mut text = format_report(c, &r)?;
    if c.format == Format::Table {
        text.push_str("\nGPUs (allocation = GPUs held / all; fragmentation = FGD's expected idle GPUs no GPU job of the workload's mix can use, % of all):\n\n");
        text.push_str(&gpufrag::table(&gpu));
    }
    emit(c, &text)
}

fn cmd_swf(a: SwfArgs) -> Result<()> {
    let c = &a.common;
    let trace = swf::read(&a.trace)?;
    let node = c.node.clone().unwrap_or_else(|| "1s:2c:2t".to_string());
    let probe = Layout::new("1z:1r:1n", &node)?;
    let node_cpus = probe.min_node_cpus();
    let cluster = c.cluster.clone().unwrap_or_else(|| {
        cluster_for(
            trace.machine_procs().saturating_mul(a.replicas.max(1)),
            node_cpus,
        )
    });
    let layout = Layout::new(&cluster, &node)?;
    let (w, stats) = trace.to_workload(&swf::ReplayOptions {
        node_cpus,
        replicas: a.replicas,
        time_scale: a.time_scale,
        limit: a.limit,
        latency_frac: a.latency_frac,
        seed: c.seed,
        gangs: a.gangs,
        users: !a.anonymous,
    })?;
    if c.format == Format::Table {
        eprintln!(
            "{}: {} records used, {} skipped (unknown fields), {} split over nodes, {} gangs, {} with a time limit, {} run times clamped to it",
            trace.path,
            stats.used,
            stats.skipped,
            stats.split,
            stats.gangs,
            stats.limited,
            stats.clamped
        );
    }
    let name = w
        .name
        .trim_end_matches(".gz")
        .trim_end_matches(".swf")
        .to_string();
    let r = run_policies(&layout, &w, c, &name, &mut |_| {})?;
    emit(c, &format_report(c, &r)?)
}

fn list<T: std::str::FromStr>(s: &str, what: &str) -> Result<Vec<T>> {
    s.split(',')
        .map(|x| {
            x.trim()
                .parse()
                .map_err(|_| anyhow::anyhow!("--{what}: {x:?} is not a number"))
        })
        .collect()
}

fn cmd_hackbench(a: HackbenchArgs) -> Result<()> {
    let groups: Vec<usize> = list(&a.groups, "groups")?;
    let policies = PolicySpec::parse_list(&a.policies)?;
    let rows = hackbench::run(&a.node, &groups, a.loops, &policies, a.seed)?;
    match a.format {
        Format::Table => print!("{}", hackbench::table(&rows)),
        Format::Json => println!("{}", serde_json::to_string_pretty(&rows)?),
        Format::Csv => {
            println!("policy,groups,time_s,busy_pct,find_pct,steals,remote_wakeups");
            for r in &rows {
                println!(
                    "{},{},{:.6},{:.3},{:.4},{},{}",
                    r.policy,
                    r.groups,
                    r.time_s,
                    r.busy_pct,
                    r.find_pct,
                    r.steals,
                    r.remote_wakeups
                );
            }
        }
    }
    Ok(())
}

fn cmd_validate(a: ValidateArgs) -> Result<()> {
    let mut results = Vec::new();
    if a.mm1_load > 0.0 {
        results.push(queueing::run(&queueing::QueueingParams {
            servers: 1,
            load: a.mm1_load,
            d: 1,
            horizon: a.horizon * 100.0,
            warmup: a.warmup,
            seed: a.seed,
        })?);
    }
    for d in list::<u32>(&a.d, "d")? {
        results.push(queueing::run(&queueing::QueueingParams {
            servers: a.servers,
            load: a.load,
            d,
            horizon: a.horizon,
            warmup: a.warmup,
            seed: a.seed,
        })?);
    }
    match a.format {
        Format::Json => println!("{}", serde_json::to_string_pretty(&results)?),
        Format::Csv => {
            println!("model,servers,load,d,jobs,measured,closed_form,rel_error");
            for r in &results {
                println!(
                    "{},{},{},{},{},{:.6},{:.6},{:.6}",
                    r.model, r.servers, r.load, r.d, r.jobs, r.measured, r.closed_form, r.rel_error
                );
            }
        }
        Format::Table => {
            println!(
                "| model | servers | load | d | jobs measured | mean response | closed form | error % |"
            );
            println!("|---|---:|---:|---:|---:|---:|---:|---:|");
            for r in &results {
                println!(
                    "| {} | {} | {} | {} | {} | {:.4} | {:.4} | {:+.2} |",
                    r.model,
                    r.servers,
                    r.load,
                    r.d,
                    r.jobs,
                    r.measured,
                    r.closed_form,
                    100.0 * r.rel_error
                );
            }
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Synthetic(a) => cmd_synthetic(a),
        Cmd::Swf(a) => cmd_swf(a),
        Cmd::Alibaba(a) => cmd_alibaba(a),
        Cmd::Hackbench(a) => cmd_hackbench(a),
        Cmd::Validate(a) => cmd_validate(a),
    }
}
