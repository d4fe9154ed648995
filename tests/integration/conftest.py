"""The integration tier: real processes on loopback and no API server. The server over TLS with
hostile clients, `--workers`, the command line where its process matters (through its console script;
the rest of it is tested in-process in tests/unit/cli/), the suite itself and the benches that run as a
command."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.manifests import CliRun, Gpuguard, run_gpuguard
from tests.harness.suite import summary_fixture, summary_lines

TIER = "integration"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    for line in summary_lines(config, TIER):
        terminalreporter.write_line(f"{TIER}: {line}")


@pytest.fixture
def gpuguard(tmp_path: Path) -> Gpuguard:
    """`gpuguard(*args, stdin=...)`: the installed console script, run in the test's temp folder."""

    def run(*args: str, stdin: str | bytes = b"") -> CliRun:
        return run_gpuguard(*args, cwd=tmp_path, stdin=stdin)

    return run


summary = summary_fixture(TIER)
