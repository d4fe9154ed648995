"""What a pod create costs: the real kube-apiserver alone, with gpuguard's webhooks, with the native
MutatingAdmissionPolicy doing gpuguard's readiness-toleration injection, with the whole policy compiled
into native policies (`gpuguard policy compile`), and with both as `admission.mode: hybrid` runs them
(gpuguard's webhooks narrowed to what the native policies leave to them), in one run.

GPU pods (the shared corpus' accelerator workloads as bare pods, or bench/payloads.py's when the corpus is
absent) are created at fixed rates, open loop: each create is due at its slot whatever the earlier ones
do, and its latency runs from that slot, so a slow answer delays no later request and hides nothing. Each
admission extension selects a namespace of its own and nothing else, so the scenarios interleave in rounds
without re-registering anything; the API server still checks every selector, for microseconds, in each.
Measured per scenario: creates per second, client-observed p50/p99, the API server's own histograms
(request, admission steps, the webhook or policy), the CPU each create costs the control plane and the
extension, and whether the created pods came back mutated. The method is in bench/README.md.

    bench/run admission [--rates 50,200] [--duration 10] [--rounds 3] [--scenarios a,c,n]
                        [--out bench/admission-results.md]
"""

from __future__ import annotations

import argparse
import base64
import copy
import datetime
import functools
import http.client
import json
import os
import platform
import queue
import resource
import shutil
import ssl
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import yaml

from bench import FLOOR_MISSED, payloads
from bench.common import (
    busy_seconds,
    cpu_model,
    fmt_ms,
    own_seconds,
    process_cpu_seconds,
    quietly,
    wait_for_quiet,
)
from tests.harness import REPO_ROOT, corpus
from tests.harness.admission import READINESS_KEYS, metric_samples, readiness_tolerations
from tests.harness.controlplane import (
    LOOPBACK,
    ControlPlane,
    free_ports,
    http_get,
    spawn,
    wait_until,
    without_proxies,
)
from tests.harness.install import (
    CONFIGURATION,
    CONFIGURATION_KINDS,
    DEPLOY,
    ENDPOINTS,
    Replica,
    namespaces_of,
    render,
    route_to,
    service_account_kubeconfig,
)
from webhook.certs.files import CA_FILE
from webhook.policy.model import Accelerators, default_policy, parse_policy
from webhook.policy.native import compile_policy
from webhook.policy.nativenarrow import CONDITION_NAME, narrowing
from webhook.policy.workload import accelerator_resources

JSON = dict[str, Any]
MAP_MANIFEST = REPO_ROOT / "bench" / "map" / "readiness-tolerations.yaml"
KYVERNO_POLICY = REPO_ROOT / "bench" / "kyverno" / "readiness-tolerations.yaml"
# What selects each extension's namespace: the webhook configurations' and the binding's namespaceSelector.
GPUGUARD_LABEL = "bench.gpuguard.io/gpuguard"
MAP_LABEL = "bench.gpuguard.io/map"
KYVERNO_LABEL = "bench.gpuguard.io/kyverno"
NO_OP_LABEL = "bench.gpuguard.io/no-op"
NATIVE_LABEL = "bench.gpuguard.io/native"
HYBRID_LABEL = "bench.gpuguard.io/hybrid"
NATIVE_PREFIX = "bench-native-"  # (n)'s compiled objects, beside (c)'s hand-written MAP of the same name
HYBRID_PREFIX = "bench-hybrid-"  # (h)'s compiled objects and configurations, beside (n)'s and (b)'s
# deploy/'s webhooks that scenario (e) copies, and the names of the copies.
NO_OP_MIRRORS = {
    "mutate.gpuguard.io": "mutate.no-op.bench.gpuguard.io",
    "validate.gpuguard.io": "validate.no-op.bench.gpuguard.io",
}
KYVERNO_NAMESPACE = "kyverno"
CONNECTIONS = 32  # the open loop's pool: enough that a slow create never holds up the next one
SATURATION_CONNECTIONS = 8
CLEAN_UP_TIMEOUT_S = 300.0
FLOOR_RATE = 200
FLOOR_P50_MS = 1.0
FLOOR_P99_MS = 3.0
# The compiled native policies may add at most this much more than the hand-written MAP of (c).
NATIVE_OVER_MAP = 1.10
API_SERVER_DEFAULT_SECONDS = 300
CORPUS_PRIORITY = (
    2000  # for classes the corpus names: above acceleratorNodeGuard's minPriority, as the e2e does
)
HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}
SAY: Callable[[str], None] = lambda text: print(f"bench: {text}", file=sys.stderr, flush=True)  # noqa: E731


# --- the pods ------------------------------------------------------------------------------------------


def _pod_template(doc: JSON) -> JSON | None:
    """The pod (metadata and spec) a manifest creates: the Pod itself, or its workload's template."""
    kind, spec = doc.get("kind"), doc.get("spec") or {}
    if kind == "Pod":
        return {"metadata": doc.get("metadata") or {}, "spec": spec}
    if kind == "CronJob":
        spec = (spec.get("jobTemplate") or {}).get("spec") or {}
    if kind in ("Deployment", "StatefulSet", "ReplicaSet", "Job", "CronJob"):
        template: JSON = spec.get("template") or {}
        return template
    return None  # DaemonSets are left alone by every extension; the rest are not workloads


def is_accelerator_pod(spec: JSON, accelerators: Accelerators) -> bool:
    """A container or init container asks for an accelerator extended resource (DRA claims aside: the
    bench creates no ResourceClaims, and the policy could not tell what a claim asks for)."""
    containers = (*(spec.get("containers") or []), *(spec.get("initContainers") or []))
    return any(accelerator_resources(container, accelerators) for container in containers)


def bare_pod(source: str, template: JSON) -> JSON:
    """The pod a user (or a controller) would create from `template`, named by the API server."""
    metadata = template.get("metadata") or {}
    spec = copy.deepcopy(template.get("spec") or {})
    spec.pop("priority", None)  # a resolved priority is refused on create; the class name stays
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": "bench-",
            "labels": dict(metadata.get("labels") or {}),
            "annotations": {**(metadata.get("annotations") or {}), "bench.gpuguard.io/source": source},
        },
        "spec": spec,
    }


