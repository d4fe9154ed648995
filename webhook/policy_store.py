"""Where the active policy comes from and how a new one replaces it: validated first, last good kept.

A source (a mounted file, a watched ConfigMap) offers text; a valid, different policy is swapped in
whole, an invalid one is refused with the error logged, counted and reported, and the active policy
stays. A source that disappears leaves the active policy in place.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from webhook.policy.model import Policy, PolicyError, parse_policy

log = logging.getLogger("gpuguard.policy")
FILE_POLL_SECONDS = 1.0
# The key of the policy ConfigMap (--policy-configmap) that holds the policy YAML.
CONFIGMAP_KEY = "policy.yaml"


@dataclass(frozen=True)
class PolicyStatus:
    hash: str
    source: str
    loaded_at: float
    last_error: str | None
    errors: int


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
            with self._lock:
                self.errors += 1
                self.last_error = str(exc)
            log.error(
                "refused policy from %s; keeping policy %s",
                source,
                self.policy.hash,
                extra={"fields": {"error": str(exc), "source": source}},
            )
            self.on_error(str(exc))
            return False
        with self._lock:
            self.last_error = None
            if policy.hash == self.policy.hash:
                return False
            self.policy, self.source, self.loaded_at = policy, source, time.time()
        log.info("policy %s loaded from %s", policy.hash, source, extra={"fields": {"policy": policy.hash}})
        self.on_loaded(policy)
        return True


class FileWatcher:
    """Re-reads a policy file (for example a mounted ConfigMap, updated by symlink swap) when it changes."""

    def __init__(self, path: Path, store: PolicyStore, stop: threading.Event) -> None:
        self.path = path
        self.store = store
        self.stop = stop
        self._last = self._read()
        self.thread = threading.Thread(target=self._run, name="policy-file", daemon=True)

    def _read(self) -> str | None:
        try:
            return self.path.read_text(encoding="utf-8")
        except OSError:
            return None

    def _run(self) -> None:
        while not self.stop.wait(FILE_POLL_SECONDS):
            text = self._read()
            if text != self._last:
                self._last = text
                self.store.offer(text, source=f"file {self.path}")
