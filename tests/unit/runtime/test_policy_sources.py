"""webhook.runtime.policy_store: whatever a source offers, a failure to read or parse it is a refused policy,
reported as such, and the source keeps running; a file edited in place is never served half-written."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from webhook.policy.model import PolicyError, default_policy, parse_policy
from webhook.runtime.policy_store import FileWatcher, PolicyStore, policy_text

WARN = "mode: warn\n"
AUDIT = "mode: audit\n"
DEEP = "a: " + "[" * 20_000 + "]" * 20_000 + "\n"


@pytest.fixture
def store() -> PolicyStore:
    return PolicyStore(default_policy(), source="embedded default")


def watcher(path: Path, store: PolicyStore) -> FileWatcher:
    return FileWatcher(path, store, threading.Event(), loaded=path.read_bytes())


@pytest.mark.parametrize(
    ("text", "error"),
    [
        pytest.param(DEEP, "nests deeper", id="deep-yaml"),
        pytest.param("enabled: 'no'\n", "enabled", id="string-kill-switch"),
        pytest.param("rules: [", "not valid YAML", id="broken-yaml"),
    ],
)
def test_a_policy_that_cannot_be_used_is_refused_and_reported(
    store: PolicyStore, text: str, error: str
) -> None:
    reported: list[str] = []
    store.on_error = reported.append

    assert store.offer(text, source="ConfigMap gpuguard/gpuguard-policy") is False

    status = store.status()
    assert (status.hash, status.errors) == (default_policy().hash, 1)
    assert status.last_error is not None and error in status.last_error
    assert reported == [status.last_error]  # what becomes the InvalidPolicy Event


def test_invalid_utf8_and_deep_yaml_in_the_file_are_refused_and_later_edits_still_apply(
    tmp_path: Path, store: PolicyStore
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(WARN)
    files = watcher(path, store)

    for data in (b"mode: \xff\xfe warn\n", DEEP.encode()):
        path.write_bytes(data)
        files.poll()
        files.poll()
    status = store.status()
    assert status.errors == 2
    assert status.last_error is not None and "nests deeper" in status.last_error

    path.write_text("enabled: false\n")  # the kill switch still works
    files.poll()
    files.poll()
    assert store.policy.enabled is False
    assert store.status().last_error is None


def test_the_watcher_thread_survives_what_it_reads(tmp_path: Path, store: PolicyStore) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(WARN)
    refused, loaded = threading.Event(), threading.Event()
    store.on_error = lambda _: refused.set()
    store.on_loaded = lambda _: loaded.set()
    stop = threading.Event()
    files = FileWatcher(path, store, stop, loaded=path.read_bytes())
    files.thread.start()
    try:
        path.write_bytes(DEEP.encode() + b"\xff")
        assert refused.wait(timeout=30), "the refusal was never reported"
        assert files.thread.is_alive()
        path.write_text("enabled: false\n")
        assert loaded.wait(timeout=30), "the kill switch was never applied"
        assert store.policy.enabled is False
    finally:
        stop.set()
        files.thread.join(timeout=30)


def test_an_edit_is_taken_once_the_file_has_settled(tmp_path: Path, store: PolicyStore) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(WARN)
    files = watcher(path, store)

    # Midway through a truncate-then-write edit: empty, then half of the new text.
    path.write_text("")
    files.poll()
    path.write_text("mode: au")
    files.poll()
    path.write_text(AUDIT)
    files.poll()
    assert (store.policy.hash, store.status().errors) == (default_policy().hash, 0)

    files.poll()  # the same bytes a poll later: settled
    assert store.policy.hash == parse_policy(AUDIT).hash


def test_an_empty_file_that_stays_empty_is_refused_not_read_as_the_defaults(
    tmp_path: Path, store: PolicyStore
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(WARN)
    store.offer(WARN, source="file")
    files = watcher(path, store)

    path.write_text("")
    files.poll()
    files.poll()

    assert store.policy.hash == parse_policy(WARN).hash
    assert "policy file is empty" in (store.status().last_error or "")
    path.write_text("{}\n")  # what the defaults are written as
    files.poll()
    files.poll()
    assert store.policy.hash == default_policy().hash


def test_a_file_that_disappears_keeps_the_active_policy(tmp_path: Path, store: PolicyStore) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(WARN)
    store.offer(WARN, source="file")
    files = watcher(path, store)
    path.unlink()
    files.poll()
    files.poll()
    assert (store.policy.hash, store.status().errors) == (parse_policy(WARN).hash, 0)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(b"", "empty", id="empty"),
        pytest.param(b"  \n\n", "empty", id="blank"),
        pytest.param(b"mode: \xffwarn\n", "not UTF-8", id="not-utf8"),
    ],
)
def test_policy_file_bytes_that_are_no_policy(data: bytes, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        policy_text(data)


def test_a_bug_while_parsing_is_a_refusal_not_a_dead_source(
    store: PolicyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(text: str) -> None:
        raise RecursionError("somewhere deep")

    monkeypatch.setattr("webhook.runtime.policy_store.parse_policy", broken)
    assert store.offer(WARN, source="file") is False
    assert "RecursionError: somewhere deep" in (store.status().last_error or "")