def corpus_pods(corpus: Path) -> list[JSON]:
    """Every accelerator pod the corpus' manifests would create, as a bare pod."""
    accelerators = default_policy().accelerators
    pods = []
    for path in sorted(corpus.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            template = _pod_template(doc) if isinstance(doc, dict) else None
            if template is not None and is_accelerator_pod(template.get("spec") or {}, accelerators):
                pods.append(bare_pod(f"{path.name}/{doc['kind']}", template))
    return pods


def fallback_pods() -> list[JSON]:
    """bench/payloads.py's 8-GPU pod (serving) and GPU Job's template (batch), as submitted."""
    pod = payloads.gpu_pod()["request"]["object"]
    job = payloads.gpu_job()["request"]["object"]
    return [
        bare_pod("bench/payloads.py gpu_pod", {"metadata": pod["metadata"], "spec": pod["spec"]}),
        bare_pod("bench/payloads.py gpu_job", job["spec"]["template"]),
    ]


def readiness_seconds(pod: JSON) -> tuple[int | None, ...]:
    """tolerationSeconds of the not-ready and unreachable tolerations, in that order."""
    found = readiness_tolerations(pod.get("spec") or {})
    return tuple(seconds for key in READINESS_KEYS for seconds in found[key])


# --- the API server's own histograms ---------------------------------------------------------------------


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram summed over the series that match, or the difference of two scrapes."""

    count: float = 0.0
    total_s: float = 0.0
    buckets: tuple[tuple[float, float], ...] = ()  # (le, cumulative count), ascending

    def __sub__(self, before: Histogram) -> Histogram:
        earlier = dict(before.buckets)
        return Histogram(
            self.count - before.count,
            self.total_s - before.total_s,
            tuple((le, n - earlier.get(le, 0.0)) for le, n in self.buckets),
        )

    @property
    def mean_ms(self) -> float:
        return self.total_s / self.count * 1e3 if self.count else 0.0

    def bound_s(self, quantile: float) -> float:
        """The upper bound of the bucket holding `quantile`: all a histogram knows about it."""
        for le, n in self.buckets:
            if n >= quantile * self.count:
                return le
        return float("inf")


@dataclass(frozen=True)
class Series:
    metric: str
    labels: Mapping[str, str]


# What the report reads from /metrics. Label sets are matched as subsets and summed.
REQUEST = Series("apiserver_request_duration_seconds", {"verb": "POST", "resource": "pods", "group": ""})
ADMIT_STEP = Series(
    "apiserver_admission_step_admission_duration_seconds", {"type": "admit", "operation": "CREATE"}
)
VALIDATE_STEP = Series(
    "apiserver_admission_step_admission_duration_seconds", {"type": "validate", "operation": "CREATE"}
)


def plugin(name: str) -> Series:
    """An admission plugin's own time (the webhook dispatchers and the policy plugin are plugins too)."""
    return Series(
        "apiserver_admission_controller_admission_duration_seconds", {"name": name, "operation": "CREATE"}
    )


def webhook_series(name: str) -> Series:
    return Series(
        "apiserver_admission_webhook_admission_duration_seconds", {"name": name, "operation": "CREATE"}
    )


def policy_check(policy: str) -> Series:
    """Each mutation of a MutatingAdmissionPolicy, evaluated and applied (not its matching)."""
    return Series("apiserver_mutating_admission_policy_check_duration_seconds", {"policy": policy})


FAIL_OPEN = "apiserver_admission_webhook_fail_open_count"
REJECTIONS = "apiserver_admission_webhook_rejection_count"


class Scrape:
    """One GET /metrics of the API server, kept to the metrics the report reads (the whole text is megabytes)."""

    def __init__(self, plane: ControlPlane, metrics: set[str]) -> None:
        status, body = http_get(plane.port, "/metrics", plane.pki.admin_context())
        if status != 200:
            raise RuntimeError(f"the API server's /metrics answered {status}")
        wanted = {f"{m}{suffix}" for m in metrics for suffix in ("", "_bucket", "_sum", "_count")}
        self.text = "\n".join(
            line for line in body.decode().splitlines() if line.partition("{")[0].partition(" ")[0] in wanted
        )

    def _matching(self, name: str, labels: Mapping[str, str]) -> Iterator[tuple[dict[str, str], float]]:
        for sample_labels, value in metric_samples(self.text, name):
            if labels.items() <= sample_labels.items():
                yield sample_labels, value

    def histogram(self, series: Series) -> Histogram:
        buckets: dict[float, float] = {}
        for labels, value in self._matching(f"{series.metric}_bucket", series.labels):
            le = float(labels["le"])
            buckets[le] = buckets.get(le, 0.0) + value
        return Histogram(
            sum(v for _, v in self._matching(f"{series.metric}_count", series.labels)),
            sum(v for _, v in self._matching(f"{series.metric}_sum", series.labels)),
            tuple(sorted(buckets.items())),
        )

    def counter(self, name: str) -> float:
        return sum(value for _, value in self._matching(name, {}))


# --- the extensions --------------------------------------------------------------------------------------


@dataclass
class Extension:
    """One scenario: what admits the pods of its namespace, and how the API server reports on it."""

    key: str
    label: str
    namespace: str
    series: dict[str, Series]  # the extension's own histograms, by the name the report gives them
    mutates: bool
    process: Meter | None = None  # the extension's own process, when it has one


@dataclass
class Meter:
    """A running process of the bench's own, for CPU accounting (bench.common.CpuMeter)."""

    pid: int

    @property
    def running(self) -> bool:
        return Path(f"/proc/{self.pid}").exists()

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.pid)


def _labelled_namespace(plane: ControlPlane, name: str, labels: Mapping[str, str]) -> str:
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": dict(labels)}}
    plane.kubectl("apply", "-f", "-", input=json.dumps(namespace))
    return name


def no_extension(plane: ControlPlane) -> Extension:
    return Extension(
        "a", "(a) no admission extension", _labelled_namespace(plane, "bench-none", {}), {}, False
    )


def install_gpuguard(plane: ControlPlane, work: Path, stack: ExitStack) -> Extension:
    """deploy/ as `kubectl apply -k` sends it, one replica as the Deployment runs it (its flags, its service
    account), and the two webhook configurations pointed at that replica for the bench's namespace only:
    every other setting (failurePolicy, timeout, rules, matchConditions, reinvocation) as deploy/ has it."""
    rendered = render(plane)
    plane.kubectl("apply", "-f", "-", input=json.dumps(namespaces_of(rendered)))
    plane.kubectl("apply", "-k", str(DEPLOY))
    replica = Replica(work / "gpuguard", service_account_kubeconfig(plane, work / "gpuguard.kubeconfig"))
    replica.start()
    stack.callback(replica.stop)
    replica.wait_ready()
    configurations = {
        kind.lower(): doc for doc in rendered if (kind := doc["kind"]).lower() in CONFIGURATION_KINDS
    }
    webhooks = [hook for doc in configurations.values() for hook in doc["webhooks"]]
    # The pods the bench creates reach these two; deploy/ has more (device software) that they never match.
    mutating = next(hook for hook in webhooks if hook["name"] == "mutate.gpuguard.io")
    validating = next(hook for hook in webhooks if hook["name"] == "validate.gpuguard.io")
    if len({hook["failurePolicy"] for hook in webhooks}) != 1:
        raise RuntimeError("deploy/'s webhooks differ in failurePolicy; route_to sets one for all")
    urls = {kind: replica.url(path) for kind, path in ENDPOINTS.items()}
    route_to(plane, urls, failure_policy=mutating["failurePolicy"], namespace_label=GPUGUARD_LABEL)
    namespace = _labelled_namespace(plane, "bench-gpuguard", {GPUGUARD_LABEL: "true"})
    series = {
        f"webhook {mutating['name']}": webhook_series(mutating["name"]),
        f"webhook {validating['name']}": webhook_series(validating["name"]),
    }
    return Extension("b", "(b) gpuguard webhooks", namespace, series, True, Meter(replica.pid))


