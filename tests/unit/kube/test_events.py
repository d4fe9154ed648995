"""The event recorder: `record` never waits on the API server, the queue stays bounded, a refused
Event is logged and the next one still goes out, and each body is what events.k8s.io/v1 accepts."""

from __future__ import annotations

import queue
import re
import threading
from typing import Any

import pytest

from webhook.kube.events import NOTE_LIMIT, REPEAT_MEMORY, REPORTING_CONTROLLER, EventRecorder, ObjectRef

WAIT = 10.0
CONFIGMAP = ObjectRef("v1", "ConfigMap", "gpuguard", "gpuguard-policy", "uid-1")
# metadata.name of an Event must be a DNS subdomain; eventTime is a MicroTime.
SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
MICRO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")


class Sink:
    """Plays the API server: keeps what it is sent, and can be made to hang or refuse."""

    def __init__(self) -> None:
        self.sent: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self.gate = threading.Event()
        self.gate.set()
        self.refuse: set[str] = set()

    def __call__(self, namespace: str, body: dict[str, Any]) -> None:
        self.gate.wait()
        if body["reason"] in self.refuse:
            raise RuntimeError("(422)\nReason: Unprocessable Entity\nHTTP response headers: ...")
        self.sent.put((namespace, body))


def test_an_event_body_is_what_the_events_api_accepts(stop: threading.Event) -> None:
    sink = Sink()
    recorder = EventRecorder(sink, stop=stop)
    recorder.start()
    recorder.record(CONFIGMAP, "InvalidPolicy", "x" * (NOTE_LIMIT + 10), action="LoadPolicy", warning=True)
    namespace, body = sink.sent.get(timeout=WAIT)
    assert namespace == "gpuguard"
    assert body["apiVersion"] == "events.k8s.io/v1" and body["type"] == "Warning"
    assert SUBDOMAIN.match(body["metadata"]["name"]) and body["metadata"]["name"].startswith(
        "gpuguard-policy."
    )
    assert MICRO_TIME.match(body["eventTime"])
    assert body["reportingController"] == REPORTING_CONTROLLER and body["reportingInstance"]
    assert body["regarding"] == {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "namespace": "gpuguard",
        "name": "gpuguard-policy",
        "uid": "uid-1",
    }
    assert len(body["note"]) == NOTE_LIMIT and body["action"] == "LoadPolicy"


def test_record_does_not_wait_for_a_hanging_api_server_and_the_queue_stays_bounded(
    stop: threading.Event,
) -> None:
    sink = Sink()
    sink.gate.clear()  # the API server takes every request and never answers
    recorder = EventRecorder(sink, stop=stop, limit=3)
    recorder.start()
    for index in range(10):
        recorder.record(CONFIGMAP, "PolicyLoaded", f"policy {index}", action="LoadPolicy", warning=False)
    # The sender holds at most one in its hands (6 dropped), or took none yet (7 dropped); the queue
    # keeps the newest three either way.
    assert recorder.pending() <= 3
    assert recorder.dropped in (6, 7)
    sink.gate.set()
    notes = [sink.sent.get(timeout=WAIT)[1]["note"] for _ in range(10 - recorder.dropped)]
    assert notes[-1] == "policy 9"


def test_a_refused_event_is_logged_and_the_next_one_still_goes_out(
    stop: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    sink = Sink()
    sink.refuse.add("InvalidPolicy")
    recorder = EventRecorder(sink, stop=stop)
    recorder.start()
    recorder.record(CONFIGMAP, "InvalidPolicy", "bad", action="LoadPolicy", warning=True)
    recorder.record(CONFIGMAP, "PolicyLoaded", "good", action="LoadPolicy", warning=False)
    assert sink.sent.get(timeout=WAIT)[1]["reason"] == "PolicyLoaded"
    assert recorder.failed == 1
    (warning,) = [r for r in caplog.records if r.name == "gpuguard.events"]
    # One readable line: the status, not the response headers.
    assert "InvalidPolicy" in warning.getMessage() and "headers" not in warning.getMessage()


def test_the_sender_ends_when_stopped(stop: threading.Event) -> None:
    recorder = EventRecorder(Sink(), stop=stop)
    recorder.start()
    stop.set()
    recorder.thread.join(WAIT)
    assert not recorder.thread.is_alive()


def test_deduplication_stays_bounded_and_linear_past_its_memory(stop: threading.Event) -> None:
    # An open breaker over 30,000 pods says "eviction held" once for each, all within one repeat window.
    clock = [1000.0]
    recorder = EventRecorder(Sink(), stop=stop, clock=lambda: clock[0])
    remembered = []
    for index in range(30_000):
        recorder.record(CONFIGMAP, "EvictionHeld", f"pod {index}", action="Evict", warning=True)
        remembered.append(len(recorder._recent))
        clock[0] += 0.001
    # The memory never passes its bound (each record forgets at most what it added: linear work).
    assert max(remembered) == REPEAT_MEMORY
    assert remembered[-1] == REPEAT_MEMORY
    # The newest are still recognised as repeats; the oldest were forgotten and go out again.
    recorder.record(CONFIGMAP, "EvictionHeld", "pod 29999", action="Evict", warning=True)
    assert recorder.repeated == 1
    recorder.record(CONFIGMAP, "EvictionHeld", "pod 0", action="Evict", warning=True)
    assert recorder.repeated == 1


def test_an_event_is_sent_again_once_its_repeat_window_passed(stop: threading.Event) -> None:
    clock = [1000.0]
    recorder = EventRecorder(Sink(), stop=stop, clock=lambda: clock[0], repeat_seconds=600)
    recorder.record(CONFIGMAP, "PolicyLoaded", "p", action="LoadPolicy", warning=False)
    clock[0] += 599
    recorder.record(CONFIGMAP, "PolicyLoaded", "p", action="LoadPolicy", warning=False)
    assert (recorder.repeated, recorder.pending()) == (1, 1)
    clock[0] += 1
    recorder.record(CONFIGMAP, "PolicyLoaded", "q", action="LoadPolicy", warning=False)
    assert len(recorder._recent) == 1  # the expired one was forgotten on the way
    recorder.record(CONFIGMAP, "PolicyLoaded", "p", action="LoadPolicy", warning=False)
    assert (recorder.repeated, recorder.pending()) == (1, 3)


def test_the_reporting_instance_is_the_one_given(stop: threading.Event) -> None:
    # The node agent reports as its node: its admission policy refuses Events reported by another.
    sink = Sink()
    recorder = EventRecorder(sink, stop=stop, instance="node-a")
    recorder.start()
    recorder.record(CONFIGMAP, "PolicyLoaded", "p", action="LoadPolicy", warning=False)
    assert sink.sent.get(timeout=WAIT)[1]["reportingInstance"] == "node-a"
