"""The node health controller and the pod device-health watcher, wired to each other and to the state
they share (ledger, pod index, device reports, breaker, eviction rate limits) from their seams.

The one place they are built: `gpuguard controllers` passes the API's informers and writers, the fleet-day
bench its simulated cluster, the tests their fakes; a new argument of either controller is added here.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Iterable, Mapping

from webhook.controllers.breaker import Breaker, StateStore
from webhook.controllers.fleet import (
    DeviceReports,
    DisruptionBudgets,
    DraIndex,
    EvictionRateLimits,
    Ledger,
    PodIndex,
)
from webhook.controllers.nodehealth import DeviceTaintRules, NodeHealth, NodeWrites
from webhook.controllers.podhealth import Evictions, PodHealth
from webhook.kube.events import EventRecorder
from webhook.kube.informer import Change, Informer
from webhook.policy.health import fences, observed
from webhook.policy.model import Policy
from webhook.runtime.metrics import Registry


class HealthControllers:
    def __init__(
        self,
        *,
        nodes: Informer[observed.NodeFacts],
        pods: Informer[observed.PodFacts],
        namespace_labels: Callable[[str], Mapping[str, str] | None],
        policy: Callable[[], Policy],
        writes: NodeWrites,
        rules: DeviceTaintRules,
        evictions: Evictions,
        breaker_store: StateStore,
        events: EventRecorder,
        registry: Registry,
        clock: Callable[[], datetime.datetime],
        stop: threading.Event,
        slices: Informer[observed.SliceFacts] | None = None,
        claims: Informer[observed.ClaimFacts] | None = None,
        own_rules: Informer[fences.OwnRule] | None = None,
        budgets: Informer[observed.BudgetFacts] | None = None,
    ) -> None:
        self.ledger = Ledger()
        self.index = PodIndex()
        self.budgets = DisruptionBudgets()
        self.dra = DraIndex(
            fencing=lambda: own_rules is not None and own_rules.served,
            user=lambda key: self.budgets.user(key, pods.get(key), namespace_labels(key.partition("/")[0])),
        )
        self.reports = DeviceReports()
        self.breaker = Breaker(breaker_store, clock)
        self.limits = EvictionRateLimits(clock=lambda: clock().timestamp())
        self.pod_health = PodHealth(
            pods=pods,
            nodes=nodes,
            index=self.index,
            reports=self.reports,
            dra=self.dra,
            namespace_labels=namespace_labels,
            breaker=self.breaker,
            fleet_size=self.ledger.fleet_size,
            limits=self.limits,
            policy=policy,
            evictions=evictions,
            events=events,
            registry=registry,
            clock=clock,
            stop=stop,
        )
        self.node_health = NodeHealth(
            nodes=nodes,
            pods=pods,
            index=self.index,
            reports=self.reports,
            dra=self.dra,
            ledger=self.ledger,
            breaker=self.breaker,
            policy=policy,
            writes=writes,
            rules=rules,
            events=events,
            registry=registry,
            clock=clock,
            on_drain=lambda node: self.pod_health.enqueue(self.index.keys_on(node)),
            stop=stop,
        )
        nodes.on_change(self.node_health.node_changed)
        pods.on_change(self.pod_changed)
        # Without them (a cluster, a bench or a test without DRA) nodes have no DRA devices.
        if slices is not None:
            slices.on_change(lambda change: self.node_health.devices_changed(self.dra.slice_changed(change)))
        if claims is not None:
            claims.on_change(self.claim_changed)
        if own_rules is not None:
            own_rules.on_change(self.rule_changed)
        if budgets is not None:
            budgets.on_change(self.budget_changed)

    def pod_changed(self, change: Change[observed.PodFacts]) -> None:
        # Remembered before either controller is enqueued: neither decides on a status not yet counted.
        self.reports.observe(change)
        self.node_health.pods_changed(self.index.changed(str(change.key), change.new))
        self.pod_health.pod_changed(change)

    def claim_changed(self, change: Change[observed.ClaimFacts]) -> None:
        self.node_health.devices_changed(self.dra.claim_changed(change))
        claims = [claim for claim in (change.old, change.new) if claim is not None]
        self.pod_health.enqueue(sorted({f"{c.namespace}/{pod}" for c in claims for pod in c.pods}))

    def rule_changed(self, change: Change[fences.OwnRule]) -> None:
        """A fence's effect decides whether the pod watcher evicts the pods of its device."""
        self.node_health.devices_changed(self.dra.rule_changed(change))
        rules = [rule for rule in (change.old, change.new) if rule is not None]
        self.pod_health.enqueue(sorted({pod for rule in rules for pod in self.dra.pods_using(rule.device)}))

    def budget_changed(self, change: Change[observed.BudgetFacts]) -> None:
        """A budget may change who is to evict the pods of a fenced device: its rule's effect."""
        self.budgets.changed(change)
        self.node_health.devices_changed(tuple(self.dra.fenced_nodes()))

    def seed(self, nodes: Iterable[observed.NodeFacts], policy: Policy, now: datetime.datetime) -> None:
        """Takes the records the nodes carry into the ledger and the breaker's log."""
        nodes = [self.dra.joined(node) for node in nodes]
        self.ledger.seed(nodes, policy, now)
        self.breaker.seed(nodes)

    def enqueue_all(self) -> None:
        self.node_health.enqueue_all()
        self.pod_health.enqueue_all()
