"""Where the active policy comes from and how a new one replaces it: validated first, last good kept.

A source (a mounted file, a watched ConfigMap) offers text; a valid, different policy is swapped in
whole, an invalid one is refused with the error logged, counted and reported, and the active policy
stays. Anything that goes wrong reading or parsing a policy is such a refusal: a source never dies of
what it reads, because a dead source would silently ignore every later edit, the `enabled: false` kill
switch included. A source that disappears leaves the active policy in place.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from webhook.policy.model import Policy, PolicyError, default_policy, parse_policy

log = logging.getLogger("gpuguard.policy")
FILE_POLL_SECONDS = 1.0


@dataclass(frozen=True)
class PolicyStatus:
    hash: str
    source: str
    loaded_at: float
    last_error: str | None
    errors: int

    def as_json(self) -> dict[str, object]:
        """The fields /policy reports, in its names."""
        return {
            "hash": self.hash,
            "source": self.source,
            "loadedAt": self.loaded_at,
            "lastError": self.last_error,
            "errors": self.errors,
        }


class PolicyStore:
    def __init__(self, policy: Policy, *, source: str) -> None:
        self.policy = policy
        self.source = source
        self.loaded_at = time.time()
        self.last_error: str | None = None
        self.errors = 0
        # Hooks for the source to report back (for example as Kubernetes Events on a ConfigMap).
        self.on_error: Callable[[str], None] = lambda _: None
        self.on_loaded: Callable[[Policy], None] = lambda _: None
        self._lock = threading.Lock()

    def status(self) -> PolicyStatus:
        with self._lock:
            return PolicyStatus(self.policy.hash, self.source, self.loaded_at, self.last_error, self.errors)

    def offer(self, text: str | None, *, source: str) -> bool:
        """Takes a new policy text from `source`; True when it became the active policy.

        The hooks run after the lock is released: they may be slow (an Event to send) or read the store.
        """
        if text is None:
            log.warning("policy source %s is gone; keeping policy %s", source, self.policy.hash)
            return False
        try:
            policy = parse_policy(text)
        except PolicyError as exc:
            self.refuse(str(exc), source=source)
            return False
        except Exception as exc:  # a bug in parsing must not take the source down with it
            log.exception("policy from %s could not be parsed", source)
            self.refuse(f"policy could not be parsed: {type(exc).__name__}: {exc}", source=source)
            return False
        with self._lock:
            self.last_error = None
            # The same policy from another source is adopted all the same: a ConfigMap that spells out
            # the defaults must be said active (its PolicyLoaded Event, /policy's source), and from then
            # on it is where the policy comes from.
            if policy.hash == self.policy.hash and source == self.source:
                return False
            self.policy, self.source, self.loaded_at = policy, source, time.time()
        log.info("policy %s loaded from %s", policy.hash, source, extra={"fields": {"policy": policy.hash}})
        self.on_loaded(policy)
        return True

    def refuse(self, error: str, *, source: str) -> None:
        """Records a policy from `source` that could not be used; the active one stays."""
        with self._lock:
            self.errors += 1
            self.last_error = error
        log.error(
            "refused policy from %s; keeping policy %s",
            source,
            self.policy.hash,
            extra={"fields": {"error": error, "source": source}},
        )
        self.on_error(error)


def policy_text(data: bytes) -> str:
    """A policy file's bytes as text; PolicyError when they cannot be a policy file.

    An empty file is refused rather than read as "every default": a truncate-then-write edit in place
    passes through empty, and a replica must never serve the defaults because it looked at that moment.
    `{}` is the policy that takes every default.
    """
    if not data.strip():
        raise PolicyError("policy file is empty (an edit still being written?); write {} for the defaults")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyError(f"policy file is not UTF-8 text: {exc}") from exc


def initial_policy(policy_file: Path | None) -> tuple[Policy, str, bytes]:
    """The policy a process starts with, its source, and the file's bytes it was read from (b"" without
    one, for a FileWatcher to know what it has already offered)."""
    if policy_file is not None:
        data = policy_file.read_bytes()
        return parse_policy(policy_text(data)), f"file {policy_file}", data
    return default_policy(), "embedded default", b""


class FileWatcher:
    """Re-reads a policy file (for example a mounted ConfigMap, updated by symlink swap) when it changes.

    A change is taken once the file has read the same on two polls in a row, so a file rewritten in place
    is never offered half-written; a mounted ConfigMap swaps whole and is simply taken a poll later.
    """

    def __init__(self, path: Path, store: PolicyStore, stop: threading.Event, *, loaded: bytes) -> None:
        self.path = path
        self.store = store
        self.stop = stop
        self.source = f"file {path}"
        self._offered: bytes | None = loaded  # what the store was last given, by bytes
        self._seen: bytes | None = loaded  # what the previous poll read
        self.thread = threading.Thread(target=self._run, name="policy-file", daemon=True)

    def _read(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except OSError:
            return None

    def poll(self) -> None:
        """One look at the file: offers it when it changed and has settled since the previous look."""
        data, previous = self._read(), self._seen
        self._seen = data
        if data == self._offered or data != previous:
            return
        self._offered = data
        if data is None:
            self.store.offer(None, source=self.source)
            return
        try:
            text = policy_text(data)
        except PolicyError as exc:
            self.store.refuse(str(exc), source=self.source)
            return
        self.store.offer(text, source=self.source)

    def _run(self) -> None:
        while not self.stop.wait(FILE_POLL_SECONDS):
            try:
                self.poll()
            except Exception:  # keep watching: the next edit may be the kill switch
                log.exception("policy file %s: poll failed", self.path)