def install_no_op_webhooks(plane: ControlPlane, work: Path, stack: ExitStack) -> Extension:
    """Scenario (e), the least a webhook costs: `bench/echo.py --work allow` (uvicorn over TLS, as gpuguard
    serves; it finds the uid and allows, changing nothing) behind copies of deploy/'s two webhook
    configurations with every setting kept (rules, matchConditions, failurePolicy, timeouts,
    reinvocation), renamed and pointed at it for the bench's namespace. What (b) pays for being two
    webhooks at all, before gpuguard decides or patches anything."""
    from webhook.certs import tls  # cryptography, for the echo's own CA and certificate

    certs = work / "no-op-certs"
    tls.generate_serving_files(certs, [LOOPBACK])
    (port,) = free_ports(1)
    argv: list[str | Path] = [sys.executable, "-m", "bench.echo", "--work", "allow"]
    argv += ["--port", str(port), "--cert-dir", certs]
    process = spawn(argv, work / "no-op.log", os.environ, cwd=REPO_ROOT)
    stack.callback(process.stop)
    context = ssl.create_default_context(cafile=str(certs / CA_FILE))
    wait_until(
        lambda: http_get(port, "/", context)[0] == 200, timeout=30, what="the no-op webhook", process=process
    )
    ca_bundle = base64.b64encode((certs / CA_FILE).read_bytes()).decode()
    series = {}
    for doc in render(plane):
        kind = doc["kind"].lower()
        if kind not in CONFIGURATION_KINDS:
            continue
        # The two webhooks the bench's pods reach; deploy/'s third (device software in kube-system) never.
        hooks = [hook for hook in doc["webhooks"] if hook["name"] in NO_OP_MIRRORS]
        for hook in hooks:
            hook["name"] = NO_OP_MIRRORS[hook["name"]]
            hook["clientConfig"] = {
                "url": f"https://{LOOPBACK}:{port}{ENDPOINTS[kind]}",
                "caBundle": ca_bundle,
            }
            hook["namespaceSelector"] = {"matchLabels": {NO_OP_LABEL: "true"}}
            series[f"webhook {hook['name']}"] = webhook_series(hook["name"])
        plane.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps(doc | {"metadata": {"name": "bench-no-op"}, "webhooks": hooks}),
        )
    namespace = _labelled_namespace(plane, "bench-no-op", {NO_OP_LABEL: "true"})
    return Extension("e", "(e) no-op webhooks", namespace, series, False, Meter(process.popen.pid))


def install_map(plane: ControlPlane) -> Extension:
    """bench/map/ as written, its binding narrowed to the bench's namespace."""
    docs = [doc for doc in yaml.safe_load_all(MAP_MANIFEST.read_text()) if doc]
    policy = next(doc for doc in docs if doc["kind"] == "MutatingAdmissionPolicy")
    binding = next(doc for doc in docs if doc["kind"] == "MutatingAdmissionPolicyBinding")
    binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"] = {MAP_LABEL: "true"}
    plane.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    namespace = _labelled_namespace(plane, "bench-map", {MAP_LABEL: "true"})
    name = policy["metadata"]["name"]
    return Extension(
        "c", "(c) MutatingAdmissionPolicy", namespace, {f"policy {name}": policy_check(name)}, True
    )


def install_native(plane: ControlPlane) -> Extension:
    """`gpuguard policy compile` of the default policy, every binding narrowed to the bench's namespace. Each
    object renamed, so that no compiled object replaces another scenario's of the same name (the compiled
    readiness MAP once had bench/map/'s, and (c) measured it instead of the hand-written MAP)."""
    objects = compile_policy(default_policy()).objects
    for obj in objects:
        obj["metadata"]["name"] = NATIVE_PREFIX + obj["metadata"]["name"]
        if obj["kind"].endswith("Binding"):
            obj["spec"]["policyName"] = NATIVE_PREFIX + obj["spec"]["policyName"]
            obj["spec"]["matchResources"]["namespaceSelector"] = {"matchLabels": {NATIVE_LABEL: "true"}}
    plane.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
    )
    namespace = _labelled_namespace(plane, "bench-native", {NATIVE_LABEL: "true"})
    series = {
        f"policy {name}": policy_check(name)
        for obj in objects
        if obj["kind"] == "MutatingAdmissionPolicy"
        for name in [obj["metadata"]["name"]]
    }
    return Extension("n", "(n) gpuguard policy compile (native)", namespace, series, True)


def install_hybrid(plane: ControlPlane) -> Extension:
    """Scenario (h), `admission.mode: hybrid` as the controllers' leader leaves it: the default policy
    compiled for hybrid (a policy standing aside where its rule is left to the webhook), and copies of
    (b)'s two webhooks, pointed at the same gpuguard replica, with the match condition the leader adds
    (nativenarrow): gpuguard is called only for what the native policies cannot decide. Installed after
    (b), whose configurations it copies; the replica's CPU is (b)'s."""
    policy = parse_policy("admission: {mode: hybrid}\n")
    objects = compile_policy(policy).objects
    for obj in objects:
        obj["metadata"]["name"] = HYBRID_PREFIX + obj["metadata"]["name"]
        if obj["kind"].endswith("Binding"):
            obj["spec"]["policyName"] = HYBRID_PREFIX + obj["spec"]["policyName"]
            obj["spec"]["matchResources"]["namespaceSelector"] = {"matchLabels": {HYBRID_LABEL: "true"}}
    series = {
        f"policy {obj['metadata']['name']}": policy_check(obj["metadata"]["name"])
        for obj in objects
        if obj["kind"] == "MutatingAdmissionPolicy"
    }
    conditions = narrowing(policy).conditions
    for kind in CONFIGURATION_KINDS:
        configuration = plane.kubectl_json("get", kind, CONFIGURATION)
        condition = conditions[configuration["kind"]]
        # The two webhooks the bench's pods reach, as (e) copies them.
        hooks = [hook for hook in configuration["webhooks"] if hook["name"] in NO_OP_MIRRORS]
        for hook in hooks:
            hook["name"] = hook["name"].replace(".gpuguard.io", ".hybrid.bench.gpuguard.io")
            hook["namespaceSelector"] = {"matchLabels": {HYBRID_LABEL: "true"}}
            if condition is not None:
                hook["matchConditions"] = [
                    *hook.get("matchConditions", []),
                    {"name": CONDITION_NAME, "expression": condition},
                ]
            series[f"webhook {hook['name']}"] = webhook_series(hook["name"])
        objects.append(
            {
                "apiVersion": configuration["apiVersion"],
                "kind": configuration["kind"],
                "metadata": {"name": f"{HYBRID_PREFIX}{CONFIGURATION}"},
                "webhooks": hooks,
            }
        )
    plane.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
    )
    namespace = _labelled_namespace(plane, "bench-hybrid", {HYBRID_LABEL: "true"})
    return Extension("h", "(h) gpuguard hybrid (native + narrowed webhooks)", namespace, series, True)


