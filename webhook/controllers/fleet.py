"""What the controllers know about the fleet as a whole: the accelerator nodes per pool, gpuguard's
verdict on each node (the ledger), the pods bound to each node, the circuit breaker and the eviction
rate limits. Shared by the node health controller, the pod device-health watcher, the metrics and the
probes, so every method is safe from any thread.

The ledger mirrors the records kept on the nodes (`gpuguard.io/remediation`) and, in audit and warn
mode where nothing is written, holds those records in memory: the budget and the breaker then count
what enforce mode would have done.
"""

from __future__ import annotations

import collections
import datetime
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from webhook.kube.remediation import StoredState
from webhook.policy import health
from webhook.policy.health import HealthState, NodeFacts, NodePlan, NodeRecord, PodFacts
from webhook.policy.model import Policy


@dataclass(frozen=True)
class Entry:
    pool: str
    state: HealthState
    record: NodeRecord | None
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
        self._memory: dict[str, NodeRecord] = {}
        self._lock = threading.Lock()

    def classify(self, node: NodeFacts, policy: Policy) -> None:
        """Counts the node in its pool when it is an accelerator node (what budgets are shares of)."""
        pool = policy.health.pool_of(node.labels) if health.is_accelerator_node(node, policy) else None
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

    def seed(self, nodes: Iterable[NodeFacts], policy: Policy) -> None:
        """Takes the records the nodes carry, before any reconcile decides on a budget: a new leader
        must count the nodes its predecessor acted on."""
        for node in nodes:
            self.classify(node, policy)
            if node.record is not None:
                entry = Entry(policy.health.pool_of(node.labels), "unhealthy", node.record, "", "", "", None)
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

    def unhealthy_since(self) -> list[datetime.datetime]:
        """When each node not left alone became due for remediation: the breaker's demand."""
        with self._lock:
            return [
                entry.record.unhealthy_since
                for entry in self._entries.values()
                if not entry.hands_off and entry.record and entry.record.unhealthy_since
            ]

    def held(self) -> list[str]:
        with self._lock:
            return sorted(name for name, entry in self._entries.items() if entry.held)

    def memory(self, name: str) -> NodeRecord | None:
        with self._lock:
            return self._memory.get(name)

    def entry(self, name: str) -> Entry | None:
        with self._lock:
            return self._entries.get(name)

    def update(self, name: str, plan: NodePlan, *, persisted: bool, now: datetime.datetime) -> None:
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

    def states(self) -> list[tuple[str, str, HealthState]]:
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

    def changed(self, key: str, pod: PodFacts | None) -> tuple[str, ...]:
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


# --- the circuit breaker -----------------------------------------------------------------------------


@dataclass(frozen=True)
class BreakerState:
    open: bool = False
    opened_at: datetime.datetime | None = None
    reason: str = ""
    closed_at: datetime.datetime | None = None
    closed_by: str = ""

    def to_data(self) -> dict[str, str]:
        data = {"state": "open" if self.open else "closed"}
        for key, moment in (("openedAt", self.opened_at), ("closedAt", self.closed_at)):
            if moment is not None:
                data[key] = health.format_time(moment)
        if self.reason:
            data["reason"] = self.reason
        if self.closed_by:
            data["closedBy"] = self.closed_by
        return data

    @classmethod
    def from_data(cls, data: dict[str, str]) -> BreakerState:
        def moment(key: str) -> datetime.datetime | None:
            value = data.get(key)
            try:
                return datetime.datetime.fromisoformat(value) if value else None
            except ValueError:
                return None

        return cls(
            open=data.get("state") == "open",
            opened_at=moment("openedAt"),
            reason=data.get("reason", ""),
            closed_at=moment("closedAt"),
            closed_by=data.get("closedBy", ""),
        )


class StateStore(Protocol):
    """The breaker's ConfigMap: read, and write at the version read (ConflictError when it changed)."""

    def read(self) -> StoredState: ...

    def write(self, data: dict[str, str], read: StoredState) -> None: ...


class Breaker:
    """Open means: nothing new is tainted, cordoned, drained or evicted. It opens when
    `health.breaker_trips` says so and stays open until an operator closes it in the ConfigMap
    (`gpuguard nodes reset-breaker`). In audit and warn mode it opens in memory only."""

    def __init__(self, store: StateStore | None, clock: Callable[[], datetime.datetime]) -> None:
        self.store = store
        self.clock = clock
        self._state = BreakerState()
        self._lock = threading.Lock()

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def observe(self, data: dict[str, str] | None) -> bool:
        """The ConfigMap as the informer sees it; True when that closed an open breaker."""
        observed = BreakerState.from_data(data or {})
        with self._lock:
            was_open = self._state.open
            if was_open and not observed.open and observed.closed_at is None:
                # Closed by hand (kubectl edit): the moment it was seen closed is when it closed.
                observed = BreakerState(
                    False, observed.opened_at, observed.reason, self.clock(), observed.closed_by
                )
            if data is not None or not was_open:
                self._state = observed
            return was_open and not self._state.open

    def trip(self, reason: str, *, persist: bool) -> bool:
        """Opens the breaker; False when it was open already. Written to the ConfigMap when `persist`
        (raises what the write raises; the caller retries the reconcile)."""
        now = self.clock()
        with self._lock:
            if self._state.open:
                return False
            opened = BreakerState(True, now, reason, self._state.closed_at, self._state.closed_by)
        if persist and self.store is not None:
            stored = self.store.read()
            if BreakerState.from_data(stored.data).open:
                opened = BreakerState.from_data(stored.data)
            else:
                self.store.write({**stored.data, **opened.to_data()}, stored)
        with self._lock:
            self._state = opened
        return True


# --- eviction rate limits ----------------------------------------------------------------------------


class EvictionRateLimits:
    """At most n evictions per minute per node and per namespace (health.eviction), sliding window."""

    WINDOW_SECONDS = 60.0

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._times: dict[tuple[str, str], collections.deque[float]] = {}
        self._lock = threading.Lock()

    def wait(self, node: str, namespace: str, policy: Policy) -> float:
        """Seconds until one more eviction on `node` in `namespace` is allowed; 0 when it is now."""
        eviction = policy.health.eviction
        now = self.clock()
        waits = [0.0]
        with self._lock:
            for key, limit in (
                (("node", node), eviction.perNodePerMinute),
                (("namespace", namespace), eviction.perNamespacePerMinute),
            ):
                times = self._window(key, now)
                if len(times) >= limit:
                    waits.append(times[len(times) - limit] + self.WINDOW_SECONDS - now)
        return max(waits)

    def taken(self, node: str, namespace: str) -> None:
        now = self.clock()
        with self._lock:
            for key in (("node", node), ("namespace", namespace)):
                self._window(key, now).append(now)

    def _window(self, key: tuple[str, str], now: float) -> collections.deque[float]:
        times = self._times.setdefault(key, collections.deque())
        while times and times[0] <= now - self.WINDOW_SECONDS:
            times.popleft()
        return times
