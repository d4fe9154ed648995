"""webhook.kube.lease: one leader at a time, takeover after the lease duration, release on a clean stop,
and no write from a leader that has not renewed within the renew deadline.

The Lease store here is a dict with the API server's optimistic concurrency (a write at a stale
resourceVersion conflicts); the end-to-end tests run the same elector against the real API server.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
from typing import Any

import pytest
from kubernetes import client

from webhook.kube.controller import Controller, Result
from webhook.kube.lease import ConflictError, LeaderElector, LeaseRecord
from webhook.kube.queue import WorkQueue
from webhook.kube.remediation import Fence, NodeWriter, NotLeaderError


class MemoryLeases:
    def __init__(self) -> None:
        self.record: LeaseRecord | None = None
        self.version = 0
        self.writes = 0
        # Writes after this many fail as if the API server were unreachable.
        self.reachable_writes = 1_000_000

    def get(self, timeout: float) -> LeaseRecord | None:
        return self.record

    def create(self, record: LeaseRecord, timeout: float) -> LeaseRecord:
        if self.record is not None:
            raise ConflictError("exists")
        return self._store(record)

    def update(self, record: LeaseRecord, timeout: float) -> LeaseRecord:
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


def leader(leases: MemoryLeases, clock: Clock) -> LeaderElector:
    """Replica "a", having acquired the Lease (as its elector's run would)."""
    a = elector(leases, "a", clock)
    assert a.try_acquire_or_renew(clock.now + 10)
    a.leading = True
    return a


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_the_first_candidate_creates_the_lease_and_the_second_waits(clock: Clock) -> None:
    leases = MemoryLeases()
    a, b = elector(leases, "a", clock), elector(leases, "b", clock)
    assert a.try_acquire_or_renew(clock.now + 10)
    assert not b.try_acquire_or_renew(clock.now + 10)
    assert leases.record is not None and leases.record.holder == "a" and leases.record.transitions == 0
    clock.now += 2
    assert a.try_acquire_or_renew(clock.now + 10)  # renewing
    clock.now += 14
    assert not b.try_acquire_or_renew(clock.now + 10)  # b saw a renew 14 s ago by its own clock: still valid


def test_a_dead_leaders_lease_is_taken_over_after_the_lease_duration(clock: Clock) -> None:
    leases = MemoryLeases()
    a, b = elector(leases, "a", clock), elector(leases, "b", clock)
    assert a.try_acquire_or_renew(clock.now + 10)
    assert not b.try_acquire_or_renew(clock.now + 10)
    clock.now += 14.9
    assert not b.try_acquire_or_renew(clock.now + 10)
    clock.now += 0.2
    assert b.try_acquire_or_renew(clock.now + 10)
    assert leases.record is not None and (leases.record.holder, leases.record.transitions) == ("b", 1)
    assert not a.try_acquire_or_renew(clock.now + 10)  # a came back: it is a standby now


def test_a_released_lease_is_taken_at_once(clock: Clock) -> None:
    leases = MemoryLeases()
    a, b = leader(leases, clock), elector(leases, "b", clock)
    assert not b.try_acquire_or_renew(clock.now + 10)
    assert a.release()
    assert b.try_acquire_or_renew(clock.now + 10)


def test_two_candidates_racing_on_one_record_cannot_both_win(clock: Clock) -> None:
    leases = MemoryLeases()
    a, b = elector(leases, "a", clock), elector(leases, "b", clock)
    assert a.try_acquire_or_renew(clock.now + 10)
    a.leading = True
    a.release()
    stale = leases.record
    assert b.try_acquire_or_renew(clock.now + 10)
    # c read the released record before b wrote: its write conflicts.
    c = elector(leases, "c", clock)
    leases.get = lambda timeout: stale  # type: ignore[method-assign]
    assert not c.try_acquire_or_renew(clock.now + 10)
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


class SleepingStop(threading.Event):
    """A stop flag whose waits advance the fake clock by the time waited instead of sleeping."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock

    def wait(self, timeout: float | None = None) -> bool:
        self.clock.now += timeout or 0.0
        return self.is_set()


class TroubledLeases(MemoryLeases):
    """From `trouble_from` on, the API server refuses connections until `answers_from`, then answers a
    get in 4.9 s and lets an update time out after 5 s; each call gives up at its timeout, as the
    client's `_request_timeout` does."""

    def __init__(self, clock: Clock, trouble_from: float, answers_from: float) -> None:
        super().__init__()
        self.clock = clock
        self.trouble_from = trouble_from
        self.answers_from = answers_from
        self.timeouts: list[float] = []

    def _takes(self, seconds: float, timeout: float) -> None:
        self.timeouts.append(timeout)
        self.clock.now += min(seconds, timeout)
        if seconds >= timeout:
            raise TimeoutError("read timed out")

    def get(self, timeout: float) -> LeaseRecord | None:
        if self.clock.now >= self.trouble_from:
            if self.clock.now < self.answers_from:
                raise OSError("connection refused")
            self._takes(4.9, timeout)
        return super().get(timeout)

    def update(self, record: LeaseRecord, timeout: float) -> LeaseRecord:
        if self.clock.now >= self.trouble_from:
            self._takes(5.0, timeout)
        return super().update(record, timeout)


def test_a_slow_api_server_cannot_stretch_a_renewal_past_the_renew_deadline(clock: Clock) -> None:
    # Renewed at 104, then the API server refuses until 112 and answers slowly after: each request
    # may only take what is left of the deadline, so the leader stops at 114, before any standby may
    # take over (119 at the earliest). Without the bound, an attempt started at 112 ran to about 122.
    leases = TroubledLeases(clock, trouble_from=105.0, answers_from=112.0)
    started = threading.Event()
    stopped_at: list[float] = []
    a = elector(leases, "a", clock)
    a.stop = SleepingStop(clock)
    a.on_started = started.set
    a.on_stopped = lambda: stopped_at.append(clock.now)
    a.run()
    assert started.wait(5)
    assert stopped_at == [pytest.approx(114.0)]
    assert leases.timeouts == [pytest.approx(2.0)]  # 112 + 2: all that was left of the deadline
    assert not a.leading


class RenewalCounter(MemoryLeases):
    """Says when the holder has renewed the Lease `renewals` times after acquiring it."""

    def __init__(self, renewals: int) -> None:
        super().__init__()
        self.renewed = threading.Event()
        self.renewals = renewals

    def update(self, record: LeaseRecord, timeout: float) -> LeaseRecord:
        stored = super().update(record, timeout)
        if self.writes > self.renewals:
            self.renewed.set()
        return stored


def test_the_leaders_work_starting_slowly_does_not_hold_up_the_renewals(clock: Clock) -> None:
    # Starting the leader's work (a first pass over a large fleet) took longer than the renew deadline
    # and ran on the elector's thread: its first renewal came past the deadline and a healthy leader
    # exited. Here the work waits for two renewals before it may finish starting.
    leases = RenewalCounter(renewals=2)
    a = elector(leases, "a", clock)
    a.stop = SleepingStop(clock)
    renewed_while_starting: list[bool] = []

    def start_leading() -> None:
        renewed_while_starting.append(leases.renewed.wait(5))
        a.stop.set()

    a.on_started = start_leading
    a.on_stopped = lambda: renewed_while_starting.append(False)
    a.run()  # returns once the work has started (it sets the stop) or the Lease is lost
    assert renewed_while_starting == [True]


def test_a_leader_paused_past_its_lease_writes_nothing(clock: Clock) -> None:
    leases = MemoryLeases()
    a, b = leader(leases, clock), elector(leases, "b", clock)
    assert not b.try_acquire_or_renew(clock.now + 10)
    assert a.write_window() == 15.0  # a write may take until a standby could take over
    clock.now += 9.9
    assert a.write_window() == pytest.approx(5.1)
    # Paused (GC, CPU starvation, a frozen VM): its elector has not run, so it still says it leads, but
    # it has not renewed within the renew deadline.
    clock.now += 0.1
    assert a.leading and a.write_window() == 0.0
    clock.now += 10
    assert b.try_acquire_or_renew(clock.now + 10)  # the standby took over meanwhile

    sent: list[str] = []

    class Core:
        def patch_node(self, name: str, patch: dict[str, Any], **options: Any) -> Any:
            sent.append(name)
            raise AssertionError("a write went out")

    writer = NodeWriter(client.ApiClient(), Fence(a.write_window))
    writer.core = Core()  # type: ignore[assignment]
    with pytest.raises(NotLeaderError):
        writer.patch("gpu-1", {"metadata": {"resourceVersion": "7"}, "spec": {"unschedulable": True}})
    assert sent == []

    # Through a controller: the refused write drops the reconcile, the key is not retried.
    def cordon(name: str) -> Result:
        writer.patch(name, {"spec": {"unschedulable": True}})
        return Result(requeue_after=30)

    queue: WorkQueue[str] = WorkQueue(clock=clock)
    controller = Controller("node-health", cordon, stop=threading.Event(), queue=queue)
    controller.enqueue("gpu-1")
    assert controller.process_next(0)
    clock.now += 3600
    assert queue.get(0) is None and queue.requeues("gpu-1") == 0
    assert sent == []


def test_a_leader_that_sees_another_holder_writes_nothing_at_once(clock: Clock) -> None:
    leases = MemoryLeases()
    a = leader(leases, clock)
    assert leases.record is not None
    # Another replica holds the Lease (its clock ran faster, or an operator edited the Lease).
    leases.record = dataclasses.replace(leases.record, holder="b", renew_time="later")
    clock.now += 1
    assert not a.try_acquire_or_renew(clock.now + 10)
    assert a.leading and a.write_window() == 0.0


def test_a_renewed_leader_writes_with_what_is_left_of_its_lease(clock: Clock) -> None:
    leases = MemoryLeases()
    a = leader(leases, clock)
    clock.now += 8
    assert Fence(a.write_window).timeout() == pytest.approx(7.0)
    assert a.try_acquire_or_renew(clock.now + 10)
    assert Fence(a.write_window).timeout() == 10.0  # the client's own request timeout caps it


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