def install_kyverno(plane: ControlPlane, build: Path, work: Path, stack: ExitStack) -> Extension:
    """Kyverno's admission controller (bench/kyverno/build.sh's build) as a process outside the cluster,
    the way its own docs run it for development (`--serverIP`: webhook URLs on loopback instead of its
    Service), with the Helm chart's defaults where they touch admission: events for PolicyApplied and
    PolicySkipped omitted. Admission reports are off: Kyverno writes them after answering, and without
    its reports controller (not run here) they pile up. Its webhooks select the bench's namespace only
    (the `webhooks` key of its ConfigMap); bench/kyverno/'s ClusterPolicy does the mutation."""
    plane.kubectl("apply", "--server-side", "-R", "-f", str(build / "crds"))
    configmaps = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": KYVERNO_NAMESPACE},
            "data": data,
        }
        for name, data in (
            (
                "kyverno",
                {"webhooks": json.dumps({"namespaceSelector": {"matchLabels": {KYVERNO_LABEL: "true"}}})},
            ),
            ("kyverno-metrics", {}),
        )
    ]
    _labelled_namespace(plane, KYVERNO_NAMESPACE, {})
    plane.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": configmaps})
    )
    port, metrics_port, profile_port = free_ports(3)
    env = without_proxies() | {
        "KYVERNO_NAMESPACE": KYVERNO_NAMESPACE,
        "KYVERNO_POD_NAME": "kyverno-bench",
        "KYVERNO_SERVICEACCOUNT_NAME": "kyverno-admission-controller",
        "KYVERNO_DEPLOYMENT": "kyverno-admission-controller",
        "KYVERNO_SVC": "kyverno-svc",
        "INIT_CONFIG": "kyverno",
        "METRICS_CONFIG": "kyverno-metrics",
    }
    argv: list[str | Path] = [
        build / "kyverno",
        f"--kubeconfig={plane.kubeconfig}",
        f"--serverIP={LOOPBACK}:{port}",
        f"--webhookServerHost={LOOPBACK}",
        f"--webhookServerPort={port}",
        f"--metricsPort={metrics_port}",
        f"--profilePort={profile_port}",
        "--controllerRuntimeMetricsAddress=0",
        "--caSecretName=kyverno-svc.kyverno.svc.kyverno-tls-ca",
        "--tlsSecretName=kyverno-svc.kyverno.svc.kyverno-tls-pair",
        "--webhookTimeout=3",  # deploy/'s timeoutSeconds for gpuguard
        "--omitEvents=PolicyApplied,PolicySkipped",
        "--admissionReports=false",
        "--loggingFormat=json",
    ]
    process = spawn(argv, work / "kyverno.log", env, cwd=work)
    stack.callback(process.stop)
    # The policy webhook validating ClusterPolicies is Kyverno's own: the apply works once it answers.
    policy = KYVERNO_POLICY.read_text()

    def applied() -> bool:
        return plane.kubectl("apply", "-f", "-", input=policy, check=False).returncode == 0

    wait_until(applied, timeout=120, what="Kyverno accepting its ClusterPolicy", process=process)
    namespace = _labelled_namespace(plane, "bench-kyverno", {KYVERNO_LABEL: "true"})
    webhook = "mutate.kyverno.svc-ignore"  # the ClusterPolicy's failurePolicy: Ignore
    return Extension(
        "d",
        "(d) Kyverno ClusterPolicy",
        namespace,
        {f"webhook {webhook}": webhook_series(webhook)},
        True,
        Meter(process.popen.pid),
    )


# --- the load --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    due: float  # when the create was due (open loop) or sent (closed loop)
    sent: float
    done: float
    status: int
    body: bytes
    template: int

    @property
    def latency_ms(self) -> float:
        return (self.done - self.due) * 1e3

    @property
    def created(self) -> bool:
        return self.status == 201


class _Batch:
    """The samples of one load run, from every connection; `finished` is set when all its jobs are done."""

    def __init__(self, jobs: int) -> None:
        self.samples: list[Sample] = []
        self._left = jobs
        self._lock = threading.Lock()
        self.finished = threading.Event()

    def add(self, sample: Sample) -> None:
        with self._lock:
            self.samples.append(sample)

    def job_done(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self.finished.set()


@dataclass(frozen=True)
class _Job:
    path: str
    bodies: Sequence[bytes]
    template: int
    due: float
    batch: _Batch
    until: float | None = None  # closed loop: create again and again until then


class Creators:
    """Keep-alive HTTPS connections to the API server as its admin, one thread each, taking creates from a
    queue: the open loop puts each create there at its slot, whichever connection is free sends it."""

    def __init__(self, plane: ControlPlane, size: int) -> None:
        self.plane = plane
        self.context = plane.pki.admin_context()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, daemon=True) for _ in range(size)]

    def __enter__(self) -> Creators:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        for _thread in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join(timeout=30)

    def _connect(self, timeout_s: float = 30) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(LOOPBACK, self.plane.port, context=self.context, timeout=timeout_s)

    def _work(self) -> None:
        connection: http.client.HTTPSConnection | None = None
        while (job := self._jobs.get()) is not None:
            template = job.template
            while True:
                sent = time.perf_counter()
                try:
                    connection = connection or self._connect()
                    connection.request("POST", job.path, job.bodies[template], HEADERS)
                    response = connection.getresponse()
                    status, body = response.status, response.read()
                except (OSError, http.client.HTTPException) as exc:
                    status, body = 0, repr(exc).encode()
                    if connection is not None:
                        connection.close()
                    connection = None
                done = time.perf_counter()
                job.batch.add(
                    Sample(job.due if job.until is None else sent, sent, done, status, body, template)
                )
                if job.until is None or done >= job.until:
                    break
                template = (template + 1) % len(job.bodies)
            job.batch.job_done()
        if connection is not None:
            connection.close()

    def open_loop(self, namespace: str, bodies: Sequence[bytes], rate: float, seconds: float) -> list[Sample]:
        """`rate` creates a second for `seconds`, each sent at its slot (or as soon as a connection is free)."""
        count = max(1, round(rate * seconds))
        batch, path = _Batch(count), f"/api/v1/namespaces/{namespace}/pods"
        start = time.perf_counter() + 0.01
        for i in range(count):
            due = start + i / rate
            pause = due - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            self._jobs.put(_Job(path, bodies, i % len(bodies), due, batch))
        if not batch.finished.wait(timeout=seconds + 60):
            raise RuntimeError(f"creates in {namespace} still unanswered a minute after the run")
        return batch.samples

    def closed_loop(
        self, namespace: str, bodies: Sequence[bytes], connections: int, seconds: float
    ) -> list[Sample]:
        """`connections` creates in flight at all times, for `seconds`: the most the setup can take."""
        batch, path = _Batch(connections), f"/api/v1/namespaces/{namespace}/pods"
        until = time.perf_counter() + seconds
        for i in range(connections):
            self._jobs.put(_Job(path, bodies, i % len(bodies), 0.0, batch, until=until))
        if not batch.finished.wait(timeout=seconds + 60):
            raise RuntimeError(f"creates in {namespace} still unanswered a minute after the run")
        return batch.samples

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """One request on a connection of its own (setup and clean-up, outside any measurement). Deleting
        the 2,000 pods of a 200/s run can take minutes on a busy machine: the timeout allows for it."""
        connection = self._connect(timeout_s=CLEAN_UP_TIMEOUT_S)
        try:
            connection.request(method, path, body, HEADERS)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()


