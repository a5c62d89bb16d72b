"""Renders deploy/helm/pdworker with helm's template engine (tools/chart_render:
Go text/template + sprig, missingkey=error) and checks the manifests a
cluster would receive.

  chart_test.py --renderer=R --chart=DIR --pdworker=BIN --alerts=alerts.yaml

Run by bazel (tests/deploy:chart_test) with /usr/bin/python3 and Debian's
python3-yaml and python3-jsonschema.
"""
import argparse
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

import jsonschema
import yaml

from junit_xml import run_tests

ARGS = None  # parsed command line, set in main()

# The role defaults of DESIGN.md ("Roles and configuration").
EXPECTED_MODE = {"prefill": "PIECEWISE", "decode": "FULL_DECODE_ONLY"}
GPU = "nvidia.com/gpu"
STANDARD_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance",
                   "app.kubernetes.io/version", "app.kubernetes.io/managed-by",
                   "helm.sh/chart")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class RenderError(Exception):
    pass


def tmpdir():
    return os.environ.get("TEST_TMPDIR") or tempfile.gettempdir()


def write_values(name, values):
    path = os.path.join(tmpdir(), name)
    with open(path, "w") as f:
        yaml.safe_dump(values, f)
    return path


def render(values_files=(), release="pdworker", namespace="default",
           chart=None):
    """Runs the renderer; returns (manifests, notes, coalesced values)."""
    out = tempfile.mkdtemp(dir=tmpdir())
    notes, values_json = os.path.join(out, "NOTES.txt"), os.path.join(out, "values.json")
    cmd = [ARGS.renderer, "--chart=" + (chart or ARGS.chart),
           "--release=" + release, "--namespace=" + namespace,
           "--notes_out=" + notes, "--values_out=" + values_json]
    cmd += ["--values=" + v for v in values_files]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RenderError(proc.stderr.strip())
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d is not None]
    with open(notes) as f:
        notes_text = f.read()
    with open(values_json) as f:
        values = json.load(f)
    return docs, notes_text, values


