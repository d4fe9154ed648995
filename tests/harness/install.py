"""deploy/ on the real API server, and gpuguard replicas run as local processes with its service account.

There are no nodes, so the Deployment never runs: each replica is `gpuguard serve` with the Deployment's
certificate flags, a kubeconfig holding a token of the gpuguard ServiceAccount (so RBAC is the real
one), and the webhook configurations pointed at the replicas by URL instead of the Service.
"""

from __future__ import annotations

import base64
import json
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509

from tests.harness import REPO_ROOT
from tests.harness.admission import gpu_pod, gpuguard_annotations, metric_samples
from tests.harness.controlplane import (
    LOOPBACK,
    ControlPlane,
    Process,
    free_ports,
    http_get,
    log_tail,
    spawn,
    wait_until,
    without_proxies,
)
from webhook.certs import tls

DEPLOY = REPO_ROOT / "deploy"
NAMESPACE = "gpuguard"
SERVICE_ACCOUNT = "gpuguard"
SERVICE = "gpuguard"
SECRET = "gpuguard-tls"
POLICY_CONFIGMAP = "gpuguard-policy"
CONFIGURATION = "gpuguard"  # both webhook configurations
CONFIGURATION_KINDS = ("mutatingwebhookconfiguration", "validatingwebhookconfiguration")
CONTROLLERS = "gpuguard-controllers"  # their ServiceAccount, ClusterRole and ClusterRoleBinding
ENDPOINTS = {"mutatingwebhookconfiguration": "/mutate", "validatingwebhookconfiguration": "/validate"}


