"""The pod device-health watcher and the memory of what a pod's devices reported, against seams: real
informers over listed objects, evictions recorded, a fake clock.

What the pure verdicts cannot show: that the memory of earlier statuses reaches both controllers, that a
device Unknown from the start never evicts however long it stays, and that the memory goes with the pod.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
from typing import Any

from webhook.controllers.fleet import Breaker, DeviceReports, EvictionRateLimits, Ledger, PodIndex
from webhook.controllers.nodehealth import NodeHealth
from webhook.controllers.podhealth import PodHealth
from webhook.kube.events import EventRecorder
from webhook.kube.informer import Change, Informer
from webhook.kube.remediation import EvictionOutcome
from webhook.policy import health
from webhook.policy.health import NodeFacts, PodFacts
from webhook.policy.model import Policy

from .builders import make_policy
from .test_health import raw_device_plugin, raw_node, raw_pod
from .test_nodehealth import Listed, NoStore, RecordedWrites, _registry

NOW = datetime.datetime(2026, 3, 1, 12, 0, tzinfo=datetime.UTC)
CLAIM = "claim:gpu/req"
DEVICE = "k8s.gpu.nvidia.com/claim=uid-gpu-0"
POLICY = make_policy(
    {"health": {"mode": "enforce", "signals": {"podDeviceHealth": {"unknownForSeconds": 300}}}}
)


def dra_pod(state: str) -> dict[str, Any]:
    return raw_pod(gpus=0, claims=["gpu"], devices=[(f"{CLAIM} {DEVICE}", state)])


def driver() -> dict[str, Any]:
    return raw_device_plugin(started=NOW - datetime.timedelta(hours=1))


def facts(raw: dict[str, Any]) -> PodFacts:
    converted = health.pod_facts(raw)
    assert converted is not None
    return converted


class Recorded:
    def __init__(self) -> None:
        self.evicted: list[str] = []

    def evict(self, namespace: str, name: str, uid: str) -> EvictionOutcome:
        self.evicted.append(f"{namespace}/{name}")
        return EvictionOutcome("evicted")


class World:
    """The pod and node informers over listed objects, wired as `gpuguard controllers` wires them."""

    def __init__(self, *pods: dict[str, Any], policy: Policy = POLICY) -> None:
        self.stop = threading.Event()
        self.clock = [NOW]
        self.nodes: Informer[NodeFacts] = Informer(
            "nodes",
            Listed(raw_node("gpu-1")),
            lambda r: (f.name, f) if (f := health.node_facts(r)) else None,
            stop=self.stop,
        )
        self.pods: Informer[PodFacts] = Informer(
            "pods",
            Listed(*pods),
            lambda r: (f.key, f) if (f := health.pod_facts(r)) else None,
            stop=self.stop,
        )
        for informer in (self.nodes, self.pods):
            assert informer.sync()
        self.index = PodIndex()
        self.reports = DeviceReports()
        for key, pod in self.pods.snapshot().items():
            self.index.changed(str(key), pod)
        self.evictions = Recorded()
        self.events = EventRecorder(lambda namespace, body: None, stop=self.stop)
        self.breaker = Breaker(NoStore(), lambda: self.clock[0])
        self.pod_health = PodHealth(
            pods=self.pods,
            nodes=self.nodes,
            index=self.index,
            reports=self.reports,
            namespace_labels=lambda namespace: {},
            breaker=self.breaker,
            fleet_size=lambda: 1,
            limits=EvictionRateLimits(clock=lambda: self.clock[0].timestamp()),
            policy=lambda: policy,
            evictions=self.evictions,
            events=self.events,
            registry=_registry(),
            clock=lambda: self.clock[0],
            stop=self.stop,
        )
        self.writes = RecordedWrites()
        ledger = Ledger()
        for node in self.nodes.snapshot().values():
            ledger.classify(node, policy)
        self.node_health = NodeHealth(
            nodes=self.nodes,
            pods=self.pods,
            index=self.index,
            reports=self.reports,
            ledger=ledger,
            breaker=self.breaker,
            policy=lambda: policy,
            writes=self.writes,
            events=self.events,
            registry=_registry(),
            clock=lambda: self.clock[0],
            on_drain=lambda node: None,
            stop=self.stop,
        )

    def earlier(self, raw: dict[str, Any]) -> None:
        """A status the watch delivered before the one now cached (what the manager feeds the memory)."""
        self.reports.observe(Change(facts(raw).key, None, facts(raw)))

    def at(self, seconds: float) -> None:
        self.clock[0] = NOW + datetime.timedelta(seconds=seconds)


def test_a_dra_device_unknown_from_the_start_is_never_evicted() -> None:
    world = World(dra_pod("Unknown"), driver())
    for seconds in (0, 301, 3600):
        world.at(seconds)
        assert world.pod_health.reconcile("ml/trainer").requeue_after is None
    assert world.evictions.evicted == []


def test_unknown_after_healthy_evicts_once_it_persisted_while_the_driver_runs() -> None:
    world = World(dra_pod("Unknown"), driver())
    world.earlier(dra_pod("Healthy"))
    first = world.pod_health.reconcile("ml/trainer")
    assert first.requeue_after == 300 and world.evictions.evicted == []
    world.at(300)
    world.pod_health.reconcile("ml/trainer")
    assert world.evictions.evicted == ["ml/trainer"]


def test_unknown_after_healthy_while_the_driver_restarts_waits_for_it() -> None:
    restarting = driver()
    restarting["status"]["conditions"][0]["status"] = "False"
    world = World(dra_pod("Unknown"), restarting)
    world.earlier(dra_pod("Healthy"))
    for seconds in (0, 3600):
        world.at(seconds)
        world.pod_health.reconcile("ml/trainer")
    assert world.evictions.evicted == []


def test_the_node_controller_reads_the_same_memory() -> None:
    immediate = make_policy(
        {"health": {"mode": "enforce", "signals": {"podDeviceHealth": {"unknownForSeconds": 0}}}}
    )
    never = World(dra_pod("Unknown"), driver(), policy=immediate)
    never.node_health.reconcile("gpu-1")
    assert never.writes.calls == []

    known = World(dra_pod("Unknown"), driver(), policy=immediate)
    known.earlier(dra_pod("Healthy"))
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