# --- one measurement ---------------------------------------------------------------------------------


@dataclass
class Run:
    """One bounded load run against one extension: the samples, the API server's histograms over the run,
    and the CPU the control plane and the extension spent meanwhile."""

    samples: list[Sample]
    histograms: dict[str, Histogram]
    fail_open: float
    rejections: float
    plane_cpu_s: float
    extension_cpu_s: float
    client_cpu_s: float  # the bench's own process: its creating threads, and the scheduling one
    noise: float = 0.0

    @property
    def created(self) -> list[Sample]:
        return [s for s in self.samples if s.created]

    @property
    def errors(self) -> list[Sample]:
        return [s for s in self.samples if not s.created]

    @property
    def seconds(self) -> float:
        return max(s.done for s in self.samples) - min(s.due for s in self.samples)

    @property
    def rate(self) -> float:
        return len(self.created) / self.seconds if self.seconds else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


class Bench:
    def __init__(self, plane: ControlPlane, creators: Creators, bodies: list[bytes], warmup_s: float) -> None:
        self.plane = plane
        self.creators = creators
        self.bodies = bodies
        self.warmup_s = warmup_s
        self.plane_meters = [Meter(pid) for pid in plane.pids]

    def measure(
        self, extension: Extension, load: Callable[[], list[Sample]], warmup: Callable[[], object]
    ) -> Run:
        warmup()  # keep-alive connections to the API server and from it to a webhook, and the caches
        series = {"request": REQUEST, "admit step": ADMIT_STEP, "validate step": VALIDATE_STEP}
        series |= {name: plugin(name) for name in PLUGINS} | extension.series
        metrics = {s.metric for s in series.values()} | {FAIL_OPEN, REJECTIONS}
        before = Scrape(self.plane, metrics)
        plane_cpu, extension_cpu, client_cpu = self._plane_cpu(), self._cpu(extension), _client_cpu()
        samples = load()
        plane_cpu, extension_cpu, client_cpu = (
            self._plane_cpu() - plane_cpu,
            self._cpu(extension) - extension_cpu,
            _client_cpu() - client_cpu,
        )
        after = Scrape(self.plane, metrics)
        self.delete_pods(extension.namespace)
        return Run(
            samples,
            {name: after.histogram(s) - before.histogram(s) for name, s in series.items()},
            after.counter(FAIL_OPEN) - before.counter(FAIL_OPEN),
            after.counter(REJECTIONS) - before.counter(REJECTIONS),
            plane_cpu,
            extension_cpu,
            client_cpu,
        )

    def at_rate(self, extension: Extension, rate: float, seconds: float) -> Run:
        return self.measure(
            extension,
            lambda: self.creators.open_loop(extension.namespace, self.bodies, rate, seconds),
            lambda: self.creators.open_loop(extension.namespace, self.bodies, rate, self.warmup_s),
        )

    def saturated(self, extension: Extension, seconds: float) -> Run:
        return self.measure(
            extension,
            lambda: self.creators.closed_loop(
                extension.namespace, self.bodies, SATURATION_CONNECTIONS, seconds
            ),
            lambda: self.creators.closed_loop(
                extension.namespace, self.bodies, SATURATION_CONNECTIONS, self.warmup_s
            ),
        )

    def delete_pods(self, namespace: str) -> None:
        # No pod is bound to a node here, so a delete removes it at once: the next run starts as empty.
        status, body = self.creators.request("DELETE", f"/api/v1/namespaces/{namespace}/pods")
        if status != 200:
            raise RuntimeError(f"deleting the pods of {namespace} answered {status}: {body[:300]!r}")

    def _plane_cpu(self) -> float:
        return sum(meter.cpu_seconds() for meter in self.plane_meters)

    @staticmethod
    def _cpu(extension: Extension) -> float:
        return extension.process.cpu_seconds() if extension.process is not None else 0.0


def _client_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


PLUGINS = ("MutatingAdmissionWebhook", "ValidatingAdmissionWebhook", "MutatingAdmissionPolicy")


# --- proving that the extensions mutate --------------------------------------------------------------


