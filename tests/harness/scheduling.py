"""A kube-scheduler of the tests' own, and nodes that are API objects only (no kubelet).

The scheduler answers only pods naming its own scheduler name, so nothing else in the suite is ever
bound; the nodes carry a label of their own that the tests' pods select, so no other pod could fit
them. A node created with a status (capacity, allocatable, a Ready condition) is all the scheduler
reads: binding a pod to it is the proof of where it may land.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.harness.controlplane import (
    ControlPlane,
    Process,
    wait_until,
)

SCHEDULER_NAME = "gpuguard-e2e-scheduler"


def start_scheduler(plane: ControlPlane, workdir: Path) -> Process:
    """The control plane's kube-scheduler with one profile, `SCHEDULER_NAME` (its default profile would
    bind every other test's pods as soon as a node exists). Stop it with the returned Process."""
    config = workdir / "scheduler.yaml"
    config.write_text(
        json.dumps(
            {
                "apiVersion": "kubescheduler.config.k8s.io/v1",
                "kind": "KubeSchedulerConfiguration",
                "clientConnection": {"kubeconfig": str(plane.kubeconfig)},
                "leaderElection": {"leaderElect": False},
                "profiles": [{"schedulerName": SCHEDULER_NAME}],
            }
        )
    )
    return plane.start_scheduler(flags={"config": str(config)})


def node(name: str, labels: Mapping[str, str], *, gpus: int = 8) -> dict[str, Any]:
    """A Ready node with room for pods and `gpus` nvidia.com/gpu, as a kubelet would have reported it."""
    resources = {"cpu": "32", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}},
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "e2e"}],
        },
    }


def create_nodes(plane: ControlPlane, nodes: list[dict[str, Any]]) -> None:
    """Creates the nodes ready to take pods. The API server's TaintNodesByCondition plugin gives every new
    node a `node.kubernetes.io/not-ready:NoSchedule` taint that the node lifecycle controller lifts once the
    kubelet reports Ready; there is neither here, so the test lifts it."""
    plane.kubectl("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": nodes}))
    names = [n["metadata"]["name"] for n in nodes]
    plane.kubectl("taint", "nodes", *names, "node.kubernetes.io/not-ready:NoSchedule-")


def bound_node(plane: ControlPlane, namespace: str, pod: str, timeout: float = 60.0) -> str:
    """The node the scheduler bound `pod` to, once it has."""
    found: list[str] = []

    def bound() -> bool:
        name = plane.kubectl_json("get", "pod", pod, "-n", namespace)["spec"].get("nodeName")
        found[:] = [name] if name else []
        return bool(name)

    wait_until(bound, timeout=timeout, what=f"pod {namespace}/{pod} bound to a node")
    return found[0]
