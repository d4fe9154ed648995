"""The real gpuguard server as a subprocess, and its registration with a ControlPlane."""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import re
import secrets
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from tests.harness import REPO_ROOT, manifests
from tests.harness.controlplane import (
    LOOPBACK,
    POLL_INTERVAL,
    ControlPlane,
    Process,
    free_ports,
    http_get,
    spawn,
    wait_until,
    without_proxies,
)
from webhook.policy.model import parse_policy

CONFIG_NAME = "gpuguard-e2e"
MUTATING_WEBHOOK = "mutate.gpuguard.io"
VALIDATING_WEBHOOK = "validate.gpuguard.io"
ANNOTATION_PREFIX = "gpuguard.io/"
RULES_ANNOTATION = f"{ANNOTATION_PREFIX}rules"
READINESS_KEYS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
API_SERVER_DEFAULT_SECONDS = 300  # kube-apiserver's --default-*-toleration-seconds
# What the embedded default policy (webhook/default-policy.yaml) promises, as a user reads it in the README.
SERVING_SECONDS = 600
BATCH_SECONDS = 1800
PRE_STOP = {"sleep": {"seconds": 10}}
GRACE_SECONDS = 60  # max(minGracePeriodSeconds 60, preStop 10 + marginSeconds 20)
IMAGE = "registry.k8s.io/pause:3.10"

FailurePolicy = Literal["Fail", "Ignore"]
# A namespace carrying this label belongs to another gpuguard under test (the value names its webhook
# configuration): the session's registration leaves it alone, so no object is mutated by two gpuguards.
OWNER_LABEL = "gpuguard-e2e/webhook"


class WebhookProcess:
    """`python -m webhook serve` on a fixed loopback port and cert dir.

    Port and certificates survive `restart`, so the registered URL and caBundle stay valid.
    """

    def __init__(
        self, workdir: Path, python: str = sys.executable, *, extra_args: Sequence[str] = ()
    ) -> None:
        self.python = python
        self.extra_args = tuple(extra_args)  # passed to `serve` on every start (--kubeconfig, ...)
        self.cert_dir = workdir / "certs"
        self.log_path = workdir / "gpuguard.log"
        (self.port,) = free_ports(1)
        self.url = f"https://{LOOPBACK}:{self.port}"
        self.policy_path: Path | None = None
        self._process: Process | None = None

    @property
    def ca_bundle_b64(self) -> str:
        return base64.b64encode((self.cert_dir / "ca.crt").read_bytes()).decode()

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.running()

    def start(self, policy_path: Path | None = None, timeout: float = 30.0) -> None:
        if self.running:
            raise RuntimeError("gpuguard is already running")
        argv = [self.python, "-m", "webhook", "serve", "--host", LOOPBACK, "--port", str(self.port)]
        argv += ["--cert-dir", str(self.cert_dir)]
        if policy_path is not None:
            argv += ["--policy", str(policy_path)]
        argv += self.extra_args
        self.policy_path = policy_path
        with self.log_path.open("a") as log:  # the log spans restarts; mark where each one begins
            log.write(f"# e2e: {' '.join(argv)}\n")
        # Run from the source tree whether or not the package is installed into the interpreter.
        env = without_proxies()  # the kubernetes client would send its API calls through a proxy
        env["PYTHONPATH"] = f"{REPO_ROOT}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(REPO_ROOT)
        self._process = spawn(argv, self.log_path, env, cwd=REPO_ROOT)
        try:
            wait_until(self._ready, timeout=timeout, what="gpuguard /readyz", process=self._process)
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        ca = self.cert_dir / "ca.crt"
        if not ca.is_file():  # the server writes its certificates before it listens
            return False
        return http_get(self.port, "/readyz", ssl.create_default_context(cafile=str(ca)))[0] == 200

    def metrics(self) -> str:
        """GET /metrics: gpuguard's Prometheus text."""
        context = ssl.create_default_context(cafile=str(self.cert_dir / "ca.crt"))
        status, body = http_get(self.port, "/metrics", context)
        if status != 200:
            raise RuntimeError(f"gpuguard /metrics answered {status}")
        return body.decode()

    def request_json(self, method: str, path: str, payload: Any = None) -> Any:
        """One HTTPS request to gpuguard (a JSON body when `payload` is given); the JSON answer."""
        context = ssl.create_default_context(cafile=str(self.cert_dir / "ca.crt"))
        conn = http.client.HTTPSConnection(LOOPBACK, self.port, timeout=10, context=context)
        try:
            body = None if payload is None else json.dumps(payload)
            conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        if response.status != 200:
            raise RuntimeError(f"gpuguard {method} {path} answered {response.status}: {data[:300]!r}")
        return json.loads(data)

    def wait(self, ready: Callable[[], bool], *, what: str, timeout: float = 10.0) -> float:
        """Polls `ready` (bounded); fails fast with the log tail if gpuguard dies. Returns the seconds taken."""
        if self._process is None:
            raise RuntimeError("gpuguard is not running")
        return wait_until(ready, timeout=timeout, what=what, process=self._process)

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()
            self._process = None

    def restart(self, policy_path: Path | None) -> None:
        self.stop()
        self.start(policy_path)


