"""`gpuguard serve --workers N`: N processes answering on one listening socket, seen as one server.

The supervisor (the process the container runs) binds the socket and forks the workers. Each worker
builds what a one-process `gpuguard serve` builds (the policy store and its watcher, the cluster
caches, the certificate manager) and answers on the inherited socket: the kernel hands each new
connection to whichever worker accepts it first, and a worker accepts only once it is built.

What one process would know alone is made whole through a board: shared memory made before the first
fork, one slot per worker. Every PUBLISH_SECONDS, and whenever another worker asks, each worker writes
its counters and its own readiness into its slot. Whichever worker answers `/metrics` or `/readyz` asks
every other worker to publish (an eventfd per slot) and waits for their fresh slots (at most
ASKED_WAIT_SECONDS, for a worker too busy to answer in time). A scrape adds its live counters to
theirs: it counts every request answered before it, each once. `/readyz` answers ready only when every
worker is, as it is at that answer: each slot published within STALE_SECONDS, none with a failing check
(a worker told to stop fails one from then on). A slot is locked with a POSIX record lock
while it is written or read, which the kernel releases when its holder dies, so a worker killed
mid-write blocks nobody.

A worker that has served and dies is forked again into its slot and continues the slot's counters,
so every sum stays monotonic. A worker that ends (SIGTERM, an error) publishes a last time; one killed
outright loses the requests it answered since its last publication, at most PUBLISH_SECONDS' worth.
A worker that dies before any worker of its slot ever served ends the supervisor with its exit
status, as a one-process server would: a broken configuration crash-loops where the kubelet shows it
instead of being retried in silence.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import gc
import logging
import math
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import orjson

from webhook.runtime.metrics import Metrics

# How often a worker publishes its counters and readiness, and how old a slot may be and still count.
PUBLISH_SECONDS = 0.5
STALE_SECONDS = 4 * PUBLISH_SECONDS
# How long a scrape or a readiness probe waits for the other workers' fresh slots before it uses their
# last ones.
ASKED_WAIT_SECONDS = 0.25
ASKED_POLL_SECONDS = 0.002
# Room for one worker's published state: its counters are a few hundred series at most (~20 KB).
SLOT_BYTES = 256 * 1024
LENGTH_BYTES = 4
# A worker that served and died is forked again after this delay, doubled for each death that follows
# within RESTART_RESET_SECONDS of its start, up to the maximum.
RESTART_DELAY_SECONDS = 0.5
MAX_RESTART_DELAY_SECONDS = 30.0
RESTART_RESET_SECONDS = 60.0
# The readiness check a worker adds for the others; it is not part of what the worker publishes.
WORKERS_CHECK = "workers"
PR_SET_PDEATHSIG = 1

log = logging.getLogger("gpuguard.workers")


def parse_cpu_max(text: str) -> float | None:
    """CPUs allowed by a cgroup v2 `cpu.max` ("150000 100000" -> 1.5), None for no limit ("max ...")."""
    quota, _, period = text.strip().partition(" ")
    if quota == "max" or not period:
        return None
    return int(quota) / int(period)


def cpu_limit(cgroup: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The container's CPU limit from its cgroup (v2, else v1), None when there is none."""
    try:
        return parse_cpu_max((cgroup / "cpu.max").read_text())
    except (OSError, ValueError):
        pass
    try:
        quota = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def auto_count(limit: float | None, usable_cpus: int) -> int:
    """`--workers auto`: one worker per CPU of the limit, rounded up, never more than the CPUs usable;
    without a limit, one per usable CPU."""
    wanted = usable_cpus if limit is None else math.ceil(limit)
    return max(1, min(wanted, usable_cpus))


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0))


@dataclass(frozen=True)
class Published:
    """One worker's slot as last written."""

    pid: int
    at: float  # time.monotonic() of the write: one clock for every process on the machine
    failing: tuple[str, ...]
    served: bool  # this slot's worker (this one or an earlier) has served
    metrics: Mapping[str, Any]

    def ready(self, now: float) -> bool:
        return self.pid != 0 and not self.failing and now - self.at <= STALE_SECONDS


