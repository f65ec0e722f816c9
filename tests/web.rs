//! The dispatcher's web page in a real browser: a dispatcher with
//! `--http-listen`, eight agents in two zones and four racks (one rack
//! overloaded, one node cordoned then freed so it steals, one agent
//! killed), long-running jobs; then headless Chromium renders the page
//! (its JavaScript fetching the API) and the DOM must show what the API
//! reports: zones, racks, node counts, busy CPUs, the queue by class, the
//! steals, and the drill-down of one rack with its nodes. A screenshot is
//! checked to be a real 1400x900 PNG; with `WEB_UI_SCREENSHOT=PATH` (relative
//! to the workspace) it is also saved there, which is how `docs/web-ui.png`
//! is made (a second test checks that `--dev` serves the page and prints
//! its URL):
//!
//! ```sh
//! WEB_UI_SCREENSHOT=docs/web-ui.png cargo test -p e2e --test web
//! ```

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use e2e::{Agent, Dispatcher, chromium, eventually, http_get, rendered_dom, wait_nodes};
use proto::v1::{JobSpec, NodeActionRequest, SubmitJobsRequest};
use serde_json::Value;

const ZONE: &str = "topology.kubernetes.io/zone";
const RACK: &str = "dispatch.io/rack";
const LONG: Duration = Duration::from_secs(120);

/// GET a JSON document from the web port.
fn get_json(port: u16, path: &str) -> Result<Value> {
    let (status, body) = http_get(port, path)?;
    ensure!(status == 200, "GET {path}: status {status}: {body}");
    serde_json::from_str(&body).with_context(|| format!("GET {path}: not JSON: {body}"))
}

/// `<a class="rack ..." data-key=... data-nodes=...>` for one rack of the
/// aggregate, exactly as the page writes it.
fn rack_cell(zone: &str, rack: &Value) -> String {
    let t = &rack["totals"];
    format!(
        "data-key=\"{zone}/{}\" data-nodes=\"{}\" data-busy=\"{}\" data-cpus=\"{}\" data-free=\"{}\" data-overloaded=\"{}\"",
        rack["name"].as_str().unwrap_or_default(),
        t["nodes"],
        t["busy_cpus"],
        t["cpus"],
        t["free_cpus"],
        t["overloaded_nodes"],
    )
}

/// Check the overview page's DOM against the aggregate.
fn check_overview(dom: &str, view: &Value) -> Result<()> {
    let zones = view["zones"].as_array().context("zones")?;
    ensure!(zones.len() == 2, "two zones expected: {view}");
    for z in zones {
        let name = z["name"].as_str().context("zone name")?;
        ensure!(
            dom.contains(&format!("data-zone=\"{name}\"")),
            "zone {name} missing from the page"
        );
        ensure!(
            dom.contains(&format!(
                "{} node{} · {}/{} CPUs busy",
                z["totals"]["nodes"],
                if z["totals"]["nodes"] == 1 { "" } else { "s" },
                z["totals"]["busy_cpus"],
                z["totals"]["cpus"]
            )),
            "zone {name}'s totals missing from the page"
        );
        for r in z["racks"].as_array().context("racks")? {
            let cell = rack_cell(name, r);
            ensure!(
                dom.contains(&cell),
                "rack cell `{cell}` missing from the page"
            );
        }
    }
    let totals = &view["totals"];
    for (stat, key) in [
        ("nodes", "nodes"),
        ("down", "down"),
        ("cordoned", "cordoned"),
        ("CPUs", "cpus"),
        ("free CPUs", "free_cpus"),
        ("overloaded nodes", "overloaded_nodes"),
        ("queued on nodes", "queued_jobs"),
    ] {
        let want = format!("data-stat=\"{stat}\"><b>{}</b>", totals[key]);
        ensure!(dom.contains(&want), "`{want}` missing from the page");
    }
    for q in view["queue"].as_array().context("queue")? {
        let want = format!(
            "data-class=\"{}\" data-pending=\"{}\"",
            q["class"].as_str().unwrap_or_default(),
            q["pending"]
        );
        ensure!(dom.contains(&want), "queue row `{want}` missing");
    }
    let pending: i64 = view["queue"]
        .as_array()
        .context("queue")?
        .iter()
        .filter_map(|q| q["pending"].as_i64())
        .sum();
    let want = format!("data-class=\"total\" data-pending=\"{pending}\"");
    ensure!(dom.contains(&want), "queue total `{want}` missing");
    // The jobs waiting longest, each with the kind of its pending reason.
    let waiting = view["waiting"].as_array().context("waiting")?;
    ensure!(!waiting.is_empty(), "no waiting jobs in {view}");
    for w in waiting {
        let want = format!(
            "data-job=\"{}\" data-kind=\"{}\"",
            w["job"].as_str().unwrap_or_default(),
            w["kind"].as_str().unwrap_or_default()
        );
        ensure!(dom.contains(&want), "waiting: `{want}` missing");
        // (Serialised DOM text escapes only `&`, `<` and `>`, which no
        // message has.)
        let message = w["message"].as_str().unwrap_or_default();
        ensure!(dom.contains(message), "waiting: `{message}` missing");
    }
    ensure!(
        waiting.iter().any(|w| w["kind"] == "no_match_cpus"),
        "the 64-CPU job fits no node: {view}"
    );
    for list in ["recent_steals", "recent_placements"] {
        let moves = view[list].as_array().context("moves")?;
        ensure!(!moves.is_empty(), "no {list} in {view}");
        for m in moves {
            let want = format!("data-job=\"{}\"", m["job"].as_str().unwrap_or_default());
            ensure!(dom.contains(&want), "{list}: `{want}` missing");
        }
    }
    Ok(())
}

