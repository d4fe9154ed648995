"""A real kube-scheduler next to a ControlPlane, and nodes that are API objects only (no kubelet).

The scheduler answers only pods naming its own scheduler name, so nothing else in the suite is ever
bound; the nodes carry a label of their own that the tests' pods select, so no other pod could fit
them. A node created with a status (capacity, allocatable, a Ready condition) is all the scheduler
reads: binding a pod to it is the proof of where it may land.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from controlplane import (
    LOOPBACK,
    ControlPlane,
    Process,
    free_ports,
    http_get,
    spawn,
    wait_until,
    without_proxies,
)

SCHEDULER_NAME = "gpuguard-e2e-scheduler"


class Scheduler:
    """kube-scheduler with one profile, `SCHEDULER_NAME`, authenticated with the admin kubeconfig."""

    def __init__(self, plane: ControlPlane, workdir: Path) -> None:
        self.plane = plane
        workdir.mkdir(parents=True, exist_ok=True)
        self.config = workdir / "scheduler.yaml"
        self.log_path = workdir / "scheduler.log"
        (self.port,) = free_ports(1)
        self._process: Process | None = None

    def start(self, timeout: float = 60.0) -> None:
        kubeconfig = str(self.plane.kubeconfig)
        self.config.write_text(
            json.dumps(
                {
                    "apiVersion": "kubescheduler.config.k8s.io/v1",
                    "kind": "KubeSchedulerConfiguration",
                    "clientConnection": {"kubeconfig": kubeconfig},
                    "leaderElection": {"leaderElect": False},
                    "profiles": [{"schedulerName": SCHEDULER_NAME}],
                }
            )
        )
        argv = [
            str(self.plane.bin_dir / "kube-scheduler"),
            f"--config={self.config}",
            f"--bind-address={LOOPBACK}",
            f"--secure-port={self.port}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
        ]
        self._process = spawn(argv, self.log_path, without_proxies(), cwd=self.config.parent)
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # its own self-signed serving certificate
        wait_until(
            lambda: http_get(self.port, "/readyz", context)[0] == 200,
            timeout=timeout,
            what="kube-scheduler /readyz",
            process=self._process,
        )

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()
            self._process = None


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
