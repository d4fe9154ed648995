"""Readiness flakes on a real node: its kubelet stops for longer than the API server's default
toleration allows (compressed here: conftest.DEFAULT_TOLERATION_SECONDS instead of 300 s). The
real node-lifecycle controller marks the node unreachable and taints it; the real taint-eviction
controller evicts the GPU pod that has only the API server's tolerations, and leaves alone the
same pod that gpuguard gave its longer ones. When the kubelet returns, the taint goes and the
guarded pod is still running, in the same container, never restarted."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.harness.admission import READINESS_KEYS, gpu_pod, readiness_tolerations, submit
from tests.harness.controlplane import wait_until
from tests.harness.node import Node
from tests.harness.workloads import container_status, delete_all_pods, get_pod, on_node, running, wait_for_pod

from .conftest import DEFAULT_TOLERATION_SECONDS, NODE_MONITOR_GRACE_SECONDS, UNGUARDED_NAMESPACE, NodeCluster
from .test_device_health import LONG_RUNNING

NODE = "node-a"
UNREACHABLE = "node.kubernetes.io/unreachable"
SERVING_SECONDS = 600  # conftest.POLICY's servingSeconds: what gpuguard gives a restartPolicy Always pod


def no_execute_taints(node: dict[str, Any]) -> set[str]:
    return {t["key"] for t in node.get("spec", {}).get("taints") or [] if t["effect"] == "NoExecute"}


def stop_until_unreachable(node: Node) -> float:
    """Stops the node's kubelet and waits until the node-lifecycle controller taints the node
    unreachable; returns the seconds that took."""
    stopped = time.monotonic()
    node.stop_kubelet()
    wait_until(
        lambda: UNREACHABLE in no_execute_taints(node.node()),
        timeout=NODE_MONITOR_GRACE_SECONDS + 60,
        what=f"{node.name} tainted {UNREACHABLE}:NoExecute",
    )
    return time.monotonic() - stopped


@pytest.fixture
def unguarded(cluster: NodeCluster) -> Iterator[str]:
    """The namespace gpuguard's policy turns itself off in (it has a fixed name: the policy names it)."""
    cluster.plane.kubectl("create", "namespace", UNGUARDED_NAMESPACE)
    yield UNGUARDED_NAMESPACE
    delete_all_pods(cluster.plane, UNGUARDED_NAMESPACE)
    cluster.plane.kubectl("delete", "namespace", UNGUARDED_NAMESPACE, "--wait=false", check=False)


def test_pod_with_gpuguard_tolerations_survives_a_kubelet_outage_that_evicts_the_default(
    cluster: NodeCluster,
    namespace: str,
    unguarded: str,
    kubelets_back: None,
    summary: Callable[[str, str], None],
) -> None:
    plane, node = cluster.plane, cluster.nodes[NODE]
    for ns in (namespace, unguarded):
        submit(plane, "create", on_node(gpu_pod("trainer", ns, restart_policy="Always"), NODE, LONG_RUNNING))
    guarded = wait_for_pod(plane, namespace, "trainer", running, what="running")
    bare = wait_for_pod(plane, unguarded, "trainer", running, what="running")
    assert guarded is not None and bare is not None
    assert readiness_tolerations(guarded["spec"]) == {key: [SERVING_SECONDS] for key in READINESS_KEYS}
    assert readiness_tolerations(bare["spec"]) == {
        key: [DEFAULT_TOLERATION_SECONDS] for key in READINESS_KEYS
    }
    container_before = container_status(guarded)["containerID"]

    stopped = time.monotonic()
    tainted = stop_until_unreachable(node)
    evicted = wait_for_pod(
        plane,
        unguarded,
        "trainer",
        lambda p: p is None or "deletionTimestamp" in p["metadata"],
        what="evicted by the taint-eviction controller",
        timeout=DEFAULT_TOLERATION_SECONDS + 60,
    )
    eviction = time.monotonic() - stopped
    assert evicted is not None  # its kubelet is away: the pod object waits for it, Terminating
    reasons = {c["type"]: c.get("reason") for c in evicted["status"].get("conditions") or []}
    assert reasons.get("DisruptionTarget") == "DeletionByTaintManager"
    still = get_pod(plane, namespace, "trainer")
    assert still is not None and "deletionTimestamp" not in still["metadata"]  # gpuguard's 600 s hold

    back = node.start_kubelet()
    node.wait_for(lambda: UNREACHABLE not in no_execute_taints(node.node()), what="unreachable taint removed")
    outage = time.monotonic() - stopped
    after = wait_for_pod(plane, namespace, "trainer", running, what="running after the outage")
    assert after is not None and "deletionTimestamp" not in after["metadata"]
    assert container_status(after)["containerID"] == container_before  # the same container, kept running
    assert container_status(after)["restartCount"] == 0
    # The evicted one's kubelet is back and finishes its deletion.
    wait_for_pod(plane, unguarded, "trainer", lambda p: p is None, what="gone once its kubelet is back")
    assert outage > DEFAULT_TOLERATION_SECONDS
    summary(
        "readiness_flake",
        f"kubelet down {outage:.0f} s: tainted {UNREACHABLE} after {tainted:.1f} s, the pod with the API "
        f"server's {DEFAULT_TOLERATION_SECONDS} s toleration evicted after {eviction:.1f} s, the one with "
        f"gpuguard's {SERVING_SECONDS} s kept running; kubelet back and Ready in {back:.1f} s",
    )
