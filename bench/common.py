"""What every bench shares: load generators pinned to their core (wrk, hey), servers pinned to theirs and
measured from /proc (CPU, resident set), the wait for a quiet machine and the accounting of other
processes' load during a measurement, and the pieces of a report (floor tables, saturated-run rows).

The benches are `python -m bench.<name>`: serving (the default, `python -m bench`), hotpath, cores,
admission, fleet, controllers, fleetday, audit; bench/README.md explains each and its floors.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import resource
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import orjson

T = TypeVar("T")

SERVER_CORE = "1"
LOAD_CORE = "0"
GPU_POD = "10 KB GPU pod"
SATURATION_CONNECTIONS = 16
# A floor measurement during which other processes took more than this share of a core is taken again
# once the machine is quiet (at most twice more); the least disturbed attempt is kept and its share shown.
NOISE_LIMIT = 0.15

WRK_SCRIPT = """\
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = assert(io.open("{body}", "rb"))
wrk.body = f:read("*a")
f:close()
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_RESULT {{"requests":%.0f,"duration_us":%.0f,"p50_us":%.1f,"p99_us":%.1f,"max_us":%.1f,' ..
    '"connect":%.0f,"read":%.0f,"write":%.0f,"status":%.0f,"timeout":%.0f}}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99), latency.max,
    e.connect, e.read, e.write, e.status, e.timeout))
end
"""


# --- load generators -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """One bounded load run: throughput, latency percentiles and every kind of error the client saw."""

    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int
    rss_peak_mb: float = 0.0
    server_cpu_s: float = 0.0  # CPU the server process used during the run

    @property
    def cpu_us(self) -> float:
        """Server CPU per request: unlike req/s, not lowered by other processes sharing the core."""
        return self.server_cpu_s / self.requests * 1e6 if self.requests else 0.0

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def pinned(core: str, argv: Sequence[str]) -> list[str]:
    return ["taskset", "-c", core, *argv]


def wrk(
    url: str, script: Path, *, connections: int, seconds: int, timeout_s: int = 5, core: str = LOAD_CORE
) -> Load:
    argv = pinned(
        core,
        [
            "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{seconds}s",
            f"--timeout={timeout_s}s",
            "-s",
            str(script),
            url,
        ],
    )
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=seconds + 60).stdout
    match = re.search(r"^WRK_RESULT (\{.*\})$", out, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"wrk printed no result:\n{out}")
    r = json.loads(match.group(1))
    errors = int(r["connect"] + r["read"] + r["write"] + r["status"] + r["timeout"])
    return Load(int(r["requests"]), r["duration_us"] / 1e6, r["p50_us"] / 1e3, r["p99_us"] / 1e3, errors)


def hey(url: str, body: Path, *, rate: int, workers: int, seconds: int) -> Load:
    argv = pinned(
        LOAD_CORE,
        [
            "hey", "-z", f"{seconds}s", "-c", str(workers), "-q", str(rate // workers), "-cpus", "1",
            "-m", "POST", "-T", "application/json", "-D", str(body), url,
        ],
    )  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=seconds + 60).stdout

    def number(pattern: str) -> float:
        match = re.search(pattern, out)
        if match is None:
            raise RuntimeError(f"hey output lacks {pattern!r}:\n{out}")
        return float(match.group(1))

    answers, _, failures = out.partition("Error distribution:")
    ok = sum(int(n) for n in re.findall(r"\[200\]\s+(\d+) responses", answers))
    statuses = sum(int(n) for n in re.findall(r"\[\d+\]\s+(\d+) responses", answers))
    failed = sum(int(n) for n in re.findall(r"^\s+\[(\d+)\]", failures, re.MULTILINE))
    return Load(
        requests=ok,
        seconds=number(r"Total:\s+([\d.]+) secs"),
        p50_ms=number(r"50% in ([\d.]+) secs") * 1e3,
        p99_ms=number(r"99% in ([\d.]+) secs") * 1e3,
        errors=failed + statuses - ok,
    )


# --- servers ---------------------------------------------------------------------------------------------


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a running process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter(Protocol):
    """A process of the bench's own whose CPU is not other processes' load: a server, the API server."""

    @property
    def running(self) -> bool: ...

    def cpu_seconds(self) -> float: ...


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Server:
    """A server process pinned to `cores` (SERVER_CORE unless told); `start` returns the seconds from spawn
    to the first 200."""

    def __init__(
        self, name: str, argv: list[str], *, port: int, ca: Path, log: Path, cores: str = SERVER_CORE
    ) -> None:
        self.name = name
        self.argv = argv
        self.cores = cores
        self.port = port
        self.ca = ca
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.pid)

    def url(self, path: str) -> str:
        return f"https://127.0.0.1:{self.port}{path}"

    def context(self) -> ssl.SSLContext:
        # Verified against the CA the server was started with: the caBundle path, which wrk and hey skip.
        return ssl.create_default_context(cafile=str(self.ca))

    def start(self, timeout_s: float = 30.0) -> float:
        with self.log.open("ab") as log:
            started = time.perf_counter()
            self.proc = subprocess.Popen(pinned(self.cores, self.argv), stdout=log, stderr=log)
        deadline = started + timeout_s
        context: ssl.SSLContext | None = None
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log}")
            # The CA file may appear only once the server has generated it.
            context = context or (self.context() if self.ca.exists() else None)
            if context is not None and self._ready(context):
                return time.perf_counter() - started
            time.sleep(0.002)
        raise RuntimeError(f"{self.name} not ready after {timeout_s} s; see {self.log}")

    def _ready(self, context: ssl.SSLContext) -> bool:
        connection = http.client.HTTPSConnection("127.0.0.1", self.port, context=context, timeout=1)
        try:
            connection.request("GET", "/readyz")
            return connection.getresponse().status == 200
        except OSError:
            return False
        finally:
            connection.close()

    def post(self, path: str, body: bytes) -> Any:
        connection = http.client.HTTPSConnection("127.0.0.1", self.port, context=self.context(), timeout=30)
        try:
            connection.request("POST", path, body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            if response.status != 200:
                raise RuntimeError(f"{self.name} answered {response.status}")
            return orjson.loads(response.read())
        finally:
            connection.close()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextmanager
def peak_rss(pid: int, out: list[float]) -> Iterator[None]:
    """Samples the process's resident set every 50 ms while the block runs; appends the peak to `out`."""
    stop = threading.Event()
    peak = [rss_mb(pid)]

    def sample() -> None:
        while not stop.wait(0.05):
            try:
                peak[0] = max(peak[0], rss_mb(pid))
            except (OSError, RuntimeError):
                return

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        out.append(peak[0])


