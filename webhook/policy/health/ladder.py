"""The ladder: what gpuguard should do about a node (`plan_node`), and when to stop (the breaker).

The controllers hand in the node's facts, its pods, gpuguard's own record of the node, the fleet
figures the budget needs and `now`, and get back a plan. The plan names the node state it wants
(condition, taint, cordon, record) with every step's effect already decided by its mode, so the
caller only writes the difference and records the steps.

Signals are timed from when gpuguard first saw them (kept in the record, on the node), never from a
`lastTransitionTime`, which agents reset (karpenter#2833) or backdate.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from webhook.policy.health.fences import DeviceFence, failed_devices, fence_effect
from webhook.policy.health.observed import (
    TAINT_KEY,
    NodeFacts,
    OwnCondition,
    PodFacts,
)
from webhook.policy.health.records import (
    ACK_ANNOTATION,
    RECORD_ANNOTATION,
    NodeRecord,
    clamped,
)
from webhook.policy.health.signals import (
    Assessment,
    Signal,
    assess,
    left_alone,
    listed,
    not_ready,
    registered_devices,
)
from webhook.policy.model import Mode, Policy
from webhook.policy.model_health import scaled_count

# A node held back (budget, breaker, someone else's cordon) is looked at again this often, since what
# holds it changes on other nodes.
HELD_RECHECK_SECONDS = 30.0

Effect = Literal["do", "would", "hold"]
# The steps of the ladder as they appear in Events, metrics and `gpuguard nodes`.
StepAction = Literal["condition", "taint", "drain", "recover", "cancel"]


# --- plan: what to do about it -----------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    action: StepAction
    effect: Effect
    mode: Mode
    note: str


@dataclass(frozen=True)
class Fleet:
    """What the budget needs to know beyond the node: its pool, and who else is being acted on."""

    pool_nodes: int
    # Nodes of the pool gpuguard acts on now (admitted), this node left out.
    pool_admitted: int
    breaker_open: bool


@dataclass(frozen=True)
class NodePlan:
    assessment: Assessment
    # What to keep on the node; None: nothing (the annotation goes).
    record: NodeRecord | None
    # The node as wanted after the steps that are done ("do"); "would" and "hold" change nothing.
    condition: OwnCondition | None
    tainted: bool
    unschedulable: bool
    steps: tuple[Step, ...]
    # Why gpuguard writes nothing to the node at all (excluded, paused, someone else remediates it, the
    # node lifecycle controller handles it); "" otherwise.
    hands_off: str
    # Why disruptive steps are held back (budget, breaker, someone else's cordon); "" otherwise.
    held: str
    requeue_after: float | None
    # The node became due for remediation with this plan (the record's unhealthy_since is new): what
    # the circuit breaker counts. Never for a node left alone.
    became_due: bool = False
    # gpuguard's marks are on the node without a readable record of them: the record was rebuilt from
    # the marks, and this says so (a warning to report); "" otherwise.
    record_lost: str = ""
    # The record's times that were later than now, clamped to now (to log).
    clamped: tuple[str, ...] = ()
    # Why gpuguard keeps its marks on a node whose devices are clear again (repeated failures), until
    # an operator acknowledges it; "" otherwise.
    escalated: str = ""
    # The DeviceTaintRules gpuguard wants on this node's DRA devices, by device id.
    fences: Mapping[str, DeviceFence] = field(default_factory=dict)

    def budget_slot(self) -> bool:
        """The node takes a place in its pool's budget."""
        return self.record is not None and self.record.admitted_at is not None


def budget(policy: Policy, pool_nodes: int) -> int:
    return scaled_count(policy.health.budget.maxUnhealthy, pool_nodes)


