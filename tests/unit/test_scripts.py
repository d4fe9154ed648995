"""The scripts the README tells people to run, run as it says."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness import REPO_ROOT

STARTUP_SECONDS = 60.0  # includes sourcing venv.sh, which may have to reinstall after a pyproject edit
LISTEN = "0A"  # the TCP state LISTEN in /proc/net/tcp


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _listening_addresses(port: int) -> set[str]:
    """The local addresses (hex, as the kernel writes them) with a socket listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, _, hex_port = fields[1].partition(":")
            if int(hex_port, 16) == port and fields[3] == LISTEN:
                found.add(address)
    return found


def test_scripts_serve_listens_on_loopback_only(tmp_path: Path) -> None:
    port = _free_port()
    env = {**os.environ, "GPUGUARD_VENV": sys.prefix}
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            ["bash", str(REPO_ROOT / "scripts" / "serve"), "--port", str(port), "--cert-dir", str(tmp_path)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while not _listening_addresses(port):
            assert time.monotonic() < deadline, (
                f"not listening within {STARTUP_SECONDS} s:\n{log.read_text()}"
            )
            try:
                process.wait(timeout=0.1)  # paces the polling; an early exit ends the wait at once
            except subprocess.TimeoutExpired:
                continue
            raise AssertionError(f"scripts/serve exited with {process.returncode}:\n{log.read_text()}")
        assert _listening_addresses(port) == {"0100007F"}, "listening beyond 127.0.0.1"
        assert f"gpuguard: serving https://127.0.0.1:{port}" in log.read_text()
    finally:
        process.kill()
        process.wait(timeout=30)


def test_constraints_check_runs_outside_the_venv() -> None:
    # -S: no site-packages at all, as for a system Python that has neither gpuguard nor packaging.
    result = subprocess.run(
        [sys.executable, "-S", str(REPO_ROOT / "scripts" / "constraints.py"), "--check"],
        capture_output=True,
        text=True,
        env={**os.environ, "GPUGUARD_VENV": sys.prefix},
        cwd="/",
        timeout=120,
        check=False,
    )
    assert (result.returncode, result.stderr) == (0, ""), result.stdout


# scripts/test, run as it is, with stand-ins for the slow tools it calls: ruff, mypy, pytest and go
# write their command line to a log and exit with the status a test sets for the tool (for pytest: for
# its tier), so what
# is checked is the script's order: the check first, then the tiers, each after its own builds.
STAND_IN = """#!/bin/sh
echo "$(basename "$0")${*:+ $*}" >> "$STAND_IN_LOG"
key=$(basename "$0")
if [ "$key" = pytest ]; then key=${1#tests/}; key=${key%%/*}; fi
exit "$(cat "$STAND_IN_LOG.$key" 2>/dev/null || echo 0)"
"""
CHECK = ["ruff check webhook tests bench", "ruff format --check webhook tests bench", "mypy"]
CONTROL_PLANE = "build the control plane"
HELM = "build Helm"


@dataclass
class ScriptRun:
    code: int
    steps: list[str]
    stderr: str


@pytest.fixture
def run_scripts_test(tmp_path: Path) -> Callable[..., ScriptRun]:
    """`run_scripts_test(*args, statuses={tier: pytest's exit code})`: scripts/test in a virtualenv of
    stand-ins (venv.sh finds it installed: its stamp matches), builds going to empty folders."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for tool in ("python", "ruff", "mypy", "pytest", "go", "wrk", "hey", "taskset"):
        (venv / "bin" / tool).write_text(STAND_IN)
        (venv / "bin" / tool).chmod(0o755)
    pins = (REPO_ROOT / "pyproject.toml").read_bytes() + (REPO_ROOT / "constraints.txt").read_bytes()
    (venv / ".gpuguard-installed").write_text(hashlib.sha256(pins).hexdigest() + "\n")
    log = tmp_path / "log"
    env = {
        **os.environ,
        "GPUGUARD_VENV": str(venv),
        "GPUGUARD_K8S_BIN": str(tmp_path / "k8s-bin"),
        "GPUGUARD_HELM_BIN": str(tmp_path / "helm"),
        "STAND_IN_LOG": str(log),
    }

    def run(*args: str, statuses: dict[str, int] | None = None) -> ScriptRun:
        for tier, status in (statuses or {}).items():
            Path(f"{log}.{tier}").write_text(str(status))
        log.write_text("")
        result = subprocess.run(
            ["bash", str(REPO_ROOT / "scripts" / "test"), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
        return ScriptRun(result.returncode, _steps(log.read_text().splitlines()), result.stderr)

    return run


def _steps(lines: list[str]) -> list[str]:
    """The stand-ins' log, a build's many `go` calls said once."""
    steps: list[str] = []
    for line in lines:
        if line.startswith("go "):
            line = HELM if "helm.sh/helm" in line else CONTROL_PLANE
        if not steps or steps[-1] != line:
            steps.append(line)
    return steps


def test_scripts_test_checks_first_then_runs_the_tiers_fastest_first(
    run_scripts_test: Callable[..., ScriptRun],
) -> None:
    run = run_scripts_test()
    assert (run.code, run.steps) == (
        0,
        [
            *CHECK,
            "pytest tests/unit",
            "pytest tests/integration",
            CONTROL_PLANE,
            HELM,
            "pytest tests/e2e",
            CONTROL_PLANE,
            "pytest tests/node",
        ],
    ), run.stderr


def test_the_unit_tier_builds_nothing_and_takes_pytest_arguments(
    run_scripts_test: Callable[..., ScriptRun],
) -> None:
    run = run_scripts_test("unit", "-k", "priority", "-x")
    assert (run.code, run.steps) == (0, [*CHECK, "pytest tests/unit -k priority -x"]), run.stderr


def test_the_integration_tier_runs_alone_and_builds_nothing(
    run_scripts_test: Callable[..., ScriptRun],
) -> None:
    run = run_scripts_test("integration")
    assert (run.code, run.steps) == (0, [*CHECK, "pytest tests/integration"]), run.stderr


def test_tiers_named_run_in_the_suite_order(run_scripts_test: Callable[..., ScriptRun]) -> None:
    run = run_scripts_test("node", "unit")
    assert run.steps == [*CHECK, "pytest tests/unit", CONTROL_PLANE, "pytest tests/node"], run.stderr


def test_a_path_runs_in_its_own_tier_only(run_scripts_test: Callable[..., ScriptRun]) -> None:
    run = run_scripts_test("./tests/e2e/test_guard.py::test_one", "-q")
    assert (run.code, run.steps) == (
        0,
        [*CHECK, CONTROL_PLANE, HELM, "pytest tests/e2e/test_guard.py::test_one -q"],
    ), run.stderr


def test_a_path_in_no_tier_is_refused_before_anything_runs(
    run_scripts_test: Callable[..., ScriptRun],
) -> None:
    run = run_scripts_test("tests/controlplane")
    assert (run.code, run.steps) == (2, [])
    assert (
        "tests/controlplane is in no tier's folder (tests/unit tests/integration tests/e2e tests/node)"
        in run.stderr
    )


def test_a_failing_check_stops_before_any_test_or_build(run_scripts_test: Callable[..., ScriptRun]) -> None:
    run = run_scripts_test(statuses={"ruff": 1})
    assert (run.code, run.steps) == (1, [CHECK[0]])


def test_a_failing_tier_stops_the_run_before_the_next_tiers_builds(
    run_scripts_test: Callable[..., ScriptRun],
) -> None:
    run = run_scripts_test(statuses={"unit": 1})
    assert (run.code, run.steps) == (1, [*CHECK, "pytest tests/unit"])


def test_a_tier_where_nothing_is_selected_is_passed_over(run_scripts_test: Callable[..., ScriptRun]) -> None:
    run = run_scripts_test("unit", "node", "-k", "kubelet", statuses={"unit": 5})
    assert (run.code, run.steps[-1]) == (0, "pytest tests/node -k kubelet")


def test_nothing_selected_in_any_tier_is_pytests_exit_code_5(
    run_scripts_test: Callable[..., ScriptRun],
) -> None:
    run = run_scripts_test("unit", "-k", "nothing", statuses={"unit": 5})
    assert run.code == 5
