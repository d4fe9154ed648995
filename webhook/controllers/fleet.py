"""What the controllers know about the fleet as a whole: the accelerator nodes per pool, gpuguard's
verdict on each node (the ledger), the pods bound to each node, their DRA devices and the eviction
rate limits, the PodDisruptionBudgets (the circuit breaker has a module of its own, `breaker`). Shared by the node health
controller, the pod device-health watcher, the metrics and the probes, so every method is safe from
any thread.

The ledger mirrors the records kept on the nodes (`gpuguard.io/remediation`) and, in audit and warn
mode where nothing is written, holds those records in memory: the budget then counts what enforce
mode would have done.
"""

from __future__ import annotations

import collections
import datetime
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TypeVar

from webhook.kube.informer import Change
from webhook.policy.health import fences, ladder, observed, records, signals
from webhook.policy.model import Policy

_K = TypeVar("_K")


@dataclass(frozen=True)
class Entry:
    pool: str
    state: signals.HealthState
    record: records.NodeRecord | None
    hands_off: str
    held: str
    # The last step taken or recorded, with its effect ("taint do", "drain would", ...).
    last_step: str
    last_step_at: datetime.datetime | None


class Ledger:
    def __init__(self) -> None:
        self._pools: dict[str, str] = {}  # accelerator node -> pool
        self._pool_sizes: collections.Counter[str] = collections.Counter()
        self._entries: dict[str, Entry] = {}
        self._memory: dict[str, records.NodeRecord] = {}
        self._lock = threading.Lock()

    def classify(self, node: observed.NodeFacts, policy: Policy) -> None:
        """Counts the node in its pool when it is an accelerator node (what budgets are shares of)."""
        pool = policy.health.pool_of(node.labels) if signals.in_health_scope(node, policy) else None
        with self._lock:
            self._unpool(node.name)
            if pool is not None:
                self._pools[node.name] = pool
                self._pool_sizes[pool] += 1

    def _unpool(self, name: str) -> None:
        old = self._pools.pop(name, None)
        if old is not None:
            self._pool_sizes[old] -= 1

    def forget(self, name: str) -> None:
        with self._lock:
            self._unpool(name)
            self._entries.pop(name, None)
            self._memory.pop(name, None)

    def seed(self, nodes: Iterable[observed.NodeFacts], policy: Policy, now: datetime.datetime) -> None:
        """Takes the records the nodes carry, before any reconcile decides on a budget: a new leader
        must count the nodes its predecessor acted on, those whose record was stripped or broken but
        that carry gpuguard's taint or condition included (`health.owned_record`)."""
        for node in nodes:
            self.classify(node, policy)
            record, _ = ladder.owned_record(node, node.record, now)
            if record != records.NodeRecord():
                entry = Entry(policy.health.pool_of(node.labels), "unhealthy", record, "", "", "", None)
                with self._lock:
                    self._entries[node.name] = entry

    def pool_size(self, pool: str) -> int:
        with self._lock:
            return self._pool_sizes[pool]

    def fleet_size(self) -> int:
        with self._lock:
            return len(self._pools)

    def admitted_in(self, pool: str, *, excluding: str) -> int:
        with self._lock:
            return sum(
                1
                for name, entry in self._entries.items()
                if name != excluding and entry.pool == pool and entry.record and entry.record.admitted_at
            )

    def held(self) -> list[str]:
        with self._lock:
            return sorted(name for name, entry in self._entries.items() if entry.held)

    def memory(self, name: str) -> records.NodeRecord | None:
        with self._lock:
            return self._memory.get(name)

    def entry(self, name: str) -> Entry | None:
        with self._lock:
            return self._entries.get(name)

    def update(self, name: str, plan: ladder.NodePlan, *, persisted: bool, now: datetime.datetime) -> None:
        with self._lock:
            previous = self._entries.get(name)
            if plan.record is None and plan.assessment.state == "healthy":
                self._entries.pop(name, None)
                self._memory.pop(name, None)
                return
            last = next((s for s in reversed(plan.steps) if s.effect != "hold"), None)
            self._entries[name] = Entry(
                pool=plan.assessment.pool,
                state=plan.assessment.state,
                record=plan.record,
                hands_off=plan.hands_off,
                held=plan.held,
                last_step=f"{last.action} {last.effect}"
                if last
                else (previous.last_step if previous else ""),
                last_step_at=now if last else (previous.last_step_at if previous else None),
            )
            if plan.record is None or (persisted and not plan.hands_off):
                self._memory.pop(name, None)
            else:
                self._memory[name] = plan.record

    def states(self) -> list[tuple[str, str, signals.HealthState]]:
        """(node, pool, state) of every accelerator node."""
        with self._lock:
            return [
                (name, pool, self._entries[name].state if name in self._entries else "healthy")
                for name, pool in self._pools.items()
            ]


