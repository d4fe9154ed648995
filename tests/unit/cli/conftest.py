"""The command line in-process: `webhook.cli.main` without a process per call. What needs the real
process (the console script, what a plain run imports, servers, --workers) is in tests/integration/."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.manifests import CliRun, Gpuguard, run_gpuguard_in_process


@pytest.fixture
def gpuguard(tmp_path: Path) -> Gpuguard:
    """`gpuguard(*args, stdin=...)`: `webhook.cli.main` in-process, in the test's temp folder."""

    def run(*args: str, stdin: str | bytes = b"") -> CliRun:
        return run_gpuguard_in_process(*args, cwd=tmp_path, stdin=stdin)

    return run
