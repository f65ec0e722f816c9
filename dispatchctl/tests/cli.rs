//! The `dispatchctl` binary as a user runs it: help texts, server
//! resolution precedence, exit codes, and the message when the dispatcher
//! cannot be reached (against a closed loopback port). Every run gets an
//! explicit environment (an empty temporary HOME, no DISPATCH_* variables
//! unless the test sets them) so the developer's own config never leaks
//! in, and the test process's environment is never modified.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use clap::CommandFactory;

const BIN: &str = env!("CARGO_BIN_EXE_dispatchctl");

/// Runs dispatchctl with `args` and exactly the DISPATCH_* / config
/// variables given in `env`.
fn ctl(args: &[&str], env: &[(&str, &str)]) -> Output {
    let home = tempfile::tempdir().expect("temp HOME");
    Command::new(BIN)
        .args(args)
        .env_remove("DISPATCH_SERVER")
        .env_remove("DISPATCH_CONFIG")
        .env_remove("XDG_CONFIG_HOME")
        .env("HOME", home.path())
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("run dispatchctl")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A loopback port nothing listens on: bound, then released.
fn closed_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let port = l.local_addr().expect("local addr").port();
    drop(l);
    port
}

fn write_config(dir: &Path, server: &str) -> String {
    let p = dir.join("config.json");
    std::fs::write(&p, format!("{{\"server\": \"{server}\"}}")).expect("write config");
    p.to_string_lossy().into_owned()
}

/// Every command path, from the clap definition (so new subcommands are
/// covered without editing this test).
fn command_paths() -> Vec<Vec<String>> {
    fn walk(cmd: &clap::Command, prefix: &[String], out: &mut Vec<Vec<String>>) {
        out.push(prefix.to_vec());
        for sub in cmd.get_subcommands() {
            let mut p = prefix.to_vec();
            p.push(sub.get_name().to_string());
            walk(sub, &p, out);
        }
    }
    let mut out = Vec::new();
    walk(&dispatchctl::cli::Cli::command(), &[], &mut out);
    out
}

#[test]
fn help_works_for_every_subcommand() {
    let paths = command_paths();
    for expected in [
        "submit", "get", "ls", "cancel", "logs", "watch", "nodes", "node", "top", "config",
    ] {
        assert!(
            paths.iter().any(|p| p.len() == 1 && p[0] == expected),
            "missing command {expected}"
        );
    }
    for path in &paths {
        for flag in ["--help", "-h"] {
            let mut args: Vec<&str> = path.iter().map(String::as_str).collect();
            args.push(flag);
            let o = ctl(&args, &[]);
            assert!(o.status.success(), "{args:?}: {}", stderr(&o));
            let out = stdout(&o);
            assert!(out.contains("Usage: dispatchctl"), "{args:?}: {out}");
        }
    }
    // `help <command>` works too.
    let o = ctl(&["help", "submit"], &[]);
    assert!(o.status.success());
    assert!(stdout(&o).contains("--latency-nice"));
}

#[test]
fn top_level_help_documents_exit_codes_and_server() {
    let o = ctl(&["--help"], &[]);
    let out = stdout(&o);
    assert!(out.contains("Exit codes:"), "{out}");
    assert!(
        out.contains("2    the dispatcher cannot be reached"),
        "{out}"
    );
    assert!(out.contains("DISPATCH_SERVER"), "{out}");
    let o = ctl(&["submit", "--help"], &[]);
    let out = stdout(&o);
    for flag in [
        "--name",
        "--cpus",
        "--memory",
        "--align",
        "--policy",
        "--selector",
        "--env",
        "--cwd",
        "--latency-nice",
        "--nice",
        "--waker",
        "--group",
        "--retries",
        "--timeout",
        "--array",
        "--wait",
        "--follow",
        "--output",
    ] {
        assert!(out.contains(flag), "submit --help lacks {flag}");
    }
}

#[test]
fn version_and_usage_errors() {
    let o = ctl(&["--version"], &[]);
    assert!(o.status.success());
    assert!(stdout(&o).starts_with("dispatchctl "));
    for bad in [
        &["frobnicate"][..],
        &["submit", "echo", "hi"],
        &["submit", "--memory", "4X", "--", "true"],
        &["submit", "--timeout", "30", "--", "true"],
        &["ls", "--state", "sleeping"],
        &["node", "drain"],
    ] {
        let o = ctl(bad, &[]);
        assert_eq!(o.status.code(), Some(64), "{bad:?}: {}", stderr(&o));
        assert!(stderr(&o).contains("error:"), "{bad:?}");
    }
    let o = ctl(&["submit", "--memory", "4X", "--", "true"], &[]);
    assert!(stderr(&o).contains("unknown unit"), "{}", stderr(&o));
}

