#!/usr/bin/env python3
"""Offline tests of the Helm chart in helm/dispatch.

No cluster and no helm binary: the chart is linted and rendered by the real
Helm SDK (Go, through the PyPI package helm-python-sdk), and every rendered
manifest is validated against the Kubernetes 1.30 OpenAPI schemas with
kubernetes-validate (strict: unknown fields are errors). Custom resources
(the Prometheus Operator's ServiceMonitor) are not in those schemas: their
structure is checked here instead, and the test says so.

On top of schema validity the tests check what the chart promises: the
agent's security context, the dispatcher's store and advertise URL per
mode, values that must fail, and (when HELM_TEST_BIN_DIR names the built
binaries, as scripts/test does) that every flag the chart passes exists in
the binaries' --help, and that the dispatcher and agent started from the
chart's rendered arguments work: the agent with only the capabilities the
chart grants it, TLS and tokens as the chart wires them, three replicas
sharing a local etcd, an agent through dispatch-relay (relay.enabled) with
the relay's readiness probe answered.

Run: helm/run-tests (makes the venv), or python3 helm/test_chart.py with
helm-python-sdk, kubernetes-validate and pyyaml installed.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from loopback_ports import free_port  # noqa: E402

import helm_python as helm
import kubernetes_validate
import yaml

CHART = Path(__file__).resolve().parent / "dispatch"
KUBE_VERSION = "1.30.0"
RELEASE, NAMESPACE = "rel", "jobs"
FULLNAME = f"{RELEASE}-dispatch"

# The kinds that make pods.
WORKLOADS = ("StatefulSet", "DaemonSet", "Deployment")

# Kinds outside Kubernetes' own schemas, checked by validate_custom_resource.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}

# The values files in helm/dispatch/ci (examples for users, and the
# chart-testing convention), by name, plus the defaults.
SCENARIOS: dict[str, dict] = {"default": {}} | {
    p.name.removesuffix("-values.yaml"): yaml.safe_load(p.read_text())
    for p in sorted((CHART / "ci").glob("*-values.yaml"))
}


def render(values: dict) -> tuple[list[dict], str]:
    """The rendered manifests (parsed) and NOTES.txt."""
    chart = helm.Chart.load(str(CHART))
    chart.validate_schema(values)
    rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    docs, notes = [], ""
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            notes = text
        elif path.endswith((".yaml", ".yml")):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs, notes


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = find(docs, kind, name)
    assert len(found) == 1, f"want one {kind} {name}, got {len(found)}: {[d['metadata']['name'] for d in find(docs, kind)]}"
    return found[0]


def container(workload: dict, name: str) -> dict:
    for c in workload["spec"]["template"]["spec"]["containers"]:
        if c["name"] == name:
            return c
    raise AssertionError(f"no container {name} in {workload['metadata']['name']}")


def arg_map(c: dict) -> dict[str, list[str]]:
    """--flag=value arguments by flag (a flag may repeat)."""
    out: dict[str, list[str]] = {}
    for a in c.get("args", []):
        if a.startswith("--"):
            k, _, v = a.partition("=")
            out.setdefault(k, []).append(v)
    return out


def validate_custom_resource(doc: dict, docs: list[dict]) -> None:
    """Structure of a ServiceMonitor: it must select a rendered Service by
    its labels and name ports that Service has."""
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor"), doc["kind"]
    assert set(doc) == {"apiVersion", "kind", "metadata", "spec"}, sorted(doc)
    assert doc["metadata"]["name"] and doc["metadata"]["namespace"] == NAMESPACE
    spec = doc["spec"]
    assert set(spec) <= {"selector", "namespaceSelector", "endpoints", "jobLabel"}, sorted(spec)
    wanted = spec["selector"]["matchLabels"]
    services = [s for s in find(docs, "Service")
                if all(s["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())]
    assert services, f"ServiceMonitor {doc['metadata']['name']} selects no rendered Service ({wanted})"
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    for ep in spec["endpoints"]:
        assert set(ep) <= {"port", "path", "interval", "relabelings", "scheme", "tlsConfig"}, sorted(ep)
        assert re.fullmatch(r"[0-9]+(ms|s|m|h)", ep["interval"]), ep["interval"]
        for s in services:
            ports = {p["name"] for p in s["spec"]["ports"]}
            assert ep["port"] in ports, f"{doc['metadata']['name']}: port {ep['port']} not in {s['metadata']['name']} {ports}"


def validate_all(docs: list[dict]) -> int:
    """Validate every manifest; returns how many went through kubernetes-validate."""
    validated = 0
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
            print(f"  note: {doc['kind']} {doc['metadata']['name']} is a custom resource, not in the "
                  f"Kubernetes {KUBE_VERSION} schemas: checked structurally instead", file=sys.stderr)
            validate_custom_resource(doc, docs)
            continue
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        validated += 1
        check_references(doc, docs)
    return validated


def check_references(doc: dict, docs: list[dict]) -> None:
    """What the schema cannot see: mounts name declared volumes, named probe
    ports exist, Services select pods that some workload makes, and
    StatefulSets' serviceName is a rendered headless Service."""
    if doc["kind"] in WORKLOADS:
        pod = doc["spec"]["template"]
        assert doc["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        volumes = {v["name"] for v in pod["spec"].get("volumes", [])}
        volumes |= {t["metadata"]["name"] for t in doc["spec"].get("volumeClaimTemplates", [])}
        for c in pod["spec"]["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{doc['metadata']['name']}/{c['name']} mounts undeclared {m['name']}"
            ports = {p["name"] for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe"):
                for how in ("tcpSocket", "httpGet", "grpc"):
                    port = c.get(probe, {}).get(how, {}).get("port")
                    if isinstance(port, str):
                        assert port in ports, f"{doc['metadata']['name']}: {probe} port {port} not in {ports}"
            for ref in c.get("envFrom", []):
                one(docs, "ConfigMap", ref["configMapRef"]["name"])
        if doc["kind"] == "StatefulSet":
            hl = one(docs, "Service", doc["spec"]["serviceName"])
            assert hl["spec"]["clusterIP"] == "None"
            assert hl["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        sa = pod["spec"].get("serviceAccountName")
        if sa:
            one(docs, "ServiceAccount", sa)
    if doc["kind"] == "Service":
        pods = [w["spec"]["template"] for w in docs if w["kind"] in WORKLOADS]
        matching = [p for p in pods if doc["spec"]["selector"].items() <= p["metadata"]["labels"].items()]
        assert matching, f"Service {doc['metadata']['name']} selects no pods"
        for port in doc["spec"]["ports"]:
            names = {p["name"] for m in matching for c in m["spec"]["containers"] for p in c.get("ports", [])}
            assert port["targetPort"] in names, f"Service {doc['metadata']['name']}: targetPort {port['targetPort']}"


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in WORKLOADS]


def help_flags(argv: list[str]) -> set[str]:
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", out))


class ChartTest(unittest.TestCase):
    maxDiff = None

    def test_the_scenarios_are_there(self):
        self.assertEqual(set(SCENARIOS), {"default", "ha", "bundled-etcd", "tls", "tls-node-certs", "options",
                                          "relay"})

    def test_lint_strict_every_scenario(self):
        for name, values in SCENARIOS.items():
            with self.subTest(scenario=name):
                report = helm.lint(str(CHART), values, strict=True, namespace=NAMESPACE,
                                   kube_version="v" + KUBE_VERSION)
                self.assertEqual(report["errors"], [])
                bad = [m for m in report["messages"] if m["severity"] >= 2]
                self.assertEqual(bad, [], f"lint findings for {name}")

    def test_every_scenario_renders_valid_manifests(self):
        for name, values in SCENARIOS.items():
            with self.subTest(scenario=name):
                docs, notes = render(values)
                n = validate_all(docs)
                print(f"  {name}: {len(docs)} manifests, {n} validated against Kubernetes {KUBE_VERSION}",
                      file=sys.stderr)
                self.assertGreaterEqual(n, 8)
                self.assertIn("DISPATCH_SERVER", notes)
                for w in workloads(docs):
                    for c in w["spec"]["template"]["spec"]["containers"]:
                        twice = {f for f, v in arg_map(c).items() if len(v) > 1 and f != "--label"}
                        self.assertEqual(twice, set(), f"{w['metadata']['name']} repeats flags")
                names = [(d["kind"], d["metadata"]["name"]) for d in docs]
                self.assertEqual(len(names), len(set(names)), f"duplicate objects in {name}")

    def test_default_is_one_replica_with_the_embedded_store_on_a_volume(self):
        docs, notes = render({})
        sts = one(docs, "StatefulSet", f"{FULLNAME}-dispatcher")
        self.assertEqual(sts["spec"]["replicas"], 1)
        args = arg_map(container(sts, "dispatcher"))
        self.assertEqual(args["--store"], ["embedded"])
        self.assertNotIn("--etcd-endpoints", args)
        self.assertEqual(args["--listen"], ["0.0.0.0:50051"])
        self.assertEqual(args["--data-dir"], ["/var/lib/dispatch"])
        self.assertEqual([t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]], ["data"])
        self.assertEqual(find(docs, "StatefulSet", f"{FULLNAME}-etcd"), [])
        self.assertEqual(find(docs, "PodDisruptionBudget"), [])
        self.assertEqual(find(docs, "ServiceMonitor"), [])
        pod = sts["spec"]["template"]
        self.assertEqual(pod["metadata"]["annotations"]["prometheus.io/scrape"], "true")
        self.assertTrue(pod["spec"]["securityContext"]["runAsNonRoot"])
        self.assertIn("kubectl -n jobs port-forward svc/rel-dispatch-dispatcher 50051:50051", notes)
        self.assertIn("export DISPATCH_SERVER=http://127.0.0.1:50051", notes)

    def test_agent_daemonset_security_and_node_labels(self):
        docs, _ = render({})
        ds = one(docs, "DaemonSet", f"{FULLNAME}-agent")
        pod = ds["spec"]["template"]["spec"]
        self.assertNotIn("hostPID", pod)
        c = container(ds, "agent")
        sys_mount = [m for m in c["volumeMounts"] if m["mountPath"] == "/sys"]
        self.assertEqual(len(sys_mount), 1)
        self.assertTrue(sys_mount[0]["readOnly"])
        sys_vol = [v for v in pod["volumes"] if v["name"] == sys_mount[0]["name"]][0]
        self.assertEqual(sys_vol["hostPath"]["path"], "/sys")
        sc = c["securityContext"]
        self.assertTrue(sc["readOnlyRootFilesystem"])
        self.assertFalse(sc["allowPrivilegeEscalation"])
        self.assertFalse(sc.get("privileged", False))
        self.assertEqual(sc["capabilities"]["drop"], ["ALL"])
        self.assertEqual(set(sc["capabilities"]["add"]), {"SYS_NICE", "KILL", "SETUID", "SETGID"})
        # Nothing writable but the state dir and /tmp.
        # No limits: jobs share the agent container's cgroup.
        self.assertNotIn("limits", c["resources"])
        writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
        self.assertEqual(writable, {"/var/lib/dispatch-agent", "/tmp"})
        state = [v for v in pod["volumes"] if v["name"] == "state"][0]
        self.assertEqual(state["hostPath"], {"path": "/var/lib/dispatch-agent", "type": "DirectoryOrCreate"})
        args = arg_map(c)
        self.assertEqual(c["args"][0], "run")
        self.assertEqual(args["--node-name"], ["$(NODE_NAME)"])
        env = {e["name"]: e for e in c["env"]}
        self.assertEqual(env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"], "spec.nodeName")
        self.assertEqual(args["--k8s-node-labels"], ["topology.kubernetes.io/zone,dispatch.io/rack"])
        # The dispatcher reads the same labels.
        d = arg_map(container(one(docs, "StatefulSet", f"{FULLNAME}-dispatcher"), "dispatcher"))
        self.assertEqual(d["--zone-label"], ["topology.kubernetes.io/zone"])
        self.assertEqual(d["--rack-label"], ["dispatch.io/rack"])
        # RBAC: the agent's ServiceAccount may get nodes, and nothing else.
        self.assertTrue(pod["automountServiceAccountToken"])
        role = one(docs, "ClusterRole", f"{FULLNAME}-agent-{NAMESPACE}")
        self.assertEqual(role["rules"], [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}])
        binding = one(docs, "ClusterRoleBinding", f"{FULLNAME}-agent-{NAMESPACE}")
        self.assertEqual(binding["roleRef"]["name"], role["metadata"]["name"])
        self.assertEqual(binding["subjects"], [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                                "namespace": NAMESPACE}])
        # Agents get every replica's URL from the ConfigMap.
        cm = one(docs, "ConfigMap", f"{FULLNAME}-config")
        self.assertEqual(cm["data"]["DISPATCH_SERVER"],
                         "http://rel-dispatch-dispatcher-0.rel-dispatch-dispatcher-hl.jobs.svc:50051")

    def test_no_rbac_and_no_token_without_node_labels(self):
        docs, _ = render({"agent": {"labelsFromNode": False}})
        self.assertEqual(find(docs, "ClusterRole") + find(docs, "ClusterRoleBinding"), [])
        ds = one(docs, "DaemonSet", f"{FULLNAME}-agent")
        self.assertFalse(ds["spec"]["template"]["spec"]["automountServiceAccountToken"])
        self.assertNotIn("--k8s-node-labels", arg_map(container(ds, "agent")))

    def test_ha_uses_etcd_and_a_stable_url_per_replica(self):
        docs, notes = render(SCENARIOS["ha"])
        sts = one(docs, "StatefulSet", f"{FULLNAME}-dispatcher")
        self.assertEqual(sts["spec"]["replicas"], 3)
        self.assertEqual(sts["spec"]["podManagementPolicy"], "Parallel")
        c = container(sts, "dispatcher")
        args = arg_map(c)
        self.assertEqual(args["--store"], ["etcd"])
        self.assertEqual(args["--etcd-endpoints"], [",".join(SCENARIOS["ha"]["etcd"]["endpoints"])])
        self.assertEqual(args["--etcd-prefix"], ["/dispatch"])
        hl = sts["spec"]["serviceName"]
        self.assertEqual(args["--advertise-url"], [f"http://$(POD_NAME).{hl}.{NAMESPACE}.svc:50051"])
        env = {e["name"]: e for e in c["env"]}
        self.assertEqual(env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"], "metadata.name")
        self.assertTrue(one(docs, "Service", hl)["spec"]["publishNotReadyAddresses"])
        # No per-replica volume: the state is in etcd.
        self.assertNotIn("volumeClaimTemplates", sts["spec"])
        self.assertEqual(find(docs, "StatefulSet", f"{FULLNAME}-etcd"), [])
        urls = one(docs, "ConfigMap", f"{FULLNAME}-config")["data"]["DISPATCH_SERVER"].split(",")
        self.assertEqual(urls, [f"http://{FULLNAME}-dispatcher-{i}.{hl}.{NAMESPACE}.svc:50051" for i in range(3)])
        one(docs, "PodDisruptionBudget", f"{FULLNAME}-dispatcher")
        anti = sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
        self.assertEqual(anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]["topologyKey"],
                         "kubernetes.io/hostname")
        self.assertIn("exec -it rel-dispatch-dispatcher-0 -- dispatchctl nodes", notes)

    def test_bundled_etcd_members_match_the_dispatchers_endpoints(self):
        docs, _ = render(SCENARIOS["bundled-etcd"])
        etcd = one(docs, "StatefulSet", f"{FULLNAME}-etcd")
        self.assertEqual(etcd["spec"]["replicas"], 3)
        eargs = arg_map(container(etcd, "etcd"))
        hl = etcd["spec"]["serviceName"]
        members = eargs["--initial-cluster"][0].split(",")
        self.assertEqual(members, [f"{FULLNAME}-etcd-{i}=http://{FULLNAME}-etcd-{i}.{hl}.{NAMESPACE}.svc:2380"
                                   for i in range(3)])
        self.assertEqual(eargs["--name"], ["$(POD_NAME)"])
        d = arg_map(container(one(docs, "StatefulSet", f"{FULLNAME}-dispatcher"), "dispatcher"))
        self.assertEqual(d["--store"], ["etcd"])
        self.assertEqual(d["--etcd-endpoints"][0].split(","),
                         [f"http://{FULLNAME}-etcd-{i}.{hl}.{NAMESPACE}.svc:2379" for i in range(3)])
        one(docs, "PodDisruptionBudget", f"{FULLNAME}-etcd")

    def test_bundled_etcd_flags_exist_in_etcd(self):
        etcd = shutil.which("etcd")
        if etcd is None:
            self.skipTest("no etcd binary (Debian package etcd-server) to check the bundled etcd's flags against")
        out = subprocess.run([etcd, "--help"], capture_output=True, text=True).stdout
        known = set(re.findall(r"(?m)^\s+(--[a-z][a-z0-9-]*)", out))
        self.assertIn("--initial-cluster", known)
        docs, _ = render(SCENARIOS["bundled-etcd"])
        passed = set(arg_map(container(one(docs, "StatefulSet", f"{FULLNAME}-etcd"), "etcd")))
        self.assertEqual(passed - known, set(), "flags etcd does not have")

    def test_tls_and_tokens(self):
        docs, notes = render(SCENARIOS["tls"])
        sts = one(docs, "StatefulSet", f"{FULLNAME}-dispatcher")
        c = container(sts, "dispatcher")
        args = arg_map(c)
        self.assertEqual(args["--tls-cert"], ["/etc/dispatch/tls/tls.crt"])
        self.assertEqual(args["--tls-key"], ["/etc/dispatch/tls/tls.key"])
        self.assertEqual(args["--tls-client-ca"], ["/etc/dispatch/tls/ca.crt"])
        self.assertEqual(args["--tokens"], ["/etc/dispatch/auth/tokens"])
        vols = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
        self.assertEqual(vols["tls"]["secret"]["secretName"], "dispatch-tls")
        self.assertEqual(vols["auth"]["secret"]["secretName"], "dispatch-tokens")
        ds = one(docs, "DaemonSet", f"{FULLNAME}-agent")
        a = arg_map(container(ds, "agent"))
        self.assertEqual(a["--tls-ca"], ["/etc/dispatch/tls/ca.crt"])
        self.assertEqual(a["--tls-cert"], ["/etc/dispatch/tls/tls.crt"])
        self.assertEqual(a["--tls-key"], ["/etc/dispatch/tls/tls.key"])
        avols = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
        self.assertEqual(avols["tls"]["secret"]["secretName"], "dispatch-agent-tls")
        cm = one(docs, "ConfigMap", f"{FULLNAME}-config")["data"]
        self.assertTrue(cm["DISPATCH_SERVER"].startswith("https://"))
        self.assertEqual(cm["DISPATCH_TLS_CA"], "/etc/dispatch/tls/ca.crt")
        self.assertIn("DISPATCH_TLS_CA", notes)
        self.assertEqual(len(find(docs, "ServiceMonitor")), 2)
        for sm in find(docs, "ServiceMonitor"):
            self.assertEqual(sm["metadata"]["labels"]["release"], "prom")

    def test_tls_with_certificates_on_each_node(self):
        docs, notes = render(SCENARIOS["tls-node-certs"])
        ds = one(docs, "DaemonSet", f"{FULLNAME}-agent")
        vol = [v for v in ds["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"][0]
        self.assertEqual(vol, {"name": "tls", "hostPath": {"path": "/etc/dispatch/tls", "type": "Directory"}})
        mount = [m for m in container(ds, "agent")["volumeMounts"] if m["name"] == "tls"][0]
        self.assertTrue(mount["readOnly"])
        self.assertIn("/etc/dispatch/tls on each node", notes)
        sts = one(docs, "StatefulSet", f"{FULLNAME}-dispatcher")
        svol = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"][0]
        self.assertEqual(svol["secret"]["secretName"], "dispatch-tls")

    def test_no_relay_by_default(self):
        docs, _ = render({})
        self.assertEqual(find(docs, "Deployment") + find(docs, "Service", f"{FULLNAME}-relay"), [])
        a = arg_map(container(one(docs, "DaemonSet", f"{FULLNAME}-agent"), "agent"))
        self.assertNotIn("--dispatcher", a, "agents take every replica from DISPATCH_SERVER")

    def test_relay_deployment_service_probe_and_agents_address(self):
        docs, notes = render(SCENARIOS["relay"])
        dep = one(docs, "Deployment", f"{FULLNAME}-relay")
        self.assertEqual(dep["spec"]["replicas"], 2)
        c = container(dep, "relay")
        self.assertEqual(c["command"], ["dispatch-relay"])
        r = arg_map(c)
        # Upstream: every dispatcher replica (the relay follows the leader).
        cm = one(docs, "ConfigMap", f"{FULLNAME}-config")["data"]
        self.assertEqual(r["--dispatcher"], [cm["DISPATCH_SERVER"]])
        self.assertEqual(r["--listen"], ["0.0.0.0:50052"])
        # Readiness: the Kubernetes gRPC probe on the plain-text health port.
        self.assertEqual(r["--health-listen"], ["0.0.0.0:50053"])
        self.assertEqual(c["readinessProbe"]["grpc"], {"port": 50053})
        self.assertEqual({p["name"]: p["containerPort"] for p in c["ports"]},
                         {"grpc": 50052, "health": 50053, "metrics": 9102})
        self.assertEqual(r["--metrics-listen"], ["0.0.0.0:9102"])
        self.assertEqual(c["livenessProbe"]["httpGet"], {"path": "/metrics", "port": "metrics"})
        sc = c["securityContext"]
        self.assertEqual((sc["readOnlyRootFilesystem"], sc["allowPrivilegeEscalation"], sc["capabilities"]),
                         (True, False, {"drop": ["ALL"]}))
        self.assertTrue(dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"])
        svc = one(docs, "Service", f"{FULLNAME}-relay")
        self.assertEqual([(p["name"], p["port"], p["targetPort"]) for p in svc["spec"]["ports"]],
                         [("grpc", 50052, "grpc"), ("metrics", 9102, "metrics")])
        # The agents attach to the relay's Service, over TLS.
        a = arg_map(container(one(docs, "DaemonSet", f"{FULLNAME}-agent"), "agent"))
        self.assertEqual(a["--dispatcher"], [f"https://{FULLNAME}-relay.{NAMESPACE}.svc:50052"])
        # TLS: the relay's client certificate (naming its nodes) towards
        # the dispatcher, its server certificate and the client CA towards
        # the agents, as the dispatcher has them.
        self.assertEqual(r["--tls-ca"], ["/etc/dispatch/tls-client/ca.crt"])
        self.assertEqual(r["--tls-cert"], ["/etc/dispatch/tls-client/tls.crt"])
        self.assertEqual(r["--tls-key"], ["/etc/dispatch/tls-client/tls.key"])
        self.assertEqual(r["--serve-tls-cert"], ["/etc/dispatch/tls/tls.crt"])
        self.assertEqual(r["--serve-tls-key"], ["/etc/dispatch/tls/tls.key"])
        self.assertEqual(r["--tls-client-ca"], ["/etc/dispatch/tls/ca.crt"])
        vols = {v["name"]: v["secret"]["secretName"] for v in dep["spec"]["template"]["spec"]["volumes"]}
        self.assertEqual(vols, {"tls": "dispatch-tls", "tls-client": "dispatch-relay-tls"})
        one(docs, "PodDisruptionBudget", f"{FULLNAME}-relay")
        sm = one(docs, "ServiceMonitor", f"{FULLNAME}-relay")
        self.assertEqual(sm["spec"]["endpoints"][0]["port"], "metrics")
        self.assertIn(f"{FULLNAME}-relay.{NAMESPACE}.svc", notes)
        # Without TLS: plain URLs, no TLS flags or volumes.
        docs, _ = render({"relay": {"enabled": True, "replicas": 1}})
        c = container(one(docs, "Deployment", f"{FULLNAME}-relay"), "relay")
        self.assertEqual([f for f in arg_map(c) if "tls" in f], [])
        self.assertNotIn("volumes", one(docs, "Deployment", f"{FULLNAME}-relay")["spec"]["template"]["spec"])
        a = arg_map(container(one(docs, "DaemonSet", f"{FULLNAME}-agent"), "agent"))
        self.assertEqual(a["--dispatcher"], [f"http://{FULLNAME}-relay.{NAMESPACE}.svc:50052"])
        self.assertEqual(find(docs, "PodDisruptionBudget", f"{FULLNAME}-relay"), [])

    def test_options(self):
        docs, _ = render(SCENARIOS["options"])
        ds = one(docs, "DaemonSet", f"{FULLNAME}-agent")
        pod = ds["spec"]["template"]
        self.assertTrue(pod["spec"]["hostPID"])
        self.assertNotIn("prometheus.io/scrape", pod["metadata"]["annotations"])
        c = container(ds, "agent")
        a = arg_map(c)
        self.assertEqual(a["--on-shutdown"], ["leave"])
        self.assertEqual(a["--cgroup-root"], ["/sys/fs/cgroup/dispatch.slice"])
        self.assertEqual(a["--topology"], ["2s:8c:2t"])
        self.assertEqual(a["--otlp-endpoint"], ["http://otel:4317"])
        self.assertEqual(a["--label"], ["dispatch.io/pool=gpu"])
        self.assertEqual(a["--k8s-node-labels"], ["topology.kubernetes.io/zone,example.com/rack"])
        cg = [m for m in c["volumeMounts"] if m["mountPath"] == "/sys/fs/cgroup"]
        self.assertEqual(len(cg), 1)
        self.assertFalse(cg[0].get("readOnly", False))
        self.assertEqual(c["image"], "dispatch/dispatch:v9")
        data = [m for m in c["volumeMounts"] if m["name"] == "data"]
        self.assertEqual(data, [{"name": "data", "mountPath": "/data"}])
        sts = one(docs, "StatefulSet", f"{FULLNAME}-dispatcher")
        d = arg_map(container(sts, "dispatcher"))
        self.assertEqual(d["--rack-label"], ["example.com/rack"])
        self.assertEqual(d["--otlp-endpoint"], ["http://otel:4317"])
        self.assertIn("--etcd-max-txn-ops=64", container(sts, "dispatcher")["args"])
        etcd = one(docs, "StatefulSet", f"{FULLNAME}-etcd")
        self.assertEqual(etcd["spec"]["replicas"], 1)
        self.assertNotIn("volumeClaimTemplates", etcd["spec"])
        self.assertEqual(find(docs, "PodDisruptionBudget"), [])

    def assert_rejected(self, values: dict, message: str) -> None:
        """Both the schema and the templates' own checks refuse the values
        (the templates' fail() guards installs that skip the schema)."""
        chart = helm.Chart.load(str(CHART))
        with self.assertRaises(helm.HelmValuesError):
            chart.validate_schema(values)
        with self.assertRaises(helm.HelmValuesError):
            chart.render(values, name=RELEASE, namespace=NAMESPACE)
        with tempfile.TemporaryDirectory() as tmp:
            unschema = Path(tmp) / "dispatch"
            shutil.copytree(CHART, unschema)
            (unschema / "values.schema.json").unlink()
            with self.assertRaises(helm.HelmRenderError) as err:
                helm.Chart.load(str(unschema)).render(values, name=RELEASE, namespace=NAMESPACE)
            self.assertIn(message, str(err.exception))

    def test_replicas_above_one_without_etcd_fail(self):
        self.assert_rejected({"dispatcher": {"replicas": 3}}, "dispatcher.replicas > 1 needs etcd")
        self.assert_rejected({"dispatcher": {"replicas": 2}, "etcd": {"endpoints": []}},
                             "dispatcher.replicas > 1 needs etcd")

    def test_tls_without_a_secret_fails(self):
        self.assert_rejected({"tls": {"enabled": True}}, "tls.enabled=true needs tls.secretName")

    def test_relay_with_client_certificates_but_no_relay_certificate_fails(self):
        self.assert_rejected({"relay": {"enabled": True}, "tls": {"enabled": True, "secretName": "s"}},
                             "relay.enabled with tls.requireClientCerts needs relay.clientSecretName")
        # Without client certificates the relay needs none of its own.
        render({"relay": {"enabled": True},
                "tls": {"enabled": True, "secretName": "s", "requireClientCerts": False}})

    def test_leave_running_without_host_pid_fails(self):
        self.assert_rejected({"agent": {"onShutdown": "leave"}}, "agent.onShutdown=leave needs agent.hostPID=true")

    def test_schema_rejects_typos_and_bad_values(self):
        chart = helm.Chart.load(str(CHART))
        for bad in ({"dispatcher": {"replica": 3}},
                    {"dispatcher": {"replicas": 0}},
                    {"etcd": {"endpoints": ["etcd:2379"]}},
                    {"agent": {"runAs": "nobody"}},
                    {"agent": {"onShutdown": "stop"}},
                    {"topology": {"rackLabel": "not a label"}},
                    {"etcd": {"bundled": {"enabled": True, "replicas": 2}}}):
            with self.subTest(values=bad), self.assertRaises(helm.HelmError):
                chart.validate_schema(bad)
        chart.validate_schema(SCENARIOS["options"])

    def test_the_image_has_what_the_chart_runs(self):
        """helm/Dockerfile (not built here: no container runtime) copies
        every workspace member, without which cargo cannot load the
        workspace, and installs every binary the chart's containers run."""
        root = CHART.parent.parent
        dockerfile = (CHART.parent / "Dockerfile").read_text()
        members = re.search(r"members\s*=\s*\[([^\]]*)\]", (root / "Cargo.toml").read_text()).group(1)
        copied = set(re.findall(r"(?m)^COPY (\S+) \1$", dockerfile))
        for member in re.findall(r'"([^"]+)"', members):
            self.assertIn(member, copied, f"helm/Dockerfile does not COPY workspace member {member}")
        installed = re.search(r"(?m)^COPY --from=build (.*) /usr/local/bin/$", dockerfile).group(1).split()
        installed = {Path(p).name for p in installed}
        docs = render(SCENARIOS["options"])[0] + render(SCENARIOS["relay"])[0]
        self.assertIn("dispatch-relay", [w["spec"]["template"]["spec"]["containers"][0]["command"][0]
                                         for w in find(docs, "Deployment")])
        for w in workloads(docs):
            if w["metadata"]["name"].endswith("-etcd"):
                continue
            for c in w["spec"]["template"]["spec"]["containers"]:
                self.assertIn(c["command"][0], installed)
        self.assertIn("dispatchctl", installed, "NOTES.txt runs dispatchctl in a dispatcher pod")

    def test_every_flag_exists_in_the_binaries(self):
        bin_dir = os.environ.get("HELM_TEST_BIN_DIR")
        if not bin_dir:
            self.skipTest("HELM_TEST_BIN_DIR is not set (scripts/test sets it to the built binaries)")
        known = {
            "dispatcher": help_flags([f"{bin_dir}/dispatcher", "--help"]),
            "agent": help_flags([f"{bin_dir}/agent", "run", "--help"]),
            "dispatch-relay": help_flags([f"{bin_dir}/dispatch-relay", "--help"]),
        }
        missing: dict[str, set[str]] = {}
        checked: set[str] = set()
        # The relay without TLS too (the relay scenario has it on).
        for name, values in [*SCENARIOS.items(), ("relay-plain", {"relay": {"enabled": True}})]:
            docs, _ = render(values)
            for w in workloads(docs):
                for c in w["spec"]["template"]["spec"]["containers"]:
                    binary = c["command"][0]
                    if binary not in known:
                        continue  # etcd
                    checked.add(binary)
                    for flag in arg_map(c):
                        if flag not in known[binary]:
                            missing.setdefault(binary, set()).add(flag)
        self.assertEqual(missing, {}, "flags the chart passes that the binaries do not have")
        self.assertEqual(checked, set(known), "a binary the chart never runs")


def head_and_tail(text: str, head: int = 1500, tail: int = 2000) -> str:
    """A log for a failure message: its start and its end. A process that
    exits with an error prints the error first and its backtrace after it:
    the end alone once showed a backtrace without the error."""
    if len(text) <= head + tail:
        return text
    return f"{text[:head]}\n[... {len(text) - head - tail} characters ...]\n{text[-tail:]}"


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def wait_for(what: str, check, timeout: float = 30.0):
    """Poll `check` until it returns something truthy (generous timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def grpc_health(port: int, service: str = "") -> int | None:
    """grpc.health.v1.Health/Check over plain-text HTTP/2, as the kubelet's
    gRPC probe sends it: the status (1 SERVING, 2 NOT_SERVING), or None
    when the call fails. A minimal client (no HPACK decoding: only the
    response's DATA frame is read)."""
    def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
        return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload

    def literal(name: str, value: str) -> bytes:  # literal without indexing, new name
        n, v = name.encode(), value.encode()
        return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v

    headers = b"".join(literal(k, v) for k, v in (
        (":method", "POST"), (":scheme", "http"), (":path", "/grpc.health.v1.Health/Check"),
        (":authority", "localhost"), ("content-type", "application/grpc"), ("te", "trailers")))
    request = (b"\x0a" + bytes([len(service)]) + service.encode()) if service else b""
    message = b"\x00" + len(request).to_bytes(4, "big") + request
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, b"")
                         + frame(1, 0x4, 1, headers) + frame(0, 0x1, 1, message))
            buf = b""
            while True:
                while len(buf) < 9 or len(buf) < 9 + int.from_bytes(buf[:3], "big"):
                    chunk = sock.recv(65536)
                    if not chunk:
                        return None
                    buf += chunk
                size = int.from_bytes(buf[:3], "big")
                kind, flags, stream = buf[3], buf[4], int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
                payload, buf = buf[9:9 + size], buf[9 + size:]
                if kind == 4 and not flags & 1:
                    sock.sendall(frame(4, 1, 0, b""))  # SETTINGS ACK
                elif kind == 0 and stream == 1 and len(payload) >= 5:
                    body = payload[5:]
                    # HealthCheckResponse: field 1 (status) as a varint; absent = UNKNOWN (0).
                    return body[1] if body[:1] == b"\x08" else 0
                elif kind in (3, 7) or (kind == 1 and stream == 1 and flags & 1):
                    return None  # RST_STREAM, GOAWAY, or trailers only: the call failed
    except OSError:
        return None


def processes_with(marker: str) -> list[tuple[int, int, str]]:
    """(pid, uid, state) of the processes whose command line holds marker."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if marker not in (d / "cmdline").read_bytes().decode(errors="replace"):
                continue
            status = (d / "status").read_text()
        except OSError:
            continue
        uid = int(re.search(r"(?m)^Uid:\s+(\d+)", status).group(1))
        state = re.search(r"(?m)^State:\s+(\S)", status).group(1)
        found.append((int(d.name), uid, state))
    return found


def deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class ChartSystem:
    """The chart's dispatcher and agent, started on loopback from the exact
    arguments and environment the chart renders (host paths mapped into a
    temporary directory, listen addresses onto free loopback ports, the
    downward-API names filled in), the agent confined by setpriv to the
    chart's capabilities with no_new_privs as allowPrivilegeEscalation:
    false sets. Needs the built binaries, root and setpriv."""

    NODE = "capnode"

    def __init__(self, test: unittest.TestCase, values: dict, tmp: str, marker: str):
        self.test, self.tmp, self.marker = test, tmp, marker
        self.bin_dir = os.environ["HELM_TEST_BIN_DIR"]
        # The agent reads its Node from the API server only in a cluster
        # (agent/src/k8s.rs has its own tests against a TLS server).
        docs, _ = render(deep_merge(values, {"agent": {"labelsFromNode": False}}))
        self.dispatcher = container(one(docs, "StatefulSet", f"{FULLNAME}-dispatcher"), "dispatcher")
        self.agent = container(one(docs, "DaemonSet", f"{FULLNAME}-agent"), "agent")
        self.config = one(docs, "ConfigMap", f"{FULLNAME}-config")["data"]
        self.sc = self.agent["securityContext"]
        self.replicas = one(docs, "StatefulSet", f"{FULLNAME}-dispatcher")["spec"]["replicas"]
        self.ports = [free_port() for _ in range(self.replicas)]
        self.http_ports = [free_port() for _ in range(self.replicas)]
        self.port, self.http_port, self.metrics_port = self.ports[0], self.http_ports[0], free_port()
        self.tls = "DISPATCH_TLS_CA" in self.config
        scheme = "https" if self.tls else "http"
        self.urls = [f"{scheme}://localhost:{p}" for p in self.ports]
        self.url = ",".join(self.urls)
        self.etcd_port = free_port() if "--etcd-endpoints" in arg_map(self.dispatcher) else None
        relays = find(docs, "Deployment", f"{FULLNAME}-relay")
        # One relay process stands for the Deployment's interchangeable replicas.
        self.relay = container(relays[0], "relay") if relays else None
        self.relay_port, self.relay_health_port, self.relay_metrics_port = free_port(), free_port(), free_port()
        self.relay_url = f"{scheme}://localhost:{self.relay_port}"
        self.procs: list[subprocess.Popen] = []
        self.logs: list = []

    def path(self, arg: str, side: str) -> str:
        """A container path in an argument -> its place under tmp."""
        arg = arg.replace("/etc/dispatch/tls/", f"{self.tmp}/tls-{side}/")
        arg = arg.replace("/etc/dispatch/tls-client/", f"{self.tmp}/tls-{side}-client/")
        arg = arg.replace("/etc/dispatch/auth/", f"{self.tmp}/auth/")
        arg = arg.replace("/var/lib/dispatch-agent", f"{self.tmp}/agent")
        arg = arg.replace("/var/lib/dispatch", f"{self.tmp}/data")
        return arg

    def dispatcher_argv(self, replica: int = 0) -> list[str]:
        argv = []
        for a in self.dispatcher["args"]:
            a = re.sub(r"^--listen=0\.0\.0\.0:\d+$", f"--listen=127.0.0.1:{self.ports[replica]}", a)
            a = re.sub(r"^--http-listen=0\.0\.0\.0:\d+$",
                       f"--http-listen=127.0.0.1:{self.http_ports[replica]}", a)
            # The in-cluster names: this replica's stable URL, the etcd members.
            a = re.sub(r"^--advertise-url=.*$", f"--advertise-url={self.urls[replica]}", a)
            a = re.sub(r"^--etcd-endpoints=.*$", f"--etcd-endpoints=http://127.0.0.1:{self.etcd_port}", a)
            a = re.sub(r"^--data-dir=.*$", f"--data-dir={self.tmp}/data-{replica}", a)
            argv.append(self.path(a, "dispatcher"))
        return [f"{self.bin_dir}/{self.dispatcher['command'][0]}", *argv]

    def start_etcd(self) -> None:
        peer, metrics = free_port(), free_port()
        log = open(Path(self.tmp) / "etcd.log", "w")
        self.logs.append(log)
        self.procs.append(subprocess.Popen(
            ["etcd", "--name", "t", "--data-dir", f"{self.tmp}/etcd",
             "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
             "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"t=http://127.0.0.1:{peer}", "--initial-cluster-state", "new",
             "--listen-metrics-urls", f"http://127.0.0.1:{metrics}", "--logger=zap", "--log-outputs=stderr"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

        def healthy():
            self.died()
            try:
                return b'"health":"true"' in self.http_get_body(self.etcd_port, "/health")
            except OSError:
                return False
        wait_for("etcd to be healthy", healthy)

    def relay_argv(self) -> list[str]:
        argv = []
        for a in self.relay["args"]:
            a = re.sub(r"^--listen=0\.0\.0\.0:\d+$", f"--listen=127.0.0.1:{self.relay_port}", a)
            a = re.sub(r"^--health-listen=0\.0\.0\.0:\d+$", f"--health-listen=127.0.0.1:{self.relay_health_port}", a)
            a = re.sub(r"^--metrics-listen=0\.0\.0\.0:\d+$",
                       f"--metrics-listen=127.0.0.1:{self.relay_metrics_port}", a)
            # The in-cluster names of the replicas -> loopback.
            a = re.sub(r"^--dispatcher=.*$", f"--dispatcher={self.url}", a)
            argv.append(self.path(a, "relay"))
        return [f"{self.bin_dir}/{self.relay['command'][0]}", *argv]

    def agent_argv(self) -> list[str]:
        argv = []
        for a in self.agent["args"]:
            a = re.sub(r"^--metrics-listen=0\.0\.0\.0:\d+$", f"--metrics-listen=127.0.0.1:{self.metrics_port}", a)
            # The relay's Service (only it) -> the relay on loopback.
            a = re.sub(rf"^--dispatcher=https?://{FULLNAME}-relay\.{NAMESPACE}\.svc:\d+$",
                       f"--dispatcher={self.relay_url}", a)
            argv.append(self.path(a, "agent").replace("$(NODE_NAME)", self.NODE))
        caps = ",".join("+" + c.lower() for c in self.sc["capabilities"]["add"])
        confine = ["setpriv", "--bounding-set", "-all," + caps, "--inh-caps", "-all"]
        if self.sc["allowPrivilegeEscalation"] is False:
            confine.append("--no-new-privs")
        return [*confine, f"{self.bin_dir}/{self.agent['command'][0]}", *argv]

    def env(self, c: dict, side: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update({k: self.path(v, side) for k, v in self.config.items()})
        env["DISPATCH_SERVER"] = self.url  # in-cluster names -> loopback
        env.update({e["name"]: e["value"] for e in c.get("env", []) if "value" in e})
        return env

    def make_certificates(self, tokens: str) -> None:
        ca = f"{self.tmp}/ca"
        relay = ["--relay", "relay", "--relay-node", self.NODE] if self.relay else []
        subprocess.run([f"{self.bin_dir}/dispatcher", "gen-certs", "--ca-dir", ca, "--server-name", "localhost",
                        "--agent", self.NODE, *relay], check=True, capture_output=True, timeout=60)
        sides = [("dispatcher", "server.pem", "server.key"),
                 ("agent", f"agent-{self.NODE}.pem", f"agent-{self.NODE}.key")]
        if self.relay:
            # Its server certificate (the dispatcher's Secret, by default)
            # and its client certificate naming the node.
            sides += [("relay", "server.pem", "server.key"), ("relay-client", "relay-relay.pem", "relay-relay.key")]
        for side, cert, key in sides:
            d = Path(self.tmp) / f"tls-{side}"
            d.mkdir()
            # The layout of a kubernetes.io/tls Secret with ca.crt.
            shutil.copy(f"{ca}/ca.pem", d / "ca.crt")
            shutil.copy(f"{ca}/{cert}", d / "tls.crt")
            shutil.copy(f"{ca}/{key}", d / "tls.key")
        (Path(self.tmp) / "auth").mkdir()
        (Path(self.tmp) / "auth" / "tokens").write_text(tokens)

    def start(self) -> None:
        if self.etcd_port is not None:
            self.start_etcd()
        runs = [(f"dispatcher{'' if i == 0 else f'-{i}'}", self.dispatcher_argv(i),
                 self.env(self.dispatcher, "dispatcher")) for i in range(self.replicas)]
        runs.append(("agent", self.agent_argv(), self.env(self.agent, "agent")))
        if self.relay:
            runs.append(("relay", self.relay_argv(), self.env(self.relay, "relay")))
        for name, argv, env in runs:
            log = open(Path(self.tmp) / f"{name}.log", "w")
            self.logs.append(log)
            self.procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True))
        # The chart's readiness probe: every replica's gRPC port, followers too.
        for port in self.ports:
            wait_for(f"the dispatcher's port {port}", lambda: port_open(port) or self.died())

    def died(self):
        for p in self.procs:
            if p.poll() is not None:
                raise AssertionError(f"{p.args[0]} exited {p.returncode}:\n{self.log_text()}")
        return False

    def log_text(self) -> str:
        return "\n".join(f"--- {p.name}\n" + head_and_tail(p.read_text()) for p in sorted(Path(self.tmp).glob("*.log")))

    def ctl(self, *args: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
        run_env = self.env(self.agent, "agent") if env is None else env
        return subprocess.run([f"{self.bin_dir}/dispatchctl", *args], env=run_env, check=check,
                              capture_output=True, text=True, timeout=60)

    def wait_registered(self) -> None:
        wait_for("the agent to register",
                 lambda: self.died() or self.NODE in self.ctl("nodes", check=False).stdout)

    def http_get_body(self, port: int, path: str) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(f"GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n".encode())
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks)

    def http_get(self, port: int, path: str) -> int:
        return int(self.http_get_body(port, path).split(b" ", 2)[1])

    def probe_paths_answer(self) -> None:
        """The chart's liveness probes: GET /metrics on the named ports (on
        every replica: a follower that failed it would be restarted)."""
        targets = [(self.dispatcher, p) for p in self.http_ports] + [(self.agent, self.metrics_port)]
        if self.relay:
            targets.append((self.relay, self.relay_metrics_port))
        for c, port in targets:
            path = c["livenessProbe"]["httpGet"]["path"]
            self.test.assertEqual(self.http_get(port, path), 200, f"{c['name']} liveness {path} on {port}")

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for log in self.logs:
            log.close()
        # Shims (own sessions, their job dir under tmp) and jobs.
        def leftovers():
            return processes_with(self.marker) + processes_with(f"{self.tmp}/agent")
        for pid, _, _ in leftovers():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_for("the jobs and shims to exit", lambda: not leftovers(), timeout=10)


class ChartRuntimeTest(unittest.TestCase):
    """Real processes started from the chart's rendered arguments."""

    def setUp(self):
        if not os.environ.get("HELM_TEST_BIN_DIR"):
            self.skipTest("HELM_TEST_BIN_DIR is not set (scripts/test sets it to the built binaries)")
        if os.geteuid() != 0 or shutil.which("setpriv") is None:
            self.skipTest("needs root and setpriv (util-linux) to drop capabilities")
        self.marker = f"chartcheck-{os.getpid()}-{time.monotonic_ns()}"

    def test_agent_works_with_only_the_charts_capabilities(self):
        values = {"agent": {"topology": "1s:2c:1t", "oversubscribe": 2}}
        with tempfile.TemporaryDirectory() as tmp:
            system = ChartSystem(self, values, tmp, self.marker)
            sc = system.sc
            self.assertEqual(sc["capabilities"]["drop"], ["ALL"])
            try:
                system.start()
                system.wait_registered()
                status = (Path("/proc") / str(system.procs[1].pid) / "status").read_text()
                bounding = int(re.search(r"(?m)^CapBnd:\s+([0-9a-f]+)", status).group(1), 16)
                self.assertEqual(bin(bounding).count("1"), len(sc["capabilities"]["add"]))
                self.assertRegex(status, r"(?m)^NoNewPrivs:\s+1$")
                system.probe_paths_answer()

                # A job runs as the chart's runAs user, pinned to one CPU.
                out = system.ctl("submit", "--wait", "--follow", "--",
                                 "sh", "-c", "id -u; grep Cpus_allowed_list /proc/self/status").stdout
                uid = arg_map(system.agent)["--run-as"][0].split(":")[0]
                self.assertIn(uid, out.split())
                self.assertRegex(out, r"Cpus_allowed_list:\s+\d+\n")

                # 2 CPUs, 2 jobs each (--topology 1s:2c:1t --oversubscribe=2):
                # the agent stops and continues jobs of another user (KILL),
                # pins them (SYS_NICE), then cancels them (KILL).
                ids = [system.ctl("submit", "--", "sh", "-c", f"while :; do :; done # {self.marker}").stdout.strip()
                       for _ in range(4)]
                wait_for("a job stopped by the agent",
                         lambda: any(state == "T" for _, _, state in processes_with(self.marker)))
                self.assertEqual({u for _, u, _ in processes_with(self.marker)}, {int(uid)})
                for job in ids:
                    system.ctl("cancel", job)
                wait_for("every job cancelled", lambda: not processes_with(self.marker))
                log = (Path(tmp) / "agent.log").read_text()
                self.assertNotRegex(log, r"EPERM|not permitted", "the agent lacked a privilege")
            finally:
                system.stop()

    def test_ha_replicas_share_etcd_as_the_chart_wires_them(self):
        if shutil.which("etcd") is None:
            self.skipTest("no etcd binary (Debian package etcd-server)")
        with tempfile.TemporaryDirectory() as tmp:
            system = ChartSystem(self, SCENARIOS["ha"], tmp, self.marker)
            self.assertEqual(system.replicas, 3)
            try:
                system.start()
                # Agents and dispatchctl get every replica's URL (the
                # ConfigMap's DISPATCH_SERVER) and find the leader.
                system.wait_registered()
                out = system.ctl("submit", "--wait", "--follow", "--", "sh", "-c", "echo through-the-leader").stdout
                self.assertIn("through-the-leader", out)
                system.probe_paths_answer()
                # Each replica advertised its own URL.
                logs = "".join(p.read_text() for p in Path(tmp).glob("dispatcher*.log"))
                for url in system.urls:
                    self.assertIn(url, logs)
            finally:
                system.stop()

    def test_a_job_runs_through_the_relay_as_the_chart_wires_it(self):
        """The relay scenario (TLS, the relay's own client certificate):
        dispatcher, relay and agent from the rendered arguments; the agent
        reaches the dispatcher only through the relay."""
        token = "chart-test-token-0123456789"
        with tempfile.TemporaryDirectory() as tmp:
            system = ChartSystem(self, SCENARIOS["relay"], tmp, self.marker)
            self.assertTrue(system.tls and system.relay)
            system.make_certificates(f"{token} admin ops\n")
            probe = system.relay["readinessProbe"]["grpc"]
            self.assertEqual(f"--health-listen=0.0.0.0:{probe['port']}" in system.relay["args"], True)
            try:
                system.start()
                # The chart's readiness probe: SERVING once its stream is open.
                wait_for("the relay to be ready (grpc.health.v1 SERVING)",
                         lambda: system.died() or grpc_health(system.relay_health_port, probe.get("service", "")) == 1)
                system.wait_registered()
                out = system.ctl("submit", "--wait", "--follow", "--", "sh", "-c", "echo through-the-relay").stdout
                self.assertIn("through-the-relay", out)
                relay_log = re.sub(r"\x1b\[[0-9;]*m", "", (Path(tmp) / "relay.log").read_text())
                self.assertRegex(relay_log, f"agent attached through the relay node={system.NODE}", "the agent did not attach through the relay")
                system.probe_paths_answer()
                metrics = system.http_get_body(system.relay_metrics_port, "/metrics").decode()
                self.assertRegex(metrics, r"(?m)^dispatch_relay_agents 1$")
                self.assertRegex(metrics, r"(?m)^dispatch_relay_upstream_connected 1$")
                # The dispatcher gone: the relay is no longer ready.
                os.killpg(system.procs[0].pid, signal.SIGKILL)
                system.procs[0].wait()
                system.procs.pop(0)
                wait_for("the relay to report NOT_SERVING",
                         lambda: grpc_health(system.relay_health_port) == 2)
            finally:
                system.stop()

    def test_tls_and_tokens_work_as_the_chart_wires_them(self):
        token = "chart-test-token-0123456789"
        with tempfile.TemporaryDirectory() as tmp:
            system = ChartSystem(self, SCENARIOS["tls"], tmp, self.marker)
            self.assertTrue(system.tls)
            system.make_certificates(f"{token} admin ops\n")
            try:
                system.start()
                with_token = dict(system.env(system.agent, "agent"), DISPATCH_TOKEN=token)
                # The agent got in with the certificate naming its node.
                wait_for("the agent to register over TLS",
                         lambda: system.died() or system.NODE in system.ctl("nodes", env=with_token,
                                                                             check=False).stdout)
                out = system.ctl("submit", "--wait", "--follow", "--", "sh", "-c", "echo over-tls",
                                 env=with_token).stdout
                self.assertIn("over-tls", out)
                # --tokens is on: no token, no service.
                refused = system.ctl("nodes", check=False)
                self.assertNotEqual(refused.returncode, 0, refused.stdout)
                system.probe_paths_answer()
                # --tls-client-ca is on: an agent whose certificate names
                # another node is turned away.
                impostor = [a.replace(f"--node-name={system.NODE}", "--node-name=impostor")
                             .replace(f"{tmp}/agent", f"{tmp}/agent-impostor")
                             .replace(f":{system.metrics_port}", f":{free_port()}")
                            for a in system.agent_argv()]
                with open(Path(tmp) / "impostor.log", "w") as log:
                    system.procs.append(subprocess.Popen(impostor, env=system.env(system.agent, "agent"),
                                                         stdout=log, stderr=subprocess.STDOUT,
                                                         start_new_session=True))
                    wait_for("the dispatcher to refuse the impostor",
                             lambda: "agent refused" in (Path(tmp) / "dispatcher.log").read_text())
                nodes = system.ctl("nodes", env=with_token).stdout
                self.assertNotIn("impostor", nodes)
            finally:
                system.stop()


class HelpersTest(unittest.TestCase):
    """The helpers the runtime tests lean on."""

    def test_ports_are_distinct_bindable_and_outside_the_ephemeral_range(self):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        ports = [free_port() for _ in range(200)]
        self.assertEqual(len(set(ports)), len(ports), "a port handed out twice")
        if low - 10000 >= 1000:
            self.assertTrue(all(10000 <= p < low for p in ports), ports)
        for p in ports[:20]:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", p))

    def test_a_long_log_keeps_its_start_and_its_end(self):
        self.assertEqual(head_and_tail("short"), "short")
        text = "Error: binding 127.0.0.1:1\n" + "x" * 5000 + "\nlast frame"
        shown = head_and_tail(text)
        self.assertTrue(shown.startswith("Error: binding"))
        self.assertTrue(shown.endswith("last frame"))
        self.assertLess(len(shown), len(text))


if __name__ == "__main__":
    # The templates' fail() messages are also logged by the SDK at INFO:
    # the assertions above read them from the errors instead.
    helm.disable_logging()
    unittest.main(verbosity=2)