def pdworker_flags():
    """Flag names defined in worker/main.cc, from `pdworker --help` (which
    lists exactly those, grouped, as "  --name (default: ...)")."""
    proc = subprocess.run([ARGS.pdworker, "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    flags = set(re.findall(r"^  --(\w+) \(default: ", proc.stdout, re.M))
    assert {"role", "port", "metrics_port", "compilation_config"} <= flags, flags
    return flags


def by_kind(docs, kind):
    return [d for d in docs if d.get("kind") == kind]


def named(docs, kind, name):
    matches = [d for d in by_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, got {len(matches)}"
    return matches[0]


def container(deployment):
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, "one worker container per pod"
    return containers[0]


def flag_values(args):
    """['--a=1', '--b=x'] -> {'a': '1', 'b': 'x'}; every arg must be --k=v."""
    out = {}
    for a in args:
        m = re.match(r"^--(\w+)=(.*)$", a)
        assert m, f"worker arg {a!r} is not --flag=value"
        assert m.group(1) not in out, f"flag --{m.group(1)} passed twice"
        out[m.group(1)] = m.group(2)
    return out


def seconds(duration):
    """A chart duration ('1m30s', '500ms') in seconds."""
    parts = re.findall(r"([0-9]+)(ms|s|m|h)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    unit = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(int(n) * unit[u] for n, u in parts)


def role_of(deployment):
    return deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def selects(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


class ManifestChecks:
    """Checks every rendered values case; subclasses set VALUES_FILES etc."""

    VALUES_FILES = ()
    RELEASE = "pdworker"
    NAMESPACE = "default"
    TLS = False

    @classmethod
    def setUpClass(cls):
        cls.docs, cls.notes, cls.values = render(
            [f() for f in cls.VALUES_FILES], cls.RELEASE, cls.NAMESPACE)
        cls.deployments = {role_of(d): d for d in by_kind(cls.docs, "Deployment")}

    def test_schema_accepts_the_values(self):
        with open(os.path.join(ARGS.chart, "values.schema.json")) as f:
            schema = json.load(f)
        jsonschema.Draft7Validator.check_schema(schema)
        errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(self.values),
                        key=lambda e: list(e.path))
        self.assertEqual([], [f"{list(e.path)}: {e.message}" for e in errors])

    def test_both_roles_deployed(self):
        self.assertEqual(set(EXPECTED_MODE), set(self.deployments))
        for kind in ("Service", "PodDisruptionBudget"):
            names = sorted(d["metadata"]["name"] for d in by_kind(self.docs, kind))
            self.assertEqual(len(names), 2, f"{kind}s: {names}")

    def test_each_role_gets_its_role_flag_and_graph_mode(self):
        configmap = named(self.docs, "ConfigMap", self.fullname() + "-compilation-config")
        for role, dep in self.deployments.items():
            c = container(dep)
            flags = flag_values(c["args"])
            self.assertEqual(flags["role"], role)
            self.assertEqual(flags["compilation_config"], "$(PDWORKER_COMPILATION_CONFIG)",
                             "the compilation config comes from the env (kubelet expands it)")
            env = {e["name"]: e for e in c["env"]}
            ref = env["PDWORKER_COMPILATION_CONFIG"]["valueFrom"]["configMapKeyRef"]
            self.assertEqual(ref["name"], configmap["metadata"]["name"])
            self.assertEqual(ref["key"], f"{role}.json")
            config = json.loads(configmap["data"][ref["key"]])
            self.assertEqual(config["cudagraph_mode"], EXPECTED_MODE[role],
                             f"{role} must run {EXPECTED_MODE[role]}")
            self.assertTrue(set(config) <= {"cudagraph_mode", "cudagraph_capture_sizes",
                                            "max_cudagraph_capture_size"}, config)

    def test_every_flag_is_a_pdworker_flag(self):
        known = pdworker_flags()
        for role, dep in self.deployments.items():
            unknown = set(flag_values(container(dep)["args"])) - known
            self.assertEqual(set(), unknown, f"{role}: flags pdworker does not define")

    def test_arg_variables_are_defined_in_the_env(self):
        # Kubelet expands $(VAR) in args only for variables of the
        # container's env; an undefined one stays literally "$(VAR)".
        for role, dep in self.deployments.items():
            c = container(dep)
            env = {e["name"] for e in c["env"]}
            used = {v for a in c["args"] for v in re.findall(r"\$\((\w+)\)", a)}
            self.assertTrue(used, f"{role}: args use $(POD_IP) and the compilation config")
            self.assertEqual(used - env, set(), f"{role}: $(VAR) without an env entry")

    def test_kv_handoff_flags_come_from_the_values(self):
        for role, dep in self.deployments.items():
            flags = flag_values(container(dep)["args"])
            self.assertEqual(flags["kv_lease_ttl"], self.values["worker"]["kvLeaseTtl"], role)
            self.assertEqual(flags["kv_pull_timeout"], self.values["worker"]["kvPullTimeout"],
                             role)
            for name in ("kv_lease_ttl", "kv_pull_timeout"):
                # A positive duration the worker's absl::ParseDuration takes.
                self.assertRegex(flags[name], r"^([0-9]+(ms|s|m|h))+$", f"{role} --{name}")
                self.assertRegex(flags[name], r"[1-9]", f"{role} --{name} must be > 0")

    def test_sequence_idle_timeout_comes_from_the_values(self):
        for role, dep in self.deployments.items():
            flags = flag_values(container(dep)["args"])
            self.assertEqual(flags["sequence_idle_timeout"],
                             self.values["worker"]["sequenceIdleTimeout"], role)
            # A duration the worker's absl::ParseDuration takes; 0s = never.
            self.assertRegex(flags["sequence_idle_timeout"], r"^([0-9]+(ms|s|m|h))+$",
                             f"{role} --sequence_idle_timeout")
        self.assertIn(f"for {self.values['worker']['sequenceIdleTimeout']} "
                      "(worker.sequenceIdleTimeout)", self.notes)

    def test_drain_fits_in_the_termination_grace_period(self):
        grace = self.values["terminationGracePeriodSeconds"]
        for role, dep in self.deployments.items():
            flags = flag_values(container(dep)["args"])
            self.assertEqual(flags["drain_timeout"], self.values["worker"]["drainTimeout"], role)
            self.assertEqual(dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"],
                             grace, role)
            # Live sequences drain for --drain_timeout, then an import
            # accepted just before may pull for --kv_pull_timeout; SIGKILL
            # must not come first.
            needed = seconds(flags["drain_timeout"]) + seconds(flags["kv_pull_timeout"]) + 5
            self.assertLessEqual(needed, grace,
                                 f"{role}: drain {flags['drain_timeout']} + pull "
                                 f"{flags['kv_pull_timeout']} + 5s > grace {grace}s")

    def test_numbers_are_plain_integers(self):
        # Helm decodes values as float64; a template that forgets `int64`
        # renders 268435456 as 2.68435456e+08, which the worker rejects.
        for role, dep in self.deployments.items():
            flags = flag_values(container(dep)["args"])
            for name in ("port", "metrics_port", "max_num_seqs", "max_num_batched_tokens",
                         "kv_cache_bytes", "max_model_len", "block_size", "max_queue",
                         "max_message_bytes"):
                self.assertRegex(flags[name], r"^[0-9]+$", f"{role} --{name}")

    def test_ports_match_worker_flags_services_and_probes(self):
        services = by_kind(self.docs, "Service")
        for role, dep in self.deployments.items():
            c = container(dep)
            flags = flag_values(c["args"])
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            self.assertEqual(ports, {"grpc": int(flags["port"]),
                                     "metrics": int(flags["metrics_port"])},
                             f"{role}: container ports vs --port/--metrics_port")
            self.assertEqual(flags["host"], "0.0.0.0", "must listen on the pod IP")
            # KV handles carry --advertise_address: decode pods pull from the
            # prefill pod's IP (the worker adds its --port, brackets IPv6).
            self.assertEqual(flags["advertise_address"], "$(POD_IP)",
                             f"{role}: --advertise_address is the pod IP")
            env = {e["name"]: e for e in c["env"]}
            self.assertEqual(env["POD_IP"].get("valueFrom"),
                             {"fieldRef": {"fieldPath": "status.podIP"}},
                             f"{role}: POD_IP from the downward API")
            pod_labels = dep["spec"]["template"]["metadata"]["labels"]
            svc = [s for s in services if selects(s["spec"]["selector"], pod_labels)]
            self.assertEqual(len(svc), 1, f"{role}: one Service selects its pods")
            for sp in svc[0]["spec"]["ports"]:
                self.assertIn(sp["targetPort"], ports, f"{role}: Service targetPort")
                self.assertEqual(sp["port"], ports[sp["targetPort"]],
                                 f"{role}: Service port {sp['name']} = container port")
            self.assertEqual({p["name"] for p in svc[0]["spec"]["ports"]}, {"grpc", "metrics"})
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                p = c[probe]
                if "grpc" in p:
                    self.assertEqual(p["grpc"]["port"], ports["grpc"], f"{role} {probe}")
                else:
                    self.assertIn("tcpSocket", p, f"{role} {probe}: neither gRPC nor TCP")
                    self.assertIn(p["tcpSocket"]["port"], ("grpc", ports["grpc"]),
                                  f"{role} {probe}: probes the gRPC port")

    def test_probes_use_grpc_health(self):
        for role, dep in self.deployments.items():
            c = container(dep)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                p = c[probe]
                handlers = {"grpc", "tcpSocket", "httpGet", "exec"} & set(p)
                # Kubelet's gRPC probe speaks plaintext only: with TLS the
                # chart must fall back to TCP, or every pod would fail.
                self.assertEqual(handlers, {"tcpSocket" if self.TLS else "grpc"},
                                 f"{role} {probe}")
            startup = c["startupProbe"]
            budget = startup["periodSeconds"] * startup["failureThreshold"]
            self.assertGreaterEqual(budget, 300,
                                    f"{role}: startup must tolerate model load + capture")
            self.assertLessEqual(c["readinessProbe"]["periodSeconds"], 10)

    def test_gpus_requested(self):
        for role, dep in self.deployments.items():
            res = container(dep)["resources"]
            self.assertEqual(res["requests"].get(GPU), 1, f"{role}: GPU request")
            self.assertEqual(res["limits"].get(GPU), 1, f"{role}: GPU limit")

    def test_labels_and_selectors_are_consistent(self):
        for doc in self.docs:
            labels = doc["metadata"]["labels"]
            for key in STANDARD_LABELS:
                self.assertIn(key, labels, f"{doc['kind']} {doc['metadata']['name']}")
            self.assertEqual(labels["app.kubernetes.io/instance"], self.RELEASE)
            self.assertLessEqual(len(doc["metadata"]["name"]), 63)
            self.assertRegex(doc["metadata"]["name"], DNS_LABEL)
            self.assertEqual(doc["metadata"]["namespace"], self.NAMESPACE)
        pods = {role: d["spec"]["template"]["metadata"]["labels"]
                for role, d in self.deployments.items()}
        for role, dep in self.deployments.items():
            sel = dep["spec"]["selector"]["matchLabels"]
            self.assertTrue(selects(sel, pods[role]), f"{role}: selector ⊆ pod labels")
            self.assertEqual(sel.get("app.kubernetes.io/component"), role)
            others = [r for r in pods if r != role and selects(sel, pods[r])]
            self.assertEqual(others, [], f"{role}: Deployment selector overlaps {others}")
        for kind, path in (("Service", ("spec", "selector")),
                           ("PodDisruptionBudget", ("spec", "selector", "matchLabels"))):
            for doc in by_kind(self.docs, kind):
                sel = doc
                for p in path:
                    sel = sel[p]
                matched = [r for r, labels in pods.items() if selects(sel, labels)]
                self.assertEqual(len(matched), 1,
                                 f"{kind} {doc['metadata']['name']} selects {matched}")
                self.assertTrue(doc["metadata"]["name"].endswith("-" + matched[0]))

    def test_model_volume_is_read_only(self):
        for role, dep in self.deployments.items():
            c = container(dep)
            mounts = {m["name"]: m for m in c["volumeMounts"]}
            self.assertTrue(mounts["model"]["readOnly"])
            self.assertEqual(flag_values(c["args"])["model"], mounts["model"]["mountPath"])
            volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
            source = volumes["model"]
            self.assertTrue("persistentVolumeClaim" in source or "hostPath" in source, source)
            if "persistentVolumeClaim" in source:
                self.assertTrue(source["persistentVolumeClaim"]["readOnly"])
                self.assertTrue(source["persistentVolumeClaim"]["claimName"])

    def test_pods_run_as_non_root(self):
        for role, dep in self.deployments.items():
            spec = dep["spec"]["template"]["spec"]
            self.assertTrue(spec["securityContext"]["runAsNonRoot"], role)
            self.assertNotEqual(spec["securityContext"]["runAsUser"], 0, role)
            self.assertFalse(container(dep)["securityContext"]["allowPrivilegeEscalation"])

    def test_tls_files_mounted_only_when_enabled(self):
        for role, dep in self.deployments.items():
            c = container(dep)
            flags = flag_values(c["args"])
            mounts = {m["name"]: m for m in c["volumeMounts"]}
            if not self.TLS:
                self.assertNotIn("tls", mounts)
                self.assertFalse({"tls_cert", "tls_key", "tls_client_ca"} & set(flags))
                continue
            volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
            self.assertTrue(volumes["tls"]["secret"]["secretName"])
            self.assertTrue(mounts["tls"]["readOnly"])
            for flag, key in (("tls_cert", "tls.crt"), ("tls_key", "tls.key"),
                              ("tls_client_ca", "ca.crt")):
                self.assertEqual(flags[flag], f"{mounts['tls']['mountPath']}/{key}")

    def test_dashboard_configmap(self):
        dashboards = [d for d in by_kind(self.docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
        self.assertEqual(len(dashboards), 1)
        cm = dashboards[0]
        self.assertEqual(cm["metadata"]["labels"].get("grafana_dashboard"), "1",
                         "Grafana's sidecar finds dashboards by this label")
        self.assertEqual(list(cm["data"]), ["pdworker.json"])
        dashboard = json.loads(cm["data"]["pdworker.json"])
        with open(os.path.join(ARGS.chart, "dashboards", "pdworker.json")) as f:
            self.assertEqual(dashboard, json.load(f), "ConfigMap carries dashboards/pdworker.json")
        self.assertTrue(dashboard["uid"] and dashboard["panels"])
        variables = {v["name"] for v in dashboard["templating"]["list"]}
        self.assertLessEqual({"datasource", "role", "instance"}, variables)

    def test_notes_render(self):
        for role in self.deployments:
            self.assertIn(f"--role={role}", self.notes)
        self.assertIn("kubectl", self.notes)


class DefaultValuesTest(ManifestChecks, unittest.TestCase):
    """values.yaml alone: what `helm install pdworker deploy/helm/pdworker` renders."""

    def fullname(self):
        return "pdworker"

    def test_no_operator_resources_by_default(self):
        # ServiceMonitor/PrometheusRule need the Prometheus Operator's CRDs.
        self.assertEqual(by_kind(self.docs, "ServiceMonitor"), [])
        self.assertEqual(by_kind(self.docs, "PrometheusRule"), [])

    def test_only_known_kinds(self):
        self.assertEqual(sorted({(d["apiVersion"], d["kind"]) for d in self.docs}), [
            ("apps/v1", "Deployment"), ("policy/v1", "PodDisruptionBudget"),
            ("v1", "ConfigMap"), ("v1", "Service"), ("v1", "ServiceAccount")])


class ProductionValuesTest(ManifestChecks, unittest.TestCase):
    """examples/values-production.yaml: TLS, ServiceMonitor, PrometheusRule."""

    VALUES_FILES = (lambda: ARGS.example,)
    RELEASE = "llm"
    NAMESPACE = "llm"
    TLS = True

    def fullname(self):
        return "llm-pdworker"

    def test_service_monitor_scrapes_every_worker(self):
        (sm,) = by_kind(self.docs, "ServiceMonitor")
        sel = sm["spec"]["selector"]["matchLabels"]
        services = by_kind(self.docs, "Service")
        matched = [s for s in services if selects(sel, s["metadata"]["labels"])]
        self.assertEqual(len(matched), 2, "the ServiceMonitor selects both roles' Services")
        (endpoint,) = sm["spec"]["endpoints"]
        self.assertEqual(endpoint["port"], "metrics")
        self.assertEqual(endpoint["path"], "/metrics")
        for s in matched:
            self.assertIn("metrics", [p["name"] for p in s["spec"]["ports"]])
        self.assertEqual(sm["spec"]["namespaceSelector"]["matchNames"], [self.NAMESPACE])
        self.assertEqual(sm["metadata"]["labels"].get("release"), "kube-prometheus-stack")

    def test_prometheus_rule_uses_the_example_thresholds(self):
        (rule,) = by_kind(self.docs, "PrometheusRule")
        exprs = {(r["alert"], r["labels"].get("role")): r["expr"]
                 for g in rule["spec"]["groups"] for r in g["rules"]}
        self.assertRegex(exprs[("PdworkerGraphHitRateLow", "decode")], r"< 0\.95\s*$")
        self.assertRegex(exprs[("PdworkerGraphHitRateLow", "prefill")], r"< 0\.6\s*$")

    def test_example_overrides_reach_the_worker(self):
        flags = flag_values(container(self.deployments["decode"])["args"])
        self.assertEqual(flags["max_num_seqs"], "256")
        self.assertEqual(flags["kv_cache_bytes"], "53687091200")
        for role in EXPECTED_MODE:
            flags = flag_values(container(self.deployments[role])["args"])
            self.assertEqual(flags["kv_lease_ttl"], "1m", role)
            self.assertEqual(flags["kv_pull_timeout"], "20s", role)
            self.assertEqual(flags["sequence_idle_timeout"], "5m", role)
        configmap = named(self.docs, "ConfigMap", "llm-pdworker-compilation-config")
        decode = json.loads(configmap["data"]["decode.json"])
        self.assertEqual(decode["cudagraph_capture_sizes"][-1], 256)

    def test_tls_notes_explain_the_probe_fallback(self):
        self.assertIn("TCP", self.notes)


def normalized_rules(groups):
    """Rules with every string's whitespace collapsed (YAML folding differs)."""
    def norm(v):
        if isinstance(v, str):
            return " ".join(v.split())
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        if isinstance(v, list):
            return [norm(x) for x in v]
        return v
    return norm(groups)


class ValuesHandlingTest(unittest.TestCase):
    """How the chart reacts to values: errors, toggles, the alert rules."""

    def test_prometheus_rule_equals_the_plain_rules_file(self):
        docs, _, _ = render([write_values("rule.yaml", {"prometheusRule": {"enabled": True}})])
        (rule,) = by_kind(docs, "PrometheusRule")
        with open(ARGS.alerts) as f:
            plain = yaml.safe_load(f)
        self.assertEqual(normalized_rules(rule["spec"]["groups"]),
                         normalized_rules(plain["groups"]),
                         "deploy/prometheus/alerts.yaml and the chart's PrometheusRule "
                         "(default thresholds) must stay the same rules")

    def test_kv_alert_thresholds_come_from_the_values(self):
        docs, _, _ = render([write_values("kv-rules.yaml", {"prometheusRule": {
            "enabled": True, "rules": {
                "kvLeaseExpiries": {"maxExpiries": 3, "for": "10m", "severity": "critical"},
                "kvTransferFailuresHigh": {"maxRatio": 0.2}}}})])
        (rule,) = by_kind(docs, "PrometheusRule")
        rules = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
        expiries = rules["PdworkerKvLeaseExpiries"]
        self.assertRegex(expiries["expr"], r"> 3\s*$")
        self.assertEqual((expiries["for"], expiries["labels"]["severity"]), ("10m", "critical"))
        self.assertIn("(threshold: 3)", expiries["annotations"]["description"])
        failures = rules["PdworkerKvTransferFailuresHigh"]
        self.assertRegex(failures["expr"], r"> 0\.2\s*$")
        self.assertIn('direction="receive"', failures["expr"])
        self.assertIn("(threshold: 0.2)", failures["annotations"]["description"])
        # Alert templates reach Prometheus unrendered.
        self.assertIn("{{ $labels.instance }}", failures["annotations"]["summary"])

        docs, _, _ = render([write_values("kv-rules-off.yaml", {"prometheusRule": {
            "enabled": True, "rules": {"kvLeaseExpiries": {"enabled": False},
                                       "kvTransferFailuresHigh": {"enabled": False}}}})])
        (rule,) = by_kind(docs, "PrometheusRule")
        names = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
        self.assertFalse(names & {"PdworkerKvLeaseExpiries", "PdworkerKvTransferFailuresHigh"})
        self.assertIn("PdworkerForwardErrorRateHigh", names)

    def test_sequence_alert_threshold_comes_from_the_values(self):
        docs, _, _ = render([write_values("seq-rules.yaml", {"prometheusRule": {
            "enabled": True, "rules": {
                "sequencesExpired": {"maxExpiries": 5, "for": "15m", "severity": "critical"}}}})])
        (rule,) = by_kind(docs, "PrometheusRule")
        rules = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
        expired = rules["PdworkerSequencesExpired"]
        self.assertRegex(expired["expr"], r"> 5\s*$")
        self.assertIn("pdworker_sequences_expired_total", expired["expr"])
        self.assertEqual((expired["for"], expired["labels"]["severity"]), ("15m", "critical"))
        self.assertIn("(threshold: 5)", expired["annotations"]["description"])
        # Alert templates reach Prometheus unrendered.
        self.assertIn("{{ $labels.instance }}", expired["annotations"]["summary"])

        docs, _, _ = render([write_values("seq-rules-off.yaml", {"prometheusRule": {
            "enabled": True, "rules": {"sequencesExpired": {"enabled": False}}}})])
        (rule,) = by_kind(docs, "PrometheusRule")
        names = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
        self.assertNotIn("PdworkerSequencesExpired", names)
        self.assertIn("PdworkerKvLeaseExpiries", names)

    def test_zero_sequence_idle_timeout_means_never(self):
        docs, notes, values = render([write_values("idle-never.yaml", {
            "worker": {"sequenceIdleTimeout": "0s"}})])
        with open(os.path.join(ARGS.chart, "values.schema.json")) as f:
            validator = jsonschema.Draft7Validator(json.load(f))
        self.assertEqual([], [e.message for e in validator.iter_errors(values)])
        for dep in by_kind(docs, "Deployment"):
            flags = flag_values(container(dep)["args"])
            self.assertEqual(flags["sequence_idle_timeout"], "0s", role_of(dep))
        self.assertIn("never released (worker.sequenceIdleTimeout=0s)", notes)

    def test_missing_value_fails_the_render(self):
        chart = os.path.join(tempfile.mkdtemp(dir=tmpdir()), "pdworker")
        shutil.copytree(ARGS.chart, chart)
        with open(os.path.join(chart, "templates", "zz-typo.yaml"), "w") as f:
            f.write("kind: ConfigMap\ndata: {x: {{ .Values.roles.prefill.replicas }}}\n")
        with self.assertRaises(RenderError) as e:
            render(chart=chart)
        self.assertIn("replicas", str(e.exception))

    def test_required_values_are_enforced(self):
        cases = [
            ({"model": {"pvc": {"claimName": ""}}}, "model.pvc.claimName"),
            ({"model": {"source": "hostPath"}}, "model.hostPath.path"),
            ({"tls": {"enabled": True}}, "tls.secretName"),
        ]
        for values, message in cases:
            with self.subTest(values=values), self.assertRaises(RenderError) as e:
                render([write_values("required.yaml", values)])
            self.assertIn(message, str(e.exception))

    def test_host_path_model(self):
        docs, _, _ = render([write_values("hostpath.yaml", {
            "model": {"source": "hostPath", "hostPath": {"path": "/mnt/models/llama"}}})])
        for dep in by_kind(docs, "Deployment"):
            volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
            self.assertEqual(volumes["model"]["hostPath"]["path"], "/mnt/models/llama")
            self.assertNotIn("persistentVolumeClaim", volumes["model"])

    def test_disabling_a_role_removes_all_of_its_resources(self):
        docs, _, _ = render([write_values("decode-only.yaml",
                                          {"roles": {"prefill": {"enabled": False}}})])
        names = [d["metadata"]["name"] for d in docs]
        self.assertFalse([n for n in names if n.endswith("-prefill")], names)
        (cm,) = [d for d in by_kind(docs, "ConfigMap") if "compilation" in d["metadata"]["name"]]
        self.assertEqual(list(cm["data"]), ["decode.json"])

    def test_compilation_config_override_keeps_the_mode(self):
        docs, _, _ = render([write_values("sizes.yaml", {"roles": {"decode": {
            "compilationConfig": {"cudagraph_capture_sizes": [1, 2, 4, 8]}}}})])
        (cm,) = [d for d in by_kind(docs, "ConfigMap") if "compilation" in d["metadata"]["name"]]
        self.assertEqual(json.loads(cm["data"]["decode.json"]),
                         {"cudagraph_mode": "FULL_DECODE_ONLY",
                          "cudagraph_capture_sizes": [1, 2, 4, 8]})

    def test_config_change_rolls_only_that_role(self):
        def checksums(docs):
            return {role_of(d): d["spec"]["template"]["metadata"]["annotations"]
                    ["checksum/compilation-config"] for d in by_kind(docs, "Deployment")}
        before = checksums(render()[0])
        after = checksums(render([write_values("mode.yaml", {"roles": {"prefill": {
            "compilationConfig": {"cudagraph_mode": "NONE"}}}})])[0])
        self.assertNotEqual(before["prefill"], after["prefill"])
        self.assertEqual(before["decode"], after["decode"])

    def test_cpu_only_nodes(self):
        docs, _, _ = render([write_values("cpu.yaml", {"roles": {
            "prefill": {"gpus": 0}, "decode": {"gpus": 0}}})])
        for dep in by_kind(docs, "Deployment"):
            res = container(dep)["resources"]
            self.assertNotIn(GPU, res["requests"])
            self.assertNotIn(GPU, res["limits"])

    def test_schema_rejects_typos_and_bad_values(self):
        with open(os.path.join(ARGS.chart, "values.schema.json")) as f:
            validator = jsonschema.Draft7Validator(json.load(f))
        _, _, values = render()
        cases = {
            "unknown role key": ("roles", "prefill", "replicas", 2),
            "unknown graph mode": ("roles", "decode", "compilationConfig", "cudagraph_mode", "FULL_DECODE"),
            "unknown compilation field": ("roles", "decode", "compilationConfig", "capture_sizes", [1]),
            "GPU in resources": ("roles", "decode", "resources", "limits", GPU, 1),
            "port out of range": ("ports", "grpc", 70000),
            "unknown model source": ("model", "source", "s3"),
            "ratio above 1": ("prometheusRule", "rules", "kvCacheNearlyFull", "maxUsage", 95),
            "zero lease TTL": ("worker", "kvLeaseTtl", "0s"),
            "lease TTL without a unit": ("worker", "kvLeaseTtl", "30"),
            "fractional pull timeout": ("worker", "kvPullTimeout", "1.5s"),
            "idle timeout without a unit": ("worker", "sequenceIdleTimeout", "10"),
            "negative idle timeout": ("worker", "sequenceIdleTimeout", "-1s"),
            "idle timeout as a number": ("worker", "sequenceIdleTimeout", 600),
            "fractional sequence expiry count": ("prometheusRule", "rules", "sequencesExpired",
                                                 "maxExpiries", 0.5),
            "negative sequence expiry count": ("prometheusRule", "rules", "sequencesExpired",
                                               "maxExpiries", -1),
            "fractional expiry count": ("prometheusRule", "rules", "kvLeaseExpiries", "maxExpiries", 0.5),
            "transfer failure ratio above 1": ("prometheusRule", "rules", "kvTransferFailuresHigh", "maxRatio", 5),
        }
        for what, path in cases.items():
            bad = copy.deepcopy(values)
            node = bad
            for key in path[:-2]:
                node = node[key]
            node[path[-2]] = path[-1]
            with self.subTest(what):
                self.assertTrue(list(validator.iter_errors(bad)), f"schema accepted {what}")


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    for flag in ("renderer", "chart", "pdworker", "alerts", "example"):
        parser.add_argument("--" + flag, required=True)
    ARGS, rest = parser.parse_known_args()
    # Runfiles paths are relative to the test's working directory.
    for flag in ("renderer", "chart", "pdworker", "alerts", "example"):
        setattr(ARGS, flag, os.path.abspath(getattr(ARGS, flag)))
    run_tests([sys.argv[0]] + rest)


if __name__ == "__main__":
    main()