def _rules(operations: list[str], *, validating: bool = False) -> list[dict[str, Any]]:
    # Validation also sees DaemonSets and `kubectl debug` containers, as in deploy/: trustedDeviceSoftware.
    groups = {
        "": ["pods", "pods/ephemeralcontainers"] if validating else ["pods"],
        "batch": ["jobs", "cronjobs"],
        "apps": ["deployments", "statefulsets", "replicasets", *(["daemonsets"] if validating else [])],
    }
    return [
        {
            "apiGroups": [group],
            "apiVersions": ["v1"],
            "operations": operations,
            "resources": resources,
            "scope": "Namespaced",
        }
        for group, resources in groups.items()
    ]


def webhook_configurations(
    webhook: WebhookProcess,
    failure_policy: FailurePolicy,
    *,
    name: str = CONFIG_NAME,
    namespace_selector: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The session's configurations; another `name` (and its `namespace_selector`) registers a second
    gpuguard next to it, with webhooks named `mutate.<name>.gpuguard.io` and `validate.<name>...`."""
    selector = namespace_selector or {
        "matchExpressions": [
            # A dead webhook with failurePolicy Fail must not block the control plane's own namespace; the
            # node agent's is left out as deploy/'s webhooks leave it out (its DaemonSet mounts the kubelet's
            # pod-resources directory, so the session's policy would take it for untrusted device software).
            {
                "key": "kubernetes.io/metadata.name",
                "operator": "NotIn",
                "values": ["kube-system", "gpuguard-node"],
            },
            {"key": OWNER_LABEL, "operator": "DoesNotExist"},
        ]
    }
    common: dict[str, Any] = {
        "admissionReviewVersions": ["v1"],
        "sideEffects": "None",  # also what lets --dry-run=server requests reach the webhook
        "timeoutSeconds": 5,
        "failurePolicy": failure_policy,
        "namespaceSelector": dict(selector),
    }
    infix = "" if name == CONFIG_NAME else f"{name}."

    def client_config(path: str) -> dict[str, str]:
        return {"url": f"{webhook.url}{path}", "caBundle": webhook.ca_bundle_b64}

    mutating = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": MUTATING_WEBHOOK.replace(".", f".{infix}", 1),
                "clientConfig": client_config("/mutate"),
                "reinvocationPolicy": "IfNeeded",
                "rules": _rules(["CREATE"]),
                **common,
            }
        ],
    }
    validating = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": VALIDATING_WEBHOOK.replace(".", f".{infix}", 1),
                "clientConfig": client_config("/validate"),
                "rules": _rules(["CREATE", "UPDATE"], validating=True),
                **common,
            }
        ],
    }
    return {"apiVersion": "v1", "kind": "List", "items": [mutating, validating]}


# The named objects the e2e and node tiers submit, built by manifests' builders: one set of builders,
# with what a real API server needs on top (a namespace, an image it can resolve, labels that select).


def gpu_container(name: str = "main", gpus: int = 1) -> dict[str, Any]:
    return manifests.container(name, image=IMAGE, limits={"nvidia.com/gpu": str(gpus)})


def _named(obj: dict[str, Any], namespace: str) -> dict[str, Any]:
    obj["metadata"]["namespace"] = namespace
    return obj


def gpu_pod(name: str, namespace: str, gpus: int = 1, *, restart_policy: str | None = None) -> dict[str, Any]:
    return manifests.pod(
        gpu_container(gpus=gpus), name=name, namespace=namespace, restart_policy=restart_policy
    )


def cpu_pod(name: str, namespace: str) -> dict[str, Any]:
    return manifests.pod(
        manifests.container(image=IMAGE, requests={"cpu": "10m"}), name=name, namespace=namespace
    )


def pinned_to_gpu_nodes(name: str, namespace: str) -> dict[str, Any]:
    """A CPU pod (no GPU request) with a GPU nodeSelector and no priority class: it would crowd accelerator
    nodes, and acceleratorNodeGuard is there to deny it."""
    pod = cpu_pod(name, namespace)
    pod["spec"]["nodeSelector"] = {"cloud.google.com/gke-accelerator": "nvidia-l4"}
    return pod


DEVICE_PLUGINS = "/var/lib/kubelet/device-plugins"


def device_plugin_daemonset(name: str, namespace: str, image: str) -> dict[str, Any]:
    """A device plugin the way vendors ship one: the kubelet's device-plugin directory mounted."""
    plugin = manifests.container("plugin", image=image)
    plugin["volumeMounts"] = [{"name": "device-plugins", "mountPath": DEVICE_PLUGINS}]
    volumes = [{"name": "device-plugins", "hostPath": {"path": DEVICE_PLUGINS}}]
    return _named(manifests.templated("DaemonSet", plugin, name=name, volumes=volumes), namespace)


def gpu_job(name: str, namespace: str, *, restart_policy: str = "Never") -> dict[str, Any]:
    job = manifests.job(gpu_container(), name=name, restart_policy=restart_policy, backoffLimit=4)
    job["spec"]["template"]["metadata"] = {"labels": {"app": name}}
    return _named(job, namespace)


def gpu_cronjob(name: str, namespace: str) -> dict[str, Any]:
    job = gpu_job(name, namespace)
    cronjob = manifests.cronjob(name=name)
    cronjob["spec"]["jobTemplate"]["spec"] = job["spec"]
    return _named(cronjob, namespace)


def gpu_deployment(name: str, namespace: str, *, kind: str = "Deployment") -> dict[str, Any]:
    """A Deployment, or with `kind="StatefulSet"` a StatefulSet: the fields gpuguard reads are the same."""
    workload = manifests.templated(kind, gpu_container(), name=name, restartPolicy="Always")
    workload["spec"]["replicas"] = 1
    if kind == "StatefulSet":
        workload["spec"]["serviceName"] = name
    return _named(workload, namespace)


def gpu_statefulset(name: str, namespace: str) -> dict[str, Any]:
    return gpu_deployment(name, namespace, kind="StatefulSet")


def pod_spec_of(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The pod spec inside a Pod, a workload's template or a CronJob's job template."""
    spec: dict[str, Any] = obj["spec"]
    if obj["kind"] == "Pod":
        return spec
    if obj["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    template_spec: dict[str, Any] = spec["template"]["spec"]
    return template_spec


def readiness_tolerations(pod_spec: Mapping[str, Any]) -> dict[str, list[int | None]]:
    """tolerationSeconds of every toleration naming each readiness taint key, in list order."""
    tolerations = pod_spec.get("tolerations") or []
    return {
        key: [t.get("tolerationSeconds") for t in tolerations if t.get("key") == key]
        for key in READINESS_KEYS
    }


def gpuguard_annotations(obj: dict[str, Any]) -> dict[str, str]:
    annotations: dict[str, str] = obj.get("metadata", {}).get("annotations") or {}
    return {k: v for k, v in annotations.items() if k.startswith(ANNOTATION_PREFIX)}


def default_priority_classes() -> dict[str, int]:
    """The PriorityClasses the embedded default policy names (`priorityClasses`). A real install ships
    them with gpuguard: the in-tree Priority plugin rejects pods naming a class that does not exist."""
    policy = yaml.safe_load((REPO_ROOT / "webhook" / "default-policy.yaml").read_text())
    return {str(name): int(value) for name, value in (policy.get("priorityClasses") or {}).items()}


def install_priority_classes(plane: ControlPlane, classes: Mapping[str, int]) -> None:
    items = [
        {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": name},
            "value": value,
        }
        for name, value in classes.items()
    ]
    plane.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))


def register(
    plane: ControlPlane,
    webhook: WebhookProcess,
    failure_policy: FailurePolicy = "Fail",
    *,
    name: str = CONFIG_NAME,
    namespace_selector: Mapping[str, Any] | None = None,
) -> None:
    configurations = webhook_configurations(
        webhook, failure_policy, name=name, namespace_selector=namespace_selector
    )
    plane.kubectl("apply", "-f", "-", input=json.dumps(configurations))


def unregister(plane: ControlPlane, name: str = CONFIG_NAME) -> None:
    plane.kubectl(
        "delete",
        "mutatingwebhookconfiguration,validatingwebhookconfiguration",
        name,
        "--ignore-not-found",
    )


def submit(
    plane: ControlPlane, verb: str, obj: Mapping[str, Any], *flags: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """`kubectl <verb> <flags> -f -` with `obj` as JSON (a List for several objects)."""
    return plane.kubectl(verb, *flags, "-f", "-", input=json.dumps(obj), check=check)


def read_back(plane: ControlPlane, obj: Mapping[str, Any]) -> Any:
    """The object as the API server stored it (`kubectl get -o json`)."""
    metadata = obj["metadata"]
    kind = (
        f"{obj['kind'].lower()}.{obj['apiVersion'].rsplit('/', 1)[0]}"
        if "/" in obj["apiVersion"]
        else obj["kind"]
    )
    args = ["get", kind, metadata["name"]]
    if metadata.get("namespace"):
        args += ["-n", metadata["namespace"]]
    return plane.kubectl_json(*args)


def kubectl_warnings(result: subprocess.CompletedProcess[str]) -> list[str]:
    """What kubectl printed as admission warnings (`Warning: ...` lines on stderr), prefix removed."""
    return [
        line.removeprefix("Warning: ") for line in result.stderr.splitlines() if line.startswith("Warning: ")
    ]


def probe_until(
    plane: ControlPlane,
    accept: Callable[[subprocess.CompletedProcess[str]], bool],
    *,
    what: str,
    timeout: float = 30.0,
    namespace: str = "default",
) -> float:
    """Dry-runs a GPU pod until `accept` likes the answer: webhook registrations take effect only once
    the apiserver's informer sees them. Returns the seconds it took."""
    probe = gpu_pod("gpuguard-e2e-probe", namespace)
    start = time.monotonic()
    last = ""
    while time.monotonic() - start < timeout:
        result = submit(plane, "create", probe, "--dry-run=server", "-o", "json", check=False)
        if accept(result):
            return time.monotonic() - start
        last = f"exit {result.returncode}: {result.stderr.strip() or result.stdout[:300]}"
        time.sleep(POLL_INTERVAL)
    raise TimeoutError(f"{what}: not seen within {timeout:.0f} s; last attempt: {last}")


def _mutated(result: subprocess.CompletedProcess[str]) -> bool:
    return result.returncode == 0 and bool(gpuguard_annotations(json.loads(result.stdout)))


def wait_until_called(plane: ControlPlane, timeout: float = 30.0, namespace: str = "default") -> float:
    """Until a dry-run GPU pod comes back mutated: gpuguard is registered, running and enforcing."""
    return probe_until(
        plane, _mutated, what="gpuguard mutating GPU pods", timeout=timeout, namespace=namespace
    )


def wait_until_answering(plane: ControlPlane, timeout: float = 30.0) -> float:
    """Until a dry-run GPU pod is admitted at all: with failurePolicy Fail that takes a live gpuguard,
    whatever its policy (and a fresh connection after a restart)."""
    return probe_until(plane, lambda r: r.returncode == 0, what="gpuguard answering", timeout=timeout)


def restore_default(plane: ControlPlane, webhook: WebhookProcess) -> None:
    """Back to what the session fixture set up: the default policy, failurePolicy Fail, proven called."""
    webhook.restart(None)
    register(plane, webhook)
    wait_until_called(plane)


# --- Prometheus text: the API server's and gpuguard's own ---------------------------------------------

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric_samples(text: str, name: str) -> Iterator[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of the series `name` in a Prometheus text exposition."""
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match["name"] == name:
            yield dict(_LABEL.findall(match["labels"] or "")), float(match["value"])


def admission_latency_buckets(plane: ControlPlane, webhooks: tuple[str, ...]) -> dict[str, float]:
    """The apiserver's cumulative webhook latency buckets (`le` -> calls), summed over `webhooks` and every
    operation, type and rejected label."""
    text = plane.kubectl("get", "--raw", "/metrics").stdout
    totals: dict[str, float] = {}
    for labels, value in metric_samples(
        text, "apiserver_admission_webhook_admission_duration_seconds_bucket"
    ):
        if labels.get("name") in webhooks:
            totals[labels["le"]] = totals.get(labels["le"], 0.0) + value
    return totals


def gpuguard_decisions(webhook: WebhookProcess, **match: str) -> float:
    """gpuguard's own `gpuguard_decisions_total`, summed over the samples whose labels include `match`."""
    return sum(
        value
        for labels, value in metric_samples(webhook.metrics(), "gpuguard_decisions_total")
        if match.items() <= labels.items()
    )


# --- a second gpuguard with cluster access: its policy from a ConfigMap, its facts from watches -----------

POLICY_KEY = "policy.yaml"  # the ConfigMap key `serve --policy-configmap` reads


def create_namespace(plane: ControlPlane, stem: str, labels: Mapping[str, str] | None = None) -> str:
    """A fresh namespace `<stem>-<random>` with `labels`; its name."""
    name = f"{stem}-{secrets.token_hex(3)}"
    metadata = {"name": name, "labels": dict(labels or {})}
    submit(plane, "create", {"apiVersion": "v1", "kind": "Namespace", "metadata": metadata})
    return name


def policy_configmap(namespace: str, name: str, policy: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace},
        "data": {POLICY_KEY: policy},
    }


def policy_hash(text: str) -> str:
    """The hash gpuguard names a policy text by (`gpuguard.io/policy`, `gpuguard_policy_info`, /policy)."""
    return parse_policy(text).hash


def log_records(path: Path) -> list[dict[str, Any]]:
    """gpuguard's JSON log lines; the harness' `# e2e:` markers and plain startup notes are skipped."""
    records = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line))
    return records


