"""The time-to-act histograms: how long after gpuguard first saw a node's signals each step was taken,
observed when the step's write goes out (never for a step already on the node, never for a write refused)."""

from __future__ import annotations

import datetime
import re
from typing import Any

import pytest

from tests.harness.wired import NOW, Wired
from tests.unit.controllers.test_nodehealth import ENFORCE
from tests.unit.policy.test_health import GPU, raw_node, raw_pod
from webhook.controllers import series
from webhook.kube.remediation import ConflictError
from webhook.policy.health import records
from webhook.runtime.metrics import Registry

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
    seen = records.NodeRecord(signals={GAP: FIRST_SIGHT})
    wired = Wired(ENFORCE, [raw_node("gpu-1", allocatable=7, record=seen)])
    wired.node_health.reconcile("gpu-1")
    assert observed(wired.registry) == {"condition": (1, 700.0), "taint": (1, 700.0)}
    # Buckets fit minutes and hours, not the reconcile's milliseconds.
    assert f'{series.TIME_TO_ACT}_bucket{{step="taint",le="900.0"}} 1' in wired.registry.render()
    assert f'{series.TIME_TO_ACT}_bucket{{step="taint",le="600.0"}} 0' in wired.registry.render()


def test_a_node_with_nothing_left_to_drain_is_timed_as_drained_once() -> None:
    # Every device gone and no pod on the node: the drain is done as soon as it starts.
    seen = records.NodeRecord(signals={GAP: FIRST_SIGHT})
    wired = Wired(ENFORCE, [raw_node("gpu-1", allocatable=0, record=seen)])
    wired.node_health.reconcile("gpu-1")
    assert observed(wired.registry)["drained"] == (1, 700.0)
    (_, status), _ = wired.writes.calls
    assert status["status"]["conditions"][0]["reason"] == "Drained"


def test_a_step_already_on_the_node_or_refused_is_not_timed() -> None:
    seen = records.NodeRecord(signals={GAP: FIRST_SIGHT})
    wired = Wired(ENFORCE, [raw_node("gpu-1", allocatable=7, record=seen)])

    def conflict(name: str, patch: dict[str, Any]) -> dict[str, Any]:
        raise ConflictError("the node changed")

    wired.writes.patch_status = conflict  # type: ignore[method-assign]
    wired.node_health.reconcile("gpu-1")
    assert observed(wired.registry) == {}


@pytest.mark.parametrize(
    ("record", "waited"),
    [(records.NodeRecord(signals={GAP: FIRST_SIGHT}), 700.0), (None, 0.0)],
    ids=["from-the-node-s-first-signal", "at-first-sight-of-the-report"],
)
def test_an_eviction_is_timed_from_the_first_sight_of_the_failure(
    record: records.NodeRecord | None, waited: float
) -> None:
    unhealthy = raw_pod(devices=[(f"{GPU} GPU-0", "Unhealthy")])
    wired = Wired(ENFORCE, [raw_node("gpu-1", allocatable=7, record=record)], [unhealthy])
    wired.pod_health.reconcile("ml/trainer")
    assert wired.evictions.sent == [("ml", "trainer")]
    assert observed(wired.registry) == {"evicted": (1, waited)}
