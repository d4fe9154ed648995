"""The node health controller: one key per Node, `health.plan_node` decides, this writes the difference.

Writes are the difference between the node as cached and as the plan wants it, sent at the cached
resourceVersion: the condition through a strategic merge patch of the status (conditions merge by type,
so others' stay), then taint, cordon and gpuguard's record in one merge patch of the node, so that what
gpuguard did and its record of it can never part. A 409 means the cache is behind the node; the watch
event on its way brings the node back to the queue, and the decision is taken again on what it says.

One worker: budget and breaker decisions are taken one node at a time, from the ledger, which holds
each node's latest plan as soon as it is made (not when the cache catches up with its write).
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from webhook.controllers import series
from webhook.controllers.breaker import Breaker, Trip, disrupts
from webhook.controllers.fleet import DeviceReports, DraIndex, Ledger, PodIndex
from webhook.kube.controller import Controller, Result
from webhook.kube.events import EventRecorder, ObjectRef, Reason
from webhook.kube.informer import Change, Informer
from webhook.kube.remediation import ConflictError, NotFoundError
from webhook.policy.health import fences, ladder, observed, records
from webhook.policy.model import Policy
from webhook.runtime.metrics import Registry

# A node whose write conflicted is looked at again after this, should no watch event bring it back.
CONFLICT_RECHECK_SECONDS = 1.0
EVENT_REASONS: dict[tuple[str, str], Reason] = {
    ("condition", "do"): "DeviceUnhealthy",
    ("condition", "would"): "WouldMarkDeviceUnhealthy",
    ("taint", "do"): "NodeTainted",
    ("taint", "would"): "WouldTaintNode",
    ("drain", "do"): "NodeDrainStarted",
    ("drain", "would"): "WouldDrainNode",
    ("recover", "do"): "NodeRecovered",
    ("recover", "would"): "WouldRecoverNode",
    ("cancel", "do"): "RemediationCancelled",
    ("cancel", "would"): "WouldCancelRemediation",
}
OUTCOMES = {"do": "done", "would": "would", "hold": "held"}

log = logging.getLogger("gpuguard.nodehealth")


class NodeWrites(Protocol):
    def patch(self, name: str, patch: dict[str, Any]) -> dict[str, Any]: ...

    def patch_status(self, name: str, patch: dict[str, Any]) -> dict[str, Any]: ...


class DeviceTaintRules(Protocol):
    def create(self, body: dict[str, Any]) -> None: ...

    def patch_effect(self, name: str, resource_version: str, effect: str) -> None: ...

    def delete(self, name: str, resource_version: str) -> None: ...


def persists(policy: Policy) -> bool:
    """Records go on the nodes once any node action is enforced; before that nothing is written."""
    return any(policy.health_mode(action) == "enforce" for action in ("condition", "taint", "drain"))


def announce(trip: Trip, regarding: ObjectRef, events: EventRecorder, registry: Registry) -> None:
    """The breaker opened (or, in audit and warn mode, would have): the Event, the log line, the count."""
    registry.inc(series.REMEDIATIONS, "breaker", "done" if trip.enforced else "would")
    log.error(
        "circuit breaker %s: %s",
        "opened" if trip.enforced else "would open (no disruptive action is enforced)",
        trip.reason,
        extra={"fields": {"reason": trip.reason, "enforced": trip.enforced}},
    )
    if trip.enforced:
        reason: Reason = "CircuitBreakerOpened"
        note = (
            f"{trip.reason}. Nothing new is tainted, cordoned, drained or evicted until an operator"
            " closes it (gpuguard nodes reset-breaker); recovery goes on"
        )
    else:
        reason, note = (
            "WouldOpenCircuitBreaker",
            f"{trip.reason}. No disruptive action is enforced: nothing is held",
        )
    events.record(regarding, reason, note, action="OpenCircuitBreaker", warning=True)


class NodeHealth:
    def __init__(
        self,
        *,
        nodes: Informer[observed.NodeFacts],
        pods: Informer[observed.PodFacts],
        index: PodIndex,
        reports: DeviceReports,
        dra: DraIndex,
        ledger: Ledger,
        breaker: Breaker,
        policy: Callable[[], Policy],
        writes: NodeWrites,
        rules: DeviceTaintRules,
        events: EventRecorder,
        registry: Registry,
        clock: Callable[[], datetime.datetime],
        on_drain: Callable[[str], None],
        stop: threading.Event,
    ) -> None:
        self.nodes = nodes
        self.pods = pods
        self.index = index
        self.reports = reports
        self.dra = dra
        self.ledger = ledger
        self.breaker = breaker
        self.policy = policy
        self.writes = writes
        self.rules = rules
        self.events = events
        self.registry = registry
        self.clock = clock
        self.on_drain = on_drain
        self.controller: Controller[str] = Controller(
            "node-health",
            self.reconcile,
            stop=stop,
            observe=lambda outcome, seconds: self._observed(outcome, seconds),
        )
        self._reported_errors: set[str] = set()

    def _observed(self, outcome: str, seconds: float) -> None:
        self.registry.inc(series.RECONCILES, "node-health", outcome)
        self.registry.observe(series.RECONCILE_SECONDS, seconds, "node-health")

    # --- informer handlers (the informer's thread) ---------------------------------------------------

    def node_changed(self, change: Change[observed.NodeFacts]) -> None:
        name = str(change.key)
        if change.new is None:
            self.ledger.forget(name)
            self._reported_errors.discard(name)
        else:
            self.ledger.classify(self.dra.joined(change.new), self.policy())
        self.controller.enqueue(name)
        if change.new is not None and change.new.record is not None and change.new.record.draining_since:
            self.on_drain(name)

    def pods_changed(self, nodes: tuple[str, ...]) -> None:
        for name in nodes:
            self.controller.enqueue(name)

    def devices_changed(self, nodes: tuple[str, ...]) -> None:
        """A node's ResourceSlices or its devices' claims changed: DRA devices may make it an
        accelerator node (counted in its pool) or stop doing so."""
        policy = self.policy()
        for name in nodes:
            facts = self.nodes.get(name)
            if facts is not None:
                self.ledger.classify(self.dra.joined(facts), policy)
                self.controller.enqueue(name)

    def enqueue_all(self) -> None:
        for name in self.nodes.snapshot():
            self.controller.enqueue(str(name))

    # --- reconcile -----------------------------------------------------------------------------------

    def reconcile(self, name: str) -> Result:
        node = self.nodes.get(name)
        facts = self.dra.joined(node) if node is not None else None
        if facts is None:
            self.ledger.forget(name)
            self._reported_errors.discard(name)
            return Result()
        if not facts.record_error:
            self._reported_errors.discard(name)  # a record that breaks again is reported again
        elif name not in self._reported_errors:
            self._reported_errors.add(name)
            log.warning("node %s: %s; it is read as no record", name, facts.record_error)
        policy = self.policy()
        now = self.clock()
        persist = persists(policy)
        record = self._record(facts, persist)
        cached = (self.pods.get(key) for key in self.index.keys_on(name))
        pods = [self.reports.of(pod) for pod in cached if pod is not None]
        pool = policy.health.pool_of(facts.labels)
        breaker = self.breaker.state
        fleet = ladder.Fleet(
            pool_nodes=max(self.ledger.pool_size(pool), 1),
            pool_admitted=self.ledger.admitted_in(pool, excluding=name),
            breaker_open=breaker.open,
        )
        previous = self.ledger.entry(name)
        plan = ladder.plan_node(facts, pods, policy, fleet, now, record)
        if plan.clamped:
            # The record is compared across replicas: their wall clocks must agree.
            log.warning(
                "node %s: recorded times later than now (%s) taken as now",
                name,
                ", ".join(plan.clamped),
                extra={"fields": {"node": name, "clamped": list(plan.clamped)}},
            )
        self.ledger.update(name, plan, persisted=_on_node(facts, plan, persist), now=now)
        if not breaker.open and self._trips(facts, plan, policy):
            plan = ladder.plan_node(facts, pods, policy, replace(fleet, breaker_open=True), now, record)
            self.ledger.update(name, plan, persisted=_on_node(facts, plan, persist), now=now)
        if (
            previous is not None
            and previous.record
            and previous.record.admitted_at
            and not plan.budget_slot()
        ):
            # A place in the budget came free: the nodes held for it need not wait for their recheck.
            for held in self.ledger.held():
                self.controller.enqueue(held)
        if not plan.hands_off:
            try:
                self._write(facts, plan, persist=persist, now=now)
            except ConflictError:
                log.debug("node %s changed since it was cached; deciding again", name)
                return Result(requeue_after=CONFLICT_RECHECK_SECONDS)
            except NotFoundError:
                return Result()  # deleted meanwhile: its watch event forgets it
        self._report(facts, plan, policy)
        if any(step.action == "drain" and step.effect == "do" for step in plan.steps):
            self.on_drain(name)
        return Result(requeue_after=plan.requeue_after)

    def _record(self, facts: observed.NodeFacts, persist: bool) -> records.NodeRecord | None:
        """What gpuguard knows of the node: the record on it, or the one kept in memory while nothing
        may be written (audit, warn; a node left alone) or while it holds nothing but first sightings
        (`health.sightings_only`). A record only simulated in audit mode is never taken for what was
        done once the policy enforces."""
        memory = self.ledger.memory(facts.name)
        if not persist:
            return memory or facts.record
        entry = self.ledger.entry(facts.name)
        if memory is not None and entry is not None and entry.hands_off:
            return memory
        if facts.record is None and memory is not None and records.sightings_only(memory):
            return memory
        return facts.record

    def _trips(self, facts: observed.NodeFacts, plan: ladder.NodePlan, policy: Policy) -> bool:
        """Logs the node with the breaker when it became due, and asks the breaker; True when it opened
        now (an audit trip holds nothing)."""
        if plan.hands_off or plan.record is None or plan.record.unhealthy_since is None:
            return False
        if plan.became_due:
            # Only the onset: a record rebuilt from gpuguard's marks (stripped or broken) is dated now
            # and is no new failure; a new leader takes earlier onsets from the records (Breaker.seed).
            self.breaker.became_due(facts.name, facts.uid, plan.record.unhealthy_since)
        trip = self.breaker.evaluate(policy, self.ledger.fleet_size(), enforced=disrupts(policy))
        if trip is None:
            return False
        announce(trip, _ref(facts.name, facts.uid), self.events, self.registry)
        return trip.enforced

    def _write(
        self, facts: observed.NodeFacts, plan: ladder.NodePlan, *, persist: bool, now: datetime.datetime
    ) -> None:
        version = facts.resource_version
        if plan.condition != facts.condition:
            conditions = [_condition(facts, plan, now)]
            patch = {"metadata": {"resourceVersion": version}, "status": {"conditions": conditions}}
            version = _version(self.writes.patch_status(facts.name, patch))
        node_patch: dict[str, Any] = {}
        if plan.tainted != facts.tainted:
            taints = [taint.to_raw() for taint in facts.taints if taint.key != observed.TAINT_KEY]
            if plan.tainted:
                taints.append(observed.Taint(observed.TAINT_KEY, "", "NoSchedule").to_raw())
            node_patch.setdefault("spec", {})["taints"] = taints
        if plan.unschedulable != facts.unschedulable:
            node_patch.setdefault("spec", {})["unschedulable"] = True if plan.unschedulable else None
        if _on_node(facts, plan, persist) and _record_text(plan.record) != _record_text(facts.record):
            node_patch["metadata"] = {"annotations": {records.RECORD_ANNOTATION: _record_text(plan.record)}}
        if node_patch:
            node_patch.setdefault("metadata", {})["resourceVersion"] = version
            self.writes.patch(facts.name, node_patch)
        self._fence(facts, plan)
        self._time_to_act(facts, plan, now)

    def _fence(self, facts: observed.NodeFacts, plan: ladder.NodePlan) -> None:
        """gpuguard's DeviceTaintRules on the node's devices made what the plan wants: created,
        their effect changed, or deleted (a device no longer failed, a node no longer remediated)."""
        existing = self.dra.rules_of(facts.name)
        for device, rule in sorted(existing.items()):
            fence = plan.fences.get(device)
            if fence is None:
                self.rules.delete(rule.name, rule.resource_version)
            elif fence.effect != rule.effect:
                self.rules.patch_effect(rule.name, rule.resource_version, fence.effect)
        for device, fence in sorted(plan.fences.items()):
            if device not in existing:
                self.rules.create(fences.rule_object(fence, facts.name, facts.uid))

    def _time_to_act(self, facts: observed.NodeFacts, plan: ladder.NodePlan, now: datetime.datetime) -> None:
        """Observes, once its write went out, how long after the first sight of the node's signals each
        step was taken: the condition, the taint, the node found drained."""
        if plan.record is None or not plan.record.signals or plan.condition is None:
            return
        before = facts.condition
        steps = {
            "condition": plan.condition.status == "False" and (before is None or before.status != "False"),
            "taint": (plan.tainted and not facts.tainted)
            or any(
                fence.effect != "None" and facts.dra.fenced.get(device) in (None, "None")
                for device, fence in plan.fences.items()
            ),
            "drained": plan.condition.reason == "Drained" and (before is None or before.reason != "Drained"),
        }
        waited = max((now - min(plan.record.signals.values())).total_seconds(), 0.0)
        for step, taken in steps.items():
            if taken:
                self.registry.observe(series.TIME_TO_ACT, waited, step)

    def _report(self, facts: observed.NodeFacts, plan: ladder.NodePlan, policy: Policy) -> None:
        if plan.record_lost:
            log.warning("node %s: %s", facts.name, plan.record_lost)
            self.events.record(
                _ref(facts.name, facts.uid),
                "RemediationRecordLost",
                plan.record_lost,
                action="Adopt",
                warning=True,
            )
        for step in plan.steps:
            self.registry.inc(series.REMEDIATIONS, step.action, OUTCOMES[step.effect])
            reason = EVENT_REASONS.get((step.action, step.effect), "RemediationHeld")
            warning = (
                step.effect == "hold"
                or step.mode == "warn"
                or (step.effect == "do" and step.action != "recover")
            )
            note = step.note if step.effect != "hold" else f"{step.action} held: {step.note}"
            self.events.record(
                _ref(facts.name, facts.uid), reason, note, action=_action(step), warning=warning
            )
            log.info(
                "node %s: %s %s",
                facts.name,
                step.action,
                {"do": "done", "would": f"would be done ({step.mode} mode)", "hold": "held"}[step.effect],
                extra={
                    "fields": {
                        "node": facts.name,
                        "action": step.action,
                        "effect": step.effect,
                        "note": step.note,
                    }
                },
            )


def _ref(name: str, uid: str = "") -> ObjectRef:
    return ObjectRef("v1", "Node", "", name, uid)


def _action(step: ladder.Step) -> str:
    return {
        "condition": "MarkUnhealthy",
        "taint": "Taint",
        "drain": "Drain",
        "recover": "Recover",
        "cancel": "Cancel",
    }[step.action]


def _version(raw: dict[str, Any]) -> str:
    return str(raw["metadata"]["resourceVersion"])


def _on_node(facts: observed.NodeFacts, plan: ladder.NodePlan, persist: bool) -> bool:
    """The plan's record goes on the node: records are written once any node action is enforced, and
    then only when they say more than when signals were first seen, or to change one already there."""
    if not persist:
        return False
    return facts.record is not None or plan.record is None or not records.sightings_only(plan.record)


def _record_text(record: records.NodeRecord | None) -> str | None:
    return record.to_json() if record is not None else None


def _condition(facts: observed.NodeFacts, plan: ladder.NodePlan, now: datetime.datetime) -> dict[str, Any]:
    if plan.condition is None:
        return {"type": observed.CONDITION_TYPE, "$patch": "delete"}
    entry: dict[str, Any] = {
        "type": observed.CONDITION_TYPE,
        "status": plan.condition.status,
        "reason": plan.condition.reason,
        "message": plan.condition.message,
    }
    if facts.condition is None or facts.condition.status != plan.condition.status:
        # A condition's lastTransitionTime moves only when its status does.
        entry["lastTransitionTime"] = records.format_time(now)
        entry["lastHeartbeatTime"] = records.format_time(now)
    return entry
