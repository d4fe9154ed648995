"""Fixtures of the unit suite; the builders they and the tests share are in builders.py."""

from __future__ import annotations

import pytest

from webhook.policy.model import Policy, default_policy


@pytest.fixture(scope="session")
def policy() -> Policy:
    """The embedded default policy (frozen, so one instance serves every test)."""
    return default_policy()
