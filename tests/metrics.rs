//! The Prometheus scrape endpoints of the dispatcher and the agent: a real
//! dispatcher with agents in two racks runs jobs of both latency classes;
//! `/metrics` on each is scraped over HTTP and parsed twice, by a strict
//! parser of the text exposition format written here and by the
//! `prometheus-parse` crate. Then every metric the deploy/ dashboards and
//! alert rules query must exist in those scrapes.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use e2e::{Agent, Dispatcher, all_jobs, eventually, http_get_typed, is_terminal, wait_nodes};
use proto::v1::{JobSpec, JobState, SubmitJobsRequest};

/// GET http://127.0.0.1:port/metrics; returns (content type, body).
fn scrape(port: u16) -> Result<(String, String)> {
    let (status, content_type, body) = http_get_typed(port, "/metrics")
        .with_context(|| format!("scraping the metrics port {port}"))?;
    ensure!(status == 200, "status: {status}");
    Ok((content_type, body))
}

/// One sample of a scrape.
#[derive(Debug, Clone)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// A strictly parsed scrape: families with their TYPE, and samples.
#[derive(Debug, Default)]
struct Exposition {
    types: HashMap<String, String>,
    samples: Vec<Sample>,
}

impl Exposition {
    fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.samples
            .iter()
            .find(|s| {
                s.name == name
                    && labels
                        .iter()
                        .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|s| s.value)
    }

    fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.samples
            .iter()
            .filter(|s| {
                s.name == name
                    && labels
                        .iter()
                        .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|s| s.value)
            .sum()
    }

    fn label_values(&self, name: &str, label: &str) -> BTreeSet<String> {
        self.samples
            .iter()
            .filter(|s| s.name == name)
            .filter_map(|s| s.labels.get(label).cloned())
            .collect()
    }

    /// Every name a query may use: families and their sample names.
    fn names(&self) -> BTreeSet<String> {
        let mut n: BTreeSet<String> = self.samples.iter().map(|s| s.name.clone()).collect();
        n.extend(self.types.keys().cloned());
        n
    }
}

fn is_name(s: &str, colon: bool) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || (colon && c == ':'))
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || (colon && c == ':'))
}

fn parse_value(s: &str) -> Result<f64> {
    Ok(match s {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        _ => s.parse().with_context(|| format!("bad value {s:?}"))?,
    })
}

