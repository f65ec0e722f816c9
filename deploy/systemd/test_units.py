#!/usr/bin/env python3
"""Checks of the bare-metal systemd units and their example env files.

1. Every flag the units pass -- on ExecStart and in every *_ARGS value of
   the example env files, the commented-out alternatives included -- must
   be a flag of the built binary (`dispatcher --help`, `agent run --help`):
   a renamed flag fails here, not on an operator's machine.
2. Every variable ExecStart uses is set in the example env file, and the
   ExecStart line, expanded as systemd does with that file, starts with the
   binary and has every value in place.
3. The units' promises: the agent stops with KillMode=process and keeps the
   capabilities it uses; the dispatcher keeps none.
4. Both ExecStart lines, expanded with the example env files, start a
   working dispatcher and agent (the agent confined to the unit's
   capability bounding set) that run a job.
5. `systemd-analyze verify` accepts both units (with ExecStart pointed at
   the built binaries) and `systemd-analyze security` scores them.

A check whose prerequisite is missing (no BIN_DIR, no etcd, not root, no
systemd-analyze) is skipped on a developer's machine and fails in CI (the
`CI` environment variable is set): `.ci/run` installs all of them, so a
skip there would hide a check that never ran.

Usage: deploy/systemd/test_units.py BIN_DIR (the directory holding the
built dispatcher and agent binaries, e.g. target/debug). Standard library
only.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from loopback_ports import free_port  # noqa: E402

HERE = Path(__file__).resolve().parent
BIN_DIR: Path | None = None

UNITS = {
    "dispatcher.service": {"env": "dispatcher.env", "argv0": "dispatcher", "help": ["--help"]},
    "agent.service": {"env": "agent.env", "argv0": "agent", "help": ["run", "--help"]},
}


def unit_entries(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) in order; keys may repeat; continuation lines joined."""
    entries, section, pending = [], "", ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        entries.append((section, key.strip(), value.strip()))
    return entries


def get(entries, section: str, key: str) -> list[str]:
    return [v for s, k, v in entries if s == section and k == key]


def env_file(path: Path) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """The settings, and the commented-out alternatives (KEY, VALUE)."""
    settings, alternatives = {}, []
    for line in path.read_text().splitlines():
        m = re.fullmatch(r"(#?)([A-Z_][A-Z0-9_]*)=(.*)", line.strip())
        if not m:
            continue
        value = m.group(3)
        if value.startswith('"') and value.endswith('"') and len(value) >= 2:
            value = value[1:-1]
        if m.group(1):
            alternatives.append((m.group(2), value))
        else:
            settings[m.group(2)] = value
    return settings, alternatives


def expand_exec(command: str, env: dict[str, str]) -> list[str]:
    """systemd's ExecStart expansion: ${VAR} is one word, $VAR splits."""
    argv = []
    for word in shlex.split(command):
        m = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if m:
            argv.extend(env[m.group(1)].split())
            continue
        argv.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda v: env[v.group(1)], word))
    return argv


def flags(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith("--")]


def help_flags(argv0: str, help_args: list[str]) -> set[str]:
    assert BIN_DIR is not None
    out = subprocess.run([str(BIN_DIR / argv0), *help_args], check=True, capture_output=True, text=True).stdout
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", out))


def skip_outside_ci(test: unittest.TestCase, reason: str):
    """Skip for lack of `reason` -- except in CI, which provides everything
    these checks need: there the missing prerequisite is a failure."""
    if os.environ.get("CI"):
        test.fail(f"CI must provide this check's prerequisite: {reason}")
    test.skipTest(reason)


