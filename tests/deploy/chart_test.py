"""Renders deploy/helm/pdworker with helm's template engine (tools/chart_render:
Go text/template + sprig, missingkey=error) and checks the manifests a
cluster would receive: every combination of the optional objects
(InferencePool, HPA/KEDA autoscaling, PodMonitor/ServiceMonitor, preStop,
llm-d labels, the SMG router), each object of those kinds validated against
its published API schema (testdata/schemas, see SOURCES.md there).

  chart_test.py --renderer=R --chart=DIR --pdworker=BIN --alerts=alerts.yaml \
      --example=values-production.yaml --schemas=DIR --metrics_readme=README.md

Run by bazel (tests/deploy:chart_test) with /usr/bin/python3 and Debian's
python3-yaml and python3-jsonschema.
"""
import argparse
import copy
import itertools
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
EXPECTED_MODE = {"prefill": "PIECEWISE", "decode": "FULL_DECODE_ONLY",
                 "both": "FULL_AND_PIECEWISE"}
PD_ROLES = ("prefill", "decode")
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
    """Flag names defined in worker/worker_flags.cc, from `pdworker --help` (which
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


def selects_label_selector(selector, labels):
    """A metav1.LabelSelector (matchLabels + matchExpressions) on labels."""
    if not selects(selector.get("matchLabels", {}), labels):
        return False
    for e in selector.get("matchExpressions", []):
        op, value = e["operator"], labels.get(e["key"])
        if op == "In" and value not in e["values"]:
            return False
        if op == "NotIn" and value in e["values"]:
            return False
        if op == "Exists" and e["key"] not in labels:
            return False
        if op == "DoesNotExist" and e["key"] in labels:
            return False
    return True


def is_router(doc):
    return doc["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "router"


def worker_docs(docs, kind):
    """Objects of one kind that belong to the worker pools (not the router)."""
    return [d for d in by_kind(docs, kind) if not is_router(d)]


def pod_labels(deployment):
    return deployment["spec"]["template"]["metadata"]["labels"]


def check_drain_budget(test, deployment, values):
    """terminationGracePeriodSeconds covers the preStop delay, the drain and
    a pull accepted just before it (+5 s: --drain_linger 3 s and the
    worker's last 1 s for calls in flight): SIGKILL must not come first."""
    flags = flag_values(container(deployment)["args"])
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    delay = values["preStop"]["delaySeconds"] if values["preStop"]["enabled"] else 0
    needed = delay + seconds(flags["drain_timeout"]) + seconds(flags["kv_pull_timeout"]) + 5
    test.assertLessEqual(needed, grace,
                         f"{role_of(deployment)}: preStop delay {delay}s + drain "
                         f"{flags['drain_timeout']} + pull {flags['kv_pull_timeout']} + 5s "
                         f"> grace {grace}s")


# ------------------------------------------------------------ API schemas

# (apiVersion, kind) -> schema file in --schemas (see SOURCES.md there).
SCHEMA_FILES = {
    ("inference.networking.k8s.io/v1", "InferencePool"):
        "inference.networking.k8s.io_v1_inferencepool.yaml",
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_v1alpha1_scaledobject.yaml",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_v1_podmonitor.yaml",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "autoscaling_v2_horizontalpodautoscaler.json",
    ("rbac.authorization.k8s.io/v1", "Role"): "rbac.authorization.k8s.io_v1_role.json",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rbac.authorization.k8s.io_v1_rolebinding.json",
}
_VALIDATORS = {}


def strict(schema):
    """Rejects unknown fields like `kubectl apply --validate=strict`: an
    object schema that lists properties and says nothing of others gets
    additionalProperties: false (shared YAML-anchor nodes are visited more
    than once; the change is idempotent)."""
    if isinstance(schema, dict):
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        for v in schema.values():
            strict(v)
    elif isinstance(schema, list):
        for v in schema:
            strict(v)
    return schema


def validator_for(doc):
    key = (doc["apiVersion"], doc["kind"])
    if key not in _VALIDATORS:
        path = os.path.join(ARGS.schemas, SCHEMA_FILES[key])
        with open(path) as f:
            schema = json.load(f) if path.endswith(".json") else yaml.safe_load(f)
        strict(schema)
        jsonschema.Draft7Validator.check_schema(schema)
        _VALIDATORS[key] = jsonschema.Draft7Validator(schema)
    return _VALIDATORS[key]


def cel_errors(doc):
    """The CEL rules (x-kubernetes-validations) of the schemas above, in
    Python: only InferencePool has any."""
    errors = []
    if doc["kind"] == "InferencePool":
        numbers = [p["number"] for p in doc["spec"]["targetPorts"]]
        if len(numbers) != len(set(numbers)):
            errors.append("port number must be unique")
        ref = doc["spec"]["endpointPickerRef"]
        if ref.get("kind", "Service") == "Service" and "port" not in ref:
            errors.append("port is required when kind is 'Service'")
    return errors


def schema_errors(doc):
    """Every violation of doc's published API schema, or [] for kinds the
    chart always rendered (Deployment, Service, ...), which are not here."""
    if (doc["apiVersion"], doc["kind"]) not in SCHEMA_FILES:
        return []
    errors = [f"{list(e.path)}: {e.message}" for e in validator_for(doc).iter_errors(doc)]
    return errors + cel_errors(doc)


def documented_metrics():
    """Metric names documented in metrics/README.md (what the worker exports)."""
    with open(ARGS.metrics_readme) as f:
        return set(re.findall(r"`(pdworker_\w+)`", f.read()))


def example(name):
    return os.path.join(ARGS.chart, "examples", name)


class ManifestChecks:
    """Checks every rendered values case; subclasses set VALUES_FILES etc."""

    VALUES_FILES = ()
    RELEASE = "pdworker"
    NAMESPACE = "default"
    TLS = False
    ROLES = PD_ROLES

    @classmethod
    def setUpClass(cls):
        cls.docs, cls.notes, cls.values = render(
            [f() for f in cls.VALUES_FILES], cls.RELEASE, cls.NAMESPACE)
        cls.deployments = {role_of(d): d for d in worker_docs(cls.docs, "Deployment")}

    def test_schema_accepts_the_values(self):
        with open(os.path.join(ARGS.chart, "values.schema.json")) as f:
            schema = json.load(f)
        jsonschema.Draft7Validator.check_schema(schema)
        errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(self.values),
                        key=lambda e: list(e.path))
        self.assertEqual([], [f"{list(e.path)}: {e.message}" for e in errors])

    def test_both_roles_deployed(self):
        self.assertEqual(set(self.ROLES), set(self.deployments))
        for kind in ("Service", "PodDisruptionBudget"):
            names = sorted(d["metadata"]["name"] for d in worker_docs(self.docs, kind))
            self.assertEqual(len(names), len(self.ROLES), f"{kind}s: {names}")

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

    def test_memory_flags_come_from_the_values(self):
        for role, dep in self.deployments.items():
            flags = flag_values(container(dep)["args"])
            # A decimal the worker's absl double flag parses, in (0, 1].
            self.assertEqual(float(flags["gpu_memory_utilization"]),
                             float(self.values["worker"]["gpuMemoryUtilization"]), role)
            self.assertRegex(flags["gpu_memory_utilization"], r"^(0?\.[0-9]+|1(\.0+)?)$", role)
            # 0 (the default): the KV cache is sized from the fraction.
            self.assertEqual(int(flags["kv_cache_bytes"]),
                             self.values["roles"][role]["kvCacheBytes"], role)

    def test_kv_import_wait_timeout_comes_from_the_values(self):
        for role, dep in self.deployments.items():
            flags = flag_values(container(dep)["args"])
            self.assertEqual(flags["kv_import_wait_timeout"],
                             self.values["worker"]["kvImportWaitTimeout"], role)
            # A duration the worker's absl::ParseDuration takes; 0s = no wait.
            self.assertRegex(flags["kv_import_wait_timeout"], r"^([0-9]+(ms|s|m|h))+$",
                             f"{role} --kv_import_wait_timeout")

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
            check_drain_budget(self, dep, self.values)

    def test_prestop_starts_the_drain(self):
        for dep in self.deployments.values():
            check_prestop(self, dep, self.values)

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
            for doc in worker_docs(self.docs, kind):
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
        for role in PD_ROLES:
            flags = flag_values(container(self.deployments[role])["args"])
            self.assertEqual(flags["kv_lease_ttl"], "1m", role)
            self.assertEqual(flags["kv_pull_timeout"], "20s", role)
            self.assertEqual(flags["sequence_idle_timeout"], "5m", role)
        configmap = named(self.docs, "ConfigMap", "llm-pdworker-compilation-config")
        decode = json.loads(configmap["data"]["decode.json"])
        self.assertEqual(decode["cudagraph_capture_sizes"][-1], 256)

    def test_tls_notes_explain_the_probe_fallback(self):
        self.assertIn("TCP", self.notes)