fn resolved(args: &[&str], env: &[(&str, &str)]) -> serde_json::Value {
    let mut a = args.to_vec();
    a.extend(["config", "-o", "json"]);
    let o = ctl(&a, env);
    assert!(o.status.success(), "{}", stderr(&o));
    serde_json::from_slice(&o.stdout).expect("config json")
}

#[test]
fn server_precedence_flag_env_file_default() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = write_config(dir.path(), "http://from-file:1");
    let env_and_file = [
        ("DISPATCH_SERVER", "http://from-env:2"),
        ("DISPATCH_CONFIG", cfg.as_str()),
    ];

    let v = resolved(&["--server", "http://from-flag:3"], &env_and_file);
    assert_eq!(v["server"], "http://from-flag:3");
    assert_eq!(v["source"]["kind"], "flag");

    let v = resolved(&[], &env_and_file);
    assert_eq!(v["server"], "http://from-env:2");
    assert_eq!(v["source"]["kind"], "env");

    let v = resolved(&[], &[("DISPATCH_CONFIG", cfg.as_str())]);
    assert_eq!(v["server"], "http://from-file:1");
    assert_eq!(v["source"]["kind"], "config_file");
    assert_eq!(v["source"]["path"], cfg.as_str());

    let v = resolved(&[], &[]);
    assert_eq!(v["server"], "http://127.0.0.1:50051");
    assert_eq!(v["source"]["kind"], "default");

    // ~/.config/dispatch/config.json is read when DISPATCH_CONFIG is unset.
    let home = tempfile::tempdir().expect("home");
    let conf_dir = home.path().join(".config/dispatch");
    std::fs::create_dir_all(&conf_dir).expect("mkdir");
    write_config(&conf_dir, "home-host:4");
    let h = home.path().to_string_lossy().into_owned();
    let v = resolved(&[], &[("HOME", h.as_str())]);
    assert_eq!(v["server"], "http://home-host:4");

    // The text form.
    let o = ctl(&["config"], &[("DISPATCH_SERVER", "10.1.2.3:5")]);
    assert_eq!(
        stdout(&o),
        "server: http://10.1.2.3:5\nsource: DISPATCH_SERVER\n"
    );
}

#[test]
fn config_problems_exit_1_with_the_file_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{oops").expect("write");
    let bad_s = bad.to_string_lossy().into_owned();
    let o = ctl(&["ls"], &[("DISPATCH_CONFIG", bad_s.as_str())]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains(&bad_s), "{}", stderr(&o));

    let missing = dir.path().join("missing.json");
    let m = missing.to_string_lossy().into_owned();
    let o = ctl(&["ls"], &[("DISPATCH_CONFIG", m.as_str())]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("cannot read the config file"),
        "{}",
        stderr(&o)
    );

    let o = ctl(&["--server", "ftp://x:1", "ls"], &[]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("invalid server address"),
        "{}",
        stderr(&o)
    );
}

fn assert_unreachable(o: &Output, url: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert_eq!(
        err.trim_end(),
        format!(
            "error: cannot reach the dispatcher at {url} (connection refused): is it running? \
             start one with `dispatcher --dev` or set --server / DISPATCH_SERVER"
        )
    );
    assert!(o.stdout.is_empty(), "nothing on stdout");
}

#[test]
fn unreachable_dispatcher_exits_2_for_every_command() {
    let port = closed_port();
    let url = format!("http://127.0.0.1:{port}");
    for args in [
        &["ls"][..],
        &["get", "j-1"],
        &["submit", "--wait", "--", "true"],
        &["cancel", "j-1"],
        &["logs", "-f", "j-1"],
        &["watch"],
        &["nodes"],
        &["node", "drain", "n1"],
        &["node", "show", "n1"],
        &["top", "--once"],
        &["top"],
    ] {
        let mut a = vec!["--server", url.as_str()];
        a.extend(args);
        assert_unreachable(&ctl(&a, &[]), &url);
    }
}

#[test]
fn unreachable_message_names_the_address_from_env_and_file() {
    let port = closed_port();
    let url = format!("http://127.0.0.1:{port}");
    // A bare host:port gets its scheme.
    let bare = format!("127.0.0.1:{port}");
    assert_unreachable(&ctl(&["ls"], &[("DISPATCH_SERVER", bare.as_str())]), &url);

    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = write_config(dir.path(), &url);
    assert_unreachable(&ctl(&["nodes"], &[("DISPATCH_CONFIG", cfg.as_str())]), &url);
}