def wait_for(what: str, check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class UnitTest(unittest.TestCase):
    def test_exec_start_expands_with_the_example_env(self):
        for unit, info in UNITS.items():
            with self.subTest(unit=unit):
                entries = unit_entries(HERE / unit)
                (command,) = get(entries, "Service", "ExecStart")
                settings, _ = env_file(HERE / info["env"])
                used = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", command))
                self.assertEqual(used - settings.keys(), set(), f"{info['env']} lacks variables {unit} uses")
                argv = expand_exec(command, settings)
                self.assertEqual(argv[0], f"/usr/local/bin/{info['argv0']}")
                self.assertNotIn("", argv, "an empty ${VAR}")
                passed = [f for f in flags(argv) if f != "--label"]
                self.assertEqual(len(passed), len(set(passed)), f"{unit} repeats a flag: {passed}")
                self.assertEqual(get(entries, "Service", "EnvironmentFile"), [f"/etc/dispatch/{info['env']}"])

    def test_every_flag_exists_in_the_binary(self):
        if BIN_DIR is None:
            skip_outside_ci(self, "no BIN_DIR given")
        for unit, info in UNITS.items():
            known = help_flags(info["argv0"], info["help"])
            entries = unit_entries(HERE / unit)
            (command,) = get(entries, "Service", "ExecStart")
            settings, alternatives = env_file(HERE / info["env"])
            passed = flags(expand_exec(command, settings))
            for key, value in alternatives:
                if key.endswith("_ARGS"):
                    passed += flags(value.split())
            self.assertIn("--dispatcher" if info["argv0"] == "agent" else "--listen", passed)
            missing = sorted(set(passed) - known)
            self.assertEqual(missing, [], f"{unit} passes flags {info['argv0']} does not have")

    def test_agent_leaves_jobs_alone_on_stop_and_keeps_its_capabilities(self):
        entries = unit_entries(HERE / "agent.service")
        self.assertEqual(get(entries, "Service", "KillMode"), ["process"])
        self.assertEqual(get(entries, "Service", "User"), ["root"])
        (caps,) = get(entries, "Service", "CapabilityBoundingSet")
        self.assertTrue({"CAP_SYS_NICE", "CAP_KILL", "CAP_SETUID", "CAP_SETGID"} <= set(caps.split()), caps)
        # Options that would confine the jobs (the agent's children).
        for key in ("ProtectHome", "PrivateTmp", "MemoryDenyWriteExecute", "SystemCallFilter", "ProtectProc"):
            self.assertEqual(get(entries, "Service", key), [], f"agent.service must not set {key}")
        self.assertNotEqual(get(entries, "Service", "ProtectSystem"), ["strict"])
        settings, _ = env_file(HERE / "agent.env")
        self.assertEqual(settings["DISPATCH_ON_SHUTDOWN"], "leave")

    def test_dispatcher_runs_unprivileged(self):
        entries = unit_entries(HERE / "dispatcher.service")
        self.assertEqual(get(entries, "Service", "User"), ["dispatch"])
        self.assertEqual(get(entries, "Service", "CapabilityBoundingSet"), [""])
        self.assertEqual(get(entries, "Service", "NoNewPrivileges"), ["yes"])
        self.assertEqual(get(entries, "Service", "StateDirectory"), ["dispatch"])
        sysusers = (HERE / "dispatch.sysusers.conf").read_text()
        self.assertRegex(sysusers, r"(?m)^u dispatch ")

    def test_etcd_conf_sets_only_etcd_settings(self):
        """etcd reads ETCD_FOO_BAR as --foo-bar: every key must be a flag."""
        etcd = shutil.which("etcd")
        if etcd is None:
            skip_outside_ci(self, "no etcd binary (Debian package etcd-server)")
        out = subprocess.run([etcd, "--help"], capture_output=True, text=True).stdout
        known = set(re.findall(r"(?m)^\s+(--[a-z][a-z0-9-]*)", out))
        settings, _ = env_file(HERE / "etcd.conf")
        self.assertIn("ETCD_INITIAL_CLUSTER", settings)
        flags_set = {"--" + k[len("ETCD_"):].lower().replace("_", "-") for k in settings}
        self.assertEqual(flags_set - known, set())
        names = {m.split("=")[0] for m in settings["ETCD_INITIAL_CLUSTER"].split(",")}
        self.assertIn(settings["ETCD_NAME"], names)

    def test_units_start_a_working_system(self):
        """Both ExecStart lines, expanded with the example env files, run for
        real: host paths mapped into a temporary directory, 0.0.0.0 and the
        example addresses onto loopback ports, the agent confined (setpriv)
        to the unit's CapabilityBoundingSet with NoNewPrivileges; a job runs."""
        if BIN_DIR is None:
            skip_outside_ci(self, "no BIN_DIR given")
        if os.geteuid() != 0 or shutil.which("setpriv") is None:
            skip_outside_ci(self, "needs root and setpriv (util-linux)")
        port, http_port, metrics_port = free_port(), free_port(), free_port()
        url = f"http://127.0.0.1:{port}"
        procs = []
        with tempfile.TemporaryDirectory() as tmp:
            def argv_of(unit: str) -> list[str]:
                info = UNITS[unit]
                entries = unit_entries(HERE / unit)
                settings, _ = env_file(HERE / info["env"])
                if unit == "agent.service":
                    settings["DISPATCH_SERVER"] = url
                argv = expand_exec(get(entries, "Service", "ExecStart")[0], settings)
                argv[0] = str(BIN_DIR / info["argv0"])
                out = []
                for a in argv:
                    a = a.replace("/var/lib/dispatch-agent", f"{tmp}/agent").replace("/var/lib/dispatch", f"{tmp}/data")
                    a = {"0.0.0.0:50051": f"127.0.0.1:{port}", "0.0.0.0:8080": f"127.0.0.1:{http_port}",
                         "0.0.0.0:9101": f"127.0.0.1:{metrics_port}"}.get(a, a)
                    out.append(a)
                if unit == "agent.service":
                    (caps,) = get(entries, "Service", "CapabilityBoundingSet")
                    bounding = ",".join("+" + c.lower().removeprefix("cap_") for c in caps.split())
                    confine = ["setpriv", "--bounding-set", "-all," + bounding, "--inh-caps", "-all"]
                    if get(entries, "Service", "NoNewPrivileges") == ["yes"]:
                        confine.append("--no-new-privs")
                    out = confine + out
                return out

            try:
                for unit in UNITS:
                    log = open(Path(tmp) / f"{unit}.log", "w")
                    procs.append((subprocess.Popen(argv_of(unit), stdout=log, stderr=subprocess.STDOUT,
                                                   start_new_session=True), log))
                env = dict(os.environ, DISPATCH_SERVER=url)

                def ctl(*args):
                    return subprocess.run([str(BIN_DIR / "dispatchctl"), *args], env=env, capture_output=True,
                                          text=True, timeout=60)

                def registered():
                    for p, _ in procs:
                        if p.poll() is not None:
                            logs = "".join(q.read_text() for q in Path(tmp).glob("*.log"))
                            raise AssertionError(f"{p.args} exited {p.returncode}:\n{logs[-3000:]}")
                    return "zone" in ctl("nodes", "-o", "json").stdout
                wait_for("the agent to register", registered)
                nodes = ctl("nodes", "-o", "json").stdout
                # The labels from agent.env's DISPATCH_LABEL_ARGS, read by
                # the dispatcher's zone and rack labels from dispatcher.env.
                self.assertRegex(nodes, r'"zone":\s*"z1"')
                self.assertRegex(nodes, r'"rack":\s*"r1"')
                done = ctl("submit", "--wait", "--follow", "--", "sh", "-c", "echo from-systemd-units; id -u")
                self.assertEqual(done.returncode, 0, done.stderr)
                self.assertIn("from-systemd-units", done.stdout)
                self.assertIn("65534", done.stdout.split())
                log = (Path(tmp) / "agent.service.log").read_text()
                self.assertNotRegex(log, r"EPERM|not permitted")
            finally:
                for p, log in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                    log.close()
                # With --on-shutdown leave (agent.env), shims outlive the agent.
                for d in Path("/proc").iterdir():
                    try:
                        if d.name.isdigit() and f"{tmp}/agent" in (d / "cmdline").read_text():
                            os.kill(int(d.name), signal.SIGKILL)
                    except (OSError, ProcessLookupError):
                        pass

    def test_systemd_analyze_verify(self):
        analyze = shutil.which("systemd-analyze")
        if analyze is None:
            skip_outside_ci(self, "systemd-analyze is not installed")
        if BIN_DIR is None:
            skip_outside_ci(self, "no BIN_DIR given (verify needs the ExecStart binaries)")
        with tempfile.TemporaryDirectory() as tmp:
            paths = []
            for unit, info in UNITS.items():
                text = (HERE / unit).read_text().replace(f"/usr/local/bin/{info['argv0']}",
                                                         str(BIN_DIR.resolve() / info["argv0"]))
                (Path(tmp) / unit).write_text(text)
                paths.append(str(Path(tmp) / unit))
            run = subprocess.run([analyze, "verify", "--man=no", *paths], capture_output=True, text=True, cwd=tmp)
            # verify also reports on units these depend on (network-online.target,
            # etcd.service) which a build machine may lack: only our units' lines count.
            ours = [line for line in (run.stdout + run.stderr).splitlines()
                    if any(u in line for u in UNITS)]
            self.assertEqual(ours, [], "\n".join(ours))
            print(f"  systemd-analyze verify: {len(paths)} units, exit {run.returncode}", file=sys.stderr)

    def test_systemd_analyze_security_exposure(self):
        """systemd's own exposure score (0 safest, 10 unconfined), offline:
        the dispatcher must stay at 2.0 or below; the agent, root and
        parent of arbitrary jobs, below 7.0 (it scores 6.5)."""
        analyze = shutil.which("systemd-analyze")
        if analyze is None:
            skip_outside_ci(self, "systemd-analyze is not installed")
        if BIN_DIR is None:
            skip_outside_ci(self, "no BIN_DIR given (the unit's ExecStart binary must exist)")
        with tempfile.TemporaryDirectory() as tmp:
            for unit, info in UNITS.items():
                text = (HERE / unit).read_text().replace(f"/usr/local/bin/{info['argv0']}",
                                                         str(BIN_DIR.resolve() / info["argv0"]))
                (Path(tmp) / unit).write_text(text)
                threshold = 20 if unit == "dispatcher.service" else 70
                run = subprocess.run([analyze, "security", "--offline=true", f"--threshold={threshold}", unit],
                                     capture_output=True, text=True, cwd=tmp)
                if "Unknown command verb" in run.stderr or "unrecognized option" in run.stderr:
                    skip_outside_ci(self, f"this systemd-analyze has no offline security: {run.stderr.strip()}")
                overall = [line for line in run.stdout.splitlines() if "Overall exposure level" in line]
                print(f"  {overall[-1].strip() if overall else run.stderr.strip()}", file=sys.stderr)
                self.assertEqual(run.returncode, 0, f"{unit} is above {threshold / 10}:\n{run.stdout[-600:]}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):
        BIN_DIR = Path(sys.argv.pop(1))
    unittest.main(verbosity=2)
