"""The policy store: a valid, different policy replaces the active one whole; anything else leaves it."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import yaml

from webhook.policy.model import Policy, default_policy
from webhook.runtime.policy_store import PolicyStore

SECONDS = 10.0


def text(**overrides: Any) -> str:
    return yaml.safe_dump(overrides)


@pytest.fixture
def store() -> PolicyStore:
    return PolicyStore(default_policy(), source="embedded default")


def test_a_valid_different_policy_becomes_active_and_is_announced(store: PolicyStore) -> None:
    loaded: list[Policy] = []
    store.on_loaded = loaded.append
    before = store.status()
    assert store.offer(text(enabled=False), source="ConfigMap gpuguard/gpuguard-policy")
    after = store.status()
    assert not store.policy.enabled
    assert after.hash != before.hash and after.source == "ConfigMap gpuguard/gpuguard-policy"
    assert after.loaded_at >= before.loaded_at
    assert [policy.hash for policy in loaded] == [after.hash]


def test_the_same_policy_again_from_the_same_source_changes_nothing(store: PolicyStore) -> None:
    assert store.offer(text(enabled=False), source="file policy.yaml")
    loaded_at = store.status().loaded_at
    store.on_loaded = lambda policy: pytest.fail(f"announced {policy.hash} again")
    assert not store.offer(text(enabled=False), source="file policy.yaml")
    assert store.status().loaded_at == loaded_at


def test_the_active_policy_from_another_source_is_adopted_and_announced(store: PolicyStore) -> None:
    """A ConfigMap spelling out the defaults: the embedded policy is what it says, and it must still be
    said active (its PolicyLoaded Event) and named as the source from then on."""
    loaded: list[Policy] = []
    store.on_loaded = loaded.append
    assert store.offer(text(), source="ConfigMap gpuguard/gpuguard-policy")
    status = store.status()
    assert (status.hash, status.source) == (default_policy().hash, "ConfigMap gpuguard/gpuguard-policy")
    assert [policy.hash for policy in loaded] == [default_policy().hash]


def test_an_invalid_policy_is_refused_counted_and_reported_and_the_active_one_stays(
    store: PolicyStore,
) -> None:
    errors: list[str] = []
    store.on_error = errors.append
    active = store.policy
    assert not store.offer(
        text(rules={"readinessTolerations": {"batchSeconds": "soon"}}), source="file p.yaml"
    )
    status = store.status()
    assert store.policy is active
    assert status.errors == 1 and status.last_error is not None
    assert "batchSeconds" in status.last_error and errors == [status.last_error]
    # The next valid policy clears the error but keeps the count.
    assert store.offer(text(enabled=False), source="file p.yaml")
    assert store.status().last_error is None and store.status().errors == 1


def test_a_source_that_disappears_keeps_the_active_policy(store: PolicyStore) -> None:
    store.offer(text(enabled=False), source="ConfigMap a/b")
    hash_before = store.status().hash
    assert not store.offer(None, source="ConfigMap a/b")
    assert store.status().hash == hash_before


def test_hooks_run_outside_the_lock(store: PolicyStore) -> None:
    # A hook that reads the store (as an Event sender or a metric would) from another thread must not
    # wait for the offer that called it.
    seen: list[str] = []

    def read_from_another_thread(policy: Policy) -> None:
        reader = threading.Thread(target=lambda: seen.append(store.status().hash))
        reader.start()
        reader.join(SECONDS)
        assert not reader.is_alive(), "status() blocked while the hook ran"

    store.on_loaded = read_from_another_thread
    store.on_error = lambda _: read_from_another_thread(store.policy)
    store.offer(text(enabled=False), source="x")
    store.offer("enabled: [", source="x")
    assert len(seen) == 2