class Board:
    """The workers' shared state: one slot per worker in a memory file inherited across fork."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._fd = os.memfd_create("gpuguard-workers")
        os.ftruncate(self._fd, size * SLOT_BYTES)
        # Written by a worker that wants the slot's worker to publish now (a scrape).
        self._wakeups = [os.eventfd(0, os.EFD_NONBLOCK) for _ in range(size)]

    def ask(self, slot: int) -> None:
        os.eventfd_write(self._wakeups[slot], 1)

    def wait_asked(self, slot: int, timeout: float) -> None:
        """Returns when the slot's worker is asked to publish, or after `timeout`."""
        wakeup = self._wakeups[slot]
        if select.select([wakeup], [], [], timeout)[0]:
            with contextlib.suppress(BlockingIOError):  # another thread of the worker read it first
                os.eventfd_read(wakeup)

    @contextlib.contextmanager
    def _locked(self, slot: int, kind: int) -> Iterator[None]:
        fcntl.lockf(self._fd, kind, SLOT_BYTES, slot * SLOT_BYTES, os.SEEK_SET)
        try:
            yield
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, SLOT_BYTES, slot * SLOT_BYTES, os.SEEK_SET)

    def write(self, slot: int, published: Published) -> None:
        data = orjson.dumps(
            {
                "pid": published.pid,
                "at": published.at,
                "failing": published.failing,
                "served": published.served,
                "metrics": published.metrics,
            }
        )
        if len(data) > SLOT_BYTES - LENGTH_BYTES:
            raise ValueError(f"worker {slot}'s state takes {len(data)} bytes, over {SLOT_BYTES}")
        with self._locked(slot, fcntl.LOCK_EX):
            os.pwrite(self._fd, len(data).to_bytes(LENGTH_BYTES, "little") + data, slot * SLOT_BYTES)

    def read(self, slot: int) -> Published | None:
        with self._locked(slot, fcntl.LOCK_SH):
            length = int.from_bytes(os.pread(self._fd, LENGTH_BYTES, slot * SLOT_BYTES), "little")
            data = os.pread(self._fd, length, slot * SLOT_BYTES + LENGTH_BYTES) if length else b""
        if not data:
            return None
        fields = orjson.loads(data)
        return Published(
            pid=fields["pid"],
            at=fields["at"],
            failing=tuple(fields["failing"]),
            served=fields["served"],
            metrics=fields["metrics"],
        )

    def retire(self, slot: int, reason: str) -> None:
        """Marks a dead worker's slot not ready at once; its counters stay for its successor."""
        last = self.read(slot)
        if last is not None:
            self.write(slot, Published(0, time.monotonic(), (reason,), last.served, last.metrics))


class Worker:
    """One worker's side of the board: publishes its own state, reads the others'."""

    def __init__(self, board: Board, slot: int) -> None:
        self.board = board
        self.slot = slot
        previous = board.read(slot)
        self._served = previous is not None and previous.served
        # What the slot's earlier workers counted, continued so every sum over workers stays monotonic.
        self.inherited = previous.metrics if previous is not None else None
        self._sources: tuple[Callable[[], list[str]], Metrics] | None = None
        # The board thread and the worker's last words both publish: one at a time, each reading the
        # state as it writes, so a publication made earlier never lands over a later one (a ready slot
        # over a stopping worker's, or older counters over the last ones its successor continues).
        self._publishing = threading.Lock()

    def publish(self) -> None:
        """Writes the worker's readiness and counters as they are now into its slot."""
        if self._sources is None:
            return
        failing_now, metrics = self._sources
        with self._publishing:
            # Stamped before the state is read: a slot stamped after a worker asked was read after it.
            at = time.monotonic()
            failing = failing_now()
            self._served = self._served or "started" not in failing
            self.board.write(
                self.slot, Published(os.getpid(), at, tuple(failing), self._served, metrics.snapshot())
            )

    def others(self) -> dict[int, Published | None]:
        """Every other worker's slot, published for this call: a worker answers with its own state as
        it is now, so it reads the others' as they are now too, not as they were up to PUBLISH_SECONDS
        ago (a worker that just started would otherwise be ready when it answers and starting when
        another does, one that is stopping the reverse)."""
        asked = time.monotonic()
        waiting = [slot for slot in range(self.board.size) if slot != self.slot]
        for slot in waiting:
            self.board.ask(slot)
        latest: dict[int, Published | None] = {}
        deadline = asked + ASKED_WAIT_SECONDS
        while waiting:
            for slot in list(waiting):
                published = latest[slot] = self.board.read(slot)
                # A fresh slot, or one nobody will refresh (never started, or its worker dead).
                if published is None or published.pid == 0 or published.at >= asked:
                    waiting.remove(slot)
            if waiting and time.monotonic() < deadline:
                time.sleep(ASKED_POLL_SECONDS)
            else:
                break
        return dict(sorted(latest.items()))

    def failing_others(self) -> list[str]:
        """The other workers that are not ready, with why ("worker 1: starting")."""
        others = self.others()
        now = time.monotonic()
        failing = []
        for slot, published in others.items():
            if published is None:
                failing.append(f"worker {slot}: starting")
            elif not published.ready(now):
                why = ", ".join(published.failing) or "not publishing"
                failing.append(f"worker {slot}: {why}")
        return failing

    def others_ready(self) -> bool:
        return not self.failing_others()

    def merged(self, own: Metrics) -> Metrics:
        """This worker's live counters plus every other worker's, published for this call."""
        total = Metrics()
        total.add(own.snapshot())
        for published in self.others().values():
            if published is not None:
                total.add(published.metrics)
        return total

    def publishing(self, failing: Callable[[], list[str]], metrics: Metrics, stop: threading.Event) -> None:
        """Publishes now, then every PUBLISH_SECONDS and when asked, on a thread until `stop`."""

        self._sources = (failing, metrics)

        def loop() -> None:
            while not stop.is_set():
                try:
                    self.publish()
                except Exception:  # a failed write must not end publishing: the slot would go stale
                    log.exception("worker %d could not publish its state", self.slot)
                self.board.wait_asked(self.slot, PUBLISH_SECONDS)

        self.publish()
        threading.Thread(target=loop, name="worker-board", daemon=True).start()


