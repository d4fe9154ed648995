"""Leader election on a `coordination.k8s.io/v1` Lease, as client-go's leaderelection does it.

The state is the Lease in the cluster, nothing else: the holder renews `renewTime` every retry period;
another replica takes the Lease over once it has seen the same record unchanged for the lease duration
by its own clock (never by comparing its clock with the holder's timestamps), or at once when the holder
released it on a clean stop. Every write is at the resourceVersion just read, so two candidates can
never both win: the second gets a conflict.

`on_started` runs in a thread of its own, so however long the leader's work takes to start, the renewals
go on. A leader that cannot renew within the renew deadline has lost: `on_stopped` runs and the caller must
end the process, since the other replica may already act (controller-runtime exits for that reason).
As in client-go, the renew deadline bounds the whole renewal, not one attempt: every request's timeout
is what is left of it, so `on_stopped` runs at the deadline however slow the API server answers.

Noticing is not enough: a leader paused past the lease (GC, CPU starvation, a frozen VM) runs its
workers again before its elector thread wakes up. So every write checks `write_window` just before it
goes: the Lease must have been renewed within the renew deadline by this replica's monotonic clock,
which leaves the write `lease duration - renew deadline` to land before any standby may take over.

The pinned client's own `kubernetes.leaderelection` is not used: it reaches for the global default
ApiClient, `sys.exit`s on bad values and sleeps without a stop
(docs/design/2026-12-04-own-lease-elector.md).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from webhook.kube.client import raw_json

LEASE_SECONDS = 15.0
RENEW_DEADLINE_SECONDS = 10.0
RETRY_SECONDS = 2.0

log = logging.getLogger("gpuguard.lease")


class ConflictError(Exception):
    """The Lease changed (or was created) since it was read."""


@dataclass(frozen=True)
class LeaseRecord:
    holder: str
    duration_seconds: int
    acquire_time: str
    renew_time: str
    transitions: int
    resource_version: str = ""


class Leases(Protocol):
    """The Lease in the cluster; each call gives up after `timeout` seconds."""

    def get(self, timeout: float) -> LeaseRecord | None: ...

    def create(self, record: LeaseRecord, timeout: float) -> LeaseRecord: ...

    def update(self, record: LeaseRecord, timeout: float) -> LeaseRecord: ...


def micro_time(moment: datetime.datetime) -> str:
    """A MicroTime as the API server writes it."""
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(
        self,
        leases: Leases,
        identity: str,
        *,
        stop: threading.Event,
        on_started: Callable[[], None],
        on_stopped: Callable[[], None],
        lease_seconds: float = LEASE_SECONDS,
        renew_deadline: float = RENEW_DEADLINE_SECONDS,
        retry_seconds: float = RETRY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC),
    ) -> None:
        if not retry_seconds < renew_deadline < lease_seconds:
            raise ValueError("leader election needs retry < renew deadline < lease duration")
        self.leases = leases
        self.identity = identity
        self.stop = stop
        self.on_started = on_started
        self.on_stopped = on_stopped
        self.lease_seconds = lease_seconds
        self.renew_deadline = renew_deadline
        self.retry_seconds = retry_seconds
        self.clock = clock
        self.wall = wall
        self.leading = False
        self.holder = ""
        self._observed: LeaseRecord | None = None
        self._observed_at = 0.0
        # When the last successful acquisition or renewal started, by `clock`: the server stamped it
        # later, so no standby can time the Lease out earlier than this plus the lease duration.
        self._renewed_at = 0.0
        self.thread = threading.Thread(target=self.run, name="leader-election", daemon=True)

    def write_window(self) -> float:
        """How many seconds a write may still take (its request timeout); 0 when this replica may not
        write at all: it does not lead, has seen another holder, or has not renewed the Lease within the
        renew deadline."""
        elapsed = self.clock() - self._renewed_at
        if not self.leading or self.holder != self.identity or elapsed >= self.renew_deadline:
            return 0.0
        return self.lease_seconds - elapsed

    def try_acquire_or_renew(self, deadline: float) -> bool:
        """One attempt, given up at `deadline` (by `clock`); True when this replica holds the Lease."""
        started = self.clock()
        now = micro_time(self.wall())
        try:
            current = self.leases.get(self._left(deadline))
            if current is None:
                record = LeaseRecord(self.identity, round(self.lease_seconds), now, now, 0)
                self._observe(self.leases.create(record, self._left(deadline)))
                self._renewed_at = started
                return True
            self._observe(current)
            mine = current.holder == self.identity
            if current.holder and not mine and self.clock() < self._observed_at + current.duration_seconds:
                return False  # held by another replica that renews
            record = replace(
                current, holder=self.identity, duration_seconds=round(self.lease_seconds), renew_time=now
            )
            if not mine:
                record = replace(record, acquire_time=now, transitions=current.transitions + 1)
            self._observe(self.leases.update(record, self._left(deadline)))
            self._renewed_at = started
            return True
        except ConflictError:
            return False
        except Exception as exc:
            log.warning("leader election: %s", " ".join(str(exc).splitlines()[:2]) or type(exc).__name__)
            return False

    def _left(self, deadline: float) -> float:
        left = deadline - self.clock()
        if left <= 0:
            raise TimeoutError("the renew deadline passed")
        return left

    def _observe(self, record: LeaseRecord) -> None:
        if self._observed is None or (record.holder, record.renew_time) != (
            self._observed.holder,
            self._observed.renew_time,
        ):
            self._observed_at = self.clock()
        self._observed = record
        self.holder = record.holder

    def run(self) -> None:
        """Acquires (waiting as long as it takes), then renews until the stop or a lost renewal."""
        while not self.try_acquire_or_renew(self.clock() + self.renew_deadline):
            if self.stop.wait(self.retry_seconds):
                return
        self.leading = True
        log.info("%s is the leader", self.identity, extra={"fields": {"identity": self.identity}})
        # The leader's work starts beside the renewals, as client-go starts OnStartedLeading in its own
        # goroutine: starting it may take longer than the renew deadline (a first pass over 20,000 nodes
        # and 200,000 pods does on two cores), and a renewal waiting for it would lose a healthy Lease.
        threading.Thread(target=self.on_started, name="leading", daemon=True).start()
        while True:
            deadline = self._renewed_at + self.renew_deadline
            if self.stop.wait(max(0.0, min(self.retry_seconds, deadline - self.clock()))):
                return
            if not self.try_acquire_or_renew(deadline) and self.clock() >= deadline:
                self.leading = False
                log.error("%s lost the lease", self.identity, extra={"fields": {"identity": self.identity}})
                self.on_stopped()
                return

    def release(self) -> bool:
        """Gives the Lease up (on a clean stop), so the standby takes over within a retry period."""
        if not self.leading or self._observed is None:
            return False
        self.leading = False
        record = replace(self._observed, holder="", duration_seconds=1, renew_time=micro_time(self.wall()))
        try:
            self.leases.update(record, self.renew_deadline)
        except Exception as exc:
            log.warning("could not release the lease: %s", " ".join(str(exc).splitlines()[:1]))
            return False
        return True


class LeaseStore:
    """One Lease through the API server, as raw JSON."""

    def __init__(self, api: client.ApiClient, namespace: str, name: str) -> None:
        self.coordination = client.CoordinationV1Api(api)
        self.namespace = namespace
        self.name = name

    def get(self, timeout: float) -> LeaseRecord | None:
        try:
            response = self.coordination.read_namespaced_lease(
                self.name, self.namespace, _preload_content=False, _request_timeout=timeout
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return self._record(raw_json(response))

    def create(self, record: LeaseRecord, timeout: float) -> LeaseRecord:
        return self._write(record, timeout, create=True)

    def update(self, record: LeaseRecord, timeout: float) -> LeaseRecord:
        return self._write(record, timeout, create=False)

    def _write(self, record: LeaseRecord, timeout: float, *, create: bool) -> LeaseRecord:
        metadata: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if record.resource_version:
            metadata["resourceVersion"] = record.resource_version
        body = client.V1Lease.model_validate(
            {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": metadata,
                "spec": {
                    "holderIdentity": record.holder or None,
                    "leaseDurationSeconds": record.duration_seconds,
                    "acquireTime": record.acquire_time,
                    "renewTime": record.renew_time,
                    "leaseTransitions": record.transitions,
                },
            }
        )
        options: dict[str, Any] = {"_preload_content": False, "_request_timeout": timeout}
        try:
            if create:
                response = self.coordination.create_namespaced_lease(self.namespace, body, **options)
            else:
                response = self.coordination.replace_namespaced_lease(
                    self.name, self.namespace, body, **options
                )
        except ApiException as exc:
            if exc.status == 409:
                raise ConflictError(str(exc.reason)) from exc
            raise
        return self._record(raw_json(response))

    @staticmethod
    def _record(raw: dict[str, Any]) -> LeaseRecord:
        spec = raw.get("spec") or {}
        return LeaseRecord(
            holder=str(spec.get("holderIdentity") or ""),
            duration_seconds=int(spec.get("leaseDurationSeconds") or 0),
            acquire_time=str(spec.get("acquireTime") or ""),
            renew_time=str(spec.get("renewTime") or ""),
            transitions=int(spec.get("leaseTransitions") or 0),
            resource_version=str((raw.get("metadata") or {}).get("resourceVersion", "")),
        )