def plan_node(
    node: NodeFacts,
    pods: Iterable[PodFacts],
    policy: Policy,
    fleet: Fleet,
    now: datetime.datetime,
    record: NodeRecord | None = None,
) -> NodePlan:
    """The ladder for one node: condition, then taint, then cordon and drain, undone on recovery."""
    record, record_lost = owned_record(node, record if record is not None else node.record, now)
    record, clamped_fields = clamped(record, now)
    record = _carried(node, record)
    assessment = assess(node, pods, policy, now, record)
    fences: dict[str, DeviceFence] = {}
    health = policy.health
    modes: dict[StepAction, Mode] = {
        "condition": policy.health_mode("condition"),
        "taint": policy.health_mode("taint"),
        "drain": policy.health_mode("drain"),
    }
    keep = _Wanted(node.condition, node.tainted, node.unschedulable)
    if not assessment.in_scope and assessment.state == "healthy":
        return NodePlan(assessment, None, *keep.values(), (), "", "", None)

    hands_off = left_alone(node, policy)
    was_due = record.unhealthy_since is not None
    # A node someone else cordoned (a reboot, a maintenance) is theirs until they give it back: it
    # becomes due, for the breaker too, only once gpuguard may act on it.
    may_become_due = not hands_off and not _cordoned_by_others(node, record)
    record = _bookkeeping(record, assessment, node, policy, now, may_become_due=may_become_due)
    steps: list[Step] = []
    wanted = keep
    held = escalated = ""
    due = assessment.due(now)
    if assessment.state == "unhealthy":
        # The disruptive rungs first: the condition's reason tells how far the ladder went.
        ladder: list[Step] = []
        if record.cordoned and not node.unschedulable and not hands_off:
            # An operator uncordoned the node gpuguard drained: they take over until it recovers.
            record = replace(record, cancelled_at=now, cordoned=False, draining_since=None)
            wanted, record = _step(
                ladder,
                wanted,
                record,
                "cancel",
                modes,
                "",
                now,
                change=node.tainted,
                then=replace(wanted, tainted=False),
                mode_of="taint",
                note="an operator uncordoned the node: gpuguard stops remediating it",
            )
        held = hands_off or _held(node, record, assessment, fleet, policy)
        disruptive = modes["taint"] != "off" or modes["drain"] != "off"
        # The condition is an action too: node remediators act on it, so it takes a budget place.
        acting = disruptive or modes["condition"] != "off"
        admitted = record.admitted_at is not None
        if not admitted and acting and not held and due:
            record = replace(record, admitted_at=now)
            admitted = True
        summary = _summary(assessment, due)
        devices = failed_devices(node, due) if node.dra.fencing else {}
        # Failed DRA devices are fenced alone; the node is tainted only for what no fence covers.
        device_only = bool(devices) and all(signal.device_ids for signal in due)
        effects = {key: fence_effect(policy, node.dra.users.get(key, ())) for key in sorted(devices)}
        if admitted and record.cancelled_at is None:
            if device_only:
                change = dict(node.dra.fenced) != effects
                note = f"DeviceTaintRule {_fence_effects(effects)}: {summary}"
                then = wanted
            else:
                change, note = not node.tainted, f"taint {TAINT_KEY}:NoSchedule: {summary}"
                then = replace(wanted, tainted=True)
            wanted, record = _step(
                ladder, wanted, record, "taint", modes, held, now, change=change, note=note, then=then
            )
            if (
                record.draining_since is None
                and assessment.failed_share * 100 >= health.actions.drain.threshold
            ):
                # A node the breaker finds cordoned stays so; no new drain starts while it is open.
                drain_held = held or ("circuit breaker open" if fleet.breaker_open else "")
                wanted, record = _step(
                    ladder,
                    wanted,
                    record,
                    "drain",
                    modes,
                    drain_held,
                    now,
                    change=True,
                    then=replace(wanted, unschedulable=True),
                    note=f"cordon and evict accelerator pods: {_share(assessment)}",
                )
                # Only a drain done is recorded: one only said (audit) is said again, and when the
                # drain is enforced it starts with the cordon, as on any node.
                if ladder and ladder[-1].action == "drain" and ladder[-1].effect == "do":
                    record = replace(record, draining_since=now, cordoned=not node.unschedulable)
        elif held and disruptive and due:
            ladder.append(Step("taint", "hold", modes["taint"], held))
        if modes["taint"] != "off":
            # Until the taint step is done, a None rule: the API's own dry run of the device's eviction.
            enforced = admitted and not held and record.cancelled_at is None and modes["taint"] == "enforce"
            fences = {
                key: replace(device, effect=effects[key] if enforced else "None")
                for key, device in devices.items()
            }
        last = record.last_action, record.last_action_at
        condition = _condition(assessment, record, summary, held)
        wanted, record = _mark(steps, wanted, record, node, condition, modes, hands_off, now)
        if any(step.effect == "do" for step in ladder):
            record = replace(record, last_action=last[0], last_action_at=last[1])
        steps.extend(ladder)
    elif assessment.state == "recovering":
        wanted, record, escalated = _recovering(steps, wanted, record, node, policy, modes, hands_off, now)
    elif assessment.state == "healthy":
        record = _between_episodes(record, policy, now, remediated=False)

    return NodePlan(
        assessment=assessment,
        record=None if _empty(record) else record,
        condition=wanted.condition,
        tainted=wanted.tainted,
        unschedulable=wanted.unschedulable,
        steps=tuple(steps),
        hands_off=hands_off,
        held=held,
        # A node that does not answer restarts its signals' clocks: only its coming back (a change of
        # the node, which requeues it) can change the verdict.
        requeue_after=None if not_ready(node) else _requeue_after(assessment, record, policy, now, held),
        became_due=not was_due and record.unhealthy_since is not None,
        record_lost=record_lost,
        clamped=clamped_fields,
        escalated=escalated,
        fences=fences,
    )