def dry_run(plane: ControlPlane, obj: Mapping[str, Any]) -> subprocess.CompletedProcess[str]:
    """`kubectl create --dry-run=server -o json`: the object as it would be stored, or the refusal."""
    return submit(plane, "create", obj, "--dry-run=server", "-o", "json", check=False)


def dry_run_until(
    plane: ControlPlane,
    obj: Mapping[str, Any],
    accept: Callable[[subprocess.CompletedProcess[str]], bool],
    *,
    what: str,
    timeout: float = 10.0,
) -> tuple[float, list[subprocess.CompletedProcess[str]]]:
    """Dry-runs `obj` until `accept` likes the answer, at most `timeout` seconds. Returns the seconds it took
    and every answer on the way (a caller can check that none of them was refused)."""
    start = time.monotonic()
    answers: list[subprocess.CompletedProcess[str]] = []
    while True:
        answers.append(dry_run(plane, obj))
        if accept(answers[-1]):
            return time.monotonic() - start, answers
        if time.monotonic() - start > timeout:
            last = answers[-1]
            raise TimeoutError(
                f"{what}: not seen within {timeout:.0f} s ({len(answers)} attempts); last: exit "
                f"{last.returncode}: {last.stderr.strip() or last.stdout[:500]}"
            )
        time.sleep(POLL_INTERVAL)