def listen(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """The listening socket every worker inherits (IPv6 when the host is an IPv6 address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=backlog)


class _Stopping(Exception):
    """Raised by the supervisor's signal handler to leave whatever it waits on."""


def _raise_stopping(signum: int, _: FrameType | None) -> None:
    raise _Stopping(signum)


def _die_with_parent(parent: int) -> None:
    """A worker must not outlive a supervisor killed with SIGKILL: the kernel sends it SIGTERM."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        log.info("prctl unavailable: a worker outlives a killed supervisor until its next request")
    if os.getppid() != parent:  # the supervisor died before prctl took effect
        os._exit(1)


class Supervisor:
    """Forks `count` workers running `run(worker)` (their exit status), keeps them running, stops them
    on SIGTERM or SIGINT, and returns the exit status of the whole server."""

    def __init__(self, count: int, run: Callable[[Worker], int]) -> None:
        self.count = count
        self.run_worker = run
        self.board = Board(count)
        self.children: dict[int, int] = {}  # pid -> slot
        self._started: dict[int, float] = {}  # slot -> when its current worker was forked
        self._delay: dict[int, float] = {}  # slot -> the delay before its next restart

    def _fork(self, slot: int) -> None:
        parent = os.getpid()
        # The supervisor's objects (every imported module) are shared copy-on-write with the worker:
        # frozen, the worker's collections never write to them, so their pages stay shared.
        gc.freeze()
        pid = os.fork()
        if pid == 0:  # the worker: it never returns into the supervisor's code
            status = 1
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                _die_with_parent(parent)
                status = self.run_worker(Worker(self.board, slot))
            except SystemExit as exc:
                status = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                log.exception("worker %d failed", slot)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        self.children[pid] = slot
        self._started[slot] = time.monotonic()
        log.info("worker %d started", slot, extra={"fields": {"worker": slot, "pid": pid}})

    def run(self) -> int:
        previous = {sig: signal.signal(sig, _raise_stopping) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            try:
                for slot in range(self.count):
                    self._fork(slot)
                while True:
                    pid, status = os.wait()
                    code = self._exited(pid, status)
                    if code is not None:
                        return self._stop(code)
            except _Stopping:
                return self._stop(0)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _exited(self, pid: int, status: int) -> int | None:
        """Handles a worker's exit; returns the server's exit status when the server must end."""
        slot = self.children.pop(pid, None)
        if slot is None:
            return None
        code = os.waitstatus_to_exitcode(status)
        fields = {"worker": slot, "pid": pid, "status": code}
        last = self.board.read(slot)
        if last is None or not last.served:
            log.error(
                "worker %d exited with %d before serving: stopping", slot, code, extra={"fields": fields}
            )
            return code if code > 0 else 1
        self.board.retire(slot, "restarting")
        lived = time.monotonic() - self._started[slot]
        delay = RESTART_DELAY_SECONDS
        if lived < RESTART_RESET_SECONDS:
            delay = min(self._delay.get(slot, RESTART_DELAY_SECONDS / 2) * 2, MAX_RESTART_DELAY_SECONDS)
        self._delay[slot] = delay
        log.error(
            "worker %d exited with %d; starting it again in %.1f s",
            slot,
            code,
            delay,
            extra={"fields": fields},
        )
        time.sleep(delay)  # a SIGTERM meanwhile raises _Stopping out of it
        self._fork(slot)
        return None

    def _stop(self, code: int) -> int:
        """SIGTERM to every worker (each drains as a one-process server does), then waits for them all;
        a second signal meanwhile kills them."""

        def kill(signum: int, _: FrameType | None) -> None:
            for pid in self.children:
                os.kill(pid, signal.SIGKILL)

        signal.signal(signal.SIGTERM, kill)
        signal.signal(signal.SIGINT, kill)
        for pid in self.children:
            os.kill(pid, signal.SIGTERM)
        while self.children:
            pid, _ = os.wait()
            self.children.pop(pid, None)
        return code
