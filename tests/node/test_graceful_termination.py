"""Graceful termination on a real kubelet: deleting a GPU pod runs the preStop sleep gpuguard
injected for its seconds before SIGTERM reaches the container, and the container then has the rest
of the grace period gpuguard raised to shut down on its own."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.harness.admission import gpu_pod, submit
from tests.harness.workloads import container_status, on_node, running, wait_for_pod

from .conftest import GRACE_SECONDS, PRE_STOP_SECONDS, NodeCluster

NODE = "node-b"
# The container writes when SIGTERM reached it, on the machine's uptime clock (containers share the
# kernel's), into its termination message. `sleep & wait` lets the trap run at once.
TERM_RECORDER = (
    "trap 'read up idle < /proc/uptime; echo \"$up\" > /dev/termination-log; exit 0' TERM; "
    "while true; do sleep 1 & wait $!; done"
)
HOLD = "gpuguard.test/hold"  # a finalizer: the pod object outlives its containers, to be read


def uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def test_pre_stop_runs_its_seconds_before_sigterm_reaches_the_container(
    cluster: NodeCluster, namespace: str, summary: Callable[[str, str], None]
) -> None:
    plane = cluster.plane
    manifest = on_node(gpu_pod("serving", namespace, restart_policy="Always"), NODE, TERM_RECORDER)
    manifest["metadata"]["finalizers"] = [HOLD]
    submit(plane, "create", manifest)
    pod = wait_for_pod(plane, namespace, "serving", running, what="running")
    assert pod is not None
    (container,) = pod["spec"]["containers"]
    assert container["lifecycle"]["preStop"] == {"sleep": {"seconds": PRE_STOP_SECONDS}}  # gpuguard's
    assert pod["spec"]["terminationGracePeriodSeconds"] == GRACE_SECONDS

    # The grace period the deletion was given; the kubelet's final deletion, once the container is
    # gone, sets it to 0, so it is read on the way.
    graces: set[int] = set()

    def terminated(pod: dict[str, Any] | None) -> bool:
        assert pod is not None
        graces.add(pod["metadata"]["deletionGracePeriodSeconds"])
        return "terminated" in container_status(pod).get("state", {})

    try:
        deleted_at = uptime()
        plane.kubectl("delete", "pod", "serving", "-n", namespace, "--wait=false")
        pod = wait_for_pod(
            plane, namespace, "serving", terminated, what="container terminated", timeout=GRACE_SECONDS + 30
        )
        assert pod is not None
        state = container_status(pod)["state"]["terminated"]
        term_after = float(state["message"]) - deleted_at
    finally:
        plane.kubectl(
            "patch",
            "pod",
            "serving",
            "-n",
            namespace,
            "--type=json",
            "-p",
            '[{"op": "remove", "path": "/metadata/finalizers"}]',
            check=False,
        )

    assert GRACE_SECONDS in graces and graces <= {GRACE_SECONDS, 0}
    assert term_after >= PRE_STOP_SECONDS  # the preStop sleep ran in full before SIGTERM
    assert term_after < GRACE_SECONDS  # ... and left the container time to stop on its own:
    assert state["exitCode"] == 0  # its TERM handler's exit, not SIGKILL's 137
    summary(
        "graceful_termination",
        f"SIGTERM reached the container {term_after:.1f} s after the delete (preStop sleep "
        f"{PRE_STOP_SECONDS} s, grace {GRACE_SECONDS} s); it exited 0 on its own",
    )