class SmgExampleTest(ManifestChecks, unittest.TestCase):
    """examples/values-smg.yaml: P/D workers behind an SMG router."""

    VALUES_FILES = (lambda: example("values-smg.yaml"),)
    RELEASE = "llm"
    NAMESPACE = "llm"

    def fullname(self):
        return "llm-pdworker"

    def test_every_object_matches_its_api_schema(self):
        for doc in self.docs:
            self.assertEqual([], schema_errors(doc), f"{doc['kind']} {doc['metadata']['name']}")

    def test_router_runs_pd_over_the_workers(self):
        check_router(self, self.docs, self.values)
        args = container(named(self.docs, "Deployment", "llm-pdworker-router"))["args"]
        self.assertIn("--pd-disaggregation", args)
        self.assertEqual(option(args, "--service-discovery-protocol"), "grpc")
        self.assertEqual(option(args, "--policy"), "cache_aware")
        self.assertIn("--decode-policy=power_of_two", args)

    def test_decode_scales_on_kv_usage(self):
        (so,) = by_kind(self.docs, "ScaledObject")
        self.assertEqual(so["spec"]["scaleTargetRef"]["name"], "llm-pdworker-decode")
        (trigger,) = so["spec"]["triggers"]
        self.assertIn("pdworker_kv_cache_usage_ratio", trigger["metadata"]["query"])
        self.assertEqual((so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]), (4, 8))
        self.assertNotIn("replicas", self.deployments["decode"]["spec"])
        self.assertEqual(self.deployments["prefill"]["spec"]["replicas"], 2)


