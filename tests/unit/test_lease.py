"""webhook.kube.lease: one leader at a time, takeover after the lease duration, release on a clean stop.

The Lease store here is a dict with the API server's optimistic concurrency (a write at a stale
resourceVersion conflicts); the end-to-end tests run the same elector against the real API server.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading

import pytest

from webhook.kube.lease import ConflictError, LeaderElector, LeaseRecord


class MemoryLeases:
    def __init__(self) -> None:
        self.record: LeaseRecord | None = None
        self.version = 0
        self.writes = 0
        # Writes after this many fail as if the API server were unreachable.
        self.reachable_writes = 1_000_000

    def get(self) -> LeaseRecord | None:
        return self.record

    def create(self, record: LeaseRecord) -> LeaseRecord:
        if self.record is not None:
            raise ConflictError("exists")
        return self._store(record)

    def update(self, record: LeaseRecord) -> LeaseRecord:
        if self.record is None or record.resource_version != self.record.resource_version:
            raise ConflictError("changed")
        return self._store(record)

    def _store(self, record: LeaseRecord) -> LeaseRecord:
        if self.writes >= self.reachable_writes:
            raise OSError("connection refused")
        self.version += 1
        self.writes += 1
        self.record = dataclasses.replace(record, resource_version=str(self.version))
        return self.record


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def elector(leases: MemoryLeases, identity: str, clock: Clock) -> LeaderElector:
    start = datetime.datetime(2026, 3, 1, tzinfo=datetime.UTC)
    return LeaderElector(
        leases,
        identity,
        stop=threading.Event(),
        on_started=lambda: None,
        on_stopped=lambda: None,
        lease_seconds=15,
        renew_deadline=10,
        retry_seconds=2,
        clock=clock,
        wall=lambda: start + datetime.timedelta(seconds=clock.now),
    )


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_the_first_candidate_creates_the_lease_and_the_second_waits(clock: Clock) -> None:
    leases = MemoryLeases()
    a, b = elector(leases, "a", clock), elector(leases, "b", clock)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    assert leases.record is not None and leases.record.holder == "a" and leases.record.transitions == 0
    clock.now += 2
    assert a.try_acquire_or_renew()  # renewing
    clock.now += 14
    assert not b.try_acquire_or_renew()  # b saw a renew 14 s ago by its own clock: still valid


def test_a_dead_leaders_lease_is_taken_over_after_the_lease_duration(clock: Clock) -> None:
    leases = MemoryLeases()
    a, b = elector(leases, "a", clock), elector(leases, "b", clock)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    clock.now += 14.9
    assert not b.try_acquire_or_renew()
    clock.now += 0.2
    assert b.try_acquire_or_renew()
    assert leases.record is not None and (leases.record.holder, leases.record.transitions) == ("b", 1)
    assert not a.try_acquire_or_renew()  # a came back: it is a standby now


def test_a_released_lease_is_taken_at_once(clock: Clock) -> None:
    leases = MemoryLeases()
    a, b = elector(leases, "a", clock), elector(leases, "b", clock)
    assert a.try_acquire_or_renew()
    a.leading = True
    assert not b.try_acquire_or_renew()
    assert a.release()
    assert b.try_acquire_or_renew()


def test_two_candidates_racing_on_one_record_cannot_both_win(clock: Clock) -> None:
    leases = MemoryLeases()
    a, b = elector(leases, "a", clock), elector(leases, "b", clock)
    assert a.try_acquire_or_renew()
    a.leading = True
    a.release()
    stale = leases.record
    assert b.try_acquire_or_renew()
    # c read the released record before b wrote: its write conflicts.
    c = elector(leases, "c", clock)
    leases.get = lambda: stale  # type: ignore[method-assign]
    assert not c.try_acquire_or_renew()
    assert leases.version and leases.record is not None and leases.record.holder == "b"


class TickingStop(threading.Event):
    """A stop flag whose every wait advances the fake clock by one second instead of sleeping."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock

    def wait(self, timeout: float | None = None) -> bool:
        self.clock.now += 1
        return self.is_set()


def test_a_leader_that_cannot_renew_within_the_deadline_stops(clock: Clock) -> None:
    leases = MemoryLeases()
    stopped = threading.Event()
    a = elector(leases, "a", clock)
    a.stop = TickingStop(clock)
    leases.reachable_writes = 3
    a.on_stopped = stopped.set
    a.run()  # acquires, then renews until the API server goes away below
    assert stopped.is_set() and not a.leading
    assert clock.now - 100 >= 10


def test_the_timings_must_leave_room_to_renew() -> None:
    with pytest.raises(ValueError, match="retry < renew deadline < lease duration"):
        LeaderElector(
            MemoryLeases(),
            "a",
            stop=threading.Event(),
            on_started=lambda: None,
            on_stopped=lambda: None,
            lease_seconds=5,
            renew_deadline=5,
        )