/// Check the drill-down's DOM against one rack's detail.
fn check_rack(dom: &str, detail: &Value, other_nodes: &[&str]) -> Result<()> {
    let key = format!(
        "{}/{}",
        detail["zone"].as_str().unwrap_or_default(),
        detail["rack"].as_str().unwrap_or_default()
    );
    ensure!(
        dom.contains(&format!("id=\"rack-nodes\" data-key=\"{key}\"")),
        "the drill-down of {key} is not shown"
    );
    for n in detail["nodes"].as_array().context("nodes")? {
        let name = n["name"].as_str().unwrap_or_default();
        let want = format!("data-node=\"{name}\" data-busy=\"{}\"", n["busy_cpus"]);
        ensure!(dom.contains(&want), "node row `{want}` missing");
        // Free CPUs per LLC, as "free/size" chips.
        let free = n["llc_free"].as_array().context("llc_free")?;
        let size = n["llc_cpus"].as_array().context("llc_cpus")?;
        for (f, s) in free.iter().zip(size) {
            ensure!(
                dom.contains(&format!(">{f}/{s}</span>")),
                "LLC {f}/{s} of {name}"
            );
        }
    }
    for other in other_nodes {
        ensure!(
            !dom.contains(&format!("data-node=\"{other}\"")),
            "{other} is not in {key}"
        );
    }
    Ok(())
}

/// Width and height of a PNG, checking its signature and header chunk.
fn png_size(png: &[u8]) -> Result<(u32, u32)> {
    ensure!(
        png.len() > 24 && png.starts_with(b"\x89PNG\r\n\x1a\n") && &png[12..16] == b"IHDR",
        "not a PNG"
    );
    let be = |i: usize| u32::from_be_bytes([png[i], png[i + 1], png[i + 2], png[i + 3]]);
    Ok((be(16), be(20)))
}

fn spec(cpus: u32, latency_nice: i32, selector: &[(&str, &str)]) -> JobSpec {
    JobSpec {
        command: vec!["sleep".into(), "600".into()],
        cpus,
        latency_nice,
        node_selector: selector
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<HashMap<_, _>>(),
        ..Default::default()
    }
}

