//! The dispatcher library's layering, checked on its source: no import
//! loop between its top-level modules (ARCHITECTURE.md, "No import loop
//! in the dispatcher") and no use of the `agent` crate outside the binary
//! (whose `--dev` flag runs an agent in process).
//!
//! A module's dependencies are the `crate::NAME` paths in its code (doc
//! comments and `//` comments aside, and its `#[cfg(test)]` tail, which
//! may reach anywhere).

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code of a file without comments and without its test tail.
fn code(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap_or("");
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The names following `crate::` in `code`.
fn crate_paths(code: &str) -> BTreeSet<String> {
    code.match_indices("crate::")
        .map(|(i, m)| {
            code[i + m.len()..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect::<String>()
        })
        .filter(|n| !n.is_empty())
        .collect()
}

/// Top-level module -> the top-level modules its code names.
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(src).unwrap();
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let module = top.trim_end_matches(".rs").to_string();
        if module == "bin" || module == "lib" || module.ends_with("_tests") {
            continue;
        }
        let deps = crate_paths(&code(&fs::read_to_string(&f).unwrap()));
        let entry = g.entry(module.clone()).or_default();
        entry.extend(deps.into_iter().filter(|d| *d != module));
    }
    g
}

/// A cycle of `g`, if it has one (depth-first search).
fn find_cycle(g: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        g: &BTreeMap<String, BTreeSet<String>>,
        done: &mut BTreeSet<String>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == n) {
            let mut cycle = path[i..].to_vec();
            cycle.push(n.to_string());
            return Some(cycle);
        }
        if done.contains(n) {
            return None;
        }
        path.push(n.to_string());
        for d in g.get(n).into_iter().flatten() {
            if let Some(c) = visit(d, g, done, path) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(n.to_string());
        None
    }
    let mut done = BTreeSet::new();
    g.keys()
        .find_map(|n| visit(n, g, &mut done, &mut Vec::new()))
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn the_dispatchers_modules_have_no_import_loop() {
    let g = graph(&src());
    assert!(g.contains_key("core") && g.contains_key("web"), "{g:?}");
    if let Some(cycle) = find_cycle(&g) {
        panic!("import loop: {}\n{g:#?}", cycle.join(" -> "));
    }
    // The core reaches its observers only through `observe`.
    for observer in ["metrics", "web", "telemetry"] {
        assert!(!g["core"].contains(observer), "core uses {observer}");
    }
}

#[test]
fn the_cycle_finder_finds_a_loop() {
    let g: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec![]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
    .collect();
    assert_eq!(find_cycle(&g).unwrap(), ["a", "b", "c", "a"]);
    let mut acyclic = g.clone();
    acyclic.get_mut("c").unwrap().clear();
    assert_eq!(find_cycle(&acyclic), None);
}

#[test]
fn only_the_binary_uses_the_agent_crate() {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let bin = src().join("bin");
    for f in files.iter().filter(|f| !f.starts_with(&bin)) {
        let code = code(&fs::read_to_string(f).unwrap());
        let uses_agent = code.match_indices("agent::").any(|(i, _)| {
            !code[..i]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':')
        });
        assert!(!uses_agent, "{} uses the agent crate", f.display());
    }
}
