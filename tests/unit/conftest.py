"""Fixtures of the unit suite; the builders they and the tests share are in tests/harness/manifests.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

from tests.harness.manifests import CliRun, Gpuguard, run_gpuguard
from webhook.policy.model import Policy, default_policy

# Property tests assert behaviour, not speed: on a loaded machine one example can take longer than
# hypothesis's default 200 ms deadline, which would fail a correct test. Timing lives in bench/.
settings.register_profile("gpuguard", deadline=None)
settings.load_profile("gpuguard")


@pytest.fixture(scope="session")
def policy() -> Policy:
    """The embedded default policy (frozen, so one instance serves every test)."""
    return default_policy()


@pytest.fixture
def gpuguard(tmp_path: Path) -> Gpuguard:
    """`gpuguard(*args, stdin=...)`: the installed console script, run in the test's temp folder."""

    def run(*args: str, stdin: str | bytes = b"") -> CliRun:
        return run_gpuguard(*args, cwd=tmp_path, stdin=stdin)

    return run
