"""The circuit breaker: when too many nodes became due for remediation, nothing new is disrupted
anywhere until an operator closes it.

Its state and its own log of the nodes that became due live in a ConfigMap, so that a new leader
reads them back: the ledger forgets a node that recovers or is deleted, and a breaker must not. Shared
by the node health controller, the pod device-health watcher, the metrics and the probes, so every
method is safe from any thread.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from webhook.kube.remediation import StoredState
from webhook.policy.health import ladder, observed
from webhook.policy.model import Policy

STATE_KEYS = ("state", "openedAt", "reason", "closedAt", "closedBy")
# The breaker's own log of the nodes that became due, one line per node: `<when> <node> <uid>`.
DUE_LOG_KEY = "dueNodes"
# What the log may take of the ConfigMap (the API server refuses an object over 1 MiB): about 7,500
# nodes of 40-character names, the newest kept. It needs at most maxNodes + 1 lines: the breaker opens
# then, and while it is open nothing is logged (what became due before a close never counts again).
DUE_LOG_BYTES = 800_000
# How often the leader writes the log's new lines (a storm would otherwise rewrite a growing ConfigMap
# once per node); a new leader also reads the nodes' own records back into it.
DUE_LOG_WRITE_SECONDS = 5.0
_MILLISECOND = datetime.timedelta(milliseconds=1)
# A node by name and uid: a node replaced under the same name is another node.
NodeKey = tuple[str, str]


def _stamp(moment: datetime.datetime) -> str:
    """RFC 3339 in UTC to the millisecond: a close and the nodes that became due around it keep their
    order once written."""
    return moment.astimezone(datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _moment(value: str | None) -> datetime.datetime | None:
    try:
        parsed = datetime.datetime.fromisoformat(value) if value else None
    except ValueError:
        return None
    return parsed.replace(tzinfo=datetime.UTC) if parsed is not None and parsed.tzinfo is None else parsed


def _latest(*moments: datetime.datetime | None) -> datetime.datetime | None:
    return max((moment for moment in moments if moment is not None), default=None)


@dataclass(frozen=True)
class BreakerState:
    open: bool = False
    opened_at: datetime.datetime | None = None
    reason: str = ""
    closed_at: datetime.datetime | None = None
    closed_by: str = ""

    @property
    def ever_opened(self) -> bool:
        return self.open or self.opened_at is not None or self.closed_at is not None

    @property
    def close_dated(self) -> bool:
        """Closed, and `closedAt` says when: after it opened (a `kubectl patch` of `state` alone keeps
        an earlier close's time, or none)."""
        return (
            not self.open
            and self.closed_at is not None
            and (self.opened_at is None or self.closed_at > self.opened_at)
        )

    def to_data(self) -> dict[str, str]:
        data = {"state": "open" if self.open else "closed"}
        for key, moment in (("openedAt", self.opened_at), ("closedAt", self.closed_at)):
            if moment is not None:
                data[key] = _stamp(moment)
        if self.reason:
            data["reason"] = self.reason
        if self.closed_by:
            data["closedBy"] = self.closed_by
        return data

    @classmethod
    def from_data(cls, data: Mapping[str, str]) -> BreakerState:
        return cls(
            open=data.get("state") == "open",
            opened_at=_moment(data.get("openedAt")),
            reason=data.get("reason", ""),
            closed_at=_moment(data.get("closedAt")),
            closed_by=data.get("closedBy", ""),
        )

    def written(self) -> BreakerState:
        """As it reads back from the ConfigMap (times to the millisecond)."""
        return BreakerState.from_data(self.to_data())


def _log_text(log: Mapping[NodeKey, datetime.datetime]) -> str:
    """The log as written: newest first, cut at DUE_LOG_BYTES."""
    lines: list[str] = []
    size = 0
    for (node, uid), moment in sorted(log.items(), key=lambda item: item[1], reverse=True):
        line = f"{_stamp(moment)} {node} {uid}".rstrip()
        size += len(line) + 1
        if size > DUE_LOG_BYTES:
            break
        lines.append(line)
    return "\n".join(lines)


def _log_of(text: str) -> dict[NodeKey, datetime.datetime]:
    """The log as read; a line it cannot read is left out (nothing else in the ConfigMap depends on it)."""
    log: dict[NodeKey, datetime.datetime] = {}
    for line in text.splitlines():
        fields = line.split()
        moment = _moment(fields[0]) if 2 <= len(fields) <= 3 else None
        if moment is not None:
            key = (fields[1], fields[2] if len(fields) == 3 else "")
            log[key] = min(moment, log.get(key, moment))
    return log


def _merged(*logs: Mapping[NodeKey, datetime.datetime]) -> dict[NodeKey, datetime.datetime]:
    """Every node of every log, at the earliest time any says it became due."""
    merged: dict[NodeKey, datetime.datetime] = {}
    for log in logs:
        for key, moment in log.items():
            merged[key] = min(moment, merged.get(key, moment))
    return merged


def _close(
    seen: BreakerState, known: BreakerState, now: datetime.datetime
) -> tuple[datetime.datetime, str] | None:
    """When the close `seen` in the ConfigMap happened, and by whom: its `closedAt` and `closedBy` when
    that is after it opened; else what this replica already made of the same close; else now, by an
    edit of the ConfigMap (the `closedBy` beside a stale `closedAt` is that earlier close's). None when
    there is nothing to learn from it: it never opened, or it is an undated close of an earlier opening
    than the one known."""
    if not seen.ever_opened:
        return None
    if seen.close_dated:
        assert seen.closed_at is not None
        return seen.closed_at, seen.closed_by
    if known.opened_at is not None and (seen.opened_at is None or seen.opened_at < known.opened_at):
        return None
    if known.close_dated and known.closed_at is not None and known.opened_at == seen.opened_at:
        return known.closed_at, known.closed_by
    # After the opening, whatever this replica's clock says of the one that opened it.
    after_opening = seen.opened_at + _MILLISECOND if seen.opened_at is not None else now
    return max(now, after_opening), "an edit of the ConfigMap"


def _newer(known: BreakerState, seen: BreakerState, now: datetime.datetime) -> BreakerState:
    """What the breaker is, given what this replica knew and what the ConfigMap says. A view older than
    what is known (a relist racing this replica's own trip, a republished ConfigMap) changes nothing:
    an open counts from its openedAt, a close from its close time, and the later one wins."""
    if seen.open:
        opened_at = seen.opened_at or now  # opened by hand: from when it was first seen so
        latest = _latest(known.opened_at, known.closed_at)
        if latest is not None and opened_at <= latest:
            return known
        return replace(seen, opened_at=opened_at)
    close = _close(seen, known, now)
    if close is None:
        return known  # no ConfigMap, one that never opened, or a close from before what is known
    closed_at, closed_by = close
    latest = _latest(known.opened_at, known.closed_at)
    if latest is not None and closed_at <= latest:
        return known
    return replace(seen, closed_at=closed_at, closed_by=closed_by)


@dataclass(frozen=True)
class Trip:
    reason: str
    # Opened (and written to the ConfigMap), or only said: audit and warn mode hold nothing.
    enforced: bool


def disrupts(policy: Policy) -> bool:
    """Some disruptive action is enforced (a taint, a drain, an eviction, in any namespace): the
    breaker then holds for real, and lives in its ConfigMap."""
    if any(policy.health_mode(action) == "enforce" for action in ("taint", "drain", "evict")):
        return True
    switched_on = policy.enabled and policy.health.enabled
    return switched_on and any(override.health == "enforce" for override in policy.namespaces)


class StateStore(Protocol):
    """The breaker's ConfigMap: read, and write at the version read (ConflictError when it changed)."""

    def read(self) -> StoredState: ...

    def write(self, data: dict[str, str], read: StoredState) -> None: ...


class Breaker:
    """Open means: nothing new is tainted, cordoned, drained or evicted anywhere; undoing goes on. It
    opens when more than `circuitBreaker.maxNodes` nodes became due for remediation within its window,
    counted from its own log of (node, uid, when it became due): a node counts whether it recovered,
    was deleted or was replaced since. Once open it stays open (it latches) until an operator closes it
    in the ConfigMap (`gpuguard nodes reset-breaker`); what became due before the close never counts
    again. While no disruptive action is enforced (audit, warn) a trip is only said: it holds nothing
    and writes nothing, and it is decided again once a policy enforces. Why it latches:
    docs/design/2026-12-04-latching-breaker.md."""

    def __init__(self, store: StateStore, clock: Callable[[], datetime.datetime]) -> None:
        self.store = store
        self.clock = clock
        self._state = BreakerState()
        # What the ConfigMap said when last seen.
        self._seen = BreakerState()
        self._would_open = ""
        self._log: dict[NodeKey, datetime.datetime] = {}
        # Logged here and not yet in the ConfigMap.
        self._unwritten: dict[NodeKey, datetime.datetime] = {}
        self._lock = threading.Lock()
        # Held from a decision to its write: no two trips, no log write over a trip, and a trip
        # weighs any close that reached the ConfigMap after the decision.
        self._writing = threading.Lock()

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    @property
    def would_open(self) -> str:
        """Why it would be open if a disruptive action were enforced; "" when it would not."""
        with self._lock:
            return self._would_open

    def logged(self) -> dict[NodeKey, datetime.datetime]:
        with self._lock:
            return dict(self._log)

    def became_due(self, node: str, uid: str, moment: datetime.datetime) -> None:
        """Logs that a node became due for remediation, kept until the window or a close passes it."""
        moment = moment.replace(microsecond=moment.microsecond // 1000 * 1000)  # as it will be written
        with self._lock:
            if self._state.open or (self._state.closed_at is not None and moment < self._state.closed_at):
                return  # it could never count: what became due before a close does not reopen it
            key = (node, uid)
            if key in self._log and self._log[key] <= moment:
                return
            self._log[key] = self._unwritten[key] = moment

    def seed(self, nodes: Iterable[observed.NodeFacts]) -> None:
        """The nodes' records, before a new leader's first decision (what its predecessor had not yet
        written to the log)."""
        for node in nodes:
            if node.record is not None and node.record.unhealthy_since is not None:
                self.became_due(node.name, node.uid, node.record.unhealthy_since)

    def evaluate(self, policy: Policy, fleet_nodes: int, *, enforced: bool) -> Trip | None:
        """Opens the breaker when its log says so; the trip this call made, None when it made none.
        Enforced, it is written to the ConfigMap first (raises what the write raises: the caller
        retries), and not over a close that arrived meanwhile."""
        with self._writing:
            now = self.clock()
            with self._lock:
                self._prune(policy, now)
                known = self._state
                if known.open:
                    return None
                count = ladder.breaker_demand(self._log.values(), policy, now, known.closed_at)
                allowed = ladder.breaker_allows(policy, fleet_nodes)
                if count <= allowed:
                    self._would_open = ""
                    return None
                since_close = ladder.breaker_counts_from(policy, now, known.closed_at) == known.closed_at
                reason = (
                    f"{count} of {fleet_nodes} accelerator nodes became due for remediation within "
                    f"{policy.health.circuitBreaker.windowSeconds} s"
                    f"{' (since the breaker was last closed)' if since_close else ''}; "
                    f"circuitBreaker.maxNodes {policy.health.circuitBreaker.maxNodes} allows {allowed}"
                )
                if not enforced:
                    said, self._would_open = self._would_open, reason
                    return None if said else Trip(reason, enforced=False)
            return self._open(policy, fleet_nodes, reason, now)

    def _open(self, policy: Policy, fleet_nodes: int, reason: str, now: datetime.datetime) -> Trip | None:
        stored = self.store.read()
        with self._lock:
            seen = _newer(self._state, BreakerState.from_data(stored.data), now)
            log = _merged(_log_of(stored.data.get(DUE_LOG_KEY, "")), self._log)
        if seen.open:
            with self._lock:
                self._state = seen  # opened meanwhile by another leader, which said so
            return None
        if not ladder.breaker_trips(log.values(), fleet_nodes, policy, now, seen.closed_at):
            return None  # an operator closed it after the decision: the close stands
        opened = BreakerState(True, now, reason, seen.closed_at, seen.closed_by).written()
        self._write(stored, opened, log, policy)
        return Trip(reason, enforced=True)

    def flush(self, policy: Policy) -> None:
        """Writes what the log gained since its last write (the leader, every DUE_LOG_WRITE_SECONDS);
        nothing while no disruptive action is enforced. Raises what the write raises: tried again."""
        if not disrupts(policy):
            return
        with self._writing:
            with self._lock:
                self._prune(policy, self.clock())
                if not self._unwritten:
                    return
            stored = self.store.read()
            with self._lock:
                state = _newer(self._state, BreakerState.from_data(stored.data), self.clock())
                log = _merged(_log_of(stored.data.get(DUE_LOG_KEY, "")), self._log)
            self._write(stored, state, log, policy)

    def persist(self, policy: Policy) -> None:
        """Writes what this replica holds when the ConfigMap says less: the close time it gave a close
        that carried none (so every replica counts from the same moment), or its open state over a
        ConfigMap that lost it (deleted, or replaced without openedAt). For the leader."""
        with self._lock:
            if self._state.written() == self._seen or not self._state.ever_opened:
                return  # the ConfigMap, as last seen, says it all
        with self._writing:
            stored = self.store.read()
            seen = BreakerState.from_data(stored.data)
            with self._lock:
                state = _newer(self._state, seen, self.clock()).written()
                log = _merged(_log_of(stored.data.get(DUE_LOG_KEY, "")), self._log)
            if state != seen and state.ever_opened:
                self._write(stored, state, log, policy)

    def _write(
        self,
        stored: StoredState,
        state: BreakerState,
        log: Mapping[NodeKey, datetime.datetime],
        policy: Policy,
    ) -> None:
        """Writes the state and the log (what of it can still count) at the version read."""
        start = ladder.breaker_counts_from(policy, self.clock(), state.closed_at)
        data = {key: value for key, value in stored.data.items() if key not in STATE_KEYS}
        data.update(state.to_data())
        data[DUE_LOG_KEY] = _log_text({key: moment for key, moment in log.items() if moment >= start})
        self.store.write(data, stored)
        with self._lock:
            self._state = state.written()
            if state.open:
                self._would_open = ""
            for key, moment in log.items():
                if key in self._unwritten and self._unwritten[key] >= moment:
                    del self._unwritten[key]

    def observe(self, data: Mapping[str, str] | None) -> bool:
        """The ConfigMap as the informer sees it (None: there is none); True when it closed an open
        breaker. Its log replaces this replica's, but for lines not yet written."""
        seen = BreakerState.from_data(data or {})
        with self._lock:
            self._seen = seen
            known = self._state
            self._state = _newer(known, seen, self.clock())
            if data is not None:
                self._log = _merged(_log_of(data.get(DUE_LOG_KEY, "")), self._unwritten)
            return known.open and not self._state.open

    def _prune(self, policy: Policy, now: datetime.datetime) -> None:
        """Forgets what can no longer count: before the window, or before the last close."""
        start = ladder.breaker_counts_from(policy, now, self._state.closed_at)
        for log in (self._log, self._unwritten):
            for key in [key for key, moment in log.items() if moment < start]:
                del log[key]
