"""Kubernetes Events (`events.k8s.io/v1`) with a fixed vocabulary, sent off the caller's thread.

`record` only queues: it never blocks, never raises and never waits on the API server, so it is safe
under any lock and on any hot path. One sender thread posts the queue with a request timeout; when the
API server is slow or away, the queue stays bounded and the oldest pending Events give way (counted in
`dropped`), since an Event is a courtesy to the reader of `kubectl describe`, never state.
"""

from __future__ import annotations

import collections
import datetime
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from kubernetes import client

log = logging.getLogger("gpuguard.events")

# Every reason gpuguard records, in one place: dashboards and alerts key on these. The controllers'
# Would... reasons say what audit and warn mode would have done.
Reason = Literal[
    "PolicyLoaded",
    "InvalidPolicy",
    "PriorityClassMissing",
    # Nodes (the node health controller)
    "DeviceUnhealthy",
    "WouldMarkDeviceUnhealthy",
    "NodeTainted",
    "WouldTaintNode",
    "NodeDrainStarted",
    "WouldDrainNode",
    "NodeRecovered",
    "WouldRecoverNode",
    "RemediationCancelled",
    "WouldCancelRemediation",
    "RemediationHeld",
    "RemediationRecordLost",
    "CircuitBreakerOpened",
    "WouldOpenCircuitBreaker",
    "CircuitBreakerClosed",
    # Pods (the pod device-health watcher)
    "PodEvicted",
    "WouldEvictPod",
    "EvictionHeld",
    "EvictionBlocked",
    "EvictionStuck",
    # Pods (the node agent, from the PodResources API)
    "DeviceNotAllocatable",
    "DevicesAllocatable",
]
REPORTING_CONTROLLER = "gpuguard.io/gpuguard"
QUEUE_LIMIT = 256
# The same Event (object, reason, note) recorded again within this long is not sent again: a
# level-based controller says "would taint" on every reconcile, a reader needs it once.
REPEAT_SECONDS = 600.0
# At most this many Events remembered for that: past it the oldest is forgotten (its repeat may be sent
# once more), so each record costs the same however many distinct Events a storm brings.
REPEAT_MEMORY = 10_000
REQUEST_TIMEOUT_SECONDS = 5
NOTE_LIMIT = 1024  # the API server refuses longer notes
# Posts one Event body into a namespace; raises when the API server refuses or cannot be reached.
Send = Callable[[str, dict[str, Any]], None]


@dataclass(frozen=True)
class ObjectRef:
    """What an Event is about (`regarding`)."""

    api_version: str
    kind: str
    namespace: str
    name: str
    uid: str = ""


def api_sender(api: client.ApiClient) -> Send:
    events = client.EventsV1Api(api)

    def send(namespace: str, body: dict[str, Any]) -> None:
        events.create_namespaced_event(
            namespace,
            client.EventsV1Event.model_validate(body),
            _preload_content=False,
            _request_timeout=REQUEST_TIMEOUT_SECONDS,
        )

    return send


class EventRecorder:
    def __init__(
        self,
        send: Send,
        *,
        stop: threading.Event,
        limit: int = QUEUE_LIMIT,
        repeat_seconds: float = REPEAT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        instance: str | None = None,
    ) -> None:
        self.send = send
        self.stop = stop
        # Who reports (`reportingInstance`): the replica's host name unless told (the node agent says its
        # node, which is what its admission policy holds it to).
        self.instance = instance or socket.gethostname()
        self.repeat_seconds = repeat_seconds
        self.clock = clock
        self.dropped = 0
        self.repeated = 0
        self.sent = 0
        self.failed = 0
        # Oldest first: every record moves its key to the end.
        self._recent: collections.OrderedDict[tuple[str, str, str, str, str], float] = (
            collections.OrderedDict()
        )
        self._queue: collections.deque[dict[str, Any]] = collections.deque(maxlen=limit)
        self._ready = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="event-recorder", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def record(self, regarding: ObjectRef, reason: Reason, note: str, *, action: str, warning: bool) -> None:
        body = self._body(regarding, reason, note, action=action, warning=warning)
        key = (regarding.kind, regarding.namespace, regarding.name, reason, body["note"])
        now = self.clock()
        with self._ready:
            last = self._recent.get(key)
            if last is not None and now - last < self.repeat_seconds:
                self.repeated += 1
                return
            self._recent[key] = now
            self._recent.move_to_end(key)
            self._forget_old(now)
            if len(self._queue) == self._queue.maxlen:
                self.dropped += 1
            self._queue.append(body)
            self._ready.notify()

    def _forget_old(self, now: float) -> None:
        while self._recent:
            oldest = next(iter(self._recent.values()))
            if len(self._recent) <= REPEAT_MEMORY and now - oldest < self.repeat_seconds:
                return
            self._recent.popitem(last=False)

    def pending(self) -> int:
        with self._ready:
            return len(self._queue)

    def _next(self) -> dict[str, Any] | None:
        with self._ready:
            while not self._queue:
                if self.stop.is_set():
                    return None
                self._ready.wait(timeout=1.0)
            return self._queue.popleft()

    def _run(self) -> None:
        while (body := self._next()) is not None:
            try:
                self.send(body["metadata"]["namespace"], body)
                self.sent += 1
            except Exception as exc:
                self.failed += 1
                # An ApiException's text carries every response header: its first lines say enough.
                why = " ".join(str(exc).splitlines()[:2]) or type(exc).__name__
                regarding = body["regarding"]
                log.warning(
                    "could not record event %s on %s %s/%s: %s",
                    body["reason"],
                    regarding["kind"],
                    regarding.get("namespace", ""),
                    regarding["name"],
                    why,
                )

    def _body(
        self, ref: ObjectRef, reason: Reason, note: str, *, action: str, warning: bool
    ) -> dict[str, Any]:
        regarding = {"apiVersion": ref.api_version, "kind": ref.kind, "name": ref.name}
        if ref.namespace:
            regarding["namespace"] = ref.namespace
        if ref.uid:
            regarding["uid"] = ref.uid
        return {
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            # Named as client-go names them (the API server refuses a generateName ending in "."); the
            # name only has to be unique, and a clash is one lost courtesy, not an error.
            # Events about cluster-scoped objects (Nodes) live in `default`, as client-go puts them.
            "metadata": {"name": f"{ref.name}.{time.time_ns():x}", "namespace": ref.namespace or "default"},
            "eventTime": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "reportingController": REPORTING_CONTROLLER,
            "reportingInstance": self.instance,
            "action": action,
            "reason": reason,
            "note": note[:NOTE_LIMIT],
            "type": "Warning" if warning else "Normal",
            "regarding": regarding,
        }