class PodIndex:
    """The pods bound to each node, by key, fed by the pod informer's changes."""

    def __init__(self) -> None:
        self._by_node: dict[str, set[str]] = collections.defaultdict(set)
        self._node_of: dict[str, str] = {}
        self._lock = threading.Lock()

    def changed(self, key: str, pod: observed.PodFacts | None) -> tuple[str, ...]:
        """Updates the index; the nodes whose pods changed (the old and the new node)."""
        node = pod.node if pod is not None else ""
        with self._lock:
            old = self._node_of.pop(key, "")
            if old:
                self._by_node[old].discard(key)
                if not self._by_node[old]:
                    del self._by_node[old]
            if node:
                self._node_of[key] = node
                self._by_node[node].add(key)
        return tuple(dict.fromkeys(n for n in (old, node) if n))

    def keys_on(self, node: str) -> list[str]:
        with self._lock:
            return sorted(self._by_node.get(node, ()))


class DraIndex:
    """The ResourceSlices of each node and the allocated claims of each pool, fed by their informers'
    changes: what a node's DRA devices are (`health.node_devices`), and which nodes a change touches.
    A claim belongs to the nodes whose slices publish the pools of its devices, whichever of the two
    the informers deliver first."""

    def __init__(
        self,
        fencing: Callable[[], bool] = lambda: True,
        user: Callable[[str], observed.DeviceUser] | None = None,
    ) -> None:
        # Whether DeviceTaintRules are served (`NodeDevices.fencing`).
        self.fencing = fencing
        # A pod (key) using a device, as `fences.eviction_path` reads it; None: users are not joined in.
        self.user = user
        self._slices: dict[str, observed.SliceFacts] = {}
        self._by_node: dict[str, set[str]] = collections.defaultdict(set)
        # (driver, pool) -> the nodes publishing it, and the claims allocated from it.
        self._pool_nodes: dict[tuple[str, str], set[str]] = collections.defaultdict(set)
        self._claims: dict[str, observed.ClaimFacts] = {}
        self._pool_claims: dict[tuple[str, str], set[str]] = collections.defaultdict(set)
        # device id -> the claims allocated it; pod key -> the claims reserved for it.
        self._device_claims: dict[str, set[str]] = collections.defaultdict(set)
        self._pod_claims: dict[str, set[str]] = collections.defaultdict(set)
        # gpuguard's DeviceTaintRules by node, then by device.
        self._rules: dict[str, dict[str, fences.OwnRule]] = collections.defaultdict(dict)
        self._lock = threading.Lock()

    def slice_changed(self, change: Change[observed.SliceFacts]) -> tuple[str, ...]:
        """Updates the index; the nodes whose devices may have changed."""
        name = str(change.key)
        with self._lock:
            old = self._slices.pop(name, None)
            if old is not None:
                _unlink(self._by_node, old.node, name)
                same_pool = (self._slices[s] for s in self._by_node.get(old.node, ()))
                if not any((s.driver, s.pool) == (old.driver, old.pool) for s in same_pool):
                    _unlink(self._pool_nodes, (old.driver, old.pool), old.node)
            new = change.new
            if new is not None:
                self._slices[name] = new
                self._by_node[new.node].add(name)
                self._pool_nodes[(new.driver, new.pool)].add(new.node)
        return tuple(dict.fromkeys(piece.node for piece in (old, change.new) if piece is not None))

    def claim_changed(self, change: Change[observed.ClaimFacts]) -> tuple[str, ...]:
        key = str(change.key)
        with self._lock:
            old = self._claims.pop(key, None)
            pools = _pools(old) | _pools(change.new)
            for pool in _pools(old):
                _unlink(self._pool_claims, pool, key)
            for device in _devices(old):
                _unlink(self._device_claims, device, key)
            for pod in _users(old):
                _unlink(self._pod_claims, pod, key)
            if change.new is not None:
                self._claims[key] = change.new
                for pool in _pools(change.new):
                    self._pool_claims[pool].add(key)
                for device in _devices(change.new):
                    self._device_claims[device].add(key)
                for pod in _users(change.new):
                    self._pod_claims[pod].add(key)
            nodes = {node for pool in pools for node in self._pool_nodes.get(pool, ())}
        return tuple(sorted(nodes))

    def rule_changed(self, change: Change[fences.OwnRule]) -> tuple[str, ...]:
        nodes = []
        with self._lock:
            for rule in (change.old, change.new):
                if rule is not None:
                    self._rules[rule.node].pop(rule.device, None)
                    nodes.append(rule.node)
            if change.new is not None:
                self._rules[change.new.node][change.new.device] = change.new
            for node in nodes:
                if not self._rules.get(node, True):
                    del self._rules[node]
        return tuple(dict.fromkeys(nodes))

    def rules_of(self, node: str) -> dict[str, fences.OwnRule]:
        """gpuguard's DeviceTaintRules on the node's devices, by device id."""
        with self._lock:
            return dict(self._rules.get(node, {}))

    def pods_using(self, device: str) -> list[str]:
        """The pods (keys) the claims allocated this device are reserved for."""
        with self._lock:
            claims = [self._claims[key] for key in self._device_claims.get(device, ())]
        return sorted({pod for claim in claims for pod in _users(claim)})

    def fenced_devices_of(self, pod: str, effect: str) -> tuple[str, ...]:
        """The devices of the pod's claims that carry gpuguard's DeviceTaintRule of this effect."""
        with self._lock:
            claims = [self._claims[key] for key in self._pod_claims.get(pod, ())]
            rules = {device: rule for node in self._rules.values() for device, rule in node.items()}
        return tuple(
            sorted({d for c in claims for d in _devices(c) if d in rules and rules[d].effect == effect})
        )

    def fenced_nodes(self) -> list[str]:
        """The nodes with gpuguard's DeviceTaintRules on some of their devices."""
        with self._lock:
            return sorted(self._rules)

    def joined(self, node: observed.NodeFacts) -> observed.NodeFacts:
        """The node with the DRA devices its ResourceSlices publish (the Node says nothing of them)."""
        return observed.with_devices(node, self.devices_of(node.name))

    def devices_of(self, node: str) -> observed.NodeDevices:
        with self._lock:
            slices = [self._slices[name] for name in sorted(self._by_node.get(node, ()))]
            pools = {(piece.driver, piece.pool) for piece in slices}
            keys = {key for pool in pools for key in self._pool_claims.get(pool, ())}
            claims = [self._claims[key] for key in sorted(keys)]
            fenced = {device: rule.effect for device, rule in self._rules.get(node, {}).items()}
        devices = observed.node_devices(slices, claims) if slices else observed.NO_DRA_DEVICES
        fencing = self.fencing()
        users = self._users(devices, claims)
        if fenced or not fencing or users:
            return replace(devices, fenced=fenced, fencing=fencing, users=users)
        return devices

    def _users(
        self, devices: observed.NodeDevices, claims: list[observed.ClaimFacts]
    ) -> dict[str, tuple[observed.DeviceUser, ...]]:
        """The pods using each of the node's devices, by device id."""
        if self.user is None:
            return {}
        published = {device.id for device in devices.devices}
        pods: dict[str, set[str]] = collections.defaultdict(set)
        for claim in claims:
            for device in _devices(claim) & published:
                pods[device] |= _users(claim)
        return {
            device: tuple(self.user(pod) for pod in sorted(keys)) for device, keys in sorted(pods.items())
        }


