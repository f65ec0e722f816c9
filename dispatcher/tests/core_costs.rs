//! The `core_costs` bench binary's check mode, so it cannot rot: at small
//! sizes it must count heap bytes per node and per pending job, queue each
//! stream's first LoadReport and no unchanged one, and assemble off the
//! core the same web snapshot the core used to build whole.

use std::process::Command;

#[test]
fn core_costs_check_mode_passes() {
    let out = Command::new(env!("CARGO_BIN_EXE_core_costs"))
        .arg("--check")
        .output()
        .expect("running core_costs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("| all of a node |"), "{stdout}");
    assert!(stdout.contains("| pending jobs |"), "{stdout}");
    assert!(stdout.contains("check: ok"), "{stdout}");
}
