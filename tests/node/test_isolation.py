"""The nodes run pods without touching the host: the kubelet's and containerd's default paths, the
kernel tunables the kubelet sets, the network interfaces and the mounts are as they were before the
first node started (the session's teardown checks the same once the nodes are gone)."""

from __future__ import annotations

from tests.harness.admission import gpu_pod, submit
from tests.harness.node import host_state
from tests.harness.workloads import on_node, running, wait_for_pod

from .conftest import NodeCluster, host_changes
from .test_device_health import LONG_RUNNING


def test_running_pods_leave_the_host_as_it_was(cluster: NodeCluster, namespace: str) -> None:
    for name in cluster.nodes:
        submit(
            cluster.plane,
            "create",
            on_node(gpu_pod(name, namespace, restart_policy="Always"), name, LONG_RUNNING),
        )
    for name in cluster.nodes:
        pod = wait_for_pod(cluster.plane, namespace, name, running, what="running")
        assert pod is not None and pod["status"]["podIP"]  # on the tier's bridge

    assert host_changes(cluster.host_before, host_state(cluster.network)) == {}
