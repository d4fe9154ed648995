"""The time-to-act histograms: how long after gpuguard first saw a node's signals each step was taken,
observed when the step's write goes out (never for a step already on the node, never for a write refused)."""

from __future__ import annotations

import datetime
import re
import threading
from typing import Any

import pytest

from webhook.controllers import series
from webhook.controllers.fleet import Breaker, DeviceReports, EvictionRateLimits, PodIndex
from webhook.controllers.podhealth import PodHealth
from webhook.kube.events import EventRecorder
from webhook.kube.informer import Informer
from webhook.kube.remediation import ConflictError, EvictionOutcome
from webhook.metrics import Registry
from webhook.policy import health
from webhook.policy.health import NodeFacts, NodeRecord, PodFacts

from .test_health import GPU, raw_node, raw_pod
from .test_nodehealth import ENFORCE, NOW, Listed, NoStore, _registry, controller

FIRST_SIGHT = NOW - datetime.timedelta(seconds=700)
GAP = f"deviceGap/{GPU}"


def observed(registry: Registry) -> dict[str, tuple[int, float]]:
    """step -> (count, sum) of the time-to-act histogram."""
    text = registry.render()
    found: dict[str, tuple[int, float]] = {}
    for step, count in re.findall(rf'^{series.TIME_TO_ACT}_count{{step="(\w+)"}} (\S+)$', text, re.M):
        (total,) = re.findall(rf'^{series.TIME_TO_ACT}_sum{{step="{step}"}} (\S+)$', text, re.M)
        found[step] = (int(count), float(total))
    return found


def test_condition_and_taint_are_timed_from_the_first_sight_of_the_signal() -> None:
    seen = NodeRecord(signals={GAP: FIRST_SIGHT})
    loop, _, _, _ = controller(ENFORCE, raw_node("gpu-1", allocatable=7, record=seen))
    loop.reconcile("gpu-1")
    assert observed(loop.registry) == {"condition": (1, 700.0), "taint": (1, 700.0)}
    # Buckets fit minutes and hours, not the reconcile's milliseconds.
    assert f'{series.TIME_TO_ACT}_bucket{{step="taint",le="900.0"}} 1' in loop.registry.render()
    assert f'{series.TIME_TO_ACT}_bucket{{step="taint",le="600.0"}} 0' in loop.registry.render()


def test_a_node_with_nothing_left_to_drain_is_timed_as_drained_once() -> None:
    # Every device gone and no pod on the node: the drain is done as soon as it starts.
    seen = NodeRecord(signals={GAP: FIRST_SIGHT})
    loop, writes, _, _ = controller(ENFORCE, raw_node("gpu-1", allocatable=0, record=seen))
    loop.reconcile("gpu-1")
    assert observed(loop.registry)["drained"] == (1, 700.0)
    (_, status), _ = writes.calls
    assert status["status"]["conditions"][0]["reason"] == "Drained"


def test_a_step_already_on_the_node_or_refused_is_not_timed() -> None:
    seen = NodeRecord(signals={GAP: FIRST_SIGHT})
    loop, writes, _, _ = controller(ENFORCE, raw_node("gpu-1", allocatable=7, record=seen))

    def conflict(name: str, patch: dict[str, Any]) -> dict[str, Any]:
        raise ConflictError("the node changed")

    writes.patch_status = conflict  # type: ignore[method-assign]
    loop.reconcile("gpu-1")
    assert observed(loop.registry) == {}


class Evicted:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def evict(self, namespace: str, name: str, uid: str) -> EvictionOutcome:
        self.calls.append((namespace, name))
        return EvictionOutcome("evicted")


def pod_health(node: dict[str, Any], pod: dict[str, Any]) -> tuple[PodHealth, Evicted]:
    stop = threading.Event()
    nodes: Informer[NodeFacts] = Informer(
        "nodes", Listed(node), lambda raw: (f.name, f) if (f := health.node_facts(raw)) else None, stop=stop
    )
    pods: Informer[PodFacts] = Informer(
        "pods", Listed(pod), lambda raw: (f.key, f) if (f := health.pod_facts(raw)) else None, stop=stop
    )
    assert nodes.sync() and pods.sync()
    evictions = Evicted()
    watcher = PodHealth(
        pods=pods,
        nodes=nodes,
        index=PodIndex(),
        reports=DeviceReports(),
        namespace_labels=lambda namespace: {},
        breaker=Breaker(NoStore(), lambda: NOW),
        fleet_size=lambda: 1,
        limits=EvictionRateLimits(clock=lambda: NOW.timestamp()),
        policy=lambda: ENFORCE,
        evictions=evictions,
        events=EventRecorder(lambda namespace, body: None, stop=stop),
        registry=_registry(),
        clock=lambda: NOW,
        stop=stop,
    )
    return watcher, evictions


@pytest.mark.parametrize(
    ("record", "waited"),
    [(NodeRecord(signals={GAP: FIRST_SIGHT}), 700.0), (None, 0.0)],
    ids=["from-the-node-s-first-signal", "at-first-sight-of-the-report"],
)
def test_an_eviction_is_timed_from_the_first_sight_of_the_failure(
    record: NodeRecord | None, waited: float
) -> None:
    unhealthy = raw_pod(devices=[(f"{GPU} GPU-0", "Unhealthy")])
    watcher, evictions = pod_health(raw_node("gpu-1", allocatable=7, record=record), unhealthy)
    watcher.reconcile("ml/trainer")
    assert evictions.calls == [("ml", "trainer")]
    assert observed(watcher.registry) == {"evicted": (1, waited)}
