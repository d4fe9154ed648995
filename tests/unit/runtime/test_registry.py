"""webhook.runtime.metrics.Registry and the EventRecorder's repeat suppression: what the controllers report with."""

from __future__ import annotations

import threading
from typing import Any

from webhook.kube.events import EventRecorder, ObjectRef
from webhook.runtime.metrics import Registry


def test_registered_series_render_as_prometheus_text() -> None:
    registry = Registry()
    registry.counter("gpuguard_things_total", "Things.", ("kind",))
    registry.gauge("gpuguard_open", "Open or not.", (), lambda: [((), 1.0)])
    registry.histogram("gpuguard_seconds", "Time.", ("controller",))
    registry.inc("gpuguard_things_total", "a")
    registry.inc("gpuguard_things_total", "a")
    registry.observe("gpuguard_seconds", 0.003, "node-health")
    text = registry.render()
    assert 'gpuguard_things_total{kind="a"} 2' in text
    assert "gpuguard_open 1" in text
    assert 'gpuguard_seconds_count{controller="node-health"} 1' in text
    assert "# TYPE gpuguard_open gauge" in text
    assert registry.value("gpuguard_things_total", "a") == 2


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_same_event_is_sent_once_per_repeat_period_and_nodes_go_to_default() -> None:
    clock = Clock()
    sent: list[tuple[str, dict[str, Any]]] = []
    recorder = EventRecorder(lambda ns, body: sent.append((ns, body)), stop=threading.Event(), clock=clock)
    node = ObjectRef("v1", "Node", "", "gpu-1")
    for _ in range(3):
        recorder.record(node, "WouldTaintNode", "taint it", action="taint", warning=False)
    recorder.record(node, "WouldTaintNode", "taint it: 2 devices", action="taint", warning=False)
    clock.now = 601
    recorder.record(node, "WouldTaintNode", "taint it", action="taint", warning=False)
    assert recorder.pending() == 3 and recorder.repeated == 2
    recorder.stop.set()
    recorder.start()
    recorder.thread.join(timeout=5)
    namespace, body = sent[0]
    assert namespace == "default" and body["metadata"]["namespace"] == "default"
    assert "namespace" not in body["regarding"]
