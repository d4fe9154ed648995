"""Fixtures the in-process and the integration tiers share (each tier's own are in its conftest.py; the
builders they use are in tests/harness/)."""

from __future__ import annotations

import pytest

from webhook.policy.model import Policy, default_policy


@pytest.fixture(scope="session")
def policy() -> Policy:
    """The embedded default policy (frozen, so one instance serves every test)."""
    return default_policy()
