"""Workloads for real nodes, and reading what the cluster did with them.

The manifests start from the e2e tier's (admission.gpu_pod, gpu_job), so the node tier
submits what gpuguard's other tests submit, and only swaps in an image the nodes have, a script,
and the node to run on."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping
from typing import Any

from tests.harness.admission import pod_spec_of
from tests.harness.controlplane import ControlPlane, wait_until
from tests.harness.images import BUSYBOX_IMAGE

GPU = "nvidia.com/gpu"
HOSTNAME_LABEL = "kubernetes.io/hostname"


def on_node(manifest: Mapping[str, Any], node: str, script: str) -> dict[str, Any]:
    """`manifest` (a Pod, or a workload with a pod template) with every container running `script`
    in the busybox image, scheduled by the real scheduler onto `node`."""
    result = copy.deepcopy(dict(manifest))
    spec = pod_spec_of(result)
    spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), HOSTNAME_LABEL: node}
    for container in spec["containers"]:
        container.update(image=BUSYBOX_IMAGE, imagePullPolicy="IfNotPresent", command=["sh", "-c", script])
    return result


def quantity(value: str) -> int:
    """A whole-number resource quantity (device counts: "4")."""
    return int(value)


def allocatable(node: Mapping[str, Any], resource: str) -> int:
    return quantity(node.get("status", {}).get("allocatable", {}).get(resource, "0"))


def capacity(node: Mapping[str, Any], resource: str) -> int:
    return quantity(node.get("status", {}).get("capacity", {}).get(resource, "0"))


def get_pod(plane: ControlPlane, namespace: str, name: str) -> dict[str, Any] | None:
    result = plane.kubectl("get", "pod", name, "-n", namespace, "-o", "json", check=False)
    if result.returncode != 0:
        if "NotFound" in result.stderr:
            return None
        raise RuntimeError(result.stderr)
    pod: dict[str, Any] = json.loads(result.stdout)
    return pod


def wait_for_pod(
    plane: ControlPlane,
    namespace: str,
    name: str,
    accept: Callable[[dict[str, Any] | None], bool],
    *,
    what: str,
    timeout: float = 60.0,
) -> dict[str, Any] | None:
    """Polls the pod (None once it is gone) until `accept` likes it; returns what was accepted."""
    seen: list[dict[str, Any] | None] = []

    def ready() -> bool:
        seen[:] = [get_pod(plane, namespace, name)]
        return accept(seen[0])

    wait_until(ready, timeout=timeout, what=f"pod {namespace}/{name}: {what}")
    return seen[0]


def phase(pod: Mapping[str, Any] | None) -> str | None:
    return None if pod is None else pod.get("status", {}).get("phase")


def running(pod: Mapping[str, Any] | None) -> bool:
    """Running with every container started (not merely scheduled)."""
    if phase(pod) != "Running" or pod is None:
        return False
    statuses = pod["status"].get("containerStatuses") or []
    return bool(statuses) and all("running" in s.get("state", {}) for s in statuses)


def container_status(pod: Mapping[str, Any], container: str = "main") -> dict[str, Any]:
    statuses: list[dict[str, Any]] = pod.get("status", {}).get("containerStatuses") or []
    return next(s for s in statuses if s["name"] == container)


def delete_all_pods(plane: ControlPlane, namespace: str) -> None:
    """Jobs orphaned (so nothing recreates pods), then every pod deleted without its grace period:
    the scheduler counts a terminating pod's GPUs as taken until its object is gone."""
    plane.kubectl("delete", "jobs", "--all", "-n", namespace, "--cascade=orphan", check=False)
    plane.kubectl(
        "delete", "pods", "--all", "-n", namespace, "--grace-period=0", "--force", "--wait=false", check=False
    )