def wait_until_mutating(
    creators: Creators, extension: Extension, probe: bytes, timeout: float = 30.0
) -> None:
    """Dry-runs a GPU pod until it comes back without the 300 s default: the API server has picked up the
    webhook configuration or the binding (its informers take a moment)."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        status, body = creators.request(
            "POST", f"/api/v1/namespaces/{extension.namespace}/pods?dryRun=All", probe
        )
        if status == 201 and API_SERVER_DEFAULT_SECONDS not in readiness_seconds(orjson.loads(body)):
            return
        last = f"{status}: {body[:300]!r}"
        time.sleep(0.2)
    raise TimeoutError(
        f"{extension.label} did not mutate a GPU pod within {timeout:.0f} s; last answer {last}"
    )


def admitted_everywhere(creators: Creators, pods: list[JSON], extensions: list[Extension]) -> list[JSON]:
    """The pods every scenario admits (a dry run in each namespace): a corpus pod refused for a reason of its
    own (an unfilled placeholder, a class that does not exist) would only measure the refusal."""
    kept = []
    for pod in pods:
        body = orjson.dumps(pod)
        answers = [
            creators.request("POST", f"/api/v1/namespaces/{e.namespace}/pods?dryRun=All", body)[0]
            for e in extensions
        ]
        if all(status == 201 for status in answers):
            kept.append(pod)
    return kept


@dataclass
class Mutations:
    """The readiness tolerations the created pods came back with, by extension and pod template."""

    seen: dict[str, dict[int, set[tuple[int | None, ...]]]] = field(default_factory=dict)
    pods: dict[str, int] = field(default_factory=dict)
    sources: dict[int, str] = field(default_factory=dict)

    def record(self, extension: Extension, run: Run) -> None:
        by_template = self.seen.setdefault(extension.key, {})
        for sample in run.created:
            created = orjson.loads(sample.body)
            by_template.setdefault(sample.template, set()).add(readiness_seconds(created))
            self.sources[sample.template] = (
                created["metadata"].get("annotations", {}).get("bench.gpuguard.io/source", "")
            )
        self.pods[extension.key] = self.pods.get(extension.key, 0) + len(run.created)

    def verdict(self, extension: Extension, reference: str | None) -> tuple[bool, str]:
        """Whether every pod of `extension` came back as gpuguard (the `reference` extension) leaves it; with
        no reference, whether each came back settled and without the API server's default."""
        mine, theirs = self.seen.get(extension.key, {}), self.seen.get(reference or "", {})
        if not mine:
            return False, "no pod created"
        unsettled = [t for t, values in mine.items() if len(values) != 1]
        if unsettled:
            return False, f"templates {unsettled} came back with different tolerations"
        defaulted = [t for t, (values,) in mine.items() if API_SERVER_DEFAULT_SECONDS in values]
        if defaulted:
            return False, f"templates {defaulted} kept the API server's {API_SERVER_DEFAULT_SECONDS} s"
        if reference is None:
            return (
                True,
                f"{self.pods[extension.key]:,} pods, all {len(mine)} templates settled (gpuguard not run)",
            )
        # A short run may create no pod of some templates in one scenario: only templates both created
        # can be compared (at least one, or the comparison says nothing).
        shared = [t for t in mine if t in theirs]
        if not shared:
            return False, "no pod template created in both scenarios"
        differ = [t for t in shared if theirs[t] != mine[t]]
        if differ:
            return False, f"templates {differ} differ from gpuguard's: " + "; ".join(
                f"{self.sources.get(t, t)}: {sorted(mine[t])} vs {sorted(theirs.get(t, set()))}"
                for t in differ
            )
        return (
            True,
            f"{self.pods[extension.key]:,} pods, all {len(shared)} templates both created as gpuguard leaves them",
        )


# --- the run -----------------------------------------------------------------------------------------


@dataclass
class Results:
    extensions: list[Extension]
    rates: list[float]
    sources: str
    templates: int
    runs: dict[tuple[str, float], list[Run]] = field(default_factory=dict)
    saturation: dict[str, Run] = field(default_factory=dict)
    mutations: Mutations = field(default_factory=Mutations)
    version: str = ""
    setup_s: float = 0.0
    seconds: float = 0.0
    other_cpu_s: float = 0.0

    def pooled(self, key: str, rate: float) -> list[Sample]:
        return [s for run in self.runs[(key, rate)] for s in run.samples]

    def histogram(self, key: str, rate: float, name: str) -> Histogram:
        total = Histogram()
        for run in self.runs[(key, rate)]:
            h = run.histograms.get(name, Histogram())
            merged = dict(total.buckets)
            for le, n in h.buckets:
                merged[le] = merged.get(le, 0.0) + n
            total = Histogram(total.count + h.count, total.total_s + h.total_s, tuple(sorted(merged.items())))
        return total


def load_pods(corpus: Path) -> tuple[list[JSON], str]:
    if corpus.is_dir():
        pods = corpus_pods(corpus)
        if pods:
            return pods, f"the accelerator workloads of {corpus.name}/ ({len(pods)} pod templates)"
    return fallback_pods(), "bench/payloads.py (no corpus found)"


def install_priority_classes(plane: ControlPlane, pods: list[JSON]) -> None:
    """The classes the pods name and the cluster lacks (gpuguard's own come with deploy/)."""
    names = {p["spec"]["priorityClassName"] for p in pods if p["spec"].get("priorityClassName")}
    existing = {c["metadata"]["name"] for c in plane.kubectl_json("get", "priorityclasses")["items"]}
    items = [
        {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": n},
            "value": CORPUS_PRIORITY,
        }
        for n in sorted(names - existing)
    ]
    if items:
        plane.kubectl(
            "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
        )


def install(
    args: argparse.Namespace, plane: ControlPlane, work: Path, stack: ExitStack, say: Callable[[str], None]
) -> list[Extension]:
    """The scenarios args.scenarios names, (a) first."""
    extensions = [no_extension(plane)]
    if "b" in args.scenarios:
        say("installing deploy/ and one gpuguard replica")
        extensions.append(install_gpuguard(plane, work, stack))
    else:
        # The class the policy's priority rule names ships with deploy/.
        plane.kubectl("apply", "-f", str(DEPLOY / "base" / "priorityclasses.yaml"))
    if "c" in args.scenarios:
        say("applying bench/map/")
        extensions.append(install_map(plane))
    if "n" in args.scenarios:
        say("applying `gpuguard policy compile` of the default policy")
        extensions.append(install_native(plane))
    if "h" in args.scenarios:
        say("applying hybrid: the policy compiled for it, and (b)'s webhooks narrowed")
        extensions.append(install_hybrid(plane))
    if args.kyverno is not None:
        say(f"starting Kyverno from {args.kyverno}")
        extensions.append(install_kyverno(plane, args.kyverno, work, stack))
    if "e" in args.scenarios:
        say("starting the no-op webhooks")
        extensions.append(install_no_op_webhooks(plane, work, stack))
    return extensions


