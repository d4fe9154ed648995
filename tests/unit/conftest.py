"""Fixtures of the unit suite; the builders they and the tests share are in builders.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from webhook.policy.model import Policy, default_policy

from .apiserver import FakeApiServer
from .builders import CliRun, Gpuguard, run_gpuguard

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


@pytest.fixture
def stop() -> Iterator[threading.Event]:
    """The stop event of what a test starts (informers, Event senders): set when the test ends."""
    stop = threading.Event()
    yield stop
    stop.set()


@pytest.fixture
def apiserver(stop: threading.Event) -> Iterator[FakeApiServer]:
    """An in-process API server (apiserver.py); when the test ends, the watches it holds open end, and
    with `stop` set the threads that held them do too."""
    server = FakeApiServer()
    yield server
    stop.set()
    server.close()
