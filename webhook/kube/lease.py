"""Leader election on a `coordination.k8s.io/v1` Lease, as client-go's leaderelection does it.

The state is the Lease in the cluster, nothing else: the holder renews `renewTime` every retry period;
another replica takes the Lease over once it has seen the same record unchanged for the lease duration
by its own clock (never by comparing its clock with the holder's timestamps), or at once when the holder
released it on a clean stop. Every write is at the resourceVersion just read, so two candidates can
never both win: the second gets a conflict.

A leader that cannot renew within the renew deadline has lost: `on_stopped` runs and the caller must
end the process, since the other replica may already act (controller-runtime exits for that reason).

The pinned client's own `kubernetes.leaderelection` is not used: it reaches for the global default
ApiClient, `sys.exit`s on bad values and sleeps without a stop.
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
    def get(self) -> LeaseRecord | None: ...

    def create(self, record: LeaseRecord) -> LeaseRecord: ...

    def update(self, record: LeaseRecord) -> LeaseRecord: ...


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
        self.thread = threading.Thread(target=self.run, name="leader-election", daemon=True)

    def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this replica holds the Lease afterwards."""
        now = micro_time(self.wall())
        try:
            current = self.leases.get()
            if current is None:
                record = LeaseRecord(self.identity, round(self.lease_seconds), now, now, 0)
                self._observe(self.leases.create(record))
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
            self._observe(self.leases.update(record))
            return True
        except ConflictError:
            return False
        except Exception as exc:
            log.warning("leader election: %s", " ".join(str(exc).splitlines()[:2]) or type(exc).__name__)
            return False

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
        while not self.try_acquire_or_renew():
            if self.stop.wait(self.retry_seconds):
                return
        self.leading = True
        log.info("%s is the leader", self.identity, extra={"fields": {"identity": self.identity}})
        self.on_started()
        last_renewal = self.clock()
        while not self.stop.wait(self.retry_seconds):
            if self.try_acquire_or_renew():
                last_renewal = self.clock()
            elif self.clock() - last_renewal >= self.renew_deadline:
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
            self.leases.update(record)
        except Exception as exc:
            log.warning("could not release the lease: %s", " ".join(str(exc).splitlines()[:1]))
            return False
        return True


class LeaseStore:
    """One Lease through the API server, as raw JSON."""

    def __init__(self, api: client.ApiClient, namespace: str, name: str, *, timeout: float) -> None:
        self.coordination = client.CoordinationV1Api(api)
        self.namespace = namespace
        self.name = name
        # A slow answer must not cost the lease: the client gives up well within the renew deadline.
        self.timeout = timeout

    def get(self) -> LeaseRecord | None:
        try:
            response = self.coordination.read_namespaced_lease(
                self.name, self.namespace, _preload_content=False, _request_timeout=self.timeout
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return self._record(raw_json(response))

    def create(self, record: LeaseRecord) -> LeaseRecord:
        return self._write(record, create=True)

    def update(self, record: LeaseRecord) -> LeaseRecord:
        return self._write(record, create=False)

    def _write(self, record: LeaseRecord, *, create: bool) -> LeaseRecord:
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
        options: dict[str, Any] = {"_preload_content": False, "_request_timeout": self.timeout}
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
