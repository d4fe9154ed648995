"""webhook.kube.queue and webhook.kube.controller: dedup, one worker per key, delays, backoff, shutdown."""

from __future__ import annotations

import threading

import pytest

from webhook.kube.controller import Controller, Outcome, Result, TerminalError
from webhook.kube.queue import TokenBucket, WorkQueue


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def drain(queue: WorkQueue[str]) -> list[str]:
    """Every key ready now, each marked done."""
    keys = []
    while (key := queue.get(timeout=0)) is not None:
        keys.append(key)
        queue.done(key)
    return keys


def test_a_key_added_many_times_is_queued_once(clock: FakeClock) -> None:
    queue: WorkQueue[str] = WorkQueue(clock=clock)
    for key in ["a", "b", "a", "a", "b"]:
        queue.add(key)
    assert len(queue) == 2
    assert drain(queue) == ["a", "b"]


def test_a_key_added_while_processed_comes_back_once_after_done(clock: FakeClock) -> None:
    queue: WorkQueue[str] = WorkQueue(clock=clock)
    queue.add("a")
    assert queue.get(timeout=0) == "a"
    queue.add("a")
    queue.add("a")
    # Not handed to a second worker while the first holds it.
    assert queue.get(timeout=0) is None
    queue.done("a")
    assert drain(queue) == ["a"]


def test_add_after_waits_for_its_time_and_the_earliest_delay_wins(clock: FakeClock) -> None:
    queue: WorkQueue[str] = WorkQueue(clock=clock)
    queue.add_after("a", 10)
    queue.add_after("a", 30)
    queue.add_after("b", 20)
    assert drain(queue) == []
    clock.advance(10)
    assert drain(queue) == ["a"]
    clock.advance(10)
    assert drain(queue) == ["b"]
    clock.advance(100)
    assert drain(queue) == []  # the later delay of "a" was absorbed by the earlier one


def test_failures_back_off_exponentially_until_forgotten(clock: FakeClock) -> None:
    queue: WorkQueue[str] = WorkQueue(clock=clock, base_delay=1, max_delay=8)
    delays = []
    for _ in range(5):
        queue.add_rate_limited("a")
        waited = 0
        while not drain(queue):
            clock.advance(1)
            waited += 1
        delays.append(waited)
    assert delays == [1, 2, 4, 8, 8]
    assert queue.requeues("a") == 5
    queue.forget("a")
    assert queue.requeues("a") == 0


def test_the_bucket_allows_a_burst_then_paces() -> None:
    clock = FakeClock()
    bucket = TokenBucket(qps=10, burst=3, clock=clock)
    assert [bucket.reserve() for _ in range(5)] == pytest.approx([0, 0, 0, 0.1, 0.2])
    clock.advance(1)
    assert bucket.reserve() == 0


def test_shutdown_wakes_a_waiting_worker() -> None:
    queue: WorkQueue[str] = WorkQueue()
    got: list[str | None] = []
    worker = threading.Thread(target=lambda: got.append(queue.get()))
    worker.start()
    queue.shutdown()
    worker.join(timeout=5)
    assert got == [None]
    queue.add("late")
    assert queue.get(timeout=0) is None


# --- the controller loop -----------------------------------------------------------------------------


def controller(reconcile: object, clock: FakeClock) -> tuple[Controller[str], list[Outcome]]:
    outcomes: list[Outcome] = []
    loop: Controller[str] = Controller(
        "test",
        reconcile,  # type: ignore[arg-type]
        stop=threading.Event(),
        queue=WorkQueue(clock=clock, base_delay=1),
        observe=lambda outcome, _: outcomes.append(outcome),
    )
    return loop, outcomes


def test_success_forgets_failures_and_requeue_after_comes_back_later(clock: FakeClock) -> None:
    calls: list[str] = []
    results = iter([Result(requeue_after=30), Result()])

    def reconcile(key: str) -> Result:
        calls.append(key)
        return next(results)

    loop, outcomes = controller(reconcile, clock)
    loop.enqueue("node-1")
    assert loop.process_next(timeout=0)
    assert not loop.process_next(timeout=0)
    clock.advance(30)
    assert loop.process_next(timeout=0)
    assert calls == ["node-1", "node-1"] and outcomes == ["requeue_after", "success"]


def test_an_error_is_retried_with_backoff_and_a_terminal_error_is_not(clock: FakeClock) -> None:
    failures = iter([RuntimeError("conflict"), TerminalError("invalid")])

    def reconcile(key: str) -> Result:
        raise next(failures)

    loop, outcomes = controller(reconcile, clock)
    loop.enqueue("node-1")
    assert loop.process_next(timeout=0)
    assert loop.queue.requeues("node-1") == 1
    clock.advance(1)
    assert loop.process_next(timeout=0)
    clock.advance(1000)
    assert not loop.process_next(timeout=0)
    assert outcomes == ["error", "terminal"]


def test_workers_stop_when_the_controller_shuts_down() -> None:
    seen = threading.Event()

    def reconcile(key: str) -> Result:
        seen.set()
        return Result()

    loop: Controller[str] = Controller("test", reconcile, stop=threading.Event(), workers=2)
    loop.start()
    loop.enqueue("a")
    assert seen.wait(5)
    loop.stop.set()
    loop.shutdown(timeout=5)
    assert not any(thread.is_alive() for thread in loop._threads)
