"""`gpuguard nodes`: the accelerator nodes' device health as the controllers see it, from the cluster.

The verdicts are the controllers' own (`health.plan_node` over the listed Nodes and Pods, the records
on the nodes and the breaker's ConfigMap), computed here and now; nothing is written, except by
`reset-breaker`, which closes the circuit breaker in its ConfigMap.
"""

from __future__ import annotations

import datetime
import getpass
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from webhook.controllers.fleet import BreakerState, Ledger
from webhook.kube import remediation
from webhook.kube.client import ApiClient
from webhook.kube.informer import ListWatch
from webhook.policy import health
from webhook.policy.health import Fleet, NodeFacts, NodePlan, PodFacts
from webhook.policy.model import Policy, default_policy, parse_policy
from webhook.policy_store import CONFIGMAP_KEY

STATE_CONFIGMAP = "gpuguard-remediation"
NONE = "<none>"


@dataclass(frozen=True)
class Cluster:
    nodes: list[NodeFacts]
    pods: list[PodFacts]
    breaker: BreakerState


def _list(source: ListWatch) -> Iterable[dict[str, object]]:
    token: str | None = None
    while True:
        page = source.list_page(token)
        yield from page.items
        token = page.continue_token
        if token is None:
            return


def read_cluster(api: ApiClient, namespace: str) -> Cluster:
    nodes = [n for raw in _list(remediation.nodes(api)) if (n := health.node_facts(raw)) is not None]
    pods = [p for raw in _list(remediation.pods(api)) if (p := health.pod_facts(raw)) is not None]
    state = remediation.ConfigMapStore(api, namespace, STATE_CONFIGMAP).read()
    return Cluster(nodes, pods, BreakerState.from_data(state.data))


def read_policy(api: ApiClient, configmap: str | None, policy_file: str | None) -> tuple[Policy, str]:
    """The policy the controllers run: a file, else the ConfigMap, else the embedded default."""
    if policy_file is not None:
        return parse_policy(Path(policy_file).read_text(encoding="utf-8")), f"file {policy_file}"
    if configmap:
        namespace, _, name = configmap.partition("/")
        stored = remediation.ConfigMapStore(api, namespace, name).read().data.get(CONFIGMAP_KEY)
        if stored is not None:
            return parse_policy(stored), f"ConfigMap {configmap}"
    return default_policy(), "embedded default"


@dataclass(frozen=True)
class Row:
    node: NodeFacts
    # What the leader would decide now; `node.record` is what gpuguard recorded so far.
    plan: NodePlan


def plans(cluster: Cluster, policy: Policy, now: datetime.datetime) -> list[Row]:
    """Every accelerator node's plan (and any node carrying gpuguard's marks), by name."""
    ledger = Ledger()
    ledger.seed(cluster.nodes, policy)
    by_node: dict[str, list[PodFacts]] = {}
    for pod in cluster.pods:
        by_node.setdefault(pod.node, []).append(pod)
    found = []
    for node in sorted(cluster.nodes, key=lambda n: n.name):
        pool = policy.health.pool_of(node.labels)
        fleet = Fleet(
            pool_nodes=max(ledger.pool_size(pool), 1),
            pool_admitted=ledger.admitted_in(pool, excluding=node.name),
            breaker_open=cluster.breaker.open,
        )
        plan = health.plan_node(node, by_node.get(node.name, []), policy, fleet, now)
        if plan.assessment.accelerator or plan.record is not None or plan.steps:
            found.append(Row(node, plan))
    return found


