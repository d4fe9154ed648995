"""Both remediation controllers wired by `HealthControllers`, as `gpuguard controllers` wires them, over
real informers that list the given objects; node writes, evictions and Events recorded, a clock the test
moves. Nothing runs by itself: a test reconciles the keys it means to."""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from webhook.controllers import series
from webhook.controllers.wiring import HealthControllers
from webhook.kube.events import EventRecorder
from webhook.kube.informer import Informer, ListPage, listed_events
from webhook.kube.remediation import EvictionOutcome, EvictionResult, StoredState
from webhook.policy.health import fences, observed
from webhook.policy.model import Policy
from webhook.runtime.metrics import Registry

NOW = datetime.datetime(2026, 3, 1, 12, 0, tzinfo=datetime.UTC)


class Listed:
    """A ListWatch whose list returns the given objects and whose watch stays silent."""

    def __init__(self, *objects: dict[str, Any]) -> None:
        self.objects = list(objects)

    def list_page(self, continue_token: str | None) -> ListPage:
        return ListPage(self.objects, "1", None)

    @contextlib.contextmanager
    def watch_list(self, timeout_seconds: int) -> Iterator[Iterator[dict[str, Any]]]:
        yield listed_events(self.objects, "1")

    @contextlib.contextmanager
    def watch(self, resource_version: str, timeout_seconds: int) -> Iterator[Iterator[dict[str, Any]]]:
        yield iter(())


class RecordedWrites:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.version = 7

    def patch(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self._answer("node", patch)

    def patch_status(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self._answer("status", patch)

    def _answer(self, kind: str, patch: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((kind, patch))
        self.version += 1
        return {"metadata": {"resourceVersion": str(self.version)}}


class RecordedRules:
    """`DeviceTaintRules`: what was sent, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def create(self, body: dict[str, Any]) -> None:
        self.calls.append(("create", body))

    def patch_effect(self, name: str, resource_version: str, effect: str) -> None:
        self.calls.append(("patch", (name, resource_version, effect)))

    def delete(self, name: str, resource_version: str) -> None:
        self.calls.append(("delete", (name, resource_version)))


class RecordedEvictions:
    def __init__(self, result: EvictionResult = "evicted") -> None:
        self.result = result
        self.sent: list[tuple[str, str]] = []

    def evict(self, namespace: str, name: str, uid: str) -> EvictionOutcome:
        self.sent.append((namespace, name))
        return EvictionOutcome(self.result, "" if self.result == "evicted" else "would violate the budget")


class NoStore:
    def read(self) -> StoredState:
        return StoredState({}, None)

    def write(self, data: dict[str, str], read: StoredState) -> None:
        self.written = data


def registry() -> Registry:
    registry = Registry()
    series.register(
        registry,
        node_health=list,
        breaker_open=lambda: False,
        held_nodes=lambda: 0,
        queue_depths=list,
        leader=lambda: True,
    )
    return registry


class Wired(HealthControllers):
    def __init__(
        self,
        policy: Policy,
        nodes: Sequence[dict[str, Any]],
        pods: Sequence[dict[str, Any]] = (),
        *,
        evictions: RecordedEvictions | None = None,
        slices: Sequence[dict[str, Any]] = (),
        claims: Sequence[dict[str, Any]] = (),
        rules: Sequence[dict[str, Any]] = (),
        budgets: Sequence[dict[str, Any]] = (),
    ) -> None:
        stop = threading.Event()
        self.now = NOW
        self.node_list = Listed(*nodes)
        self.nodes: Informer[observed.NodeFacts] = Informer(
            "nodes",
            self.node_list,
            lambda raw: (f.name, f) if (f := observed.node_facts(raw)) else None,
            stop=stop,
        )
        self.pods: Informer[observed.PodFacts] = Informer(
            "pods",
            Listed(*pods),
            lambda raw: (f.key, f) if (f := observed.pod_facts(raw)) else None,
            stop=stop,
        )
        self.slice_list = Listed(*slices)
        self.slices: Informer[observed.SliceFacts] = Informer(
            "resourceslices",
            self.slice_list,
            lambda raw: (f.name, f) if (f := observed.slice_facts(raw)) else None,
            stop=stop,
        )
        self.claims: Informer[observed.ClaimFacts] = Informer(
            "resourceclaims",
            Listed(*claims),
            lambda raw: (f.key, f) if (f := observed.claim_facts(raw)) else None,
            stop=stop,
        )
        self.own_rules: Informer[fences.OwnRule] = Informer(
            "devicetaintrules",
            Listed(*rules),
            lambda raw: (f.name, f) if (f := fences.own_rule(raw)) else None,
            stop=stop,
        )
        self.budget_list = Listed(*budgets)
        self.budgets_cache: Informer[observed.BudgetFacts] = Informer(
            "poddisruptionbudgets",
            self.budget_list,
            lambda raw: (f.key, f) if (f := observed.budget_facts(raw)) else None,
            stop=stop,
        )
        self.rules = RecordedRules()
        self.sent: list[dict[str, Any]] = []
        self.events = EventRecorder(lambda namespace, body: self.sent.append(body), stop=stop)
        self.writes = RecordedWrites()
        self.evictions = evictions or RecordedEvictions()
        self.registry = registry()
        super().__init__(
            nodes=self.nodes,
            pods=self.pods,
            namespace_labels=lambda namespace: {},
            policy=lambda: policy,
            writes=self.writes,
            rules=self.rules,
            evictions=self.evictions,
            breaker_store=NoStore(),
            events=self.events,
            registry=self.registry,
            clock=lambda: self.now,
            stop=stop,
            slices=self.slices,
            claims=self.claims,
            own_rules=self.own_rules,
            budgets=self.budgets_cache,
        )
        # Synced once wired, as in the manager: the first list reaches the ledger, the pod index and
        # the device reports through the controllers' own change handlers.
        assert (
            self.nodes.sync()
            and self.pods.sync()
            and self.slices.sync()
            and self.claims.sync()
            and self.own_rules.sync()
            and self.budgets_cache.sync()
        )

    def list_nodes(self, *nodes: dict[str, Any]) -> None:
        """The Nodes are now these: listed again, the differences reach the controllers as changes."""
        self.node_list.objects = list(nodes)
        assert self.nodes.sync()

    def list_slices(self, *slices: dict[str, Any]) -> None:
        """The ResourceSlices are now these, as `list_nodes` does for Nodes."""
        self.slice_list.objects = list(slices)
        assert self.slices.sync()

    def list_budgets(self, *budgets: dict[str, Any]) -> None:
        """The PodDisruptionBudgets are now these, as `list_nodes` does for Nodes."""
        self.budget_list.objects = list(budgets)
        assert self.budgets_cache.sync()

    def at(self, seconds: float) -> None:
        self.now = NOW + datetime.timedelta(seconds=seconds)

    def reasons(self) -> list[str]:
        """The reasons of the Events recorded so far, once the recorder has sent them all."""
        self.events.stop.set()
        self.events.start()
        self.events.thread.join(timeout=5)
        return [body["reason"] for body in self.sent]