# --- a quiet machine -------------------------------------------------------------------------------------


def busy_seconds() -> tuple[float, float]:
    """(CPU seconds all processes used, seconds the hypervisor stole) since boot, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


def own_seconds() -> float:
    """CPU seconds of the bench, its servers and load generators (children count once waited for)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def _ours(servers: Sequence[CpuMeter]) -> float:
    """CPU seconds of the bench and of its long-running processes, which no wait collects."""
    return own_seconds() + sum(server.cpu_seconds() for server in servers if server.running)


@contextmanager
def other_load(servers: Sequence[CpuMeter], out: list[float]) -> Iterator[None]:
    """Appends the share of a core that processes other than the bench's used while the block ran."""
    busy, own, started = busy_seconds()[0], _ours(servers), time.monotonic()
    yield
    other = (busy_seconds()[0] - busy) - (_ours(servers) - own)
    out.append(max(0.0, other) / (time.monotonic() - started))


def wait_for_quiet(
    limit_s: float,
    say: Callable[[str], None],
    window_s: float = 5.0,
    share: float = 0.1,
    servers: Sequence[CpuMeter] = (),
) -> None:
    """Waits (at most `limit_s`) for `window_s` during which other processes use under `share` of a core:
    the servers are pinned, but nothing keeps the machine's other work off their core."""
    deadline = time.monotonic() + limit_s
    while True:
        busy, _ = busy_seconds()
        own = _ours(servers)
        time.sleep(window_s)
        other = (busy_seconds()[0] - busy) - (_ours(servers) - own)
        if other < share * window_s:
            return
        if time.monotonic() >= deadline:
            say(f"the machine is busy ({other / window_s:.0%} of a core elsewhere); measuring anyway")
            return
        say(f"waiting for a quiet machine ({other / window_s:.0%} of a core used elsewhere)")