@dataclass(frozen=True)
class _Wanted:
    condition: OwnCondition | None
    tainted: bool
    unschedulable: bool

    def values(self) -> tuple[OwnCondition | None, bool, bool]:
        return self.condition, self.tainted, self.unschedulable


def _step(
    steps: list[Step],
    wanted: _Wanted,
    record: NodeRecord,
    action: StepAction,
    modes: Mapping[StepAction, Mode],
    held: str,
    now: datetime.datetime,
    *,
    change: bool,
    note: str,
    mode_of: StepAction | None = None,
    then: _Wanted | None = None,
) -> tuple[_Wanted, NodeRecord]:
    """One rung: nothing when it changes nothing or its mode is off; held, would, or done, when the
    node is wanted as `then` says (as it was, when None)."""
    mode = modes[mode_of or action]
    if not change or mode == "off":
        return wanted, record
    if held:
        steps.append(Step(action, "hold", mode, held))
        return wanted, record
    if mode != "enforce":
        steps.append(Step(action, "would", mode, note))
        return wanted, record
    steps.append(Step(action, "do", mode, note))
    return then if then is not None else wanted, replace(record, last_action=action, last_action_at=now)


def _mark(
    steps: list[Step],
    wanted: _Wanted,
    record: NodeRecord,
    node: NodeFacts,
    condition: OwnCondition,
    modes: Mapping[StepAction, Mode],
    hands_off: str,
    now: datetime.datetime,
) -> tuple[_Wanted, NodeRecord]:
    """The condition rung: gpuguard's condition as it should read, a step when the node's differs."""
    return _step(
        steps,
        wanted,
        record,
        "condition",
        modes,
        hands_off,
        now,
        change=node.condition != condition,
        then=replace(wanted, condition=condition),
        note=condition.message,
    )


# The condition reasons that say gpuguard drained the node, so cordoned it.
DRAIN_REASONS = frozenset({"Draining", "Drained"})


def owned_record(
    node: NodeFacts, record: NodeRecord | None, now: datetime.datetime
) -> tuple[NodeRecord, str]:
    """gpuguard's record of the node, rebuilt from its marks when there is none (stripped, or
    unreadable) and the node carries gpuguard's taint or condition: what they show gpuguard did keeps
    its budget place and stays gpuguard's to undo. The second value says so ("" for a record read)."""
    if record is not None:
        return record, ""
    own = node.condition
    marks = [mark for mark, on in (("taint", node.tainted), ("condition", own is not None)) if on]
    if not marks:
        return NodeRecord(), ""
    acted = node.tainted or (own is not None and own.status == "False")
    # Only gpuguard's drain writes these reasons, and it drains only a node it cordons itself.
    drained = node.unschedulable and own is not None and own.status == "False" and own.reason in DRAIN_REASONS
    rebuilt = NodeRecord(
        unhealthy_since=now,
        admitted_at=now if acted else None,
        cordoned=drained,
        draining_since=now if drained else None,
        uid=node.uid,
    )
    missing = node.record_error or f"annotation {RECORD_ANNOTATION} is missing"
    cordon = ", its cordon included" if drained else ""
    return (
        rebuilt,
        f"gpuguard's {' and '.join(marks)} are on the node but {missing}: it keeps them as its own{cordon}",
    )


