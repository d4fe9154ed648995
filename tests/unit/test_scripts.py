"""The scripts the README tells people to run, run as it says."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from .builders import REPO_ROOT

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
