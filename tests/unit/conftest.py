"""The unit tier: in-process tests of each room (tests/unit/<room>/, mirroring webhook/<room>/), and at
the top the tests of the repository as a whole. The builders they share are in tests/harness/."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from hypothesis import settings

from tests.harness.apiserver import FakeApiServer

# Property tests assert behaviour, not speed: on a loaded machine one example can take longer than
# hypothesis's default 200 ms deadline, which would fail a correct test. Timing lives in bench/.
settings.register_profile("gpuguard", deadline=None)
settings.load_profile("gpuguard")


@pytest.fixture
def stop() -> Iterator[threading.Event]:
    """The stop event of what a test starts (informers, Event senders): set when the test ends."""
    stop = threading.Event()
    yield stop
    stop.set()


@pytest.fixture
def apiserver(stop: threading.Event) -> Iterator[FakeApiServer]:
    """An in-process API server (tests/harness/apiserver.py); when the test ends, the watches it holds open end, and
    with `stop` set the threads that held them do too."""
    server = FakeApiServer()
    yield server
    stop.set()
    server.close()
