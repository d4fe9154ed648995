"""All cores: `gpuguard serve --workers 2` against one worker, saturated, in one run on this machine.

One worker runs pinned to core 1, as in `bench/run`; two workers may use both cores. wrk drives both from
core 0 with the 10 KB GPU pod at 16 connections, the two alternating for `--rounds` runs each (median),
so drift of the machine hits both alike. On a 2-core machine wrk shares core 0 with a worker, so the
ratio is what two cores give with the load generator on one of them: the CPU per request (all of the
server's processes) says what the workers themselves cost. Also reported: each process's memory (RSS,
and PSS: shared pages split between the processes sharing them, so the PSS add up to the whole), and
whether the summed `/metrics` counted every request wrk saw answered.

    bench/run cores [--duration 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import functools
import http.client
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench import FLOOR_MISSED, payloads
from bench.common import (
    GPU_POD,
    SATURATION_CONNECTIONS,
    SERVER_CORE,
    WRK_SCRIPT,
    Load,
    SaturatedRuns,
    Server,
    begin,
    command_line,
    floor_table,
    process_cpu_seconds,
    quietly,
    rss_mb,
    saturated_header,
    wrk,
)
from tests.harness.controlplane import free_ports

FLOOR_SCALING = 1.7  # two workers' saturated throughput over one worker's


class Workers(Server):
    """`gpuguard serve --workers N`: its CPU and memory are the supervisor's and every worker's."""

    def processes(self) -> list[int]:
        children = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split()
        return [self.pid, *(int(child) for child in children)]

    def cpu_seconds(self) -> float:
        return sum(process_cpu_seconds(pid) for pid in self.processes())

    def requests_counted(self) -> float:
        """gpuguard_admission_requests_total summed over endpoints and results, as one scrape says."""
        connection = http.client.HTTPSConnection("127.0.0.1", self.port, context=self.context(), timeout=10)
        try:
            connection.request("GET", "/metrics")
            text = connection.getresponse().read().decode()
        finally:
            connection.close()
        pattern = r"^gpuguard_admission_requests_total\{[^}]*\} (\S+)$"
        return sum(float(value) for value in re.findall(pattern, text, re.MULTILINE))


def pss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no Pss for pid {pid}")


@dataclass(frozen=True)
class Memory:
    role: str  # "supervisor", "worker 0", ...
    rss_mb: float
    pss_mb: float


def memory(server: Workers) -> list[Memory]:
    pids = server.processes()
    roles = ["process"] if len(pids) == 1 else ["supervisor", *(f"worker {i}" for i in range(len(pids) - 1))]
    return [Memory(role, rss_mb(pid), pss_mb(pid)) for role, pid in zip(roles, pids, strict=True)]


@dataclass
class Setup(SaturatedRuns):
    workers: int = 1
    idle: list[Memory] = field(default_factory=list)
    loaded: list[Memory] = field(default_factory=list)
    counted: float = 0.0  # requests the summed /metrics counted during the runs
    answered: int = 0  # requests wrk saw answered during the runs (warm-ups and repeats included)
    wrk_runs: int = 0


@dataclass
class Results:
    setups: list[Setup]
    noise: float
    seconds: float


def run(args: argparse.Namespace, say: Callable[[str], None]) -> Results:
    began = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="gpuguard-cores-"))
    certs = work / "certs"
    body = work / "gpu-pod.json"
    body.write_bytes(payloads.encoded(payloads.PAYLOADS[GPU_POD]()))
    script = work / "gpu-pod.lua"
    script.write_text(WRK_SCRIPT.format(body=body))
    gpuguard = str(Path(sys.executable).with_name("gpuguard"))
    setups = [Setup("one worker", workers=1), Setup("two workers", workers=2)]
    servers: list[Workers] = []

    def server(setup: Setup) -> Workers:
        (port,) = free_ports(1)
        argv = [gpuguard, "serve", "--host", "127.0.0.1", "--port", str(port), "--cert-dir", str(certs)]
        argv += ["--cluster-lookups", "off", "--workers", str(setup.workers)]
        cores = SERVER_CORE if setup.workers == 1 else "0,1"
        log = work / f"{setup.workers}.log"
        return Workers(setup.label, argv, port=port, ca=certs / "ca.crt", log=log, cores=cores)

    noise: list[float] = []
    try:
        for setup in setups:
            servers.append(server(setup))
            servers[-1].start()
        time.sleep(0.5)  # settled after the first requests of the readiness check
        for setup, guard in zip(setups, servers, strict=True):
            setup.idle = memory(guard)
            setup.counted = -guard.requests_counted()

        def saturate(setup: Setup, guard: Workers) -> Load:
            url = guard.url("/mutate")
            warm = wrk(url, script, connections=SATURATION_CONNECTIONS, seconds=args.warmup)
            cpu = guard.cpu_seconds()
            load = wrk(url, script, connections=SATURATION_CONNECTIONS, seconds=args.duration)
            setup.answered += warm.requests + load.requests
            setup.wrk_runs += 2
            return replace(load, server_cpu_s=guard.cpu_seconds() - cpu)

        for round_ in range(args.rounds):
            for setup, guard in zip(setups, servers, strict=True):
                say(f"round {round_ + 1}/{args.rounds}, {setup.label}: {args.duration} s saturated")
                load, share = quietly(
                    servers, say, setup.label, functools.partial(saturate, setup, guard), args.wait_quiet
                )
                setup.runs.append(load)
                noise.append(share)
        for setup, guard in zip(setups, servers, strict=True):
            setup.loaded = memory(guard)
            setup.counted += guard.requests_counted()
    finally:
        for guard in servers:
            guard.stop()
        shutil.rmtree(work, ignore_errors=True)
    return Results(setups, max(noise), time.perf_counter() - began)


def floors(results: Results) -> list[tuple[str, str, bool]]:
    one, two = results.setups
    scaling = two.rps / one.rps if one.rps else 0.0
    rows = [
        (
            f"Two workers ≥ {FLOOR_SCALING}x one worker, saturated ({GPU_POD})",
            f"{scaling:.2f}x ({two.rps:,.0f} vs {one.rps:,.0f} req/s); other processes "
            f"{results.noise:.0%} of a core meanwhile",
            scaling >= FLOOR_SCALING,
        )
    ]
    for setup in results.setups:
        # A scrape counts every request answered before it; wrk counts only those it saw answered in
        # time, so the counters may exceed its count by the requests in flight when each run stopped.
        cut_off = SATURATION_CONNECTIONS * setup.wrk_runs
        rows.append(
            (
                f"{setup.label}: /metrics counts every request",
                f"{setup.counted:,.0f} counted, {setup.answered:,} answered to wrk",
                setup.answered <= setup.counted <= setup.answered + cut_off,
            )
        )
    return rows


def report(results: Results, command: str) -> str:
    lines = [
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: `{command}`, took {results.seconds:.0f} s. "
        f"One worker pinned to core {SERVER_CORE}, two workers on cores 0-1; wrk on core 0, "
        f"{SATURATION_CONNECTIONS} connections, {GPU_POD}, HTTPS keep-alive.",
        "",
        *saturated_header(", all processes"),
        *(setup.row() for setup in results.setups),
    ]
    lines += [
        "",
        "| Server | Process | RSS idle MB | PSS idle MB | RSS after load MB | PSS after load MB |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for setup in results.setups:
        for idle, loaded in zip(setup.idle, setup.loaded, strict=True):
            lines.append(
                f"| {setup.label} | {idle.role} | {idle.rss_mb:.1f} | {idle.pss_mb:.1f} | "
                f"{loaded.rss_mb:.1f} | {loaded.pss_mb:.1f} |"
            )
        total = sum(m.pss_mb for m in setup.loaded)
        lines.append(
            f"| {setup.label} | all (PSS sum) | | {sum(m.pss_mb for m in setup.idle):.1f} | | {total:.1f} |"
        )
    lines += ["", *floor_table(floors(results))]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench cores", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=int, default=10, help="seconds per saturated run (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per setup, alternating (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="seconds of warm-up before each run")
    args, say = begin(parser, argv)
    results = run(args, say)
    print(report(results, command_line("bench/run cores", argv)))
    return 0 if all(met for _, _, met in floors(results)) else FLOOR_MISSED


if __name__ == "__main__":
    sys.exit(main())