def run(args: argparse.Namespace, say: Callable[[str], None] = SAY) -> Results:
    began = time.perf_counter()
    busy_before, own_before = busy_seconds()[0], own_seconds()
    work = Path(tempfile.mkdtemp(prefix="gpuguard-bench-admission-"))
    try:
        with ExitStack() as stack:
            say(f"control plane from {args.k8s_bin}")
            plane = ControlPlane.start(args.k8s_bin, work / "controlplane")
            stack.callback(plane.stop)
            creators = stack.enter_context(Creators(plane, CONNECTIONS))
            extensions = install(args, plane, work, stack, say)
            pods, sources = load_pods(args.corpus)
            install_priority_classes(plane, pods)
            probe = orjson.dumps(fallback_pods()[0])
            for extension in extensions:
                if extension.mutates:
                    wait_until_mutating(creators, extension, probe)
            pods = admitted_everywhere(creators, pods, extensions)
            if not pods:
                raise RuntimeError("no GPU pod is admitted in every scenario")
            results = Results(extensions, args.rates, sources, len(pods), version=plane.version)
            bench = Bench(plane, creators, [orjson.dumps(pod) for pod in pods], args.warmup)
            meters = [*bench.plane_meters, *(e.process for e in extensions if e.process is not None)]
            results.setup_s = time.perf_counter() - began
            if args.wait_quiet > 0:
                wait_for_quiet(args.wait_quiet, say, servers=meters)

            def quiet(what: str, measure: Callable[[], Run]) -> Run:
                measured, noise = quietly(meters, say, what, measure, args.wait_quiet, args.attempts)
                measured.noise = noise
                return measured

            for round_ in range(args.rounds):
                for rate in args.rates:
                    # Each round starts the order one further on, so no scenario always follows another.
                    order = extensions[round_ % len(extensions) :] + extensions[: round_ % len(extensions)]
                    for extension in order:
                        what = f"{extension.label} at {rate:g} creates/s"
                        say(f"round {round_ + 1}/{args.rounds}, {what}: {args.duration:g} s")
                        measured = quiet(
                            what, functools.partial(bench.at_rate, extension, rate, args.duration)
                        )
                        results.runs.setdefault((extension.key, rate), []).append(measured)
                        results.mutations.record(extension, measured)
            for extension in extensions:
                what = f"{extension.label}, {SATURATION_CONNECTIONS} creates in flight"
                say(f"saturation, {what}: {args.saturation:g} s")
                measured = quiet(what, functools.partial(bench.saturated, extension, args.saturation))
                results.saturation[extension.key] = measured
                results.mutations.record(extension, measured)
    finally:
        if args.keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    results.seconds = time.perf_counter() - began
    results.other_cpu_s = max(0.0, busy_seconds()[0] - busy_before - (own_seconds() - own_before))
    return results


# --- the report ------------------------------------------------------------------------------------------


def _delta(value: float) -> str:
    return f"{value:+.2f}" if abs(value) < 10 else f"{value:+.1f}"


def _floor_rate(results: Results) -> float:
    """The rate the latency floors are judged at: theirs when it was run, else the highest that was."""
    return FLOOR_RATE if FLOOR_RATE in results.rates else max(results.rates)


def _latencies(results: Results, key: str, rate: float) -> list[float]:
    """Client latencies, ms, of the pods scenario `key` created at `rate`, every run pooled."""
    return [s.latency_ms for s in results.pooled(key, rate) if s.created]


def _added_ms(results: Results, key: str, over: str, rate: float) -> tuple[float, float]:
    """What scenario `key` adds over scenario `over` at `rate`: p50 and p99 of the created pods, ms."""
    mine, theirs = _latencies(results, key, rate), _latencies(results, over, rate)
    return (
        percentile(mine, 0.5) - percentile(theirs, 0.5),
        percentile(mine, 0.99) - percentile(theirs, 0.99),
    )


def floors(results: Results) -> list[tuple[str, str, bool]]:
    """The floors the scenarios run can judge (--scenarios may leave some out)."""
    rate = _floor_rate(results)
    ran = {extension.key for extension in results.extensions}
    all_runs = [run for runs in results.runs.values() for run in runs] + list(results.saturation.values())
    errors = sum(len(run.errors) for run in all_runs)
    creates = sum(len(run.samples) for run in all_runs)
    fail_open = sum(run.fail_open for run in all_runs)
    checks = []
    if "b" in ran:
        base, guard = _latencies(results, "a", rate), _latencies(results, "b", rate)
        p50, p99 = _added_ms(results, "b", "a", rate)
        checks += [
            (
                f"gpuguard adds ≤ {FLOOR_P50_MS:g} ms at p50 over (a), {rate:g} creates/s",
                f"{_delta(p50)} ms ({fmt_ms(percentile(guard, 0.5))} vs {fmt_ms(percentile(base, 0.5))} ms)",
                p50 <= FLOOR_P50_MS,
            ),
            (
                f"gpuguard adds ≤ {FLOOR_P99_MS:g} ms at p99 over (a), {rate:g} creates/s",
                f"{_delta(p99)} ms ({fmt_ms(percentile(guard, 0.99))} vs {fmt_ms(percentile(base, 0.99))} ms)",
                p99 <= FLOOR_P99_MS,
            ),
        ]
    checks.append(
        (
            "No create fails (every scenario, rate and saturation run)",
            f"{errors} failed of {creates:,}; webhook calls failed open: {fail_open:.0f}",
            errors == 0 and fail_open == 0,
        )
    )
    if {"c", "n"} <= ran:
        map_p50, map_p99 = _added_ms(results, "c", "a", rate)
        native_p50, native_p99 = _added_ms(results, "n", "a", rate)
        for quantile, native, by_map in (("p50", native_p50, map_p50), ("p99", native_p99, map_p99)):
            checks.append(
                (
                    f"native adds ≤ (c) + {NATIVE_OVER_MAP - 1:.0%} at {quantile} over (a), {rate:g} creates/s",
                    f"{_delta(native)} ms vs (c) {_delta(by_map)} ms",
                    native <= by_map * NATIVE_OVER_MAP,
                )
            )
    for extension in results.extensions:
        if extension.mutates:
            ok, why = results.mutations.verdict(extension, "b" if "b" in ran else None)
            checks.append((f"{extension.label} mutates the created pods", why, ok))
    return checks