def _carried(node: NodeFacts, record: NodeRecord) -> NodeRecord:
    """What of the record still holds: the expected counts and the history belong to one Node (uid),
    and an operator's acknowledgement newer than the last one taken clears both. A drain gpuguard did
    always comes with its cordon: one recorded without (an earlier version recorded drains it only
    said) was never done."""
    if record.draining_since is not None and not record.cordoned:
        record = replace(record, draining_since=None)
    if record.uid and node.uid and record.uid != node.uid:
        record = replace(record, expected={}, remediations=())
    ack = node.acknowledged_at
    if ack is not None and (record.acknowledged_at is None or ack > record.acknowledged_at):
        kept = tuple(moment for moment in record.remediations if moment > ack)
        record = replace(record, expected={}, remediations=kept, acknowledged_at=ack)
    return record


def _bookkeeping(
    record: NodeRecord,
    assessment: Assessment,
    node: NodeFacts,
    policy: Policy,
    now: datetime.datetime,
    *,
    may_become_due: bool,
) -> NodeRecord:
    """First-seen times of the current signals (a signal that cleared starts again when it returns;
    all start again once a node that did not answer does), when the node first became due (never
    while it is left alone), since when it has been clear, and the devices it showed."""
    signals = {signal.key: signal.since for signal in assessment.signals} if not not_ready(node) else {}
    unhealthy_since = record.unhealthy_since
    if unhealthy_since is None and may_become_due and assessment.due(now):
        unhealthy_since = now
    clear_since = record.clear_since
    if assessment.signals:
        clear_since = None
    elif clear_since is None:
        clear_since = now
    return replace(
        record,
        signals=signals,
        unhealthy_since=unhealthy_since,
        clear_since=clear_since,
        uid=node.uid or record.uid,
        expected=_seen_devices(node, record, policy),
    )


def _seen_devices(node: NodeFacts, record: NodeRecord, policy: Policy) -> dict[str, int]:
    """The most devices seen per resource: what the record expects from now on. No capacity at all
    (a kubelet restart, a plugin gone, a DRA driver whose slices are gone) changes nothing; other
    resource names (a new MIG layout, a new sharing configuration) start again from what the node
    reports. A driver whose pool is being republished keeps what was expected of it."""
    reported = registered_devices(node, policy)
    reported.update((d, record.expected[d]) for d in node.dra.updating if d in record.expected)
    if not reported:
        return dict(record.expected)
    seen = record.expected if set(record.expected) == set(reported) else {}
    return {name: max(count, seen.get(name, 0)) for name, count in reported.items()}


def _held(node: NodeFacts, record: NodeRecord, assessment: Assessment, fleet: Fleet, policy: Policy) -> str:
    """Why no new disruptive step may start on this node; "" when one may."""
    health = policy.health
    if record.cancelled_at is not None:
        return "an operator uncordoned the node during gpuguard's drain; it waits for the node to recover"
    if _cordoned_by_others(node, record):
        return "the node was cordoned by someone else"
    if record.admitted_at is not None:
        return ""
    if fleet.breaker_open:
        return "circuit breaker open"
    allowed = budget(policy, fleet.pool_nodes)
    if fleet.pool_admitted >= allowed:
        pool = f"pool {assessment.pool}" if assessment.pool else "the nodes without a pool label"
        return (
            f"budget: {fleet.pool_admitted} of {fleet.pool_nodes} accelerator nodes of {pool} are being "
            f"remediated and budget.maxUnhealthy {health.budget.maxUnhealthy} allows {allowed}"
        )
    return ""


def _cordoned_by_others(node: NodeFacts, record: NodeRecord) -> bool:
    return node.unschedulable and not record.cordoned and record.draining_since is None


def _fence_effects(effects: Mapping[str, str]) -> str:
    """`key:NoSchedule on a, b; key:NoExecute on c`: the devices fenced, by effect."""
    by_effect: dict[str, list[str]] = {}
    for device, effect in effects.items():
        by_effect.setdefault(effect, []).append(device)
    return "; ".join(f"{TAINT_KEY}:{effect} on {listed(ids)}" for effect, ids in by_effect.items())


def _share(assessment: Assessment) -> str:
    return f"{assessment.failed_share:.0%} of its devices failed"