class LlmdExampleTest(ManifestChecks, unittest.TestCase):
    """examples/values-llm-d.yaml: aggregated workers in an InferencePool."""

    VALUES_FILES = (lambda: example("values-llm-d.yaml"),)
    RELEASE = "llm"
    NAMESPACE = "llm"
    ROLES = ("both",)

    def fullname(self):
        return "llm-pdworker"

    def test_every_object_matches_its_api_schema(self):
        for doc in self.docs:
            self.assertEqual([], schema_errors(doc), f"{doc['kind']} {doc['metadata']['name']}")

    def test_pool_selects_the_aggregated_workers(self):
        (pool,) = by_kind(self.docs, "InferencePool")
        check_inference_pool(self, pool, self.deployments, self.values)
        self.assertEqual(pool["metadata"]["name"], "llama-3-1-8b")
        self.assertEqual(pool["spec"]["endpointPickerRef"]["name"], "llama-3-1-8b-epp")

    def test_llmd_labels(self):
        labels = pod_labels(self.deployments["both"])
        # llm-d's prefill and decode filters both accept role "both"
        # (llm-d-inference-scheduler pkg/plugins/filter/pd_role.go).
        self.assertEqual(labels["llm-d.ai/role"], "both")
        self.assertEqual(labels["llm-d.ai/engine-type"], "vllm")
        self.assertEqual(labels["llm-d.ai/inference-serving"], "true")
        self.assertEqual(flag_values(container(self.deployments["both"])["args"])["role"], "both")

    def test_prestop_delay_fits(self):
        c = container(self.deployments["both"])
        self.assertTrue(prestop_script(c).startswith("sleep 10; kill -TERM 1;"))


def option(args, name):
    """The value after `name` in an argv list (SMG takes `--flag value`)."""
    i = args.index(name)
    return args[i + 1]


def prestop_script(c):
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["/bin/sh", "-c"] and len(command) == 3, command
    return command[2]


def check_prestop(test, dep, values):
    c = container(dep)
    if not values["preStop"]["enabled"]:
        test.assertNotIn("lifecycle", c)
        return
    script = prestop_script(c)
    # The worker drains on SIGTERM (worker/main.cc sigwait); PID 1 is the
    # worker (exec-form ENTRYPOINT). The hook returns once it has exited.
    test.assertIn("kill -TERM 1;", script)
    test.assertTrue(script.endswith("while kill -0 1 2>/dev/null; do sleep 1; done"), script)
    delay = values["preStop"]["delaySeconds"]
    test.assertEqual(script.startswith(f"sleep {delay}; "), delay > 0, script)
    test.assertNotIn("shareProcessNamespace", dep["spec"]["template"]["spec"])
    check_drain_budget(test, dep, values)


def check_inference_pool(test, pool, deployments, values):
    role = pool["metadata"]["labels"]["app.kubernetes.io/component"]
    r = values["roles"][role]["inferencePool"]
    dep = deployments[role]
    sel = pool["spec"]["selector"]["matchLabels"]
    test.assertTrue(selects(sel, pod_labels(dep)), f"{role}: pool selector {sel} misses its pods")
    if not r["matchLabels"]:
        others = [o for o, d in deployments.items() if o != role and selects(sel, pod_labels(d))]
        test.assertEqual(others, [], f"{role}: pool also selects {others}")
    grpc = {p["name"]: p["containerPort"] for p in container(dep)["ports"]}["grpc"]
    test.assertEqual(pool["spec"]["targetPorts"], [{"number": grpc}],
                     f"{role}: targetPorts = the container's gRPC port")
    test.assertEqual(pool["spec"].get("appProtocol", ""), r["appProtocol"])
    ref = pool["spec"]["endpointPickerRef"]
    test.assertEqual((ref["name"], ref["port"]["number"], ref["failureMode"]),
                     (r["endpointPicker"]["name"], r["endpointPicker"]["port"],
                      r["endpointPicker"]["failureMode"]))


