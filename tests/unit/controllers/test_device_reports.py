"""The pod device-health watcher and the memory of what a pod's devices reported, against seams: real
informers over listed objects, evictions recorded, a fake clock.

What the pure verdicts cannot show: that the memory of earlier statuses reaches both controllers, that a
device Unknown from the start never evicts however long it stays, and that the memory goes with the pod.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from tests.harness.manifests import make_policy
from tests.harness.wired import NOW, Wired
from tests.unit.policy.test_health import raw_device_plugin, raw_node, raw_pod
from webhook.controllers.fleet import DeviceReports
from webhook.kube.informer import Change
from webhook.policy.health import observed
from webhook.policy.model import Policy

CLAIM = "claim:gpu/req"
DEVICE = "k8s.gpu.nvidia.com/claim=uid-gpu-0"
POLICY = make_policy(
    {"health": {"mode": "enforce", "signals": {"podDeviceHealth": {"unknownForSeconds": 300}}}}
)


def dra_pod(state: str) -> dict[str, Any]:
    return raw_pod(gpus=0, claims=["gpu"], devices=[(f"{CLAIM} {DEVICE}", state)])


def driver() -> dict[str, Any]:
    return raw_device_plugin(started=NOW - datetime.timedelta(hours=1))


def facts(raw: dict[str, Any]) -> observed.PodFacts:
    converted = observed.pod_facts(raw)
    assert converted is not None
    return converted


def one_node_with(*pods: dict[str, Any], policy: Policy = POLICY) -> Wired:
    """One node, gpu-1, and the given pods, both controllers wired as `gpuguard controllers` wires them."""
    return Wired(policy, [raw_node("gpu-1")], pods)


def earlier(world: Wired, raw: dict[str, Any]) -> None:
    """A status the watch delivered before the one now cached (what the manager feeds the memory)."""
    world.reports.observe(Change(facts(raw).key, None, facts(raw)))


def test_a_dra_device_unknown_from_the_start_is_never_evicted() -> None:
    world = one_node_with(dra_pod("Unknown"), driver())
    for seconds in (0, 301, 3600):
        world.at(seconds)
        assert world.pod_health.reconcile("ml/trainer").requeue_after is None
    assert world.evictions.sent == []


def test_unknown_after_healthy_evicts_once_it_persisted_while_the_driver_runs() -> None:
    world = one_node_with(dra_pod("Unknown"), driver())
    earlier(world, dra_pod("Healthy"))
    first = world.pod_health.reconcile("ml/trainer")
    assert first.requeue_after == 300 and world.evictions.sent == []
    world.at(300)
    world.pod_health.reconcile("ml/trainer")
    assert world.evictions.sent == [("ml", "trainer")]


def test_unknown_after_healthy_while_the_driver_restarts_waits_for_it() -> None:
    restarting = driver()
    restarting["status"]["conditions"][0]["status"] = "False"
    world = one_node_with(dra_pod("Unknown"), restarting)
    earlier(world, dra_pod("Healthy"))
    for seconds in (0, 3600):
        world.at(seconds)
        world.pod_health.reconcile("ml/trainer")
    assert world.evictions.sent == []


def test_the_node_controller_reads_the_same_memory() -> None:
    immediate = make_policy(
        {"health": {"mode": "enforce", "signals": {"podDeviceHealth": {"unknownForSeconds": 0}}}}
    )
    never = one_node_with(dra_pod("Unknown"), driver(), policy=immediate)
    never.node_health.reconcile("gpu-1")
    assert never.writes.calls == []

    known = one_node_with(dra_pod("Unknown"), driver(), policy=immediate)
    earlier(known, dra_pod("Healthy"))
    known.node_health.reconcile("gpu-1")
    (kind, status), *_ = known.writes.calls
    (condition,) = status["status"]["conditions"]
    assert kind == "status" and f"{CLAIM}: 1 devices reported Unknown" in condition["message"]


def test_the_memory_goes_with_the_pod() -> None:
    reports = DeviceReports()
    healthy, unknown = facts(dra_pod("Healthy")), facts(dra_pod("Unknown"))
    reports.observe(Change(healthy.key, None, healthy))
    reports.observe(Change(healthy.key, healthy, unknown))
    assert reports.of(unknown).reported == {(CLAIM, DEVICE)}
    reports.observe(Change(healthy.key, unknown, None))
    assert reports.of(unknown).reported == frozenset()


def test_a_pod_replaced_under_the_same_name_starts_with_no_memory() -> None:
    reports = DeviceReports()
    healthy, unknown = facts(dra_pod("Healthy")), facts(dra_pod("Unknown"))
    reports.observe(Change(healthy.key, None, healthy))
    replaced = dataclasses.replace(unknown, uid="uid-of-the-new-pod")
    reports.observe(Change(healthy.key, healthy, replaced))
    assert reports.of(replaced).reported == frozenset()
    # The old pod's memory went with it.
    assert reports.of(unknown).reported == frozenset()
