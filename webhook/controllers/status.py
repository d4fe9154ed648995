"""What `gpuguard nodes` reports: the accelerator nodes' device health as the controllers see it.

The verdicts are the controllers' own (`health.plan_node` over the listed Nodes and Pods, the records
on the nodes and the breaker's ConfigMap), computed here and now; nothing is written, except by
`reset_breaker`, which closes the circuit breaker in its ConfigMap, and `acknowledge`, which annotates
one node. The command line (webhook.cli.nodes) prints them.
"""

from __future__ import annotations

import datetime
import getpass
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from webhook.controllers.breaker import BreakerState
from webhook.controllers.fleet import DisruptionBudgets, DraIndex, Ledger
from webhook.kube import fact_sources, remediation
from webhook.kube.client import ApiClient
from webhook.kube.informer import Change, ListWatch, NotServedError
from webhook.policy.health import fences, ladder, observed, records
from webhook.policy.model import CONFIGMAP_KEY, Policy, default_policy, parse_policy

STATE_CONFIGMAP = "gpuguard-remediation"


@dataclass(frozen=True)
class Cluster:
    nodes: list[observed.NodeFacts]
    pods: list[observed.PodFacts]
    breaker: BreakerState


def _list(source: ListWatch) -> Iterable[dict[str, object]]:
    token: str | None = None
    while True:
        page = source.list_page(token)
        yield from page.items
        token = page.continue_token
        if token is None:
            return


def _dra(api: ApiClient, pods: list[observed.PodFacts]) -> DraIndex:
    """The DRA devices of every node: ResourceSlices, allocated claims, gpuguard's DeviceTaintRules and
    the pods using each device (their budgets, their namespaces' labels), joined as the controllers
    join them (none where the cluster does not serve resource.k8s.io/v1)."""
    budgets = DisruptionBudgets()
    for raw in _list(remediation.disruption_budgets(api)):
        if (budget := observed.budget_facts(raw)) is not None:
            budgets.changed(Change(budget.key, None, budget))
    labels = {}
    for raw in _list(remediation.namespaces(api)):
        if (found := fact_sources.namespace_labels(raw)) is not None:
            labels[str(found[0])] = found[1]
    by_key = {pod.key: pod for pod in pods}
    dra = DraIndex(user=lambda key: budgets.user(key, by_key.get(key), labels.get(key.partition("/")[0])))
    try:
        for raw in _list(remediation.resource_slices(api)):
            if (piece := observed.slice_facts(raw)) is not None:
                dra.slice_changed(Change(piece.name, None, piece))
        for raw in _list(remediation.resource_claims(api)):
            if (claim := observed.claim_facts(raw)) is not None:
                dra.claim_changed(Change(claim.key, None, claim))
        for raw in _list(remediation.own_device_taint_rules(api)):
            if (rule := fences.own_rule(raw)) is not None:
                dra.rule_changed(Change(rule.name, None, rule))
    except NotServedError:
        pass
    return dra


def read_cluster(api: ApiClient, namespace: str) -> Cluster:
    pods = [p for raw in _list(remediation.pods(api)) if (p := observed.pod_facts(raw)) is not None]
    dra = _dra(api, pods)
    nodes = [
        dra.joined(n) for raw in _list(remediation.nodes(api)) if (n := observed.node_facts(raw)) is not None
    ]
    state = remediation.ConfigMapStore(api, namespace, STATE_CONFIGMAP).read()
    return Cluster(nodes, pods, BreakerState.from_data(state.data))


def read_policy(api: ApiClient, configmap: str) -> tuple[Policy, str]:
    """The policy the controllers run: the ConfigMap's (PolicyError when invalid), else the embedded one."""
    namespace, _, name = configmap.partition("/")
    stored = remediation.ConfigMapStore(api, namespace, name).read().data.get(CONFIGMAP_KEY)
    if stored is not None:
        return parse_policy(stored), f"ConfigMap {configmap}"
    return default_policy(), "embedded default"


@dataclass(frozen=True)
class Row:
    node: observed.NodeFacts
    # What the leader would decide now; `node.record` is what gpuguard recorded so far.
    plan: ladder.NodePlan


def plans(cluster: Cluster, policy: Policy, now: datetime.datetime) -> list[Row]:
    """Every accelerator node's plan (and any node carrying gpuguard's marks), by name."""
    ledger = Ledger()
    ledger.seed(cluster.nodes, policy, now)
    by_node: dict[str, list[observed.PodFacts]] = {}
    for pod in cluster.pods:
        by_node.setdefault(pod.node, []).append(pod)
    found = []
    for node in sorted(cluster.nodes, key=lambda n: n.name):
        pool = policy.health.pool_of(node.labels)
        fleet = ladder.Fleet(
            pool_nodes=max(ledger.pool_size(pool), 1),
            pool_admitted=ledger.admitted_in(pool, excluding=node.name),
            breaker_open=cluster.breaker.open,
        )
        plan = ladder.plan_node(node, by_node.get(node.name, []), policy, fleet, now)
        if plan.assessment.in_scope or plan.record is not None or plan.steps:
            found.append(Row(node, plan))
    return found


def reset_breaker(api: ApiClient, namespace: str, now: datetime.datetime) -> BreakerState | None:
    """Closes the breaker (at the ConfigMap's version: a concurrent change fails, try again); None when
    it was not open."""
    store = remediation.ConfigMapStore(api, namespace, STATE_CONFIGMAP)
    stored = store.read()
    state = BreakerState.from_data(stored.data)
    if not state.open:
        return None
    # After the opening whatever this machine's clock says: a close dated before it is no close of it.
    closed_at = max(now, state.opened_at + datetime.timedelta(milliseconds=1)) if state.opened_at else now
    closed = BreakerState(False, state.opened_at, state.reason, closed_at, getpass.getuser())
    store.write({**stored.data, **closed.to_data()}, stored)
    return closed


class NodePatch(Protocol):
    def patch(self, name: str, patch: dict[str, Any]) -> dict[str, Any]: ...


def acknowledge(nodes: NodePatch, name: str, now: datetime.datetime) -> str:
    """An operator's acknowledgement of a node: gpuguard forgets the repeated failures and the expected
    device counts it recorded before `now` (the controllers act on the annotation). The time written."""
    moment = records.format_record_time(now)
    nodes.patch(name, {"metadata": {"annotations": {records.ACK_ANNOTATION: moment}}})
    return moment