def _pools(claim: observed.ClaimFacts | None) -> set[tuple[str, str]]:
    return {(device.driver, device.pool) for device in claim.devices} if claim is not None else set()


def _devices(claim: observed.ClaimFacts | None) -> set[str]:
    return {device.id for device in claim.devices} if claim is not None else set()


def _users(claim: observed.ClaimFacts | None) -> set[str]:
    return {f"{claim.namespace}/{pod}" for pod in claim.pods} if claim is not None else set()


def _unlink(index: dict[_K, set[str]], key: _K, value: str) -> None:
    members = index.get(key)
    if members is not None:
        members.discard(value)
        if not members:
            del index[key]


class DisruptionBudgets:
    """The PodDisruptionBudgets of each namespace, fed by their informer's changes."""

    def __init__(self) -> None:
        self._by_namespace: dict[str, dict[str, observed.BudgetFacts]] = collections.defaultdict(dict)
        self._lock = threading.Lock()

    def changed(self, change: Change[observed.BudgetFacts]) -> None:
        with self._lock:
            for budget in (change.old, change.new):
                if budget is not None:
                    self._by_namespace[budget.namespace].pop(budget.name, None)
            if change.new is not None:
                self._by_namespace[change.new.namespace][change.new.name] = change.new
            for budget in (change.old, change.new):
                if budget is not None and not self._by_namespace.get(budget.namespace, True):
                    del self._by_namespace[budget.namespace]

    def select(self, namespace: str, labels: Mapping[str, str]) -> bool:
        """Some budget of the namespace selects a pod with these labels."""
        with self._lock:
            budgets = list(self._by_namespace.get(namespace, {}).values())
        return any(budget.selects(labels) for budget in budgets)

    def user(
        self, key: str, pod: observed.PodFacts | None, namespace_labels: Mapping[str, str] | None
    ) -> observed.DeviceUser:
        """A pod (key) using a DRA device, as `fences.eviction_path` reads it: a pod not seen yet may
        have a budget."""
        namespace = key.partition("/")[0]
        budgeted = pod is None or self.select(namespace, pod.labels)
        return observed.DeviceUser(namespace, budgeted, namespace_labels)