/// Parse the Prometheus text exposition format (0.0.4) strictly: every
/// line is a HELP, a TYPE, a comment or a well-formed sample; each family's
/// TYPE comes once and before its samples; samples belong to a declared
/// family (histograms: `_bucket` with `le`, `_sum`, `_count`); label names
/// are valid and not repeated; values are floats.
fn parse_strict(text: &str) -> Result<Exposition> {
    let mut e = Exposition::default();
    let mut helps = BTreeSet::new();
    let mut done: BTreeSet<String> = BTreeSet::new();
    let mut current: Option<String> = None;
    for (no, line) in text.lines().enumerate() {
        let ctx = || format!("line {}: {line:?}", no + 1);
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            match parts.next() {
                Some("HELP") => {
                    let name = parts.next().with_context(ctx)?;
                    ensure!(is_name(name, true), "bad name: {}", ctx());
                    ensure!(helps.insert(name.to_string()), "HELP twice: {}", ctx());
                }
                Some("TYPE") => {
                    let name = parts.next().with_context(ctx)?;
                    let ty = parts.next().with_context(ctx)?;
                    ensure!(is_name(name, true), "bad name: {}", ctx());
                    ensure!(
                        ["counter", "gauge", "histogram", "summary", "untyped"].contains(&ty),
                        "bad type: {}",
                        ctx()
                    );
                    ensure!(
                        !e.types.contains_key(name) && !done.contains(name),
                        "TYPE twice: {}",
                        ctx()
                    );
                    if let Some(prev) = current.replace(name.to_string()) {
                        done.insert(prev);
                    }
                    e.types.insert(name.to_string(), ty.to_string());
                }
                _ => {}
            }
            continue;
        }
        ensure!(!line.starts_with('#'), "bad comment: {}", ctx());
        // name{labels} value [timestamp]
        let name_end = line.find(['{', ' ']).with_context(ctx)?;
        let name = &line[..name_end];
        ensure!(is_name(name, true), "bad metric name: {}", ctx());
        let mut rest = &line[name_end..];
        let mut labels = BTreeMap::new();
        if let Some(r) = rest.strip_prefix('{') {
            let mut chars = r.char_indices().peekable();
            let end;
            loop {
                // label name
                let start = match chars.peek() {
                    Some((_, '}')) => {
                        end = chars.next().map(|(i, _)| i + 1);
                        break;
                    }
                    Some((i, _)) => *i,
                    None => bail!("unterminated labels: {}", ctx()),
                };
                let mut eq = None;
                for (i, c) in chars.by_ref() {
                    if c == '=' {
                        eq = Some(i);
                        break;
                    }
                }
                let eq = eq.with_context(ctx)?;
                let lname = &r[start..eq];
                ensure!(is_name(lname, false), "bad label name {lname:?}: {}", ctx());
                ensure!(
                    matches!(chars.next(), Some((_, '"'))),
                    "label value must be quoted: {}",
                    ctx()
                );
                let mut value = String::new();
                loop {
                    match chars.next() {
                        Some((_, '\\')) => match chars.next() {
                            Some((_, '\\')) => value.push('\\'),
                            Some((_, '"')) => value.push('"'),
                            Some((_, 'n')) => value.push('\n'),
                            _ => bail!("bad escape: {}", ctx()),
                        },
                        Some((_, '"')) => break,
                        Some((_, c)) => value.push(c),
                        None => bail!("unterminated label value: {}", ctx()),
                    }
                }
                ensure!(
                    labels.insert(lname.to_string(), value).is_none(),
                    "label twice: {}",
                    ctx()
                );
                match chars.next() {
                    Some((_, ',')) => {}
                    Some((i, '}')) => {
                        end = Some(i + 1);
                        break;
                    }
                    _ => bail!("expected , or }}: {}", ctx()),
                }
            }
            rest = &r[end.with_context(ctx)?..];
        }
        let rest = rest.strip_prefix(' ').with_context(ctx)?;
        let mut fields = rest.split(' ');
        let value = parse_value(fields.next().with_context(ctx)?).with_context(ctx)?;
        if let Some(ts) = fields.next() {
            ts.parse::<i64>().with_context(ctx)?;
        }
        ensure!(fields.next().is_none(), "trailing fields: {}", ctx());
        // The sample belongs to the family being declared.
        let family = current
            .as_deref()
            .with_context(|| format!("no TYPE: {}", ctx()))?;
        let ty = e.types[family].as_str();
        let ok = match ty {
            "histogram" => {
                (name == format!("{family}_bucket") && labels.contains_key("le"))
                    || name == format!("{family}_sum")
                    || name == format!("{family}_count")
            }
            "summary" => {
                name == family
                    || name == format!("{family}_sum")
                    || name == format!("{family}_count")
            }
            _ => name == family,
        };
        ensure!(ok, "sample outside its family {family} ({ty}): {}", ctx());
        if ty == "counter" {
            ensure!(value >= 0.0, "negative counter: {}", ctx());
        }
        e.samples.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    ensure!(!e.samples.is_empty(), "no samples");
    Ok(e)
}

/// Parse with the `prometheus-parse` crate too; returns family -> type.
fn parse_with_crate(text: &str) -> Result<HashMap<String, &'static str>> {
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string())))?;
    let mut out = HashMap::new();
    for s in scrape.samples {
        let ty = match s.value {
            prometheus_parse::Value::Counter(v) => {
                ensure!(v >= 0.0, "{}", s.metric);
                "counter"
            }
            prometheus_parse::Value::Gauge(_) => "gauge",
            prometheus_parse::Value::Histogram(ref h) => {
                ensure!(!h.is_empty(), "histogram without buckets: {}", s.metric);
                "histogram"
            }
            prometheus_parse::Value::Summary(_) => "summary",
            prometheus_parse::Value::Untyped(_) => "untyped",
        };
        out.insert(s.metric, ty);
    }
    Ok(out)
}

fn scrape_parsed(port: u16) -> Result<(Exposition, HashMap<String, &'static str>)> {
    let (ct, body) = scrape(port)?;
    ensure!(ct.starts_with("text/plain"), "content type {ct}");
    let strict = parse_strict(&body).with_context(|| format!("strict parse of:\n{body}"))?;
    let krate = parse_with_crate(&body)?;
    Ok((strict, krate))
}

fn job(cmd: &str, cpus: u32, latency: bool) -> JobSpec {
    JobSpec {
        command: vec!["sh".into(), "-c".into(), cmd.into()],
        cpus,
        latency_nice: if latency { -10 } else { 0 },
        ..Default::default()
    }
}