def _age(moment: datetime.datetime | None, now: datetime.datetime) -> str:
    """kubectl's way: 45s, 12m, 3h, 2d."""
    if moment is None:
        return NONE
    seconds = max(int((now - moment).total_seconds()), 0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _devices(plan: NodePlan) -> str:
    devices = plan.assessment.devices
    return ",".join(f"{name}={free}/{total}" for name, (free, total) in devices.items()) or NONE


def _signals(plan: NodePlan, now: datetime.datetime) -> str:
    kinds = [f"{s.kind}{'' if s.due(now) else '?'}" for s in plan.assessment.signals]
    kinds += [f"({s.kind} suppressed)" for s in plan.assessment.suppressed]
    return ",".join(dict.fromkeys(kinds)) or NONE


def _state(plan: NodePlan) -> str:
    state = plan.assessment.state
    if plan.hands_off:
        return f"{state},excluded" if "labelled" in plan.hands_off else f"{state},paused"
    return f"{state},held" if plan.held and state == "unhealthy" else state


def _since(row: Row) -> datetime.datetime | None:
    record = row.node.record
    if record is not None and record.unhealthy_since is not None:
        return record.unhealthy_since
    return min((s.since for s in row.plan.assessment.signals), default=None)


def table(found: Sequence[Row], breaker: BreakerState, now: datetime.datetime) -> str:
    header = ("NODE", "POOL", "DEVICES", "SIGNALS", "STATE", "LAST ACTION", "SINCE")
    rows = [header]
    for row in found:
        plan, record = row.plan, row.node.record
        last = (
            f"{record.last_action} {_age(record.last_action_at, now)} ago"
            if record and record.last_action
            else NONE
        )
        rows.append(
            (
                plan.assessment.node,
                plan.assessment.pool or NONE,
                _devices(plan),
                _signals(plan, now),
                _state(plan),
                last,
                _age(_since(row), now),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "   ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    return "\n".join([*lines, "", breaker_line(breaker, now)]) + "\n"


def breaker_line(breaker: BreakerState, now: datetime.datetime) -> str:
    if breaker.open:
        return f"circuit breaker: OPEN for {_age(breaker.opened_at, now)}: {breaker.reason} (gpuguard nodes reset-breaker)"
    closed = (
        f", closed {_age(breaker.closed_at, now)} ago by {breaker.closed_by}" if breaker.closed_at else ""
    )
    return f"circuit breaker: closed{closed}"


EFFECTS = {"do": "next", "would": "would (not enforced)", "hold": "held"}


def explain(row: Row, policy: Policy, breaker: BreakerState, now: datetime.datetime) -> str:
    plan = row.plan
    a = plan.assessment
    lines = [
        f"Node:        {a.node}",
        f"Pool:        {a.pool or NONE}",
        f"Accelerator: {'yes' if a.accelerator else 'no (not selected by the policy, or no accelerator resource or label)'}",
        f"Devices:     {_devices(plan)} (allocatable/capacity)",
        f"State:       {_state(plan)}",
        "Signals:",
    ]
    for s in a.signals:
        due = "due" if s.due(now) else f"due in {_age(now, s.due_at)}"
        confirmed = f", confirmed: {s.confirmed_by}" if s.confirmed_by else ""
        lines.append(
            f"  {s.key}: {s.message} (first seen {_age(s.since, now)} ago, waits {s.for_seconds:g} s: {due}{confirmed})"
        )
    lines += [f"  {NONE}"] if not a.signals else []
    if a.suppressed:
        lines.append("Not counted:")
        lines += [f"  {s.kind}: {s.message}" for s in a.suppressed]
    if a.correlated_failures:
        lines.append(f"Correlated:  {a.correlated_failures} device-failure exits or crash loops on the node")
    record = row.node.record
    if row.node.record_error:
        lines.append(f"Record:      {row.node.record_error}")
    if record is not None:
        lines.append(f"Record ({health.RECORD_ANNOTATION}):")
        for label, moment in (
            ("unhealthy since", record.unhealthy_since),
            ("in the budget since", record.admitted_at),
            ("draining since", record.draining_since),
            ("clear since", record.clear_since),
            ("cancelled by an operator", record.cancelled_at),
        ):
            if moment is not None:
                lines.append(f"  {label}: {health.format_time(moment)} ({_age(moment, now)} ago)")
        lines.append(f"  cordoned by gpuguard: {'yes' if record.cordoned else 'no'}")
        if record.last_action:
            lines.append(f"  last action: {record.last_action} {_age(record.last_action_at, now)} ago")
    modes = ", ".join(
        f"{action} {policy.health_mode(action)}" for action in ("condition", "taint", "drain", "evict")
    )
    lines.append(f"Modes:       {modes}")
    lines.append("Steps now:")
    lines += [f"  {step.action}: {EFFECTS[step.effect]}: {step.note}" for step in plan.steps] or [f"  {NONE}"]
    if plan.hands_off or plan.held:
        lines.append(f"Held:        {plan.hands_off or plan.held}")
    lines.append(breaker_line(breaker, now).capitalize())
    return "\n".join(lines) + "\n"


def reset_breaker(api: ApiClient, namespace: str, now: datetime.datetime) -> BreakerState | None:
    """Closes the breaker (at the ConfigMap's version: a concurrent change fails, try again); None when
    it was not open."""
    store = remediation.ConfigMapStore(api, namespace, STATE_CONFIGMAP)
    stored = store.read()
    state = BreakerState.from_data(stored.data)
    if not state.open:
        return None
    closed = BreakerState(False, state.opened_at, state.reason, now, getpass.getuser())
    store.write({**stored.data, **closed.to_data()}, stored)
    return closed