def check_autoscaler(test, doc, deployments, values):
    role = doc["metadata"]["labels"]["app.kubernetes.io/component"]
    a = values["roles"][role]["autoscaling"]
    dep = deployments[role]
    target = doc["spec"]["scaleTargetRef"]
    test.assertEqual((target["apiVersion"], target["kind"], target["name"]),
                     ("apps/v1", "Deployment", dep["metadata"]["name"]))
    test.assertFalse("replicas" in dep["spec"], f"{role}: spec.replicas set: helm would fight "
                     "the autoscaler on every upgrade")
    known = documented_metrics()
    if doc["kind"] == "HorizontalPodAutoscaler":
        test.assertEqual(a["mode"], "hpa")
        test.assertEqual((doc["spec"]["minReplicas"], doc["spec"]["maxReplicas"]),
                         (a["minReplicas"], a["maxReplicas"]))
        pods = [m["pods"]["metric"]["name"] for m in doc["spec"]["metrics"] if m["type"] == "Pods"]
        test.assertEqual(pods, [m["name"] for m in a["hpa"]["podsMetrics"]])
        test.assertLessEqual(set(pods), known, f"{role}: HPA metrics the worker does not export")
        return
    test.assertEqual(a["mode"], "keda")
    test.assertEqual((doc["spec"]["minReplicaCount"], doc["spec"]["maxReplicaCount"]),
                     (a["minReplicas"], a["maxReplicas"]))
    (trigger,) = doc["spec"]["triggers"]
    test.assertEqual(trigger["type"], "prometheus")
    meta = trigger["metadata"]
    test.assertEqual(meta["serverAddress"], values["autoscaling"]["keda"]["serverAddress"])
    test.assertEqual(meta["threshold"], a["keda"]["threshold"])
    query = meta["query"]
    test.assertNotIn("{{", query, f"{role}: unrendered template in the KEDA query")
    # The query selects this role's pods (their names: <deployment>-<hash>-<id>)
    # in the release namespace, and no other role's.
    m = re.search(r'namespace="([^"]+)",pod=~"([^"]+)"', query)
    test.assertTrue(m, f"{role}: query without the role's pod matcher: {query}")
    test.assertEqual(m.group(1), dep["metadata"]["namespace"])
    pod_re = re.compile(m.group(2))
    for other, d in deployments.items():
        name = d["metadata"]["name"] + "-5d8f9c7b6d-x2x7z"
        test.assertEqual(bool(pod_re.fullmatch(name)), other == role,
                         f"{role}: pod matcher {m.group(2)} vs {name}")
    used = set(re.findall(r"\bpdworker_\w+", query))
    test.assertTrue(used, query)
    test.assertLessEqual(used, known, f"{role}: KEDA query on metrics the worker does not export")


def check_monitor(test, docs, deployments, values):
    sm, pm = by_kind(docs, "ServiceMonitor"), by_kind(docs, "PodMonitor")
    test.assertEqual((len(sm), len(pm)),
                     (int(values["serviceMonitor"]["enabled"]), int(values["podMonitor"]["enabled"])))
    routers = [d for d in by_kind(docs, "Deployment") if is_router(d)]
    for mon in pm:
        sel = mon["spec"]["selector"]
        for role, dep in deployments.items():
            test.assertTrue(selects_label_selector(sel, pod_labels(dep)), f"PodMonitor misses {role}")
            ports = {p["name"] for p in container(dep)["ports"]}
            for ep in mon["spec"]["podMetricsEndpoints"]:
                test.assertIn(ep["port"], ports, f"{role}: PodMonitor port")
                test.assertEqual(ep["path"], "/metrics")
        for r in routers:
            test.assertFalse(selects_label_selector(sel, pod_labels(r)), "PodMonitor scrapes the router")
        test.assertEqual(mon["spec"]["namespaceSelector"]["matchNames"],
                         [mon["metadata"]["namespace"]])
    for mon in sm:
        sel = mon["spec"]["selector"]
        matched = [s for s in by_kind(docs, "Service")
                   if selects_label_selector(sel, s["metadata"]["labels"])]
        test.assertEqual(sorted(s["metadata"]["name"] for s in matched),
                         sorted(s["metadata"]["name"] for s in worker_docs(docs, "Service")))


