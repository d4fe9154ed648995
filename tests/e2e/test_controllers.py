"""The node health controller and the pod device-health watcher on the real API server, with the real
kube-controller-manager (Job, disruption, taint-eviction and pod GC controllers) and the test playing
the kubelet (see controllers_harness.py). Each test gets its own nodes, its own policy (on its own
nodes only) and a fresh controllers process."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from controllers_harness import (
    GPU,
    KCM_CONTROLLERS,
    NAMESPACE,
    ControllersProcess,
    Kubelet,
    eventually,
    fast_policy,
    install_rbac,
    own_condition,
    reasons,
    record,
    service_account_kubeconfig,
    taints,
)
from controlplane import ControlPlane

from webhook.policy import health

TAINT = f"{health.TAINT_KEY}:NoSchedule"
STATE_CONFIGMAP = "gpuguard-remediation"

Start = Callable[..., ControllersProcess]


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A control plane of its own (the suite's has no controller manager, and its Jobs must stay
    podless), with the controllers' RBAC from deploy/."""
    plane = ControlPlane.start(control_plane.bin_dir, tmp_path_factory.mktemp("controllers-plane"))
    try:
        plane.start_controller_manager(controllers=KCM_CONTROLLERS)
        install_rbac(plane)
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="module")
def kubeconfig(cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return service_account_kubeconfig(cluster, tmp_path_factory.mktemp("controllers-sa") / "sa.kubeconfig")


@pytest.fixture
def test_id(request: pytest.FixtureRequest) -> str:
    stem = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:30].rstrip("-")
    return f"{stem}-{secrets.token_hex(2)}"


@pytest.fixture
def kubelet(cluster: ControlPlane, test_id: str) -> Iterator[Kubelet]:
    playing = Kubelet(cluster, test_id)
    try:
        yield playing
    finally:
        playing.cleanup()


@pytest.fixture
def ns(cluster: ControlPlane, test_id: str) -> Iterator[str]:
    cluster.kubectl("create", "namespace", test_id)
    yield test_id
    cluster.kubectl("delete", "namespace", test_id, "--wait=false", check=False)


@pytest.fixture
def start(cluster: ControlPlane, kubeconfig: Path, tmp_path: Path) -> Iterator[Start]:
    """Starts controllers with a policy and waits until one leads; all stopped after the test, and the
    breaker's state (fleet-wide) removed."""
    started: list[ControllersProcess] = []

    def start_one(policy: dict[str, Any], identity: str = "a", *, lead: bool = True) -> ControllersProcess:
        process = ControllersProcess(tmp_path / identity, kubeconfig, policy, identity=identity)
        started.append(process)
        process.start()
        process.wait_ready()
        if lead:
            process.wait_leading()
        return process

    try:
        yield start_one
    finally:
        for process in started:
            process.stop()
        cluster.kubectl("delete", "configmap", STATE_CONFIGMAP, "-n", NAMESPACE, "--ignore-not-found")


# --- nodes ---------------------------------------------------------------------------------------------


def test_a_persisting_device_gap_gets_the_condition_the_event_and_the_taint_and_is_undone_once_it_clears(
    cluster: ControlPlane, kubelet: Kubelet, start: Start, test_id: str
) -> None:
    controllers = start(fast_policy(test_id))
    name = kubelet.node(f"{test_id}-a")
    kubelet.devices(name, capacity=8, allocatable=7)

    eventually(lambda: TAINT in taints(cluster, name), what="the taint", processes=[controllers])
    condition = own_condition(cluster, name)
    assert condition is not None
    assert (condition["status"], condition["reason"]) == ("False", "DevicesUnhealthy")
    assert "nvidia.com/gpu: 1 of 8 devices unhealthy" in condition["message"]
    node_record = record(cluster, name)
    assert node_record is not None and f"deviceGap/{GPU}" in node_record["signals"]
    eventually(
        lambda: {"DeviceUnhealthy", "NodeTainted"} <= set(reasons(cluster, kind="Node", name=name)),
        what="the Events",
    )
    assert controllers.metric("gpuguard_remediations_total", action="taint", outcome="done") == 1

    kubelet.devices(name, capacity=8, allocatable=8)
    eventually(lambda: TAINT not in taints(cluster, name), what="the taint removed", processes=[controllers])
    assert own_condition(cluster, name) is None
    assert record(cluster, name) is None
    eventually(lambda: "NodeRecovered" in reasons(cluster, kind="Node", name=name), what="NodeRecovered")
