"""Session plumbing shared by the end-to-end tiers (tests/e2e, tests/node): building the Go binaries
with their progress visible, and lines written to the terminal past pytest's output capture. Each
tier's measurements for the terminal summary are gathered by the suite's plugin (suite.py)."""

from __future__ import annotations

import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO_ROOT

BUILD_SCRIPT = REPO_ROOT / "tests" / "controlplane" / "build.sh"


def announce(config: pytest.Config, message: str) -> None:
    """Writes straight to the terminal, even with output capture on and under -q."""
    reporter: pytest.TerminalReporter | None = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        print(message, file=sys.stderr)
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(message)


def run_build_script(config: pytest.Config, script: Path) -> Path:
    """Runs a build script that prints its output folder on its last line; returns that folder.
    Its progress (stderr) reaches the terminal: a cold build takes minutes."""
    capture = config.pluginmanager.get_plugin("capturemanager")
    assert capture is not None
    with capture.global_and_fixture_disabled():
        result = subprocess.run(["bash", str(script)], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    if result.returncode != 0:
        pytest.fail(f"{script} failed with exit code {result.returncode}", pytrace=False)
    return Path(result.stdout.strip().splitlines()[-1])


def build_control_plane(config: pytest.Config) -> Path:
    """The folder of kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kubectl and
    etcd; built on first use (about 10 minutes on 2 cores), a no-op once cached."""
    return run_build_script(config, BUILD_SCRIPT)


def namespace_name(request: pytest.FixtureRequest, fallback: str) -> str:
    """A fresh namespace name for a test: its name made DNS-safe, and a random suffix."""
    stem = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].rstrip("-")
    return f"{stem or fallback}-{secrets.token_hex(3)}"