class DeviceReports:
    """The DRA devices each pod's status has reported Healthy or Unhealthy, by pod uid, pruned when the
    pod goes: what makes a later Unknown for the same device mean something (`PodFacts.reported`).
    Fed every pod change before either controller is enqueued for it, read by both.

    Kept in memory only. A restart (or a new leader) starts empty and learns again from the statuses it
    sees, so a device already Unknown then does not count until it reports again: that errs towards not
    acting, never towards evicting.
    """

    def __init__(self) -> None:
        self._by_uid: dict[str, frozenset[tuple[str, str]]] = {}
        self._lock = threading.Lock()

    def observe(self, change: Change[observed.PodFacts]) -> None:
        old, new = change.old, change.new
        with self._lock:
            if old is not None and (new is None or new.uid != old.uid):
                self._by_uid.pop(old.uid, None)
            if new is not None and new.reported:
                self._by_uid[new.uid] = self._by_uid.get(new.uid, frozenset()) | new.reported

    def of(self, pod: observed.PodFacts) -> observed.PodFacts:
        """The pod as the verdicts read it: with what its earlier statuses reported."""
        with self._lock:
            earlier = self._by_uid.get(pod.uid, frozenset())
        return observed.with_reported(pod, earlier)


# --- eviction rate limits ----------------------------------------------------------------------------


class EvictionRateLimits:
    """At most n evictions per minute per node and per namespace (health.eviction), sliding window.
    A slot is taken when it is granted, so two workers cannot both take the last one, and given back
    when the eviction did not happen."""

    WINDOW_SECONDS = 60.0

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._times: dict[tuple[str, str], collections.deque[float]] = {}
        self._swept = 0.0
        self._lock = threading.Lock()

    def reserve(self, node: str, namespace: str, policy: Policy) -> float:
        """Takes a slot for one eviction on `node` in `namespace` and answers 0; else the seconds until
        one may be free, taking none."""
        eviction = policy.health.eviction
        now = self.clock()
        keys = (
            (("node", node), eviction.perNodePerMinute),
            (("namespace", namespace), eviction.perNamespacePerMinute),
        )
        with self._lock:
            self._sweep(now)
            waits = [0.0]
            for key, limit in keys:
                times = self._window(key, now)
                if len(times) >= limit:
                    waits.append(times[len(times) - limit] + self.WINDOW_SECONDS - now)
            if max(waits) > 0:
                return max(waits)
            for key, _ in keys:
                self._times.setdefault(key, collections.deque()).append(now)
            return 0.0

    def release(self, node: str, namespace: str) -> None:
        """Gives back the newest slot taken on `node` in `namespace` (its eviction did not happen)."""
        with self._lock:
            for key in (("node", node), ("namespace", namespace)):
                times = self._times.get(key)
                if times:
                    times.pop()
                if not times:
                    self._times.pop(key, None)

    def _window(self, key: tuple[str, str], now: float) -> collections.deque[float]:
        times = self._times.get(key, collections.deque())
        while times and times[0] <= now - self.WINDOW_SECONDS:
            times.popleft()
        return times

    def _sweep(self, now: float) -> None:
        """Once a window, forgets the nodes and namespaces with no eviction in it (nodes come and go)."""
        if now - self._swept < self.WINDOW_SECONDS:
            return
        self._swept = now
        for key in [
            key for key, times in self._times.items() if not times or times[-1] <= now - self.WINDOW_SECONDS
        ]:
            del self._times[key]
