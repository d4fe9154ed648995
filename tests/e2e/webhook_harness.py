"""The real gpuguard server as a subprocess, and its registration with a ControlPlane."""

from __future__ import annotations

import base64
import json
import os
import ssl
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from controlplane import (
    LOOPBACK,
    POLL_INTERVAL,
    ControlPlane,
    Process,
    free_ports,
    http_get,
    spawn,
    wait_until,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_NAME = "gpuguard-e2e"
MUTATING_WEBHOOK = "mutate.gpuguard.io"
VALIDATING_WEBHOOK = "validate.gpuguard.io"
ANNOTATION_PREFIX = "gpuguard.io/"

FailurePolicy = Literal["Fail", "Ignore"]


class WebhookProcess:
    """`python -m webhook serve` on a fixed loopback port and cert dir.

    Port and certificates survive `restart`, so the registered URL and caBundle stay valid.
    """

    def __init__(self, workdir: Path, python: str = sys.executable) -> None:
        self.python = python
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
        self.policy_path = policy_path
        with self.log_path.open("a") as log:  # the log spans restarts; mark where each one begins
            log.write(f"# e2e: {' '.join(argv)}\n")
        # Run from the source tree whether or not the package is installed into the interpreter.
        env = dict(os.environ)
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

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()
            self._process = None

    def restart(self, policy_path: Path | None) -> None:
        self.stop()
        self.start(policy_path)


def _rules(operations: list[str]) -> list[dict[str, Any]]:
    groups = {
        "": ["pods"],
        "batch": ["jobs", "cronjobs"],
        "apps": ["deployments", "statefulsets", "replicasets"],
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


def webhook_configurations(webhook: WebhookProcess, failure_policy: FailurePolicy) -> dict[str, Any]:
    common: dict[str, Any] = {
        "admissionReviewVersions": ["v1"],
        "sideEffects": "None",  # also what lets --dry-run=server requests reach the webhook
        "timeoutSeconds": 5,
        "failurePolicy": failure_policy,
        # A dead webhook with failurePolicy Fail must not block the control plane's own namespace.
        "namespaceSelector": {
            "matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system"]},
            ]
        },
    }

    def client_config(path: str) -> dict[str, str]:
        return {"url": f"{webhook.url}{path}", "caBundle": webhook.ca_bundle_b64}

    mutating = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": CONFIG_NAME},
        "webhooks": [
            {
                "name": MUTATING_WEBHOOK,
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
        "metadata": {"name": CONFIG_NAME},
        "webhooks": [
            {
                "name": VALIDATING_WEBHOOK,
                "clientConfig": client_config("/validate"),
                "rules": _rules(["CREATE", "UPDATE"]),
                **common,
            }
        ],
    }
    return {"apiVersion": "v1", "kind": "List", "items": [mutating, validating]}


def gpu_pod(name: str, namespace: str, gpus: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                }
            ]
        },
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


def register(plane: ControlPlane, webhook: WebhookProcess, failure_policy: FailurePolicy = "Fail") -> None:
    plane.kubectl("apply", "-f", "-", input=json.dumps(webhook_configurations(webhook, failure_policy)))


def unregister(plane: ControlPlane) -> None:
    plane.kubectl(
        "delete",
        "mutatingwebhookconfiguration,validatingwebhookconfiguration",
        CONFIG_NAME,
        "--ignore-not-found",
    )


def wait_until_called(plane: ControlPlane, timeout: float = 30.0, namespace: str = "default") -> float:
    """Registration takes effect only once the apiserver's informer sees it: dry-run a GPU pod until
    the mutation shows up. Returns the seconds it took."""
    probe = json.dumps(gpu_pod("gpuguard-e2e-probe", namespace))
    start = time.monotonic()
    last = ""
    while time.monotonic() - start < timeout:
        result = plane.kubectl(
            "create", "--dry-run=server", "-o", "json", "-f", "-", input=probe, check=False
        )
        if result.returncode == 0 and gpuguard_annotations(json.loads(result.stdout)):
            return time.monotonic() - start
        last = result.stderr or "created without gpuguard.io/ annotations"
        time.sleep(POLL_INTERVAL)
    raise TimeoutError(f"the API server did not call gpuguard within {timeout:.0f} s; last attempt: {last}")
