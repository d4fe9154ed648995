"""A list-then-watch cache of one kind of object: a small informer, as client-go's are.

It lists the resource as a stream from the API server's watch cache (the WatchList protocol client-go's
reflectors use: every object as an ADDED event, then a bookmark marking the end of the list), or page
by page where the server cannot stream lists, then watches from the list's resourceVersion; watch
bookmarks keep that version fresh, so a watch that ends (its timeout, a dropped connection) resumes where it was and
only a 410 Gone (the version was compacted away) costs a full list again. Each object is reduced by a
converter to what its readers need; readers get either per-key changes (`on_change`, what a controller
enqueues) or whole snapshots (`on_snapshot`, what admission reads), or both.

The items live in a persistent mapping (a hash array mapped trie): a change makes a new version that
shares all but a few trie nodes with the last one, so publishing it to readers costs the same with
20,000 objects as with 20, and a reader holding a version never sees it change under it.

One object whose conversion raises (anything: a record annotation nested 1,000 deep makes `json.loads`
raise RecursionError) is skipped and logged once per version of it, never fails the list or the watch:
any writer of one object must not be able to keep every cache from syncing. Skipped on a change, the
object keeps its last converted value; skipped on its deletion, it stays until the next list.

Nothing here runs on a request path, and nothing here imports the Kubernetes client: the list and the
watch come through `ListWatch`, which `webhook.kube.client` implements for the real API server. Why not
the client's own informer: docs/design/2026-12-03-own-informer.md.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import immutables

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


class StreamingNotSupportedError(Exception):
    """The API server cannot stream a list (older than WatchList, or the gate is off): list by pages."""


# The annotation on the bookmark that ends a streamed list.
INITIAL_EVENTS_END = "k8s.io/initial-events-end"


@dataclass(frozen=True)
class ListPage:
    items: list[dict[str, Any]]
    resource_version: str
    continue_token: str | None


class ListWatch(Protocol):
    def list_page(self, continue_token: str | None) -> ListPage: ...

    def watch_list(self, timeout_seconds: int) -> contextlib.AbstractContextManager[Iterator[dict[str, Any]]]:
        """The list as a stream: every object as an ADDED event, then a BOOKMARK annotated
        INITIAL_EVENTS_END at the version the list is consistent at; StreamingNotSupportedError when
        the server cannot."""
        ...

    def watch(
        self, resource_version: str, timeout_seconds: int
    ) -> contextlib.AbstractContextManager[Iterator[dict[str, Any]]]: ...


def listed_events(items: Iterable[dict[str, Any]], resource_version: str) -> Iterator[dict[str, Any]]:
    """A list as `watch_list` streams it, for sources that hold their objects themselves."""
    for item in items:
        yield {"type": "ADDED", "object": item}
    yield {
        "type": "BOOKMARK",
        "object": {
            "metadata": {"resourceVersion": resource_version, "annotations": {INITIAL_EVENTS_END: "true"}}
        },
    }


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


class Snapshot(Mapping[Hashable, V]):
    """One version of an informer's items: a read-only mapping that never changes once published."""

    __slots__ = ("_items",)

    def __init__(self, items: immutables.Map[Hashable, V] | None = None) -> None:
        self._items: immutables.Map[Hashable, V] = immutables.Map() if items is None else items

    def __getitem__(self, key: Hashable) -> V:
        return self._items[key]

    def get(self, key: Hashable, default: Any = None) -> Any:
        return self._items.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Snapshot({dict(self._items)!r})"

    def with_item(self, key: Hashable, value: V) -> Snapshot[V]:
        return Snapshot(self._items.set(key, value))

    def without(self, key: Hashable) -> Snapshot[V]:
        return Snapshot(self._items.delete(key))

    @classmethod
    def of(cls, items: Mapping[Hashable, V]) -> Snapshot[V]:
        return cls(immutables.Map(items))


EMPTY: Snapshot[Any] = Snapshot()


def _metadata(raw: dict[str, Any]) -> dict[str, Any]:
    metadata = raw.get("metadata")
    return metadata if isinstance(metadata, dict) else {}


def _identity(raw: dict[str, Any]) -> str:
    metadata = _metadata(raw)
    return "/".join(str(part) for part in (metadata.get("namespace"), metadata.get("name")) if part)