def render(plane: ControlPlane, directory: Path = DEPLOY) -> list[dict[str, Any]]:
    """`kubectl kustomize` of a kustomization, parsed: what `kubectl apply -k` sends."""
    text = plane.kubectl("kustomize", str(directory)).stdout
    return [doc for doc in yaml.safe_load_all(text) if doc]


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def namespaces_of(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The Namespaces among `objects`, as one List to apply before a server-side dry run of the rest."""
    return {"apiVersion": "v1", "kind": "List", "items": [o for o in objects if o["kind"] == "Namespace"]}


@contextmanager
def deployed(
    plane: ControlPlane, directory: Path, rendered: list[dict[str, Any]], namespace: str
) -> Iterator[str]:
    """The kustomization at `directory` (deploy/ or a copy), whose objects are `rendered`, applied for real
    after a server-side dry run; yields the dry run's output. On exit it removes what would reach into
    the rest of the suite: the webhook configurations first (they may point at replicas already
    stopped), every other cluster-wide object it rendered (cluster roles and bindings, the node agent's
    admission policy), and `namespace` (which never finishes deleting here, with no garbage
    collector). PriorityClasses stay: the rest of the suite uses gpu-workload."""
    # A dry run creates nothing, not even the namespace the other objects need: create that first.
    plane.kubectl("apply", "-f", "-", input=json.dumps(namespaces_of(rendered)))
    try:
        dry_run = plane.kubectl("apply", "-k", str(directory), "--dry-run=server")
        plane.kubectl("apply", "-k", str(directory))
        yield dry_run.stdout + dry_run.stderr
    finally:
        plane.kubectl(
            "delete", ",".join(CONFIGURATION_KINDS), CONFIGURATION, "--ignore-not-found", check=False
        )
        cluster_wide = [
            f"{item['kind'].lower()}/{item['metadata']['name']}"
            for item in rendered
            if "namespace" not in item["metadata"]
            and item["kind"] not in ("Namespace", "PriorityClass")
            and item["kind"].lower() not in CONFIGURATION_KINDS
        ]
        if cluster_wide:
            plane.kubectl("delete", *cluster_wide, "--ignore-not-found", check=False)
        plane.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def service_account_kubeconfig(
    plane: ControlPlane, path: Path, namespace: str = NAMESPACE, *, account: str = SERVICE_ACCOUNT
) -> Path:
    """A kubeconfig for the API server that authenticates as a ServiceAccount (TokenRequest), by
    default gpuguard's."""
    token = plane.kubectl("create", "token", account, "-n", namespace, "--duration=2h").stdout.strip()
    config = json.loads(plane.kubeconfig.read_text())
    config["users"] = [{"name": account, "user": {"token": token}}]
    config["contexts"] = [{"name": "sa", "context": {"cluster": "e2e", "user": account}}]
    config["current-context"] = "sa"
    path.write_text(json.dumps(config))
    return path


def read_secret(plane: ControlPlane, namespace: str = NAMESPACE) -> tls.Material:
    raw = plane.kubectl_json("get", "secret", SECRET, "-n", namespace)
    return tls.Material.from_secret_data({k: base64.b64decode(v) for k, v in raw["data"].items()})


def secret_exists(plane: ControlPlane) -> bool:
    result = plane.kubectl("get", "secret", SECRET, "-n", NAMESPACE, "--ignore-not-found", "-o", "name")
    return bool(result.stdout.strip())


def ca_bundles(plane: ControlPlane) -> dict[str, list[x509.Certificate]]:
    """The caBundle of each webhook configuration (its one webhook), parsed; [] when it has none."""
    bundles: dict[str, list[x509.Certificate]] = {}
    for kind in CONFIGURATION_KINDS:
        webhook = plane.kubectl_json("get", kind, CONFIGURATION)["webhooks"][0]
        encoded = webhook["clientConfig"].get("caBundle")
        bundles[kind] = tls.parse_bundle(base64.b64decode(encoded)) if encoded else []
    return bundles


def route_to(
    plane: ControlPlane, urls: Mapping[str, str], *, failure_policy: str, namespace_label: str
) -> None:
    """Points every webhook of each configuration at a URL (a replica on loopback) instead of the Service,
    sets its failurePolicy, and narrows it to namespaces carrying `namespace_label`=true, so the rest of the
    suite never meets it. Everything else (rules, matchConditions, exclusions) stays as deploy/ has it."""
    for kind in CONFIGURATION_KINDS:
        webhooks = plane.kubectl_json("get", kind, CONFIGURATION)["webhooks"]
        operations = []
        for index in range(len(webhooks)):
            operations += [
                {"op": "remove", "path": f"/webhooks/{index}/clientConfig/service"},
                {"op": "add", "path": f"/webhooks/{index}/clientConfig/url", "value": urls[kind]},
                {"op": "replace", "path": f"/webhooks/{index}/failurePolicy", "value": failure_policy},
                {
                    "op": "add",
                    "path": f"/webhooks/{index}/namespaceSelector/matchLabels",
                    "value": {namespace_label: "true"},
                },
            ]
        plane.kubectl("patch", kind, CONFIGURATION, "--type=json", "-p", json.dumps(operations))


def insecure_context() -> ssl.SSLContext:
    """For looking at what a replica serves, whatever it is (the placeholder included)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


class Replica:
    """`gpuguard serve` with the Deployment's certificate flags, as the gpuguard ServiceAccount."""

    def __init__(
        self,
        workdir: Path,
        kubeconfig: Path,
        *,
        secret: str = SECRET,
        webhook_config: str | None = CONFIGURATION,
        rotation_delay: float = 300.0,
        namespace: str = NAMESPACE,
        workers: int = 1,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workers = workers
        (self.port,) = free_ports(1)
        self.log_path = workdir / "gpuguard.log"
        self.argv = [
            sys.executable,
            "-m",
            "webhook",
            "serve",
            f"--host={LOOPBACK}",
            f"--port={self.port}",
            f"--cert-dir={workdir / 'certs'}",
            f"--kubeconfig={kubeconfig}",
            f"--tls-secret={namespace}/{secret}",
            f"--service={SERVICE}",
            f"--policy-configmap={namespace}/{POLICY_CONFIGMAP}",
            "--cluster-lookups=on",
            f"--rotation-delay={rotation_delay}",
            f"--workers={workers}",
        ]
        if webhook_config is not None:
            self.argv.append(f"--webhook-config={webhook_config}")
        self._process: Process | None = None

    def url(self, path: str) -> str:
        return f"https://{LOOPBACK}:{self.port}{path}"

    def start(self) -> None:
        self._process = spawn(self.argv, self.log_path, _gpuguard_env(), cwd=REPO_ROOT)

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.popen.pid

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.running()

    def get(self, path: str) -> tuple[int, bytes]:
        return http_get(self.port, path, insecure_context())

    def wait_ready(self, timeout: float = 60.0) -> float:
        return wait_until(
            lambda: self.get("/readyz")[0] == 200,
            timeout=timeout,
            what="replica /readyz",
            process=self._process,
        )

    def served_certificate(self) -> x509.Certificate:
        """The certificate a new TLS handshake gets (no server name sent, as for an IP URL)."""
        with (
            socket.create_connection((LOOPBACK, self.port), timeout=5) as raw,
            insecure_context().wrap_socket(raw) as conn,
        ):
            der = conn.getpeercert(binary_form=True)
        assert der is not None
        return x509.load_der_x509_certificate(der)

    def served_certificates(self) -> set[x509.Certificate]:
        """What new handshakes get, over enough connections to reach every worker of the replica (the
        kernel hands each to whichever worker accepts first: 8 per worker miss one with odds 2**-8)."""
        samples = 1 if self.workers == 1 else 8 * self.workers
        return {self.served_certificate() for _ in range(samples)}

    def admissions(self, endpoint: str) -> float:
        """gpuguard_admission_requests_total for /mutate or /validate: calls this replica answered."""
        status, body = self.get("/metrics")
        assert status == 200, f"/metrics answered {status}"
        samples = metric_samples(body.decode(), "gpuguard_admission_requests_total")
        return sum(value for labels, value in samples if labels.get("endpoint") == endpoint)

    def log(self) -> str:
        return log_tail(self.log_path, lines=60)

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()


def wait_for(
    ready: Callable[[], bool], *, what: str, timeout: float = 30.0, replicas: Sequence[Replica] = ()
) -> float:
    """`wait_until`, with the replicas' logs in the error: what a timeout needs to be understood."""
    try:
        return wait_until(ready, timeout=timeout, what=what)
    except TimeoutError as exc:
        logs = "\n".join(f"--- {replica.log_path}\n{replica.log()}" for replica in replicas)
        raise TimeoutError(f"{exc}\n{logs}") from None


# A bound for a hung command, not a speed: with the machine's load average at 18 and a CPU hog beside the
# suite, `certs rotate` (a Python start, the Kubernetes client's imports, a new CA key) took over 60 s.
GPUGUARD_COMMAND_SECONDS = 180.0


def run_gpuguard(*args: str, timeout: float = GPUGUARD_COMMAND_SECONDS) -> subprocess.CompletedProcess[str]:
    """The gpuguard command line, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "webhook", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_gpuguard_env(),
        cwd=REPO_ROOT,
    )


def _gpuguard_env() -> dict[str, str]:
    # From the source tree, outside any pod (so the kubeconfig is used), and straight to loopback.
    env = {k: v for k, v in without_proxies().items() if k not in ("KUBERNETES_SERVICE_HOST", "KUBECONFIG")}
    env["PYTHONPATH"] = f"{REPO_ROOT}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(REPO_ROOT)
    return env


def submit_dry_run(plane: ControlPlane, obj: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return plane.kubectl(
        "apply", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(obj), check=False
    )


@dataclass(frozen=True)
class Outcome:
    at: float
    ok: bool
    detail: str


class Stream:
    """GPU pods sent with `kubectl apply --dry-run=server`, one after another, until stopped (or a count
    or time bound is hit); each outcome is ok when the pod came back admitted and mutated by gpuguard."""

    def __init__(
        self, plane: ControlPlane, namespace: str, *, max_count: int = 1500, max_seconds: float = 600
    ) -> None:
        self.plane = plane
        self.namespace = namespace
        self.max_count = max_count
        self.max_seconds = max_seconds
        self.outcomes: list[Outcome] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        started = time.monotonic()
        for index in range(self.max_count):
            if self.stop.is_set() or time.monotonic() - started > self.max_seconds:
                return
            result = submit_dry_run(self.plane, gpu_pod(f"stream-{index}", self.namespace))
            mutated = result.returncode == 0 and bool(gpuguard_annotations(json.loads(result.stdout)))
            self.outcomes.append(Outcome(time.monotonic(), mutated, result.stderr.strip()))

    def __enter__(self) -> Stream:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(timeout=60)

    def count_after(self, moment: float) -> int:
        return sum(1 for outcome in list(self.outcomes) if outcome.at > moment)


# The Policy WG's PolicyReport CRDs (gpuguard installs none; the audit's tests do).
CRD_FOLDER = Path(__file__).resolve().parent / "crds"
CRD_FILE = CRD_FOLDER / "wgpolicyk8s.io-v1alpha2.yaml"


def install_crds(plane: ControlPlane, path: Path) -> dict[str, Any]:
    """Applies the CRDs in `path` and waits until the API server serves them; returns them."""
    crds: dict[str, Any] = yaml.safe_load(path.read_text())
    # Server-side: a client-side apply keeps the whole object in an annotation, which JobSet's CRD
    # (a pod template schema per replicated Job) overflows.
    plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=json.dumps(crds))
    names = [crd["metadata"]["name"] for crd in crds["items"]]

    def established() -> bool:
        # Polled: `kubectl wait` fails outright on a CRD whose status has no conditions yet.
        listed = plane.kubectl_json("get", "crd", *names)
        found = listed.get("items", [listed])
        return all(
            any(
                c["type"] == "Established" and c["status"] == "True"
                for c in crd.get("status", {}).get("conditions") or []
            )
            for crd in found
        )

    wait_until(established, timeout=30, what=f"CRDs {', '.join(names)} established")
    return crds