def check_router(test, docs, values):
    routers = [d for d in by_kind(docs, "Deployment") if is_router(d)]
    if not values["router"]["enabled"]:
        test.assertEqual(routers, [])
        test.assertEqual(by_kind(docs, "Role") + by_kind(docs, "RoleBinding"), [])
        return
    (router,) = routers
    args = container(router)["args"]
    deployments = {role_of(d): d for d in worker_docs(docs, "Deployment")}
    pd = set(deployments) == set(PD_ROLES)
    test.assertEqual("--pd-disaggregation" in args, pd)
    spec = router["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m for m in container(router)["volumeMounts"]}
    test.assertIn(option(args, "--model-path"), mounts, "SMG reads the tokenizer from the model volume")
    grpc = values["ports"]["grpc"]
    if values["router"]["workerDiscovery"] == "kubernetes":
        test.assertIn("--service-discovery", args)
        test.assertEqual(option(args, "--service-discovery-port"), str(grpc))
        test.assertEqual(option(args, "--service-discovery-namespace"),
                         router["metadata"]["namespace"])
        flags = {"prefill": "--prefill-selector", "decode": "--decode-selector"} if pd \
            else {"both": "--selector"}
        for role, flag in flags.items():
            sel = dict(kv.split("=", 1) for kv in option(args, flag).split(","))
            matched = [r for r, d in deployments.items() if selects(sel, pod_labels(d))]
            test.assertEqual(matched, [role], f"{flag} {sel} selects {matched}")
        (role_doc,) = by_kind(docs, "Role")
        (binding,) = by_kind(docs, "RoleBinding")
        test.assertIn({"apiGroups": [""], "resources": ["pods"],
                       "verbs": ["get", "list", "watch"]}, role_doc["rules"])
        test.assertEqual(binding["roleRef"], {"apiGroup": "rbac.authorization.k8s.io",
                                              "kind": "Role", "name": role_doc["metadata"]["name"]})
        test.assertEqual(binding["subjects"], [{"kind": "ServiceAccount",
                                                "name": spec["serviceAccountName"],
                                                "namespace": router["metadata"]["namespace"]}])
        named(docs, "ServiceAccount", spec["serviceAccountName"])
    else:
        test.assertNotIn("--service-discovery", args)
        test.assertEqual(by_kind(docs, "Role"), [])
        services = {s["metadata"]["name"]: s for s in worker_docs(docs, "Service")}
        urls = ([option(args, "--prefill"), option(args, "--decode")] if pd
                else [option(args, "--worker-urls")])
        for url, role in zip(urls, PD_ROLES if pd else ("both",)):
            m = re.fullmatch(r"grpc://([a-z0-9-]+)\.([a-z0-9-]+)\.svc:(\d+)", url)
            test.assertTrue(m, url)
            svc = services[m.group(1)]
            test.assertTrue(selects(svc["spec"]["selector"], pod_labels(deployments[role])), url)
            test.assertEqual(int(m.group(3)), grpc)
    svc = named(docs, "Service", router["metadata"]["name"])
    test.assertTrue(selects(svc["spec"]["selector"], pod_labels(router)))
    test.assertEqual(container(router)["image"],
                     f"{values['router']['image']['repository']}:{values['router']['image']['tag']}")


def combination_values(roles, pool, autoscaling, monitor, prestop, llmd, router):
    v = {"roles": {"prefill": {}, "decode": {}, "both": {}},
         "serviceMonitor": {"enabled": monitor == "serviceMonitor"},
         "podMonitor": {"enabled": monitor == "podMonitor"},
         "preStop": {"enabled": prestop, "delaySeconds": 5 if prestop else 0},
         "terminationGracePeriodSeconds": 65,
         "llmd": {"labels": {"enabled": llmd}},
         "router": {"enabled": router != "off", "image": {"tag": "1.4.1"},
                    "workerDiscovery": router if router != "off" else "kubernetes"}}
    enabled = PD_ROLES if roles == "pd" else ("both",)
    for role in ("prefill", "decode", "both"):
        r = v["roles"][role]
        r["enabled"] = role in enabled
        r["inferencePool"] = {"enabled": pool, "endpointPicker": {"name": f"{role}-epp"}}
        r["autoscaling"] = {"mode": autoscaling, "minReplicas": 2, "maxReplicas": 6}
    return v, enabled


class CombinationsTest(unittest.TestCase):
    """Every combination of the optional objects, each rendered object of a
    new kind checked against its API schema and against the pods it acts on."""

    DIMENSIONS = {
        "roles": ("pd", "both"),
        "pool": (False, True),
        "autoscaling": ("none", "hpa", "keda"),
        "monitor": ("serviceMonitor", "podMonitor"),
        "prestop": (False, True),
        "llmd": (False, True),
        "router": ("off", "kubernetes", "urls"),
    }

    def test_every_combination(self):
        seen_kinds = set()
        names = list(self.DIMENSIONS)
        for combo in itertools.product(*self.DIMENSIONS.values()):
            case = dict(zip(names, combo))
            values, enabled = combination_values(**case)
            with self.subTest(**case):
                docs, _, coalesced = render(
                    [write_values("combination.yaml", values)], "rel", "ns")
                self.check_values_schema(coalesced)
                self.check(docs, coalesced, case, enabled)
                seen_kinds |= {d["kind"] for d in docs}
        # Every schema'd kind was rendered (and validated) at least once.
        self.assertLessEqual({k for _, k in SCHEMA_FILES}, seen_kinds)

    def check_values_schema(self, values):
        with open(os.path.join(ARGS.chart, "values.schema.json")) as f:
            validator = jsonschema.Draft7Validator(json.load(f))
        self.assertEqual([], [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(values)])

    def check(self, docs, values, case, enabled):
        for doc in docs:
            self.assertEqual([], schema_errors(doc), f"{doc['kind']} {doc['metadata']['name']}")
            self.assertEqual(doc["metadata"]["namespace"], "ns")
        deployments = {role_of(d): d for d in worker_docs(docs, "Deployment")}
        self.assertEqual(set(deployments), set(enabled))
        pools = by_kind(docs, "InferencePool")
        self.assertEqual(len(pools), len(enabled) if case["pool"] else 0)
        for pool in pools:
            check_inference_pool(self, pool, deployments, values)
        scalers = by_kind(docs, "HorizontalPodAutoscaler") + by_kind(docs, "ScaledObject")
        self.assertEqual(len(scalers), 0 if case["autoscaling"] == "none" else len(enabled))
        for doc in scalers:
            check_autoscaler(self, doc, deployments, values)
        for role, dep in deployments.items():
            if case["autoscaling"] == "none":
                self.assertEqual(dep["spec"]["replicas"], values["roles"][role]["replicaCount"])
            check_prestop(self, dep, values)
            labels = pod_labels(dep)
            self.assertTrue(selects(dep["spec"]["selector"]["matchLabels"], labels))
            if case["llmd"]:
                self.assertEqual(labels["llm-d.ai/role"], role)
                self.assertEqual(labels["llm-d.ai/engine-type"], "vllm")
                self.assertEqual(labels["llm-d.ai/inference-serving"], "true")
            else:
                self.assertFalse([k for k in labels if k.startswith("llm-d.ai/")], labels)
        if case["autoscaling"] == "keda":
            queries = {d["metadata"]["labels"]["app.kubernetes.io/component"]:
                       d["spec"]["triggers"][0]["metadata"]["query"]
                       for d in by_kind(docs, "ScaledObject")}
            # The defaults per role: prefill on waiting prompt tokens, decode
            # and aggregated workers on KV cache usage.
            for role, q in queries.items():
                metric = ("pdworker_waiting_prompt_tokens" if role == "prefill"
                          else "pdworker_kv_cache_usage_ratio")
                self.assertIn(metric, q, role)
        check_monitor(self, docs, deployments, values)
        check_router(self, docs, values)


class OptionalObjectValuesTest(unittest.TestCase):
    """Values of the optional objects: overrides reach the manifests, bad
    combinations fail the render or the schema."""

    def test_custom_pool_selector_and_http(self):
        docs, _, values = render([write_values("pool.yaml", {
            "llmd": {"labels": {"enabled": True, "extra": {"llm-d.ai/guide": "llama"}}},
            "roles": {"decode": {"inferencePool": {
                "enabled": True, "name": "shared-pool", "appProtocol": "http",
                "matchLabels": {"llm-d.ai/guide": "llama", "llm-d.ai/role": "decode"},
                "endpointPicker": {"name": "epp", "port": 9003, "failureMode": "FailOpen",
                                   "group": "example.com", "kind": "EndpointPicker"}}}}})])
        (pool,) = by_kind(docs, "InferencePool")
        self.assertEqual([], schema_errors(pool))
        self.assertEqual(pool["metadata"]["name"], "shared-pool")
        self.assertEqual(pool["spec"]["selector"]["matchLabels"],
                         {"llm-d.ai/guide": "llama", "llm-d.ai/role": "decode"})
        self.assertEqual(pool["spec"]["endpointPickerRef"],
                         {"group": "example.com", "kind": "EndpointPicker", "name": "epp",
                          "port": {"number": 9003}, "failureMode": "FailOpen"})
        deployments = {role_of(d): d for d in worker_docs(docs, "Deployment")}
        check_inference_pool(self, pool, deployments, values)

    def test_pool_without_app_protocol_for_older_crds(self):
        docs, _, _ = render([write_values("pool-old.yaml", {"roles": {"decode": {
            "inferencePool": {"enabled": True, "appProtocol": "",
                              "endpointPicker": {"name": "epp"}}}}})])
        (pool,) = by_kind(docs, "InferencePool")
        self.assertNotIn("appProtocol", pool["spec"])
        self.assertEqual([], schema_errors(pool))

    def test_schema_validation_catches_a_broken_pool(self):
        docs, _, _ = render([write_values("pool-ok.yaml", {"roles": {"decode": {
            "inferencePool": {"enabled": True, "endpointPicker": {"name": "epp"}}}}})])
        (pool,) = by_kind(docs, "InferencePool")
        for what, mutate in {
            "unknown field": lambda p: p["spec"].update(targetPortNumber=50051),
            "no target port": lambda p: p["spec"].update(targetPorts=[]),
            "duplicate port": lambda p: p["spec"].update(targetPorts=[{"number": 1}, {"number": 1}]),
            "bad protocol": lambda p: p["spec"].update(appProtocol="grpc"),
            "service without port": lambda p: p["spec"]["endpointPickerRef"].pop("port"),
        }.items():
            bad = copy.deepcopy(pool)
            mutate(bad)
            with self.subTest(what):
                self.assertTrue(schema_errors(bad), f"schema accepted {what}")

    def test_hpa_overrides(self):
        docs, _, _ = render([write_values("hpa.yaml", {"roles": {"prefill": {"autoscaling": {
            "mode": "hpa", "minReplicas": 2, "maxReplicas": 9,
            "hpa": {"targetCPUUtilizationPercentage": 60, "podsMetrics": [],
                    "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}}}}}}})])
        (hpa,) = by_kind(docs, "HorizontalPodAutoscaler")
        self.assertEqual([], schema_errors(hpa))
        self.assertEqual(hpa["spec"]["metrics"], [{"type": "Resource", "resource": {
            "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 60}}}])
        self.assertEqual(hpa["spec"]["behavior"], {"scaleDown": {"stabilizationWindowSeconds": 600}})
        self.assertEqual((hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]), (2, 9))

    def test_keda_overrides(self):
        docs, _, _ = render([write_values("keda.yaml", {
            "autoscaling": {"keda": {"serverAddress": "http://prom:9090",
                                     "authenticationRef": "prom-auth", "pollingInterval": 5}},
            "roles": {"prefill": {"autoscaling": {"mode": "keda", "keda": {
                "query": "sum(rate(pdworker_forward_requests_total{ {{ .selector }} }[1m]))",
                "threshold": "20", "activationThreshold": "1"}}}}}, ), ], "r", "n")
        (so,) = by_kind(docs, "ScaledObject")
        self.assertEqual([], schema_errors(so))
        (trigger,) = so["spec"]["triggers"]
        self.assertEqual(trigger["metadata"]["query"],
                         'sum(rate(pdworker_forward_requests_total{ namespace="n",'
                         'pod=~"r-pdworker-prefill-[a-z0-9]+-[a-z0-9]+" }[1m]))')
        self.assertEqual(trigger["metadata"]["activationThreshold"], "1")
        self.assertEqual(trigger["authenticationRef"], {"name": "prom-auth"})
        self.assertEqual(so["spec"]["pollingInterval"], 5)

    def test_bad_combinations_fail_the_render(self):
        cases = [
            ({"roles": {"decode": {"inferencePool": {"enabled": True}}}},
             "endpointPicker.name is required"),
            ({"tls": {"enabled": True, "secretName": "s"}, "roles": {"decode": {
                "inferencePool": {"enabled": True, "endpointPicker": {"name": "e"}}}}},
             "kubernetes.io/h2c"),
            ({"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}},
             "enable one"),
            ({"roles": {"decode": {"autoscaling": {"mode": "hpa", "hpa": {"podsMetrics": []}}}}},
             "needs targetCPUUtilizationPercentage or podsMetrics"),
            ({"roles": {"decode": {"autoscaling": {"mode": "keda", "minReplicas": 5,
                                                    "maxReplicas": 2}}}},
             "below minReplicas"),
            ({"router": {"enabled": True}}, "router.image.tag is required"),
            ({"router": {"enabled": True, "image": {"tag": "1.4.1"}},
              "tls": {"enabled": True, "secretName": "s"}}, "plaintext grpc"),
            ({"router": {"enabled": True, "image": {"tag": "1.4.1"}},
              "roles": {"both": {"enabled": True}}}, "not all three"),
            ({"router": {"enabled": True, "image": {"tag": "1.4.1"}},
              "roles": {"decode": {"enabled": False}}}, "needs roles prefill and decode"),
        ]
        for values, message in cases:
            with self.subTest(values=values), self.assertRaises(RenderError) as e:
                render([write_values("bad.yaml", values)])
            self.assertIn(message, str(e.exception))

    def test_schema_rejects_bad_new_values(self):
        with open(os.path.join(ARGS.chart, "values.schema.json")) as f:
            validator = jsonschema.Draft7Validator(json.load(f))
        _, _, values = render()
        cases = {
            "unknown autoscaling mode": ("roles", "decode", "autoscaling", "mode", "vpa"),
            "zero minReplicas": ("roles", "decode", "autoscaling", "minReplicas", 0),
            "threshold as a number": ("roles", "decode", "autoscaling", "keda", "threshold", 0.75),
            "bad metric type": ("roles", "decode", "autoscaling", "keda", "metricType", "Utilization"),
            "bad quantity": ("roles", "decode", "autoscaling", "hpa", "podsMetrics", [
                {"name": "pdworker_kv_cache_usage_ratio", "averageValue": "75%"}]),
            "unknown app protocol": ("roles", "decode", "inferencePool", "appProtocol", "grpc"),
            "bad label key": ("llmd", "labels", "roleKey", "llm-d.ai/role/x"),
            "bad label value": ("llmd", "labels", "extra", {"llm-d.ai/inference-serving": "yes please"}),
            "pool without EPP": ("roles", "decode", "inferencePool", "enabled", True),
            "negative preStop delay": ("preStop", "delaySeconds", -1),
            "unknown discovery": ("router", "workerDiscovery", "dns"),
            "router without a tag": ("router", "enabled", True),
            "unknown role": ("roles", "mixed", {}),
        }
        for what, path in cases.items():
            bad = copy.deepcopy(values)
            node = bad
            for key in path[:-2]:
                node = node[key]
            node[path[-2]] = path[-1]
            with self.subTest(what):
                self.assertTrue(list(validator.iter_errors(bad)), f"schema accepted {what}")
        both = copy.deepcopy(values)
        both["serviceMonitor"]["enabled"] = both["podMonitor"]["enabled"] = True
        self.assertTrue(list(validator.iter_errors(both)), "schema accepted both monitors")


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

    def test_user_facing_alert_thresholds_come_from_the_values(self):
        docs, _, _ = render([write_values("user-rules.yaml", {"prometheusRule": {
            "enabled": True, "rules": {
                "timeToFirstTokenHigh": {"maxSeconds": {"prefill": 0.75, "both": 3},
                                         "for": "2m", "severity": "critical"},
                "requestsWaitingGrowing": {"maxWaiting": 25},
                "preemptionStorm": {"maxPerSecond": 0.5, "severity": "info"}}}})])
        (rule,) = by_kind(docs, "PrometheusRule")
        rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
        # One TTFT rule per role: the values' roles merged with the defaults.
        ttft = {r["labels"]["role"]: r for r in rules
                if r["alert"] == "PdworkerTimeToFirstTokenHigh"}
        self.assertEqual(sorted(ttft), ["both", "decode", "prefill"])
        for role, threshold in (("prefill", "0.75"), ("decode", "1"), ("both", "3")):
            with self.subTest(role):
                r = ttft[role]
                self.assertRegex(r["expr"], r"> " + re.escape(threshold) + r"\s*$")
                self.assertIn(f'pdworker_worker_info{{role="{role}"}}', r["expr"])
                self.assertEqual((r["for"], r["labels"]["severity"]), ("2m", "critical"))
                self.assertIn(f"(threshold: {threshold}s)", r["annotations"]["description"])
                self.assertIn(f"the {role} workers of", r["annotations"]["description"])
        by_name = {r["alert"]: r for r in rules}
        waiting = by_name["PdworkerRequestsWaitingGrowing"]
        self.assertRegex(waiting["expr"], r"> 25\s*$")
        self.assertIn("(threshold: 25)", " ".join(waiting["annotations"]["description"].split()))
        self.assertEqual((waiting["for"], waiting["labels"]["severity"]), ("5m", "warning"))
        storm = by_name["PdworkerPreemptionStorm"]
        self.assertRegex(storm["expr"], r"> 0\.5\s*$")
        self.assertEqual(storm["labels"]["severity"], "info")
        self.assertIn("(threshold: 0.5)", storm["annotations"]["description"])
        # Alert templates reach Prometheus unrendered.
        self.assertIn("{{ $value | humanizeDuration }}", ttft["both"]["annotations"]["summary"])

        docs, _, _ = render([write_values("user-rules-off.yaml", {"prometheusRule": {
            "enabled": True, "rules": {"timeToFirstTokenHigh": {"enabled": False},
                                       "requestsWaitingGrowing": {"enabled": False},
                                       "preemptionStorm": {"enabled": False}}}})])
        (rule,) = by_kind(docs, "PrometheusRule")
        names = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
        self.assertFalse(names & {"PdworkerTimeToFirstTokenHigh", "PdworkerRequestsWaitingGrowing",
                                  "PdworkerPreemptionStorm"})
        self.assertIn("PdworkerGraphHitRateLow", names)

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
            "zero TTFT threshold": ("prometheusRule", "rules", "timeToFirstTokenHigh", "maxSeconds",
                                    {"prefill": 0}),
            "TTFT threshold of an unknown role": ("prometheusRule", "rules", "timeToFirstTokenHigh",
                                                  "maxSeconds", {"mixed": 1}),
            "TTFT threshold as a duration": ("prometheusRule", "rules", "timeToFirstTokenHigh",
                                             "maxSeconds", {"decode": "1s"}),
            "fractional waiting count": ("prometheusRule", "rules", "requestsWaitingGrowing",
                                         "maxWaiting", 2.5),
            "negative preemption rate": ("prometheusRule", "rules", "preemptionStorm",
                                         "maxPerSecond", -1),
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
    flags = ("renderer", "chart", "pdworker", "alerts", "example", "schemas", "metrics_readme")
    for flag in flags:
        parser.add_argument("--" + flag, required=True)
    ARGS, rest = parser.parse_known_args()
    # Runfiles paths are relative to the test's working directory.
    for flag in flags:
        setattr(ARGS, flag, os.path.abspath(getattr(ARGS, flag)))
    run_tests([sys.argv[0]] + rest)


if __name__ == "__main__":
    main()