def report(results: Results, command: str) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"Run {now} on {platform.node() or 'localhost'}: {cpu_model()}, {os.cpu_count()} cores, "
        f"{platform.system()} {platform.release()}; Python {platform.python_version()}; "
        f"kube-apiserver {results.version} with etcd, gpuguard and the bench's client on the same machine, "
        f"none pinned. Pods: {results.sources}, {results.templates} admitted in every scenario, created in turn. "
        f"Took {results.seconds:.0f} s ({results.setup_s:.0f} s to start and install everything); other processes used {results.other_cpu_s:.1f} CPU s "
        f"({results.other_cpu_s / results.seconds * 100:.0f}% of a core) meanwhile.",
        "",
        f"Command: `{command}`",
        "",
        "Client-observed pod creates (open loop: latency from the moment each create was due; "
        f"{len(next(iter(results.runs.values())))} interleaved runs pooled per row; a policy's CPU is the "
        "API server's):",
        "",
        "| Admission | Offered | Created/s | p50 ms | p99 ms | max ms | vs (a): p50 / p99 ms | Failed "
        "| CPU ms per create: API server + etcd / extension / client | Others' CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rate in results.rates:
        base = _latencies(results, "a", rate)
        for extension in results.extensions:
            runs = results.runs[(extension.key, rate)]
            latencies = [s.latency_ms for run in runs for s in run.created]
            created = sum(len(run.created) for run in runs)
            versus = (
                "—"
                if extension.key == "a"
                else f"{_delta(percentile(latencies, 0.5) - percentile(base, 0.5))} / "
                f"{_delta(percentile(latencies, 0.99) - percentile(base, 0.99))}"
            )
            plane_cpu = sum(run.plane_cpu_s for run in runs) / created * 1e3
            own_cpu = sum(run.extension_cpu_s for run in runs) / created * 1e3
            client_cpu = sum(run.client_cpu_s for run in runs) / created * 1e3
            lines.append(
                f"| {extension.label} | {rate:g}/s | {statistics.mean(run.rate for run in runs):,.1f} "
                f"| {fmt_ms(percentile(latencies, 0.5))} | {fmt_ms(percentile(latencies, 0.99))} "
                f"| {fmt_ms(max(latencies))} | {versus} | {sum(len(run.errors) for run in runs)} "
                f"| {plane_cpu:.2f} / {'—' if extension.process is None else f'{own_cpu:.2f}'} / {client_cpu:.2f} "
                f"| {max(run.noise for run in runs):.0%} |"
            )
    lines += [
        "",
        f"Saturation ({SATURATION_CONNECTIONS} creates in flight, closed loop):",
        "",
        "| Admission | Created/s | p50 ms | p99 ms | Failed | Others' CPU |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for extension in results.extensions:
        run = results.saturation[extension.key]
        latencies = [s.latency_ms for s in run.created]
        lines.append(
            f"| {extension.label} | {run.rate:,.0f} | {fmt_ms(percentile(latencies, 0.5))} "
            f"| {fmt_ms(percentile(latencies, 0.99))} | {len(run.errors)} | {run.noise:.0%} |"
        )
    rate = max(results.rates)
    lines += [
        "",
        f"The API server's own histograms at {rate:g} creates/s (means from _sum/_count; its buckets start at "
        "5 ms for requests, admission steps and webhooks, and at 0.5 µs, then 1 ms, for policy checks, so "
        "the bound column is the bucket the p99 falls in):",
        "",
        "| Admission | Histogram | Observations | Mean ms | p99 ≤ |",
        "|---|---|---:|---:|---:|",
    ]
    for extension in results.extensions:
        names = ["request", "admit step", "validate step", *PLUGINS, *extension.series]
        for name in names:
            h = results.histogram(extension.key, rate, name)
            if not h.count:
                continue
            bound = h.bound_s(0.99)
            lines.append(
                f"| {extension.label} | {_histogram_label(name)} | {h.count:,.0f} | {h.mean_ms:.3f} "
                f"| {'—' if bound == float('inf') else f'{bound * 1e3:g} ms'} |"
            )
    lines += ["", "Floors:", "", "| Floor | Measured | |", "|---|---|---|"]
    for name, measured, met in floors(results):
        lines.append(f"| {name} | {measured} | {'met' if met else '**missed**'} |")
    return "\n".join([*lines, "", *webhook_share(results)]) + "\n"


def webhook_share(results: Results) -> list[str]:
    """Splits what (b) adds into what any two webhooks cost on this machine, scenario (e), and the rest."""
    if not {"b", "e"} <= {extension.key for extension in results.extensions}:
        return []
    rate = _floor_rate(results)
    any_p50, any_p99 = _added_ms(results, "e", "a", rate)
    own_p50, own_p99 = _added_ms(results, "b", "e", rate)
    within = any_p50 <= FLOOR_P50_MS and any_p99 <= FLOOR_P99_MS
    return [
        f"Where (b)'s latency goes at {rate:g} creates/s: two webhooks that do nothing, configured as "
        f"deploy/'s, add {_delta(any_p50)} ms at p50 and {_delta(any_p99)} ms at p99 over (a), "
        f"{'within' if within else 'beyond'} the floors by themselves; gpuguard's own work adds "
        f"{_delta(own_p50)} / {_delta(own_p99)} ms over them.",
    ]


def _histogram_label(name: str) -> str:
    if name == "request":
        return f"`{REQUEST.metric}` POST pods"
    if name in ("admit step", "validate step"):
        return f"`{ADMIT_STEP.metric}` {name.split()[0]}"
    if name in PLUGINS:
        return f"`{plugin(name).metric}` {name}"
    kind, _, subject = name.partition(" ")
    metric = webhook_series(subject).metric if kind == "webhook" else policy_check(subject).metric
    return f"`{metric}` {subject}"


SCENARIOS = ("a", "b", "c", "n", "h", "e")


def _scenarios(text: str) -> set[str]:
    chosen = {part for part in text.split(",") if part} | {"a"}
    if chosen - set(SCENARIOS):
        raise argparse.ArgumentTypeError(f"scenarios are {', '.join(SCENARIOS)}, not {text!r}")
    if "h" in chosen and "b" not in chosen:
        raise argparse.ArgumentTypeError("(h) copies (b)'s webhooks: run b with it")
    return chosen


def _rates(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench admission", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--k8s-bin", type=Path, default=Path(os.environ.get("GPUGUARD_K8S_BIN", "")),
                        help="folder of kube-apiserver, etcd and kubectl (bench/run passes build.sh's)")  # fmt: skip
    parser.add_argument(
        "--rates", type=_rates, default=[50.0, 200.0], help="creates per second (default 50,200)"
    )
    parser.add_argument("--duration", type=float, default=10, help="seconds per run (default 10)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved runs per scenario and rate (default 3)"
    )
    parser.add_argument(
        "--saturation", type=float, default=10, help="seconds of the closed-loop run (default 10)"
    )
    parser.add_argument(
        "--attempts",
        type=int,
        default=3,
        help="runs of a measurement at most, while other processes take over 15%% of a core (default 3)",
    )
    parser.add_argument("--warmup", type=float, default=1, help="seconds of warm-up before each run")
    parser.add_argument(
        "--corpus", type=Path, default=corpus.CORPUS, help=f"GPU manifests (default {corpus.CORPUS})"
    )
    parser.add_argument(
        "--kyverno",
        type=Path,
        help="add scenario (d): Kyverno from this bench/kyverno/build.sh folder (bench/run --with-kyverno)",
    )
    parser.add_argument(
        "--scenarios",
        type=_scenarios,
        default=",".join(SCENARIOS),
        help=f"which to run, (a) always, (h) only with (b) (default {','.join(SCENARIOS)};"
        " (d) comes with --kyverno)",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("admission-results.md"))
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    parser.add_argument(
        "--wait-quiet", type=float, default=120, help="seconds to wait at most for other load"
    )
    args = parser.parse_args(argv)
    # The processes start in the run's work directory: paths given relative to here must not move.
    args.k8s_bin = args.k8s_bin.resolve()
    args.kyverno = args.kyverno.resolve() if args.kyverno is not None else None
    if not (args.k8s_bin / "kube-apiserver").is_file():
        sys.exit(
            "bench admission: --k8s-bin (or GPUGUARD_K8S_BIN) must name the built control plane; bench/run does"
        )
    if args.wait_quiet > 0:
        wait_for_quiet(args.wait_quiet, SAY)
    results = run(args)
    command = "bench/run admission" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    text = report(results, command)
    args.out.write_text(text)
    print(text)
    return 0 if all(met for _, _, met in floors(results)) else FLOOR_MISSED


if __name__ == "__main__":
    sys.exit(main())
