"""`gpuguard serve --workers N`: the worker count, the board the workers share, and the real server with
two workers seen from outside as one (metrics summed, readiness of all, policy reload, restarts, stop)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.harness.manifests import Gpuguard, admission_review, defaulted_gpu_pod
from tests.integration.test_http import STOP_SECONDS, Server, metric_sample, start_server
from webhook.policy.engine import Decision
from webhook.processes import serve_workers
from webhook.runtime.metrics import Metrics

# Fresh connections per check: the kernel hands each to whichever worker accepts it first, so a check
# repeated over this many sees every worker of two with near certainty (1 - 2**-39 for a fair split).
CONNECTIONS = 40
WAIT_SECONDS = 15.0


# --- how many -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "cpus"), [("max 100000\n", None), ("150000 100000\n", 1.5), ("200000 100000", 2.0), ("", None)]
)
def test_cpu_max_reads_as_cpus(text: str, cpus: float | None) -> None:
    assert serve_workers.parse_cpu_max(text) == cpus


def test_cpu_limit_reads_cgroup_v2_then_v1(tmp_path: Path) -> None:
    assert serve_workers.cpu_limit(tmp_path) is None
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert serve_workers.cpu_limit(tmp_path) == 3.0
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert serve_workers.cpu_limit(tmp_path) == 0.5


@pytest.mark.parametrize(
    ("limit", "usable", "count"), [(None, 8, 8), (1.0, 8, 1), (1.5, 8, 2), (0.1, 8, 1), (16.0, 4, 4)]
)
def test_auto_is_the_cpu_limit_rounded_up_within_the_usable_cpus(
    limit: float | None, usable: int, count: int
) -> None:
    assert serve_workers.auto_count(limit, usable) == count


@pytest.mark.parametrize("value", ["0", "-1", "two", "65", "1.5"])
def test_a_bad_worker_count_is_a_usage_error(gpuguard: Gpuguard, value: str) -> None:
    run = gpuguard("serve", "--workers", value)
    assert run.code == 2
    assert "--workers: expected auto or a number from 1 to 64" in run.err


# --- the counters and the board -----------------------------------------------------------------------


def _counted(*endpoints: str) -> Metrics:
    metrics = Metrics()
    for endpoint in endpoints:
        decision = Decision(rule="priority", mode="enforce", outcome="applied", message="set")
        metrics.observe(endpoint, "allowed", 0.002, [decision])
    return metrics


def test_metrics_added_from_snapshots_render_as_the_sum() -> None:
    one, other = _counted("mutate", "mutate"), _counted("mutate", "validate")
    total = Metrics()
    total.add(one.snapshot())
    total.add(json.loads(json.dumps(other.snapshot())))  # as the board carries it

    assert total.requests == {("mutate", "allowed"): 3, ("validate", "allowed"): 1}
    assert total.decisions == {("priority", "enforce", "applied"): 4}
    assert sum(total.latency["mutate"].counts) == 3
    assert total.latency["mutate"].total == pytest.approx(0.006)


def _published(
    pid: int, failing: tuple[str, ...] = (), *, at: float | None = None
) -> serve_workers.Published:
    at = time.monotonic() if at is None else at
    return serve_workers.Published(pid, at, failing, True, _counted("mutate").snapshot())


def test_the_board_keeps_one_state_per_worker_and_a_retired_one_keeps_its_counters() -> None:
    board = serve_workers.Board(3)
    board.write(1, _published(101))
    assert board.read(0) is None
    assert board.read(1) == _published(101, at=board.read(1).at)  # type: ignore[union-attr]

    board.retire(1, "restarting")
    retired = board.read(1)
    assert retired is not None and (retired.pid, retired.failing) == (0, ("restarting",))
    assert retired.metrics == _counted("mutate").snapshot()
    assert not retired.ready(time.monotonic())


def test_a_worker_sees_which_others_are_not_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    board = serve_workers.Board(4)
    board.write(1, _published(101))
    board.write(2, _published(102, ("certificate",)))
    board.write(3, _published(103, at=time.monotonic() - serve_workers.STALE_SECONDS - 1))
    worker = serve_workers.Worker(board, 0)

    assert worker.failing_others() == ["worker 2: certificate", "worker 3: not publishing"]
    board.write(0, _published(100))
    assert serve_workers.Worker(board, 1).failing_others() == [
        "worker 2: certificate",
        "worker 3: not publishing",
    ]
    for slot in (2, 3):
        board.write(slot, _published(100 + slot))
    assert worker.others_ready()


def test_a_worker_continues_its_slots_counters() -> None:
    board = serve_workers.Board(2)
    board.write(0, _published(100))
    board.retire(0, "restarting")

    successor = serve_workers.Worker(board, 0)
    assert successor.inherited == _counted("mutate").snapshot()
    assert serve_workers.Worker(board, 1).inherited is None


def test_a_publication_read_earlier_never_lands_over_a_later_one() -> None:
    """The board thread and a stopping worker's last word publish at once: the one that read the worker's
    state later writes later, so a worker that stopped is never left on the board as ready."""
    board = serve_workers.Board(1)
    state: list[str] = []
    read, write_on = threading.Event(), threading.Event()

    def failing() -> list[str]:
        now = list(state)
        if threading.current_thread().name == "earlier":
            read.set()
            write_on.wait(WAIT_SECONDS)
        return now

    already_stopped = threading.Event()
    already_stopped.set()
    worker = serve_workers.Worker(board, 0)
    worker.publishing(failing, Metrics(), already_stopped)  # publishes once, no thread left running
    earlier = threading.Thread(target=worker.publish, name="earlier")
    earlier.start()
    assert read.wait(WAIT_SECONDS)
    state.append("stopping")
    later = threading.Thread(target=worker.publish, name="later")
    later.start()
    # Room for a later publication that does not wait its turn to land first; one that waits is
    # unaffected (it writes once the earlier one has, whenever that is).
    later.join(timeout=0.5)
    write_on.set()
    earlier.join(WAIT_SECONDS)
    later.join(WAIT_SECONDS)

    published = board.read(0)
    assert published is not None and published.failing == ("stopping",)


def test_a_state_too_large_for_its_slot_is_refused() -> None:
    board = serve_workers.Board(1)
    huge = serve_workers.Published(1, 0.0, ("x" * serve_workers.SLOT_BYTES,), False, {})
    with pytest.raises(ValueError, match="over 262144"):
        board.write(0, huge)


# --- the real server with two workers -----------------------------------------------------------------


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _fresh(server: Server, method: str, path: str, **kwargs: object) -> httpx.Response:
    """One request on a connection of its own, so any worker may answer it."""
    with server.client() as client:
        return client.request(method, path, **kwargs)  # type: ignore[arg-type]


def _until(condition: Callable[[], bool], what: str, server: Server) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        assert server.process.poll() is None, f"gpuguard exited:\n{server.log_tail()}"
        assert time.monotonic() < deadline, f"not within {WAIT_SECONDS} s: {what}\n{server.log_tail()}"
        time.sleep(0.02)  # polling pace, not synchronisation: each check reads the server's own answer


def _log(server: Server) -> list[dict[str, Any]]:
    return [json.loads(line) for line in server.log.read_text().splitlines() if line.startswith("{")]


def _answers(server: Server) -> Counter[int]:
    """Admissions answered, by worker slot (from each decision's log line)."""
    return Counter(line["worker"] for line in _log(server) if line.get("logger") == "gpuguard.admission")


def _slot_of(server: Server, pid: int) -> int:
    (slot,) = {line["worker"] for line in _log(server) if line.get("pid") == pid}
    return int(slot)


def _requests(server: Server) -> float:
    return metric_sample(
        _fresh(server, "GET", "/metrics").text,
        "gpuguard_admission_requests_total",
        endpoint="mutate",
        result="allowed",
    )


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text("enabled: true\n")
    return path


@pytest.fixture
def two_workers(tmp_path: Path, policy_file: Path) -> Iterator[Server]:
    server = start_server(tmp_path, "--workers", "2", "--policy", str(policy_file))
    try:
        yield server
    finally:
        server.stop()


def test_two_workers_answer_and_count_as_one_server(two_workers: Server) -> None:
    assert len(_children(two_workers.process.pid)) == 2
    for _ in range(CONNECTIONS):
        answer = _fresh(two_workers, "POST", "/mutate", content=admission_review(defaulted_gpu_pod()))
        assert answer.json()["response"]["allowed"] is True

    assert set(_answers(two_workers)) == {0, 1}
    # Whichever worker answers a scrape asks the other for its counters first: every request is
    # counted, once, at once.
    assert [_requests(two_workers) for _ in range(10)] == [CONNECTIONS] * 10


def test_once_one_worker_answers_ready_every_worker_does(two_workers: Server) -> None:
    # The fixture returned on the first 200, answered by a worker with its own state as it is now: the
    # other answers the same, reading that worker's state as it is now too, not as last published.
    answers = [_fresh(two_workers, "GET", "/readyz").status_code for _ in range(CONNECTIONS // 4)]
    assert answers == [200] * (CONNECTIONS // 4)


def test_a_policy_change_reaches_every_worker(two_workers: Server, policy_file: Path) -> None:
    before = _fresh(two_workers, "GET", "/readyz").text
    policy_file.write_text(yaml.safe_dump({"enabled": True, "rules": {"priority": {"mode": "off"}}}))

    def every_worker_serves_the_new_policy() -> bool:
        return all(_fresh(two_workers, "GET", "/readyz").text != before for _ in range(CONNECTIONS // 4))

    _until(every_worker_serves_the_new_policy, "the new policy on every worker", two_workers)


@pytest.mark.parametrize("ending", [signal.SIGTERM, signal.SIGKILL])
def test_a_worker_that_ends_is_replaced_and_the_counts_never_go_back(
    two_workers: Server, ending: signal.Signals
) -> None:
    for _ in range(4):
        _fresh(two_workers, "POST", "/mutate", content=admission_review(defaulted_gpu_pod()))
    assert _requests(two_workers) == 4
    victim = _children(two_workers.process.pid)[0]
    answered = _answers(two_workers)

    os.kill(victim, ending)

    # Not ready while a worker is missing (the restart waits half a second), ready again with its successor.
    _until(lambda: _fresh(two_workers, "GET", "/readyz").status_code == 503, "not ready", two_workers)
    _until(lambda: _fresh(two_workers, "GET", "/readyz").status_code == 200, "ready again", two_workers)
    children = _children(two_workers.process.pid)
    assert len(children) == 2 and victim not in children
    assert "starting it again" in two_workers.log_tail()
    counts = [_requests(two_workers) for _ in range(10)]
    assert len(set(counts)) == 1, counts
    if ending == signal.SIGTERM:
        # A worker that ends publishes a last time: its successor continues from every count.
        assert counts[0] == 4
    else:
        # Killed outright, it loses what it answered since its last publication (at most half a second),
        # never what it had published: the survivor's answers at least, and never more than were made.
        survivor = 1 - _slot_of(two_workers, victim)
        assert answered[survivor] <= counts[0] <= 4
    _fresh(two_workers, "POST", "/mutate", content=admission_review(defaulted_gpu_pod()))
    assert _requests(two_workers) == counts[0] + 1


def test_a_worker_ended_as_soon_as_the_server_is_ready_is_started_again(two_workers: Server) -> None:
    # Each worker says on the board that it serves as it starts to: one ended at once, before its next
    # publication, has served all the same, and is started again rather than ending the server.
    os.kill(_children(two_workers.process.pid)[0], signal.SIGTERM)

    _until(lambda: "starting it again" in two_workers.log_tail(), "the worker started again", two_workers)


def test_sigterm_stops_every_worker_with_exit_code_0(two_workers: Server) -> None:
    children = _children(two_workers.process.pid)

    two_workers.process.send_signal(signal.SIGTERM)

    assert two_workers.process.wait(timeout=STOP_SECONDS) == 0, two_workers.log_tail()
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists()]


def test_a_worker_that_cannot_start_ends_the_server(gpuguard: Gpuguard, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("not a kubeconfig: [\n")
    run = gpuguard(
        "serve", "--host", "127.0.0.1", "--port", "0", "--workers", "2", "--kubeconfig", str(kubeconfig)
    )
    assert run.code != 0
    assert "before serving: stopping" in run.err