class LiveWebhook:
    """gpuguard with `--kubeconfig` and `--policy-configmap`, registered (failurePolicy Fail) for the
    namespaces labelled OWNER_LABEL=<name> only: the session's gpuguard never sees them, this one sees
    nothing else. Its ConfigMap lives in a namespace of its own."""

    CONFIGMAP = "gpuguard-policy"

    def __init__(self, plane: ControlPlane, workdir: Path, name: str) -> None:
        self.plane = plane
        self.name = name
        self.configmap_namespace = create_namespace(plane, f"{name}-config")
        self._namespaces = [self.configmap_namespace]
        self.process = WebhookProcess(
            workdir,
            extra_args=("--kubeconfig", str(plane.kubeconfig), "--policy-configmap", self.configmap_ref),
        )

    @property
    def configmap_ref(self) -> str:
        return f"{self.configmap_namespace}/{self.CONFIGMAP}"

    def start(self, policy: str) -> None:
        """Writes the ConfigMap, starts gpuguard, registers it, and waits until it mutates a GPU pod
        (so `policy` must leave the priority rule enforcing, and name a class that exists)."""
        install_priority_classes(self.plane, default_priority_classes())  # as the session fixture does
        self.edit_policy(policy)
        self.process.start()
        selector = {"matchLabels": {OWNER_LABEL: self.name}}
        register(self.plane, self.process, name=self.name, namespace_selector=selector)
        wait_until_called(self.plane, namespace=self.namespace("probe"))

    def stop(self) -> None:
        if self.plane.running:
            unregister(self.plane, self.name)
            self.plane.kubectl("delete", "namespace", *self._namespaces, "--wait=false", check=False)
        self.process.stop()

    def namespace(self, stem: str, labels: Mapping[str, str] | None = None) -> str:
        """A fresh namespace that this gpuguard, and only this one, answers for."""
        name = create_namespace(self.plane, stem, {OWNER_LABEL: self.name, **(labels or {})})
        self._namespaces.append(name)
        return name

    def edit_policy(self, text: str) -> None:
        """`kubectl apply` of the ConfigMap with `text` as its policy.yaml, and nothing more."""
        submit(self.plane, "apply", policy_configmap(self.configmap_namespace, self.CONFIGMAP, text))

    def set_policy(self, text: str, timeout: float = 10.0) -> float:
        """`edit_policy`, then wait until gpuguard reports that policy active. Returns the seconds it took."""
        expected = policy_hash(text)
        self.edit_policy(text)
        return self.process.wait(
            lambda: self.status()["hash"] == expected, what=f"policy {expected} active", timeout=timeout
        )

    def status(self) -> dict[str, Any]:
        """GET /policy: hash, source, loadedAt, lastError, errors, enabled, unavailableLookups."""
        status: dict[str, Any] = self.process.request_json("GET", "/policy")
        return status

    def events(self, reason: str) -> list[dict[str, Any]]:
        """The Events recorded on the policy ConfigMap with this reason (in no useful order: timestamps
        have whole seconds; tell new ones from old by `metadata.name`)."""
        selector = f"involvedObject.kind=ConfigMap,involvedObject.name={self.CONFIGMAP},reason={reason}"
        items: list[dict[str, Any]] = self.plane.kubectl_json(
            "get", "events", "-n", self.configmap_namespace, "--field-selector", selector
        )["items"]
        return items

    def log(self) -> list[dict[str, Any]]:
        return log_records(self.process.log_path)
