"""The composition root of `gpuguard controllers`: what runs on every replica, what only the leader runs.

Every replica: the policy (file or ConfigMap, last good kept), the informers (Nodes, Pods, Namespaces,
the breaker's ConfigMap, gpuguard's own admission policies), the Event sender and the probes (HTTP: /healthz, /readyz once the caches
synced, /metrics, /policy). Only the leader, once its caches synced and it holds the Lease: the node
health controller, the pod device-health watcher and the native admission policies of `admission.mode`
(controllers/nativesync.py). The standby keeps warm caches, so it takes over
within the lease duration of a leader's death, and at once when the leader stops cleanly (it releases
the Lease on SIGTERM). A leader that loses its Lease exits with status 1: the other replica may act.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import uuid
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from webhook.controllers import nativesync, series
from webhook.controllers.breaker import DUE_LOG_WRITE_SECONDS, disrupts
from webhook.controllers.nodehealth import announce
from webhook.controllers.wiring import HealthControllers
from webhook.kube import fact_sources, remediation
from webhook.kube.client import ApiClient, api_client, metadata_of
from webhook.kube.events import EventRecorder, ObjectRef, api_sender
from webhook.kube.informer import Informer
from webhook.kube.lease import LEASE_SECONDS, RENEW_DEADLINE_SECONDS, RETRY_SECONDS, LeaderElector, LeaseStore
from webhook.kube.policy_source import PolicyConfigMap
from webhook.policy.health import fences, observed
from webhook.policy.model import CONFIGMAP_KEY, Policy
from webhook.runtime import probes
from webhook.runtime.metrics import LabelValues, Registry
from webhook.runtime.policy_store import FileWatcher, PolicyStore, initial_policy

LEASE_NAME = "gpuguard-controllers"
STATE_CONFIGMAP = "gpuguard-remediation"
EXIT_LOST_LEASE = 1

log = logging.getLogger("gpuguard.controllers")


@dataclass(frozen=True)
class Options:
    namespace: str
    host: str = "0.0.0.0"
    port: int = 8081
    kubeconfig: str | None = None
    policy_file: Path | None = None
    policy_configmap: str | None = None
    identity: str = ""
    lease_seconds: float = LEASE_SECONDS
    renew_deadline: float = RENEW_DEADLINE_SECONDS
    retry_seconds: float = RETRY_SECONDS
    # gpuguard's webhook configurations, narrowed in admission.mode hybrid and native.
    webhook_config: str = "gpuguard"


class Metrics(Protocol):
    def render(self) -> str: ...


class LeaderRunnable(Protocol):
    """Work that runs on the leader only, beside the controllers, built by whoever composes the process
    (`gpuguard controllers` adds the audit's report loop this way: controllers never import the audit)."""

    @property
    def metrics(self) -> Metrics: ...

    def start(self) -> None: ...

    def shutdown(self) -> None: ...

    def policy_changed(self) -> None: ...


# What builds a leader runnable: the API client, the live policy and the process's stop event in.
RunnableFactory = Callable[[ApiClient, Callable[[], Policy], threading.Event], LeaderRunnable]


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _node(raw: dict[str, Any]) -> tuple[Hashable, observed.NodeFacts] | None:
    node = observed.node_facts(raw)
    return (node.name, node) if node is not None else None


def _pod(raw: dict[str, Any]) -> tuple[Hashable, observed.PodFacts] | None:
    pod = observed.pod_facts(raw)
    return (pod.key, pod) if pod is not None else None


def _slice(raw: dict[str, Any]) -> tuple[Hashable, observed.SliceFacts] | None:
    piece = observed.slice_facts(raw)
    return (piece.name, piece) if piece is not None else None


def _claim(raw: dict[str, Any]) -> tuple[Hashable, observed.ClaimFacts] | None:
    claim = observed.claim_facts(raw)
    return (claim.key, claim) if claim is not None else None


def _own_rule(raw: dict[str, Any]) -> tuple[Hashable, fences.OwnRule] | None:
    rule = fences.own_rule(raw)
    return (rule.name, rule) if rule is not None else None


def _budget(raw: dict[str, Any]) -> tuple[Hashable, observed.BudgetFacts] | None:
    budget = observed.budget_facts(raw)
    return (budget.key, budget) if budget is not None else None


def _state(raw: dict[str, Any]) -> tuple[Hashable, dict[str, str]] | None:
    data = raw.get("data")
    return str(metadata_of(raw).get("name", "")), dict(data) if isinstance(data, dict) else {}


class ControllerManager:
    def __init__(
        self, options: Options, stop: threading.Event, leader_runnables: Sequence[RunnableFactory] = ()
    ) -> None:
        self.options = options
        self.stop = stop
        self.lost_lease = False
        api = api_client(options.kubeconfig)
        initial, source, self._policy_bytes = initial_policy(options.policy_file)
        self.store = PolicyStore(initial, source=source)
        self.events = EventRecorder(api_sender(api), stop=stop)
        self.registry = Registry()
        self.nodes: Informer[observed.NodeFacts] = Informer("nodes", remediation.nodes(api), _node, stop=stop)
        self.pods: Informer[observed.PodFacts] = Informer("pods", remediation.pods(api), _pod, stop=stop)
        self.namespaces: Informer[dict[str, str]] = Informer(
            "namespaces", remediation.namespaces(api), fact_sources.namespace_labels, stop=stop
        )
        self.state: Informer[dict[str, str]] = Informer(
            "remediation state",
            remediation.config_map(api, options.namespace, STATE_CONFIGMAP),
            _state,
            stop=stop,
        )
        # DRA: a cluster that serves no resource.k8s.io/v1 leaves them unserved, and nodes without devices.
        self.slices: Informer[observed.SliceFacts] = Informer(
            "resourceslices", remediation.resource_slices(api), _slice, stop=stop
        )
        self.claims: Informer[observed.ClaimFacts] = Informer(
            "resourceclaims", remediation.resource_claims(api), _claim, stop=stop
        )
        self.own_rules: Informer[fences.OwnRule] = Informer(
            "devicetaintrules", remediation.own_device_taint_rules(api), _own_rule, stop=stop
        )
        self.budgets: Informer[observed.BudgetFacts] = Informer(
            "poddisruptionbudgets", remediation.disruption_budgets(api), _budget, stop=stop
        )
        # gpuguard's own admission policies and bindings (admission.mode): only those it labelled.
        self.own_native = nativesync.owned_informers(
            lambda resource: remediation.own_native_policies(api, resource), stop
        )
        # gpuguard's webhook configurations, which the leader narrows: not a cache any decision waits on,
        # so they are not in `informers` (readiness); a controllers' Role without their watch leaves them
        # re-narrowed only on the next policy change.
        self.own_configurations = nativesync.configuration_informers(
            lambda kind: remediation.webhook_configuration(api, kind, options.webhook_config), stop
        )
        self.informers: list[Informer[Any]] = [
            self.nodes,
            self.pods,
            self.namespaces,
            self.state,
            self.slices,
            self.claims,
            self.own_rules,
            self.budgets,
            *self.own_native,
        ]
        # Every write of the controllers checks, just before it goes, that this replica renewed the Lease
        # within the renew deadline: a leader paused past its lease never writes beside the new one.
        fence = remediation.Fence(lambda: self.elector.write_window())
        self.controllers = HealthControllers(
            nodes=self.nodes,
            pods=self.pods,
            namespace_labels=self._namespace_labels,
            policy=lambda: self.store.policy,
            writes=remediation.NodeWriter(api, fence),
            rules=remediation.DeviceTaintRuleWriter(api, fence),
            evictions=remediation.Evictor(api, fence),
            breaker_store=remediation.ConfigMapStore(api, options.namespace, STATE_CONFIGMAP, fence),
            events=self.events,
            registry=self.registry,
            clock=_now,
            stop=stop,
            slices=self.slices,
            claims=self.claims,
            own_rules=self.own_rules,
            budgets=self.budgets,
        )
        self.native = nativesync.NativePolicies(
            owned=self.own_native,
            policy=lambda: self.store.policy,
            writes=remediation.NativePolicyWriter(api, fence),
            owner=remediation.NamespaceOwner(api, options.namespace),
            namespace=options.namespace,
            configurations=remediation.WebhookConfigurationWriter(api, options.webhook_config, fence),
            watched=self.own_configurations,
            registry=self.registry,
            stop=stop,
        )
        self.state.on_snapshot(self._state_changed)
        self.runnables = [build(api, lambda: self.store.policy, stop) for build in leader_runnables]
        self.probes = probes.Probes(detail=self._detail, metrics=self._metrics, status=self._status)
        self.probes.add_readiness_check("caches", self.synced)
        self._policy_source(api)
        identity = options.identity or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"
        self.elector = LeaderElector(
            LeaseStore(api, options.namespace, LEASE_NAME),
            identity,
            stop=stop,
            on_started=self._lead,
            on_stopped=self._lose,
            lease_seconds=options.lease_seconds,
            renew_deadline=options.renew_deadline,
            retry_seconds=options.retry_seconds,
        )
        series.register(
            self.registry,
            node_health=self._node_states,
            breaker_open=lambda: self.controllers.breaker.state.open,
            held_nodes=lambda: len(self.controllers.ledger.held()),
            queue_depths=lambda: [
                ("node-health", len(self.controllers.node_health.controller.queue)),
                ("pod-health", len(self.controllers.pod_health.controller.queue)),
                (nativesync.NAME, len(self.native.controller.queue)),
            ],
            leader=lambda: self.elector.leading,
        )

    # --- wiring --------------------------------------------------------------------------------------

    def _policy_source(self, api: ApiClient) -> None:
        if self.options.policy_file is not None:
            watcher = FileWatcher(self.options.policy_file, self.store, self.stop, loaded=self._policy_bytes)
            watcher.thread.start()
            # Not ready without it: a replica that no longer sees edits would miss the kill switch too.
            self.probes.add_readiness_check("policy file", watcher.thread.is_alive)
        if not self.options.policy_configmap:
            self.store.on_loaded = self._policy_loaded
            return
        namespace, _, name = self.options.policy_configmap.partition("/")
        source = f"ConfigMap {namespace}/{name}"
        configmap = PolicyConfigMap(
            api,
            namespace,
            name,
            key=CONFIGMAP_KEY,
            offer=lambda text: self.store.offer(text, source=source),
            events=self.events,
            stop=self.stop,
        )
        self.store.on_error = lambda error: configmap.event("InvalidPolicy", error, warning=True)

        def loaded(policy: Policy) -> None:
            configmap.event(
                "PolicyLoaded", f"policy {policy.hash} is active in the controllers", warning=False
            )
            self._policy_loaded(policy)

        self.store.on_loaded = loaded
        self.informers.append(configmap.informer)

    def _policy_loaded(self, policy: Policy) -> None:
        """Another policy may select other nodes, pools or modes: decide on everything again."""
        for node in self.nodes.snapshot().values():
            self.controllers.ledger.classify(self.controllers.dra.joined(node), policy)
        if self.elector.leading:
            # First the breaker: a trip said in audit holds once a disruptive action is enforced,
            # before any worker acts under the new policy.
            self._evaluate_breaker(policy)
            self.controllers.enqueue_all()
            for runnable in self.runnables:
                runnable.policy_changed()
        # On a standby too: the key waits in the queue, and the workers start with the leadership.
        self.native.policy_changed()

    def _metrics(self) -> str:
        return self.registry.render() + "".join(runnable.metrics.render() for runnable in self.runnables)

    def _state_changed(self, snapshot: Mapping[Hashable, dict[str, str]] | None) -> None:
        if snapshot is None:
            return  # unreadable for now: keep the breaker as it was
        closed = self.controllers.breaker.observe(snapshot.get(STATE_CONFIGMAP))
        if not self.elector.leading:
            return
        self._persist_breaker()
        if closed:
            state = self.controllers.breaker.state
            note = f"circuit breaker closed by {state.closed_by or 'an operator'}; remediation resumes"
            log.warning(note)
            self.events.record(
                self._state_ref(), "CircuitBreakerClosed", note, action="CloseCircuitBreaker", warning=False
            )
            for name in self.controllers.ledger.held():
                self.controllers.node_health.controller.enqueue(name)
            self.controllers.pod_health.enqueue_all()

    def _state_ref(self) -> ObjectRef:
        return ObjectRef("v1", "ConfigMap", self.options.namespace, STATE_CONFIGMAP)

    def _persist_breaker(self) -> None:
        """The leader writes the close time it gave a close that carried none, or the open state a
        ConfigMap lost; a failure is tried again on the next change or leadership."""
        try:
            self.controllers.breaker.persist(self.store.policy)
        except Exception as exc:
            log.warning("could not write the circuit breaker's state: %s", exc)

    def _evaluate_breaker(self, policy: Policy) -> None:
        try:
            trip = self.controllers.breaker.evaluate(
                policy, self.controllers.ledger.fleet_size(), enforced=disrupts(policy)
            )
        except Exception as exc:  # the due nodes' reconciles decide it again
            log.warning("could not decide on the circuit breaker: %s", exc)
            return
        if trip is not None:
            announce(trip, self._state_ref(), self.events, self.registry)

    def _write_due_log(self) -> None:
        """The leader writes the breaker's log as it grows, so a new leader counts what this one saw."""
        while not self.stop.wait(DUE_LOG_WRITE_SECONDS):
            try:
                self.controllers.breaker.flush(self.store.policy)
            except Exception as exc:
                log.warning("could not write the circuit breaker's log: %s", exc)

    def _namespace_labels(self, namespace: str) -> Mapping[str, str] | None:
        return self.namespaces.get(namespace)

    def synced(self) -> bool:
        return all(informer.has_synced() or not informer.served for informer in self.informers)

    def _node_states(self) -> list[LabelValues]:
        return [(node, pool, state) for node, pool, state in self.controllers.ledger.states()]

    def _detail(self) -> str:
        return f"{'leader' if self.elector.leading else 'standby'} policy={self.store.policy.hash}"

    def _status(self) -> dict[str, object]:
        breaker = self.controllers.breaker.state
        return {
            **self.store.status().as_json(),
            "enabled": self.store.policy.enabled and self.store.policy.health.enabled,
            "unavailableLookups": [i.name for i in self.informers if not i.served],
            "role": "leader" if self.elector.leading else "standby",
            "identity": self.elector.identity,
            "leader": self.elector.holder,
            "breaker": {**breaker.to_data(), "wouldOpen": self.controllers.breaker.would_open},
            "heldNodes": self.controllers.ledger.held(),
            "admissionMode": self.store.policy.admission.mode,
            "nativePolicies": self.native.status(),
        }

    # --- leadership ----------------------------------------------------------------------------------

    def _lead(self) -> None:
        policy = self.store.policy
        # The records the nodes carry count against budgets and for the breaker before the first decision.
        nodes = self.nodes.snapshot().values()
        self.controllers.seed(nodes, policy, _now())
        self._persist_breaker()
        threading.Thread(target=self._write_due_log, name="breaker-log", daemon=True).start()
        self.controllers.node_health.controller.start()
        self.controllers.pod_health.controller.start()
        self.native.start_leading()
        self.controllers.enqueue_all()
        for runnable in self.runnables:
            runnable.start()

    def _lose(self) -> None:
        self.lost_lease = True
        self.stop.set()

    def _campaign(self) -> None:
        """Stands for election once every cache has synced: a leader acts on complete knowledge."""
        while not self.synced():
            if self.stop.wait(0.2):
                return
        self.elector.run()

    # --- running -------------------------------------------------------------------------------------

    def start(self) -> None:
        self.events.start()
        for informer in [*self.informers, *self.own_configurations]:
            informer.start()
        threading.Thread(target=self._campaign, name="campaign", daemon=True).start()

    def shutdown(self) -> None:
        """Stops the controllers (a reconcile in flight finishes), then gives up the Lease."""
        self.stop.set()
        self.controllers.node_health.controller.shutdown()
        self.controllers.pod_health.controller.shutdown()
        self.native.controller.shutdown()
        for runnable in self.runnables:
            runnable.shutdown()  # a finished run is kept; one never started has nothing to stop
        if not self.lost_lease:
            self.elector.release()


def run(options: Options, leader_runnables: Sequence[RunnableFactory] = ()) -> int:
    stop = threading.Event()
    manager = ControllerManager(options, stop, leader_runnables)
    server = probes.ProbeServer(manager.probes, options.host, options.port, stop)
    server.start()
    manager.start()
    stop.wait()
    manager.shutdown()
    server.shutdown()
    if manager.lost_lease:
        log.error("exiting: the Lease was lost and the other replica may act")
        return EXIT_LOST_LEASE
    return 0