struct Cluster {
    _dir: tempfile::TempDir,
    d: Dispatcher,
    _agents: Vec<Agent>,
    dispatcher_port: u16,
    agent_port: u16,
    submitted: usize,
}

/// A dispatcher and four agents (two racks of two nodes) that ran jobs of
/// both classes to completion.
async fn cluster_with_jobs() -> Result<Cluster> {
    let dir = tempfile::tempdir()?;
    // Port 0 for both endpoints: each process prints what it bound.
    let d = Dispatcher::start(
        dir.path(),
        &["--heartbeat-ms", "300", "--metrics-listen", "127.0.0.1:0"],
    )?;
    let dispatcher_port = d.web_port(Duration::from_secs(30))?;
    let mut agents = Vec::new();
    for (i, rack) in ["r1", "r1", "r2", "r2"].iter().enumerate() {
        let node = format!("n{}", i + 1);
        let rack_label = format!("dispatch.io/rack={rack}");
        let extra: Vec<&str> = if i == 0 {
            vec!["--metrics-listen", "127.0.0.1:0"]
        } else {
            vec![]
        };
        agents.push(Agent::start(
            dir.path(),
            &d.url,
            &node,
            "1s:2c:2t",
            &["topology.kubernetes.io/zone=z1", &rack_label],
            &extra,
        )?);
    }
    let agent_port = agents[0].metrics_port(Duration::from_secs(30))?;
    wait_nodes(&d, 4, Duration::from_secs(20)).await?;
    let mut jobs = d.jobs().await?;
    // More work than CPUs so that jobs queue, and both classes.
    let specs: Vec<JobSpec> = (0..24)
        .map(|i| job("sleep 0.3", 1 + (i % 2), i % 3 == 0))
        .collect();
    let submitted = specs.len();
    jobs.submit_jobs(SubmitJobsRequest { specs }).await?;
    eventually(Duration::from_secs(90), "all jobs terminal", || {
        let mut c = jobs.clone();
        async move {
            let all = all_jobs(&mut c).await.ok()?;
            (all.len() == submitted && all.iter().all(|j| is_terminal(j.state))).then_some(())
        }
    })
    .await?;
    let all = all_jobs(&mut jobs).await?;
    ensure!(
        all.iter().all(|j| j.state == JobState::Succeeded as i32),
        "{all:?}"
    );
    Ok(Cluster {
        _dir: dir,
        d,
        _agents: agents,
        dispatcher_port,
        agent_port,
        submitted,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_endpoints_scrape_and_parse() -> Result<()> {
    let c = cluster_with_jobs().await?;
    let n = c.submitted as f64;
    // The core samples on its tick: wait until the scrape shows every job.
    let port = c.dispatcher_port;
    let (e, krate) = eventually(Duration::from_secs(20), "all jobs counted", || async move {
        let (e, k) = scrape_parsed(port).ok()?;
        (e.sum("dispatch_jobs", &[("state", "succeeded")]) == n).then_some((e, k))
    })
    .await?;

    // Types, by both parsers.
    for (name, ty) in [
        ("dispatch_jobs", "gauge"),
        ("dispatch_nodes", "gauge"),
        ("dispatch_placement_seconds", "histogram"),
        ("dispatch_placements_total", "counter"),
        ("dispatch_store_commit_seconds", "histogram"),
        ("dispatch_store_writes_total", "counter"),
        ("dispatch_steals_total", "counter"),
        ("dispatch_steal_failures_total", "counter"),
        ("dispatch_busy_skip_total", "counter"),
        ("dispatch_overload_mask_weight", "gauge"),
        ("dispatch_utilization", "gauge"),
        ("dispatch_agent_heartbeat_lag_seconds", "gauge"),
        ("dispatch_schedstat_total", "counter"),
    ] {
        assert_eq!(e.types.get(name).map(String::as_str), Some(ty), "{name}");
        assert_eq!(
            krate.get(name).copied(),
            Some(ty),
            "{name} (prometheus-parse)"
        );
    }
    // Jobs by state and class: 8 of the 24 were latency-class.
    assert_eq!(
        e.get(
            "dispatch_jobs",
            &[("state", "succeeded"), ("class", "latency")]
        ),
        Some(8.0)
    );
    assert_eq!(
        e.get(
            "dispatch_jobs",
            &[("state", "succeeded"), ("class", "normal")]
        ),
        Some(16.0)
    );
    assert_eq!(e.sum("dispatch_jobs", &[("state", "pending")]), 0.0);
    assert_eq!(e.get("dispatch_nodes", &[("state", "ready")]), Some(4.0));
    // Every job was placed (a job an agent gives back to be stolen is
    // placed again) and timed once.
    assert!(e.get("dispatch_placements_total", &[]).unwrap_or(0.0) >= n);
    assert_eq!(e.get("dispatch_placement_seconds_count", &[]), Some(n));
    assert_eq!(
        e.get("dispatch_placement_seconds_bucket", &[("le", "+Inf")]),
        Some(n)
    );
    assert!(e.get("dispatch_placement_seconds_sum", &[]).unwrap_or(-1.0) > 0.0);
    // Commits were timed, and each job was written at least at its
    // submission and at its end.
    let commits = e
        .get("dispatch_store_commit_seconds_count", &[])
        .unwrap_or(0.0);
    assert!(commits >= 1.0, "{commits} commits");
    assert!(
        e.get("dispatch_store_commit_seconds_sum", &[])
            .unwrap_or(-1.0)
            > 0.0
    );
    assert!(e.get("dispatch_store_writes_total", &[]).unwrap_or(0.0) >= 2.0 * n);
    // Steals by level, overload per rack, utilization per domain, lag.
    assert_eq!(
        e.label_values("dispatch_steals_total", "level"),
        ["node", "rack", "zone"].map(String::from).into()
    );
    assert_eq!(
        e.label_values("dispatch_overload_mask_weight", "rack"),
        ["z1/r1", "z1/r2"].map(String::from).into()
    );
    assert_eq!(e.sum("dispatch_overload_mask_weight", &[]), 0.0, "all done");
    assert_eq!(
        e.label_values("dispatch_utilization", "domain"),
        ["all", "z1", "z1/r1", "z1/r2"].map(String::from).into()
    );
    assert_eq!(
        e.label_values("dispatch_agent_heartbeat_lag_seconds", "node"),
        ["n1", "n2", "n3", "n4"].map(String::from).into()
    );
    for s in e
        .samples
        .iter()
        .filter(|s| s.name == "dispatch_agent_heartbeat_lag_seconds")
    {
        assert!(s.value < 5.0, "{s:?}");
    }
    // Schedstats: the queued jobs went through the engine.
    let stats = e.label_values("dispatch_schedstat_total", "stat");
    for stat in [
        "sis_easy",
        "sis_core",
        "sis_cpu",
        "sis_none",
        "steal",
        "steal_fail",
        "busy_skip",
    ] {
        assert!(stats.contains(stat), "{stat} missing: {stats:?}");
    }
    assert!(e.sum("dispatch_schedstat_total", &[("stat", "nr_switches")]) >= n);

    // The agent's endpoint.
    let (a, akrate) = scrape_parsed(c.agent_port)?;
    for (name, ty) in [
        ("dispatch_agent_jobs", "gauge"),
        ("dispatch_agent_steals_total", "counter"),
        ("dispatch_agent_steal_failures_total", "counter"),
        ("dispatch_agent_busy_skip_total", "counter"),
        ("dispatch_agent_overload_mask_weight", "gauge"),
        ("dispatch_agent_utilization", "gauge"),
        ("dispatch_agent_schedstat_total", "counter"),
    ] {
        assert_eq!(a.types.get(name).map(String::as_str), Some(ty), "{name}");
        assert_eq!(
            akrate.get(name).copied(),
            Some(ty),
            "{name} (prometheus-parse)"
        );
    }
    assert_eq!(
        a.label_values("dispatch_agent_steals_total", "level"),
        ["cross_llc", "llc", "smt"].map(String::from).into()
    );
    assert_eq!(
        a.label_values("dispatch_agent_overload_mask_weight", "llc"),
        ["0"].map(String::from).into()
    );
    assert!(
        a.label_values("dispatch_agent_utilization", "domain")
            .contains("machine")
    );
    // n1 ran some of the jobs.
    assert!(a.sum("dispatch_agent_schedstat_total", &[("stat", "nr_switches")]) >= 1.0);
    drop(c.d);
    Ok(())
}

/// Metric names used in a PromQL expression: identifiers that start with
/// `dispatch_` (label names inside `{}` or `by ()` never do here).
fn metric_names_in(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i] as char;
        if c.is_ascii_alphabetic() || c == '_' {
            let start = i;
            while i < bytes.len()
                && ((bytes[i] as char).is_ascii_alphanumeric() || bytes[i] == b'_')
            {
                i += 1;
            }
            let word = &expr[start..i];
            if word.starts_with("dispatch_") {
                out.insert(word.to_string());
            }
        } else if c == '"' {
            // Skip string literals (label values).
            i += 1;
            while i < bytes.len() && bytes[i] != b'"' {
                i += if bytes[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
        } else {
            i += 1;
        }
    }
    out
}

/// Every `expr` string in a JSON document (Grafana targets).
fn exprs_in_json(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                if k == "expr"
                    && let Some(s) = v.as_str()
                {
                    out.push(s.to_string());
                }
                exprs_in_json(v, out);
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| exprs_in_json(v, out)),
        _ => {}
    }
}

/// Every `expr:` of a Prometheus rules file.
fn exprs_in_rules(v: &serde_yaml::Value, out: &mut Vec<String>) {
    match v {
        serde_yaml::Value::Mapping(m) => {
            for (k, v) in m {
                if k.as_str() == Some("expr")
                    && let Some(s) = v.as_str()
                {
                    out.push(s.to_string());
                }
                exprs_in_rules(v, out);
            }
        }
        serde_yaml::Value::Sequence(a) => a.iter().for_each(|v| exprs_in_rules(v, out)),
        _ => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_metric_exists_in_a_real_scrape() -> Result<()> {
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let mut exprs: Vec<(String, String)> = Vec::new();
    let dashboards = deploy.join("grafana/dashboards");
    let mut files: Vec<_> = std::fs::read_dir(&dashboards)
        .with_context(|| format!("reading {}", dashboards.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    ensure!(
        !files.is_empty(),
        "no dashboards in {}",
        dashboards.display()
    );
    for f in &files {
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(f)?)
            .with_context(|| format!("parsing {}", f.display()))?;
        let mut out = Vec::new();
        exprs_in_json(&v, &mut out);
        ensure!(!out.is_empty(), "{} has no queries", f.display());
        exprs.extend(out.into_iter().map(|e| (f.display().to_string(), e)));
    }
    let rules = deploy.join("prometheus/rules.yml");
    let v: serde_yaml::Value = serde_yaml::from_str(&std::fs::read_to_string(&rules)?)?;
    let mut out = Vec::new();
    exprs_in_rules(&v, &mut out);
    exprs.extend(out.into_iter().map(|e| (rules.display().to_string(), e)));
    // The Prometheus config scrapes both kinds of endpoint.
    let prom: serde_yaml::Value = serde_yaml::from_str(&std::fs::read_to_string(
        deploy.join("prometheus/prometheus.yml"),
    )?)?;
    let jobs: BTreeSet<String> = prom["scrape_configs"]
        .as_sequence()
        .context("scrape_configs")?
        .iter()
        .filter_map(|j| j["job_name"].as_str().map(String::from))
        .collect();
    ensure!(
        jobs.contains("dispatcher") && jobs.contains("dispatch-agent"),
        "{jobs:?}"
    );

    let c = cluster_with_jobs().await?;
    let port = c.dispatcher_port;
    let (d, _) = eventually(Duration::from_secs(20), "all jobs counted", || async move {
        let (e, k) = scrape_parsed(port).ok()?;
        (e.sum("dispatch_jobs", &[("state", "succeeded")]) == c.submitted as f64).then_some((e, k))
    })
    .await?;
    let (a, _) = scrape_parsed(c.agent_port)?;
    let mut have = d.names();
    have.extend(a.names());
    let mut missing = Vec::new();
    let mut used = BTreeSet::new();
    for (file, expr) in &exprs {
        let names = metric_names_in(expr);
        ensure!(!names.is_empty(), "{file}: no dispatch_ metric in {expr:?}");
        for name in names {
            if !have.contains(&name) {
                missing.push(format!("{file}: {name} in {expr:?}"));
            }
            used.insert(name);
        }
    }
    assert!(
        missing.is_empty(),
        "not in a real scrape:\n{}",
        missing.join("\n")
    );
    // And the dashboards cover the list.
    for name in [
        "dispatch_jobs",
        "dispatch_placement_seconds_bucket",
        "dispatch_placements_total",
        "dispatch_steals_total",
        "dispatch_agent_steals_total",
        "dispatch_steal_failures_total",
        "dispatch_overload_mask_weight",
        "dispatch_agent_overload_mask_weight",
        "dispatch_busy_skip_total",
        "dispatch_utilization",
        "dispatch_agent_heartbeat_lag_seconds",
        "dispatch_schedstat_total",
    ] {
        assert!(used.contains(name), "no dashboard shows {name}");
    }
    Ok(())
}
