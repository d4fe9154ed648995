"""The pod device-health watcher: one key per Pod, `health.pod_verdict` decides, the Eviction API acts.

Evicting (never deleting) is what makes a failed device cost a Job nothing: the API server checks the
pod's PodDisruptionBudget, adds `DisruptionTarget` (EvictionByEvictionAPI) before the pod terminates,
and the Job's `DisruptionTarget -> Ignore` rule (gpuguard's webhook injects it) then retries the pod
without counting it against `backoffLimit`. A refused eviction (429) is retried with backoff and
reported stuck after `health.eviction.timeoutSeconds`; it is never turned into a delete
(docs/design/2026-12-04-eviction-api-only.md).

Pods are evicted for an accelerator device they hold that is Unhealthy (or Unknown for long enough,
after it was reported Healthy or Unhealthy: `fleet.DeviceReports`), or because their node is drained.
Only pods of nodes the node controller remediates: a node the cache knows, selected by
`health.nodeSelector`, an accelerator node. The pause, the node's exclusion label, the breaker and the
per-node and per-namespace rate limits hold evictions back; a namespace's `health` mode says whether
they happen. A pod evicted for its device makes its node count as due with the breaker (once per
node), so a fleet-wide false signal on pods opens it as one on nodes does.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Protocol

from webhook.controllers import series
from webhook.controllers.breaker import Breaker, disrupts
from webhook.controllers.fleet import DeviceReports, DraIndex, EvictionRateLimits, PodIndex
from webhook.controllers.nodehealth import announce
from webhook.kube.controller import Controller, Result
from webhook.kube.events import EventRecorder, ObjectRef, Reason
from webhook.kube.informer import Change, Informer
from webhook.kube.remediation import EvictionOutcome
from webhook.policy.health import ladder, observed, podverdicts, signals
from webhook.policy.model import Policy
from webhook.runtime.metrics import Registry

WORKERS = 2

log = logging.getLogger("gpuguard.podhealth")


class Evictions(Protocol):
    def evict(self, namespace: str, name: str, uid: str) -> EvictionOutcome: ...


@dataclass
class _Attempts:
    first: datetime.datetime
    refused: int = 0
    stuck: bool = False


class PodHealth:
    def __init__(
        self,
        *,
        pods: Informer[observed.PodFacts],
        nodes: Informer[observed.NodeFacts],
        index: PodIndex,
        reports: DeviceReports,
        dra: DraIndex,
        namespace_labels: Callable[[str], Mapping[str, str] | None],
        breaker: Breaker,
        fleet_size: Callable[[], int],
        limits: EvictionRateLimits,
        policy: Callable[[], Policy],
        evictions: Evictions,
        events: EventRecorder,
        registry: Registry,
        clock: Callable[[], datetime.datetime],
        stop: threading.Event,
    ) -> None:
        self.pods = pods
        self.nodes = nodes
        self.index = index
        self.reports = reports
        self.dra = dra
        self.namespace_labels = namespace_labels
        self.breaker = breaker
        self.fleet_size = fleet_size
        self.limits = limits
        self.policy = policy
        self.evictions = evictions
        self.events = events
        self.registry = registry
        self.clock = clock
        self.controller: Controller[str] = Controller(
            "pod-health", self.reconcile, stop=stop, workers=WORKERS, observe=self._observed
        )
        self._unknown_since: dict[str, datetime.datetime] = {}
        self._attempts: dict[str, _Attempts] = {}
        self._lock = threading.Lock()

    def _observed(self, outcome: str, seconds: float) -> None:
        self.registry.inc(series.RECONCILES, "pod-health", outcome)
        self.registry.observe(series.RECONCILE_SECONDS, seconds, "pod-health")

    def pod_changed(self, change: Change[observed.PodFacts]) -> None:
        self.controller.enqueue(str(change.key))

    def enqueue(self, keys: list[str]) -> None:
        for key in keys:
            self.controller.enqueue(key)

    def enqueue_all(self) -> None:
        keys: list[Hashable] = list(self.pods.snapshot())
        self.enqueue([str(key) for key in keys])

    def draining(self, node: observed.NodeFacts | None, policy: Policy) -> bool:
        """The node is being drained for real (a drain in audit mode only says it would be). A drain
        gpuguard did always comes with its cordon: a record of one without (an earlier version recorded
        drains only said) evicts nothing until the node controller has cordoned the node."""
        if node is None or node.record is None or policy.health_mode("drain") != "enforce":
            return False
        record = node.record
        return record.draining_since is not None and record.cordoned and record.cancelled_at is None

    def reconcile(self, key: str) -> Result:
        cached = self.pods.get(key)
        if cached is None:
            self._forget(key)
            return Result()
        pod = self.reports.of(cached)
        policy = self.policy()
        now = self.clock()
        known = self.nodes.get(pod.node) if pod.node else None
        # With its DRA devices: a DRA-only node is an accelerator node by its ResourceSlices alone.
        node = self.dra.joined(known) if known is not None else None
        settled = self._driver_settled(pod, policy, now)
        with self._lock:
            if podverdicts.has_unknown_device(pod, policy, driver_settled=settled):
                unknown_since = self._unknown_since.setdefault(key, now)
            else:
                unknown_since = None
                self._unknown_since.pop(key, None)
        verdict = podverdicts.pod_verdict(
            pod,
            policy,
            now,
            draining=self.draining(node, policy),
            unknown_since=unknown_since,
            driver_settled=settled,
            # Pods of a device fenced NoExecute are the device-taint-eviction controller's to remove;
            # a NoSchedule fence leaves them to the Eviction API (`fences.fence_effect`).
            fenced=self.dra.fenced_devices_of(key, "NoSchedule"),
        )
        if not verdict.evict:
            with self._lock:
                self._attempts.pop(key, None)
            return Result(requeue_after=verdict.requeue_after)
        if node is not None and not signals.in_health_scope(node, policy):
            # Outside what gpuguard remediates (health.nodeSelector): not its pod to evict, nor to
            # speak of. Looked at again: the node may be relabelled into scope.
            return Result(requeue_after=ladder.HELD_RECHECK_SECONDS)
        mode = policy.health_mode("evict", pod.namespace, self.namespace_labels(pod.namespace))
        if mode == "off":
            return Result()
        held = self._held(pod, node, policy)
        # A drained node counted as due when the node controller decided the drain.
        if not held and node is not None and verdict.reason != "NodeDrain":
            held = self._count_due(node, policy, enforced=mode == "enforce" or disrupts(policy), now=now)
        if mode != "enforce":
            self._record(
                pod, "WouldEvictPod", f"would evict ({mode} mode): {verdict.message}", warning=mode == "warn"
            )
            self.registry.inc(series.REMEDIATIONS, "evict", "would")
            return Result()
        if held:
            self._record(pod, "EvictionHeld", f"eviction held: {held}; {verdict.message}", warning=True)
            self.registry.inc(series.REMEDIATIONS, "evict", "held")
            return Result(requeue_after=ladder.HELD_RECHECK_SECONDS)
        wait = self.limits.reserve(pod.node, pod.namespace, policy)
        if wait > 0:
            return Result(requeue_after=wait)
        outcome = None
        try:
            outcome = self.evictions.evict(pod.namespace, pod.name, pod.uid)
        finally:
            if outcome is None or outcome.result != "evicted":
                self.limits.release(pod.node, pod.namespace)  # no eviction happened: the slot is free
        return self._evicted(key, pod, verdict, outcome, policy, now)

    def _count_due(
        self, node: observed.NodeFacts, policy: Policy, *, enforced: bool, now: datetime.datetime
    ) -> str:
        """Logs the node as due with the breaker; "circuit breaker open" when that opened it."""
        self.breaker.became_due(node.name, node.uid, now)
        trip = self.breaker.evaluate(policy, self.fleet_size(), enforced=enforced)
        if trip is None:
            return ""
        announce(trip, ObjectRef("v1", "Node", "", node.name, node.uid), self.events, self.registry)
        return "circuit breaker open" if trip.enforced else ""

    def _driver_settled(self, pod: observed.PodFacts, policy: Policy, now: datetime.datetime) -> bool:
        """The device plugins or DRA drivers on the pod's node run settled (asked only of a pod with
        a device that reported before and is Unknown now: the node's pods are not looked at otherwise)."""
        if not any(d.health == "Unknown" and (d.resource, d.device) in pod.reported for d in pod.devices):
            return False
        node_pods = (self.pods.get(key) for key in self.index.keys_on(pod.node))
        return signals.plugins_settled((p for p in node_pods if p is not None), policy, now)

    def _held(self, pod: observed.PodFacts, node: observed.NodeFacts | None, policy: Policy) -> str:
        if node is None:
            return f"node {pod.node} is not known yet, nor its labels"
        left_alone = signals.left_alone(node, policy)
        if left_alone:
            return left_alone
        if self.breaker.state.open:
            return "circuit breaker open"
        return ""

    def _evicted(
        self,
        key: str,
        pod: observed.PodFacts,
        verdict: podverdicts.PodVerdict,
        outcome: EvictionOutcome,
        policy: Policy,
        now: datetime.datetime,
    ) -> Result:
        if outcome.result == "gone":
            self._forget(key)
            return Result()
        if outcome.result == "evicted":
            waited = (now - self._first_sight(key, pod, now)).total_seconds()
            self.registry.observe(series.TIME_TO_ACT, max(waited, 0.0), "evicted")
            self._forget(key)
            self.registry.inc(series.REMEDIATIONS, "evict", "done")
            self._record(
                pod, "PodEvicted", f"evicted through the Eviction API: {verdict.message}", warning=True
            )
            log.info(
                "evicted %s: %s",
                key,
                verdict.message,
                extra={"fields": {"pod": key, "node": pod.node, "reason": verdict.reason}},
            )
            return Result()
        with self._lock:
            attempts = self._attempts.setdefault(key, _Attempts(first=now))
            attempts.refused += 1
            waited = (now - attempts.first).total_seconds()
            newly_stuck = waited >= policy.health.eviction.timeoutSeconds and not attempts.stuck
            attempts.stuck = attempts.stuck or newly_stuck
            refused = attempts.refused
        if newly_stuck:
            self.registry.inc(series.REMEDIATIONS, "evict", "stuck")
            note = (
                f"eviction refused for {waited:.0f} s ({refused} attempts), still retrying: {outcome.message}"
            )
            self._record(pod, "EvictionStuck", note, warning=True)
            log.error("eviction of %s is stuck: %s", key, outcome.message, extra={"fields": {"pod": key}})
        else:
            self.registry.inc(series.REMEDIATIONS, "evict", "blocked")
            self._record(
                pod, "EvictionBlocked", f"eviction refused, will retry: {outcome.message}", warning=True
            )
        return Result(requeue_after=podverdicts.eviction_retry_seconds(policy, refused))

    def _first_sight(self, key: str, pod: observed.PodFacts, now: datetime.datetime) -> datetime.datetime:
        """When what the pod is evicted for was first seen: its node's earliest signal, or its device's
        Unknown report; now when neither (an Unhealthy device is acted on at first sight)."""
        node = self.nodes.get(pod.node)
        moments = list(node.record.signals.values()) if node is not None and node.record is not None else []
        with self._lock:
            unknown = self._unknown_since.get(key)
        return min([*moments, *([unknown] if unknown is not None else [])], default=now)

    def _record(self, pod: observed.PodFacts, reason: Reason, note: str, *, warning: bool) -> None:
        ref = ObjectRef("v1", "Pod", pod.namespace, pod.name, pod.uid)
        self.events.record(ref, reason, note, action="Evict", warning=warning)

    def _forget(self, key: str) -> None:
        with self._lock:
            self._attempts.pop(key, None)
            self._unknown_since.pop(key, None)