def _summary(assessment: Assessment, due: Sequence[Signal]) -> str:
    message = "; ".join(signal.message for signal in due or assessment.signals)
    if assessment.correlated_failures:
        message += f"; {assessment.correlated_failures} device-failure exits or crash loops"
    return message


def _condition(assessment: Assessment, record: NodeRecord, summary: str, held: str) -> OwnCondition:
    """False, what node remediators act on, only while gpuguard itself acts on the node; until then
    (held by the budget, the breaker, someone else's cordon; not due yet) status Unknown with reason
    Held, which they leave alone: the remediator a node is handed to obeys gpuguard's brakes."""
    if record.admitted_at is None or record.cancelled_at is not None:
        return OwnCondition("Unknown", "Held", f"{summary}; held: {held or 'the signals have not persisted'}")
    reason = "DevicesUnhealthy"
    if record.draining_since is not None:
        reason = "Drained" if assessment.drained else "Draining"
    return OwnCondition("False", reason, summary)


def _escalation(node: NodeFacts, record: NodeRecord, policy: Policy) -> str:
    """Why the node keeps gpuguard's marks although its devices are clear: it was remediated
    escalation.remediations times within the window that ends with this episode, and no operator
    acknowledged it since. "" when it recovers."""
    escalation = policy.health.recovery.escalation
    episode = record.unhealthy_since
    if not escalation.remediations or record.admitted_at is None or episode is None:
        return ""
    if record.acknowledged_at is not None and record.acknowledged_at >= episode:
        return ""
    start = episode - datetime.timedelta(seconds=escalation.windowSeconds)
    count = 1 + sum(1 for moment in record.remediations if start <= moment < episode)
    if count < escalation.remediations:
        return ""
    return (
        f"remediated {count} times within {escalation.windowSeconds} s: gpuguard keeps its marks until an "
        f"operator acknowledges the node (gpuguard nodes ack {node.name}, or the annotation {ACK_ANNOTATION})"
    )


def _between_episodes(
    record: NodeRecord, policy: Policy, now: datetime.datetime, *, remediated: bool
) -> NodeRecord:
    """What the record keeps once an episode is over: the node's identity, the devices it showed, and
    the episodes gpuguard acted on (this one too when `remediated`) that may still escalate one: within
    the window, after the operator's last acknowledgement."""
    escalation = policy.health.recovery.escalation
    history = set(record.remediations)
    if remediated and record.admitted_at is not None and record.unhealthy_since is not None:
        history.add(record.unhealthy_since)
    start = now - datetime.timedelta(seconds=escalation.windowSeconds)
    if record.acknowledged_at is not None:
        start = max(start, record.acknowledged_at + datetime.timedelta.resolution)
    recent = sorted(moment for moment in history if moment >= start)
    return NodeRecord(
        uid=record.uid,
        expected=record.expected,
        remediations=tuple(recent[-escalation.remediations :]) if escalation.remediations else (),
        acknowledged_at=record.acknowledged_at,
    )


def _recovering(
    steps: list[Step],
    wanted: _Wanted,
    record: NodeRecord,
    node: NodeFacts,
    policy: Policy,
    modes: Mapping[StepAction, Mode],
    hands_off: str,
    now: datetime.datetime,
) -> tuple[_Wanted, NodeRecord, str]:
    """A node clear again: once recovery.afterSeconds have passed gpuguard's marks come off, unless the
    node failed too often (escalation), when they stay with reason RepeatedFailures. The third value
    says why they stay ("" otherwise)."""
    assert record.clear_since is not None
    recover_at = record.clear_since + datetime.timedelta(seconds=policy.health.recovery.afterSeconds)
    if now < recover_at:
        return wanted, record, ""
    escalated = _escalation(node, record, policy)
    if escalated:
        condition = OwnCondition("False", "RepeatedFailures", escalated)
        wanted, record = _mark(steps, wanted, record, node, condition, modes, hands_off, now)
        return wanted, record, escalated
    rest = _between_episodes(record, policy, now, remediated=True)
    wanted, record = _recover(steps, node, record, rest, modes, hands_off, now)
    return wanted, record, ""