def quietly(
    servers: Sequence[CpuMeter],
    say: Callable[[str], None],
    what: str,
    measure: Callable[[], T],
    wait_s: float = 120,
    attempts: int = 3,
) -> tuple[T, float]:
    """`measure()` and the share of a core other processes took meanwhile, the least disturbed of up to
    `attempts`."""
    best: tuple[T, float] | None = None
    for attempt in range(attempts):
        noise: list[float] = []
        with other_load(servers, noise):
            result = measure()
        if best is None or noise[0] < best[1]:
            best = (result, noise[0])
        if noise[0] <= NOISE_LIMIT or attempt == attempts - 1:
            break
        say(f"{what}: other processes took {noise[0]:.0%} of a core; again once the machine is quiet")
        wait_for_quiet(wait_s, say, servers=servers)
    assert best is not None
    return best


# --- the report ------------------------------------------------------------------------------------------


def fmt_ms(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


@dataclass
class SaturatedRuns:
    """One server's saturated runs (alternating with another's): their medians, and a row of a table
    under SATURATED_HEADER."""

    label: str
    runs: list[Load] = field(default_factory=list)

    @property
    def rps(self) -> float:
        return statistics.median(load.rps for load in self.runs)

    @property
    def cpu_us(self) -> float:
        return statistics.median(load.cpu_us for load in self.runs)

    @property
    def errors(self) -> int:
        return sum(load.errors for load in self.runs)

    def row(self) -> str:
        runs = ", ".join(f"{load.rps:,.0f}" for load in self.runs)
        median = sorted(self.runs, key=lambda load: load.rps)[len(self.runs) // 2]
        return (
            f"| {self.label} | {self.rps:,.0f} | {runs} | {self.cpu_us:.0f} | "
            f"{median.p50_ms:.2f} / {median.p99_ms:.2f} | {self.errors} |"
        )


def saturated_header(cpu: str) -> list[str]:
    """The header of SaturatedRuns' rows; `cpu` says whose CPU the CPU column counts."""
    return [
        f"| Server | req/s (median) | Runs | CPU µs per request{cpu} | p50 / p99 ms | Errors |",
        "|---|---:|---|---:|---:|---:|",
    ]


def floor_table(checks: Sequence[tuple[str, str, bool]]) -> list[str]:
    """The floors as a Markdown table: name, what was measured, met or missed."""
    return [
        "| Floor | Measured | |",
        "|---|---|---|",
        *(f"| {name} | {measured} | {'met' if met else '**missed**'} |" for name, measured, met in checks),
    ]


# --- the start of a bench --------------------------------------------------------------------------------


def _preflight() -> None:
    missing = [tool for tool in ("wrk", "hey", "taskset") if shutil.which(tool) is None]
    if missing:
        sys.exit(f"bench: {', '.join(missing)} not found; run bench/run, which installs them")
    if (os.cpu_count() or 1) < 2:
        sys.exit("bench: needs 2 cores (server on core 1, load generator on core 0)")


def begin(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> tuple[argparse.Namespace, Callable[[str], None]]:
    """A wrk-driven bench's start: its arguments (with --wait-quiet), its tools, a quiet machine."""
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=120,
        help="seconds to wait at most for other load to stop (default 120)",
    )
    args = parser.parse_args(argv)
    _preflight()
    say: Callable[[str], None] = lambda text: print(f"bench: {text}", file=sys.stderr, flush=True)  # noqa: E731
    wait_for_quiet(args.wait_quiet, say)
    return args, say


def command_line(command: str, argv: Sequence[str] | None) -> str:
    return command + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
