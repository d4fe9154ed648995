"""A list-then-watch cache of one kind of object: a small informer, as client-go's are.

It lists the resource page by page, then watches from the list's resourceVersion; watch bookmarks keep
that version fresh, so a watch that ends (its timeout, a dropped connection) resumes where it was and
only a 410 Gone (the version was compacted away) costs a full list again. Each object is reduced by a
converter to what its readers need; readers get either per-key changes (`on_change`, what a controller
enqueues) or whole snapshots (`on_snapshot`, what admission reads), or both.

Nothing here runs on a request path, and nothing here imports the Kubernetes client: the list and the
watch come through `ListWatch`, which `webhook.kube.client` implements for the real API server.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

V = TypeVar("V")
Converter = Callable[[dict[str, Any]], tuple[Hashable, V] | None]
# How long one watch request runs before the server ends it (and the informer resumes it).
WATCH_SECONDS = 300
MAX_BACKOFF_SECONDS = 30.0

log = logging.getLogger("gpuguard.informer")


class NotServedError(Exception):
    """The API server does not serve this resource (404): a cluster without DRA has no claims."""


class ExpiredError(Exception):
    """410 Gone: the resourceVersion (or a list's continue token) is older than the server keeps."""


@dataclass(frozen=True)
class ListPage:
    items: list[dict[str, Any]]
    resource_version: str
    continue_token: str | None


class ListWatch(Protocol):
    def list_page(self, continue_token: str | None) -> ListPage: ...

    def watch(
        self, resource_version: str, timeout_seconds: int
    ) -> contextlib.AbstractContextManager[Iterator[dict[str, Any]]]: ...


def paged(source: ListWatch) -> Iterator[ListPage]:
    """Every page of one list, following continue tokens; a 410 on a token raises ExpiredError."""
    token: str | None = None
    while True:
        page = source.list_page(token)
        yield page
        token = page.continue_token
        if token is None:
            return


@dataclass(frozen=True)
class Change(Generic[V]):
    """One key's value before and after; `old` None: it appeared, `new` None: it is gone."""

    key: Hashable
    old: V | None
    new: V | None


class Informer(Generic[V]):
    """Mirrors one resource into `{key: converted value}`.

    Snapshot listeners get `None` when the list cannot be read (the facts are then unknown, not empty).
    Handlers run on the informer's thread, one change at a time, in order; a handler that raises is
    logged and does not stop the watch.
    """

    def __init__(
        self,
        name: str,
        source: ListWatch,
        convert: Converter[V],
        *,
        stop: threading.Event,
        watch_seconds: int = WATCH_SECONDS,
        first_backoff_seconds: float = 1.0,
    ) -> None:
        self.name = name
        self.source = source
        self.convert = convert
        self.stop = stop
        self.watch_seconds = watch_seconds
        self.first_backoff_seconds = first_backoff_seconds
        self.served = True
        self.resource_version: str | None = None
        self._items: dict[Hashable, V] = {}
        self._synced = threading.Event()
        self._change_handlers: list[Callable[[Change[V]], None]] = []
        self._snapshot_listeners: list[Callable[[Mapping[Hashable, V] | None], None]] = []
        self.thread = threading.Thread(target=self._run, name=f"informer-{name}", daemon=True)

    def on_change(self, handler: Callable[[Change[V]], None]) -> None:
        self._change_handlers.append(handler)

    def on_snapshot(self, listener: Callable[[Mapping[Hashable, V] | None], None]) -> None:
        self._snapshot_listeners.append(listener)

    def has_synced(self) -> bool:
        """True once a first list was read in full."""
        return self._synced.is_set()

    def wait_for_sync(self, timeout: float | None = None) -> bool:
        return self._synced.wait(timeout)

    def get(self, key: Hashable) -> V | None:
        return self._items.get(key)

    def snapshot(self) -> dict[Hashable, V]:
        return dict(self._items)

    def sync(self) -> bool:
        """The first list, before the caller goes on; False (and unknown facts) when it cannot be read."""
        try:
            self._relist()
            return True
        except Exception as exc:
            self._failed(exc)
            return False

    def start(self) -> None:
        self.thread.start()

    # --- the loop ---------------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = self.first_backoff_seconds
        while not self.stop.is_set() and self.served:
            try:
                if self.resource_version is None:
                    self._relist()
                self._watch()
                backoff = self.first_backoff_seconds
            except ExpiredError as exc:
                # Stale by moments, not unknown: keep what readers have and list again at once.
                log.info("%s watch expired (%s): listing again", self.name, exc)
                self.resource_version = None
            except Exception as exc:
                self._failed(exc)
                if self.stop.wait(backoff):
                    return
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)

    def _relist(self) -> None:
        items: dict[Hashable, V] = {}
        resource_version = ""
        for page in paged(self.source):
            for raw in page.items:
                converted = self.convert(raw)
                if converted is not None:
                    items[converted[0]] = converted[1]
            resource_version = page.resource_version
        previous, self._items = self._items, items
        self.resource_version = resource_version
        for key in previous.keys() - items.keys():
            self._changed(Change(key, previous[key], None))
        for key, value in items.items():
            if previous.get(key) != value:
                self._changed(Change(key, previous.get(key), value))
        self._synced.set()
        self._publish()

    def _watch(self) -> None:
        assert self.resource_version is not None
        with self.source.watch(self.resource_version, self.watch_seconds) as events:
            for event in events:
                if self.stop.is_set():
                    return
                self._apply(event)
        # The server ended the watch (its timeout): resume from the last version seen, no relist.

    def _apply(self, event: dict[str, Any]) -> None:
        raw = event.get("object")
        raw = raw if isinstance(raw, dict) else {}
        kind = event.get("type")
        if kind == "ERROR":
            self.resource_version = None
            if raw.get("code") == 410:
                raise ExpiredError(str(raw.get("message", "")))
            raise RuntimeError(f"watch error: {raw.get('message', raw)}")
        metadata = raw.get("metadata")
        version = metadata.get("resourceVersion") if isinstance(metadata, dict) else None
        if version:
            self.resource_version = str(version)
        converted = None if kind == "BOOKMARK" else self.convert(raw)
        if converted is None:
            return
        key, value = converted
        old = self._items.get(key)
        if kind == "DELETED":
            if key not in self._items:
                return
            del self._items[key]
            self._changed(Change(key, old, None))
        elif old == value and key in self._items:
            return  # status-only churn (node heartbeats) changes nothing a reader looks at
        else:
            self._items[key] = value
            self._changed(Change(key, old, value))
        self._publish()

    # --- delivery ---------------------------------------------------------------------------------

    def _changed(self, change: Change[V]) -> None:
        for handler in self._change_handlers:
            try:
                handler(change)
            except Exception:
                log.exception("%s change handler failed for %s", self.name, change.key)

    def _publish(self, *, unknown: bool = False) -> None:
        if not self._snapshot_listeners:
            return
        published = None if unknown else dict(self._items)
        for listener in self._snapshot_listeners:
            try:
                listener(published)
            except Exception:
                log.exception("%s snapshot listener failed", self.name)

    def _failed(self, exc: Exception) -> None:
        self.resource_version = None
        if isinstance(exc, NotServedError):
            if self.served:
                log.info("%s are not served by this API server; lookups disabled", self.name)
            self.served = False
        else:
            log.warning("%s lookup failed: %s", self.name, exc)
        self._publish(unknown=True)