def _recover(
    steps: list[Step],
    node: NodeFacts,
    record: NodeRecord,
    rest: NodeRecord,
    modes: Mapping[StepAction, Mode],
    hands_off: str,
    now: datetime.datetime,
) -> tuple[_Wanted, NodeRecord]:
    """Undoes exactly gpuguard's marks: its condition, its taint, and the cordon only if it cordoned.
    Once they are gone the record is `rest`."""
    wanted = _Wanted(node.condition, node.tainted, node.unschedulable)
    undo: list[StepAction] = []
    if node.condition is not None:
        undo.append("condition")
    if node.tainted:
        undo.append("taint")
    if record.cordoned and node.unschedulable:
        undo.append("drain")
    marks = ", ".join({"condition": "condition", "taint": "taint", "drain": "cordon"}[a] for a in undo)
    effects = [modes[action] for action in undo if modes[action] != "off"]
    if not effects:
        return wanted, rest if not undo else record
    note = f"devices healthy again: removing gpuguard's {marks}"
    if hands_off:
        steps.append(Step("recover", "hold", effects[0], hands_off))
        return wanted, record
    # Each mark the node carries comes off where its step is enforced.
    enforced = {action for action in undo if modes[action] == "enforce"}
    wanted = _Wanted(
        None if "condition" in enforced else node.condition,
        False if "taint" in enforced else node.tainted,
        False if "drain" in enforced else node.unschedulable,
    )
    done = all(mode == "enforce" for mode in effects)
    effect: Effect = "do" if any(mode == "enforce" for mode in effects) else "would"
    steps.append(Step("recover", effect, "enforce" if effect == "do" else effects[0], note))
    left = wanted.condition is not None or wanted.tainted or (record.cordoned and wanted.unschedulable)
    if done and not left:
        return wanted, rest
    return wanted, replace(record, last_action="recover", last_action_at=now)


def _empty(record: NodeRecord) -> bool:
    """Nothing worth keeping on the node: what is known of the node itself (uid, devices, the last
    acknowledgement) is kept only along with an episode or a history."""
    return replace(record, uid="", expected={}, acknowledged_at=None) == NodeRecord()


def _requeue_after(
    assessment: Assessment, record: NodeRecord, policy: Policy, now: datetime.datetime, held: str
) -> float | None:
    """When the verdict can next change without any object changing: a signal coming due, recovery.

    A moment already past is no reason to look again: a recovery that is due and still here was only
    said (its mode is audit or warn) and waits for a policy change, which requeues every node anyway.
    """
    moments = [signal.due_at for signal in assessment.signals if not signal.due(now)]
    if assessment.state == "recovering" and record.clear_since is not None:
        moments.append(record.clear_since + datetime.timedelta(seconds=policy.health.recovery.afterSeconds))
    delays = [(moment - now).total_seconds() for moment in moments if moment > now]
    if held:
        delays.append(HELD_RECHECK_SECONDS)
    return min(delays, default=None)


# --- circuit breaker ---------------------------------------------------------------------------------


def breaker_counts_from(
    policy: Policy, now: datetime.datetime, closed_at: datetime.datetime | None
) -> datetime.datetime:
    """From when a node that became due counts for the breaker: its window, cut at its last close."""
    start = now - datetime.timedelta(seconds=policy.health.circuitBreaker.windowSeconds)
    return max(start, closed_at) if closed_at is not None else start


def breaker_demand(
    became_due: Iterable[datetime.datetime],
    policy: Policy,
    now: datetime.datetime,
    closed_at: datetime.datetime | None = None,
) -> int:
    """How many of these nodes became due for remediation within circuitBreaker.windowSeconds and
    since an operator last closed the breaker."""
    start = breaker_counts_from(policy, now, closed_at)
    return sum(1 for moment in became_due if moment >= start)


def breaker_allows(policy: Policy, fleet_nodes: int) -> int:
    return scaled_count(policy.health.circuitBreaker.maxNodes, fleet_nodes)


def breaker_trips(
    became_due: Iterable[datetime.datetime],
    fleet_nodes: int,
    policy: Policy,
    now: datetime.datetime,
    closed_at: datetime.datetime | None = None,
) -> bool:
    """More than circuitBreaker.maxNodes nodes became due for remediation within its window (and since
    an operator last closed the breaker): something fleet-wide is wrong, stop and ask a human."""
    return breaker_demand(became_due, policy, now, closed_at) > breaker_allows(policy, fleet_nodes)
