"""JobSet's CRD and its controller manager on a control plane, for the tests that run JobSets for real
(tests/e2e/test_jobset_controller.py without kubelets, tests/node/test_gang_restart.py on real nodes).

Both come from the shared third_party folder (third_party.py): the CRD as shipped, the manager
built into the cache. The manager runs without leader election and without its certificate management;
its webhook server gets a certificate here and is registered nowhere, so what JobSet's defaulting
webhook adds must be in the manifests (`JOBSET_DEFAULTS`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from tests.harness import third_party
from tests.harness.controlplane import (
    LOOPBACK,
    ControlPlane,
    Process,
    free_ports,
    http_get,
    spawn,
    wait_until,
    without_proxies,
)
from tests.harness.install import install_crds
from webhook.certs import tls

RESTARTS_LABEL = "jobset.sigs.k8s.io/restart-attempt"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
# What JobSet's webhook defaults (pkg/webhooks/jobset_webhook.go, Default): the controller reads them.
JOBSET_DEFAULTS: dict[str, Any] = {
    "successPolicy": {"operator": "All"},
    "startupPolicy": {"startupPolicyOrder": "AnyOrder"},
    "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
}


def install_jobset_crd(plane: ControlPlane, workdir: Path) -> None:
    crd = yaml.safe_load((third_party.jobset_source() / third_party.JOBSET_CRD).read_text())
    path = workdir / "jobset-crd.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": [crd]}))
    install_crds(plane, path)


def start_jobset_manager(plane: ControlPlane, workdir: Path) -> Process:
    """JobSet's controller manager with the admin's credentials, ready (its /readyz answers)."""
    binary = third_party.jobset_manager()
    tls.generate_serving_files(workdir / "certs", [LOOPBACK])
    webhook_port, health_port = free_ports(2)
    config = {
        "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "webhook": {"port": webhook_port, "host": LOOPBACK, "certDir": str(workdir / "certs")},
        "metrics": {"bindAddress": "0"},
        "health": {"healthProbeBindAddress": f"{LOOPBACK}:{health_port}"},
    }
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    argv: list[str | Path] = [
        binary,
        f"--config={workdir / 'config.yaml'}",
        f"--kubeconfig={plane.kubeconfig}",
    ]
    process = spawn(argv, workdir / "manager.log", without_proxies())
    try:
        wait_until(
            lambda: http_get(health_port, "/readyz")[0] == 200,
            timeout=60,
            what="JobSet manager",
            process=process,
        )
    except Exception:
        process.stop()
        raise
    return process


def jobset_status(plane: ControlPlane, name: str, namespace: str) -> dict[str, Any]:
    found: dict[str, Any] = plane.kubectl_json("get", "jobset.jobset.x-k8s.io", name, "-n", namespace).get(
        "status", {}
    )
    return found


def attempt_pods(plane: ControlPlane, name: str, namespace: str, attempt: int) -> list[dict[str, Any]]:
    """The JobSet's pods of one restart attempt that are not being deleted."""
    selector = f"{JOBSET_NAME_LABEL}={name},{RESTARTS_LABEL}={attempt}"
    pods: list[dict[str, Any]] = plane.kubectl_json("get", "pods", "-n", namespace, "-l", selector)["items"]
    return [pod for pod in pods if not pod["metadata"].get("deletionTimestamp")]