class Informer(Generic[V]):
    """Mirrors one resource into `{key: converted value}`.

    Snapshot listeners get `None` when the list cannot be read (the facts are then unknown, not empty).
    Handlers run on the informer's thread, one change at a time, in order; a handler that raises is
    logged and does not stop the watch. `reconvert` lists again with another converter (the policy
    changed what readers need) on the caller's thread; the items, the converter and the resourceVersion
    change together, and the watch, which was applying events to the old items, starts again from the
    new list's version.
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
        # Lists stream until the server says it cannot; then this informer lists by pages.
        self.streams_lists = True
        self.resource_version: str | None = None
        self._items: Snapshot[V] = EMPTY
        # Held while the items, the converter and the resourceVersion change; a new list bumps the
        # generation, which retires the watch that was applying events to the items it replaced.
        self._lock = threading.RLock()
        self._generation = 0
        self._synced = threading.Event()
        # The objects the converter raised on, by namespace/name, at the version last logged.
        self._unconvertible: dict[str, str] = {}
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
        value: V | None = self._items.get(key)
        return value

    def current(self) -> Snapshot[V]:
        """The items now, without a copy: the same version on_snapshot listeners were last given."""
        return self._items

    def snapshot(self) -> dict[Hashable, V]:
        """A copy of the items as a plain dict: O(n); `current()` shares them instead."""
        return dict(self._items)

    def reconvert(self, convert: Converter[V]) -> bool:
        """Lists again with `convert` and replaces every item; False (logged) when the list failed, in
        which case the informer's own loop lists again with `convert`."""
        with self._lock:
            self.convert = convert
            self._generation += 1
        try:
            self._relist()
            return True
        except Exception as exc:
            self._failed(exc)
            return False

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
        with self._lock:
            generation, convert = self._generation, self.convert
        unconvertible: dict[str, str] = {}
        listed = self._streamed(convert, unconvertible) if self.streams_lists else None
        items, resource_version = listed or self._paged(convert, unconvertible)
        with self._lock:
            if generation != self._generation:
                return  # a list with a newer converter started meanwhile: its items are the ones to keep
            self._unconvertible = unconvertible
            self._generation += 1
            previous, self._items = self._items, Snapshot.of(items)
            self.resource_version = resource_version
            for key in previous.keys() - items.keys():
                self._changed(Change(key, previous[key], None))
            for key, value in items.items():
                old = previous.get(key)
                if old != value:
                    self._changed(Change(key, old, value))
            self._synced.set()
            self._publish()

    def _streamed(
        self, convert: Converter[V], unconvertible: dict[str, str]
    ) -> tuple[dict[Hashable, V], str] | None:
        """The list streamed from the API server's watch cache, one object in memory at a time: at
        200,000 pods this took 13 s where pages of 100 took 56 s (every continued page is a new
        request the server answers from etcd). None, and pages from then on, when the server cannot
        stream lists: it refuses, or answers as a plain watch (events other than ADDED, or no end)."""
        items: dict[Hashable, V] = {}
        try:
            with self.source.watch_list(self.watch_seconds) as events:
                for event in events:
                    kind, raw = event.get("type"), event.get("object")
                    raw = raw if isinstance(raw, dict) else {}
                    if kind == "ADDED":
                        converted = self._converted(convert, raw, unconvertible)
                        if converted is not None:
                            items[converted[0]] = converted[1]
                    elif kind == "BOOKMARK":
                        metadata = _metadata(raw)
                        annotations = metadata.get("annotations")
                        if isinstance(annotations, dict) and annotations.get(INITIAL_EVENTS_END) == "true":
                            return items, str(metadata.get("resourceVersion") or "")
                    elif kind == "ERROR":
                        raise RuntimeError(f"list stream error: {raw.get('message', raw)}")
                    else:
                        raise StreamingNotSupportedError(f"a {kind} event before the end of the list")
            raise StreamingNotSupportedError("the stream ended before the end of the list")
        except StreamingNotSupportedError as exc:
            log.info("%s: the API server does not stream lists (%s): listing by pages", self.name, exc)
            self.streams_lists = False
            return None

    def _paged(self, convert: Converter[V], unconvertible: dict[str, str]) -> tuple[dict[Hashable, V], str]:
        items: dict[Hashable, V] = {}
        resource_version = ""
        for page in paged(self.source):
            for raw in page.items:
                converted = self._converted(convert, raw, unconvertible)
                if converted is not None:
                    items[converted[0]] = converted[1]
            resource_version = page.resource_version
        return items, resource_version

    def _watch(self) -> None:
        with self._lock:
            generation, version = self._generation, self.resource_version
        if version is None:
            return  # a reconversion failed between the list and here: the loop lists again
        with self.source.watch(version, self.watch_seconds) as events:
            for event in events:
                if self.stop.is_set():
                    return
                with self._lock:
                    if generation != self._generation:
                        return  # a newer list replaced the items: watch again from its version
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
        if kind == "BOOKMARK":
            return
        converted = self._converted(self.convert, raw, self._unconvertible)
        if kind == "DELETED":
            self._unconvertible.pop(_identity(raw), None)  # nothing more will come of it
        if converted is None:
            return
        key, value = converted
        old = self._items.get(key)
        if kind == "DELETED":
            if key not in self._items:
                return
            self._items = self._items.without(key)
            self._changed(Change(key, old, None))
        elif old == value and key in self._items:
            return  # status-only churn (node heartbeats) changes nothing a reader looks at
        else:
            self._items = self._items.with_item(key, value)
            self._changed(Change(key, old, value))
        self._publish()

    def _converted(
        self, convert: Converter[V], raw: dict[str, Any], unconvertible: dict[str, str]
    ) -> tuple[Hashable, V] | None:
        """`convert(raw)`, or None when it raises; `unconvertible` remembers which version was logged."""
        identity = _identity(raw)
        try:
            converted = convert(raw)
        except Exception as exc:
            version = str(_metadata(raw).get("resourceVersion", ""))
            if self._unconvertible.get(identity) != version:
                log.error(
                    "%s: skipping %s at resourceVersion %s, which cannot be read: %s",
                    self.name,
                    identity,
                    version,
                    " ".join(str(exc).splitlines()[:1]) or type(exc).__name__,
                    extra={"fields": {"informer": self.name, "object": identity, "resourceVersion": version}},
                )
            unconvertible[identity] = version
            return None
        unconvertible.pop(identity, None)
        return converted

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
        published = None if unknown else self._items
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