/// Everything but what changes with every report (ages, times).
fn stable_part(view: &Value) -> Value {
    serde_json::json!({
        "zones": view["zones"],
        "queue": view["queue"],
        "steals": view["recent_steals"],
        "placements": view["recent_placements"],
        "waiting": view["waiting"].as_array().map(|w| {
            w.iter()
                .map(|w| (w["job"].clone(), w["kind"].clone(), w["node"].clone(), w["jobs_ahead"].clone()))
                .collect::<Vec<_>>()
        }),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn web_page_renders_the_cluster_in_headless_chromium() -> Result<()> {
    let dir = tempfile::tempdir()?;
    // Port 0: the dispatcher prints the address its page is on.
    let d = Dispatcher::start(
        dir.path(),
        &["--heartbeat-ms", "300", "--http-listen", "127.0.0.1:0"],
    )?;
    let web = d.web_port(Duration::from_secs(30))?;
    let nodes = [
        ("a1-n1", "2s:2c:1t", "zone-a", "rack-a1"),
        ("a1-n2", "2s:2c:1t", "zone-a", "rack-a1"),
        ("a2-n1", "1s:4c:2t", "zone-a", "rack-a2"),
        ("a2-n2", "2s:2c:2t", "zone-a", "rack-a2"),
        ("b1-n1", "2s:4c:1t", "zone-b", "rack-b1"),
        ("b1-n2", "2s:4c:1t", "zone-b", "rack-b1"),
        ("b2-n1", "1s:4c:1t", "zone-b", "rack-b2"),
        ("b2-n2", "1s:4c:1t", "zone-b", "rack-b2"),
    ];
    let mut agents = Vec::new();
    for (node, topo, zone, rack) in nodes {
        let z = format!("{ZONE}={zone}");
        let r = format!("{RACK}={rack}");
        agents.push(Agent::start(
            dir.path(),
            &d.url,
            node,
            topo,
            &[&z, &r],
            &[],
        )?);
    }
    wait_nodes(&d, nodes.len(), LONG).await?;
    // b2-n2's agent dies: the node shows down.
    let mut dead = agents.pop().context("agents")?;
    dead.proc.kill9();
    eventually(LONG, "b2-n2 down in the API", move || async move {
        let v = get_json(web, "/api/v1/racks/zone-b/rack-b2").ok()?;
        let n = v["nodes"]
            .as_array()?
            .iter()
            .find(|n| n["name"] == "b2-n2")?;
        (n["state"] != "ready").then_some(())
    })
    .await?;

    // Rack a1 with a1-n2 cordoned: two of four 2-CPU jobs for the rack
    // run on a1-n1, two queue.
    let mut admin = d.nodes().await?;
    admin
        .cordon_node(NodeActionRequest {
            name: "a1-n2".into(),
        })
        .await?;
    let mut jobs = d.jobs().await?;
    let a1 = [(RACK, "rack-a1")];
    let mut specs = vec![
        spec(2, 0, &a1),
        spec(2, -5, &a1),
        spec(2, 0, &a1),
        spec(2, -5, &a1),
    ];
    // Elsewhere: a mix of sizes, some in the latency class.
    for (i, cpus) in [1, 2, 4, 2, 1, 3, 2].into_iter().enumerate() {
        specs.push(spec(cpus, if i % 3 == 0 { -3 } else { 0 }, &[]));
    }
    jobs.submit_jobs(SubmitJobsRequest { specs }).await?;
    // (The engine queues one on each node of the rack; cordoned a1-n2
    // holds nothing, so both are overloaded.)
    eventually(LONG, "jobs queued in rack a1", move || async move {
        let v = get_json(web, "/api/v1/racks/zone-a/rack-a1").ok()?;
        let t = &v["totals"];
        (t["queued_jobs"] == 2 && t["overloaded_nodes"].as_u64()? >= 1).then_some(())
    })
    .await?;
    // a1-n2 comes back: it starts its queued job, then, idle with room,
    // steals the other from its overloaded rack peer.
    admin
        .uncordon_node(NodeActionRequest {
            name: "a1-n2".into(),
        })
        .await?;
    eventually(LONG, "a steal in the API", move || async move {
        let v = get_json(web, "/api/v1/cluster").ok()?;
        let steal = v["recent_steals"].as_array()?.first()?.clone();
        (steal["to"] == "a1-n2" && steal["from"] == "a1-n1").then_some(())
    })
    .await?;
    // More for rack a1 than it holds: it stays overloaded. And a job no
    // node has the CPUs for.
    let specs = vec![
        spec(2, 0, &a1),
        spec(2, -5, &a1),
        spec(4, 0, &a1),
        spec(64, 0, &[]),
    ];
    jobs.submit_jobs(SubmitJobsRequest { specs }).await?;

    // Wait for a settled state (two successive snapshots alike, nothing
    // ASSIGNED, rack a1 overloaded), render it, and check that the API
    // still says the same afterwards. On a loaded machine a late heartbeat
    // can change a node's state while Chromium renders: then settle and
    // render again (the DOM is only ever compared with a snapshot taken
    // both before and after it was rendered).
    let base = format!("http://127.0.0.1:{web}/");
    let mut changes = Vec::new();
    let (view, dom) = loop {
        let view = eventually(LONG, "a settled cluster in the API", move || async move {
            let a = get_json(web, "/api/v1/cluster").ok()?;
            tokio::time::sleep(Duration::from_millis(1500)).await;
            let b = get_json(web, "/api/v1/cluster").ok()?;
            let assigned: i64 = b["queue"]
                .as_array()?
                .iter()
                .map(|q| q["assigned"].as_i64().unwrap_or(0))
                .sum();
            let overloaded = b["totals"]["overloaded_nodes"].as_i64()? >= 1;
            (a["generated_ms"] != b["generated_ms"]
                && stable_part(&a) == stable_part(&b)
                && assigned == 0
                && overloaded)
                .then_some(b)
        })
        .await?;
        // The overview, rendered by Chromium.
        let dom = tokio::task::spawn_blocking({
            let base = base.clone();
            move || rendered_dom(&base)
        })
        .await??;
        let after = get_json(web, "/api/v1/cluster")?;
        if stable_part(&after) == stable_part(&view) {
            break (view, dom);
        }
        changes.push(format!(
            "before: {}\nafter: {}",
            stable_part(&view),
            stable_part(&after)
        ));
        ensure!(
            changes.len() < 4,
            "the cluster changed while Chromium rendered it, {} times:\n{}",
            changes.len(),
            changes.join("\n\n")
        );
    };
    ensure!(
        view["totals"]["nodes"] == 8 && view["totals"]["down"] == 1,
        "{view}"
    );
    ensure!(view["totals"]["busy_cpus"].as_u64() > Some(0), "{view}");
    check_overview(&dom, &view).with_context(|| format!("API: {view}\n\nDOM:\n{dom}"))?;

    // The drill-down of rack a1.
    let url = format!("{base}#rack=zone-a/rack-a1");
    let detail = get_json(web, "/api/v1/racks/zone-a/rack-a1")?;
    ensure!(
        detail["nodes"].as_array().map(Vec::len) == Some(2),
        "{detail}"
    );
    let dom = tokio::task::spawn_blocking({
        let url = url.clone();
        move || rendered_dom(&url)
    })
    .await??;
    check_rack(&dom, &detail, &["a2-n1", "b1-n1"])
        .with_context(|| format!("API: {detail}\n\nDOM:\n{dom}"))?;
    let (status, body) = http_get(web, "/api/v1/racks/zone-a/no-such-rack")?;
    ensure!(
        status == 404 && body.contains("no-such-rack"),
        "{status} {body}"
    );

    // A screenshot of the drill-down: a real 1400x900 PNG with content.
    let shots = tempfile::tempdir()?;
    let shot = shots.path().join("web-ui.png");
    tokio::task::spawn_blocking({
        let shot = shot.clone();
        move || {
            chromium(
                &[
                    "--virtual-time-budget=5000".into(),
                    "--window-size=1400,900".into(),
                    format!("--screenshot={}", shot.display()),
                    url,
                ],
                LONG,
            )
        }
    })
    .await??;
    let png = std::fs::read(&shot).context("chromium wrote no screenshot")?;
    ensure!(png_size(&png)? == (1400, 900), "size {:?}", png_size(&png));
    ensure!(
        png.len() > 20_000,
        "a blank-looking screenshot: {} bytes",
        png.len()
    );
    if let Ok(path) = std::env::var("WEB_UI_SCREENSHOT") {
        let workspace = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let target = workspace.join(path);
        std::fs::copy(&shot, &target)
            .with_context(|| format!("saving the screenshot to {}", target.display()))?;
        eprintln!("screenshot saved to {}", target.display());
    }

    // /metrics is served on the same port.
    let (status, metrics) = http_get(web, "/metrics")?;
    ensure!(
        status == 200 && metrics.contains("dispatch_nodes{state=\"ready\"} 7"),
        "{metrics}"
    );
    drop(agents);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_mode_serves_the_page_and_prints_its_url() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let d = Dispatcher::start_dev(dir.path(), &[])?;
    let port: u16 = eventually(LONG, "the page's URL in the banner", || {
        let log = d.proc.log_text();
        async move {
            let rest = log.split("web page on http://127.0.0.1:").nth(1)?;
            rest.split('/').next()?.parse().ok()
        }
    })
    .await?;
    // The banner's dispatchctl line is still there.
    ensure!(
        d.proc
            .log_text()
            .contains(&format!("export DISPATCH_SERVER={}", d.url)),
        "{}",
        d.proc.log_text()
    );
    let (status, page) = http_get(port, "/")?;
    ensure!(
        status == 200 && page.contains("/api/v1/cluster"),
        "{status}"
    );
    // The in-process agent shows up as one node.
    eventually(LONG, "the --dev node in the API", move || async move {
        let v = get_json(port, "/api/v1/cluster").ok()?;
        (v["totals"]["nodes"] == 1).then_some(())
    })
    .await?;
    Ok(())
}
