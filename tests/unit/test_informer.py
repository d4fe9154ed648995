"""The informer against scripted list and watch streams: what readers see for each thing a real API
server does (ADDED, MODIFIED, DELETED, BOOKMARK, 410 Gone, a watch that drops, a resource not served).

The source plays the API server: each `list_page` answers from the pages scripted for the next list,
each `watch` plays the next scripted stream and then parks until the test stops the informer. Tests
wait on what the informer delivers (a queue), never on time.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Hashable, Iterator, Mapping
from typing import Any

import pytest

from webhook.kube.informer import Change, ExpiredError, Informer, ListPage, NotServedError

WAIT = 10.0
Stream = list[dict[str, Any] | Exception]


def obj(name: str, version: str, *, gpus: int = 1) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": version}, "status": {"gpus": gpus}}


def event(kind: str, raw: dict[str, Any]) -> dict[str, Any]:
    return {"type": kind, "object": raw}


def bookmark(version: str) -> dict[str, Any]:
    return event("BOOKMARK", {"metadata": {"resourceVersion": version}})


def gone() -> dict[str, Any]:
    return event("ERROR", {"kind": "Status", "code": 410, "message": "too old resource version: 1 (7)"})


def gpus(raw: dict[str, Any]) -> tuple[Hashable, int] | None:
    name = raw["metadata"].get("name")
    return (name, raw["status"]["gpus"]) if name else None


class ScriptedSource:
    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        # Per list: its pages in order (an exception instead of a page fails that page's request).
        self.lists: list[list[ListPage | Exception] | Exception] = []
        self.streams: list[Stream] = []
        self.list_calls = 0
        self.watched_from: list[str] = []
        self._pages: list[ListPage | Exception] = []

    def list_page(self, continue_token: str | None) -> ListPage:
        if continue_token is None:
            self.list_calls += 1
            script = self.lists.pop(0)
            if isinstance(script, Exception):
                raise script
            self._pages = list(script)
        answer = self._pages.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    @contextlib.contextmanager
    def watch(self, resource_version: str, timeout_seconds: int) -> Iterator[Iterator[dict[str, Any]]]:
        self.watched_from.append(resource_version)
        stream = self.streams.pop(0) if self.streams else None
        yield self._play(stream)

    def _play(self, stream: Stream | None) -> Iterator[dict[str, Any]]:
        if stream is None:
            self.stop.wait()  # nothing more scripted: a quiet watch, until the test ends
            return
        for item in stream:
            if isinstance(item, Exception):
                raise item
            yield item


def page(*items: dict[str, Any], version: str, token: str | None = None) -> ListPage:
    return ListPage(items=list(items), resource_version=version, continue_token=token)


class Readers:
    """What the informer delivered, in order, for the test to wait on."""

    def __init__(self, informer: Informer[int]) -> None:
        self.changes: queue.Queue[Change[int]] = queue.Queue()
        self.snapshots: queue.Queue[Mapping[Hashable, int] | None] = queue.Queue()
        informer.on_change(self.changes.put)
        informer.on_snapshot(self.snapshots.put)

    def change(self) -> Change[int]:
        return self.changes.get(timeout=WAIT)

    def snapshot(self) -> Mapping[Hashable, int] | None:
        return self.snapshots.get(timeout=WAIT)


@pytest.fixture
def stop() -> Iterator[threading.Event]:
    stop = threading.Event()
    yield stop
    stop.set()


@pytest.fixture
def source(stop: threading.Event) -> ScriptedSource:
    return ScriptedSource(stop)


def started(source: ScriptedSource, stop: threading.Event) -> tuple[Informer[int], Readers]:
    informer = Informer("gpus", source, gpus, stop=stop, first_backoff_seconds=0.01)
    readers = Readers(informer)
    assert informer.sync()
    informer.start()
    return informer, readers


def test_a_paginated_list_is_one_snapshot_at_the_last_pages_version(
    source: ScriptedSource, stop: threading.Event
) -> None:
    source.lists.append([page(obj("a", "3"), version="9", token="next"), page(obj("b", "4"), version="10")])
    informer, readers = started(source, stop)
    assert informer.has_synced()
    assert readers.snapshot() == {"a": 1, "b": 1}
    assert {readers.change().key, readers.change().key} == {"a", "b"}
    assert informer.resource_version == "10"


def test_added_modified_deleted_reach_handlers_and_snapshots(
    source: ScriptedSource, stop: threading.Event
) -> None:
    source.lists.append([page(obj("a", "3"), version="10")])
    source.streams.append(
        [
            event("ADDED", obj("b", "11")),
            event("MODIFIED", obj("a", "12", gpus=4)),
            event("DELETED", obj("b", "13")),
        ]
    )
    informer, readers = started(source, stop)
    assert readers.change() == Change("a", None, 1)
    assert readers.snapshot() == {"a": 1}
    assert readers.change() == Change("b", None, 1)
    assert readers.snapshot() == {"a": 1, "b": 1}
    assert readers.change() == Change("a", 1, 4)
    assert readers.snapshot() == {"a": 4, "b": 1}
    assert readers.change() == Change("b", 1, None)
    assert readers.snapshot() == {"a": 4}
    assert informer.get("a") == 4 and informer.get("b") is None
    assert source.watched_from[0] == "10"


def test_a_change_no_reader_sees_is_not_delivered(source: ScriptedSource, stop: threading.Event) -> None:
    # A node heartbeat changes its resourceVersion, not what the converter keeps.
    source.lists.append([page(obj("a", "3"), version="10")])
    source.streams.append([event("MODIFIED", obj("a", "11")), event("ADDED", obj("z", "12"))])
    _, readers = started(source, stop)
    readers.change(), readers.snapshot()
    assert readers.change() == Change("z", None, 1)  # the heartbeat produced nothing before it
    assert readers.snapshot() == {"a": 1, "z": 1}


def test_a_watch_that_ends_resumes_from_the_last_bookmark_without_a_list(
    source: ScriptedSource, stop: threading.Event
) -> None:
    source.lists.append([page(obj("a", "3"), version="10")])
    source.streams += [[bookmark("57")], [event("ADDED", obj("b", "58"))]]
    _, readers = started(source, stop)
    readers.change()
    assert readers.change() == Change("b", None, 1)
    assert source.watched_from[:2] == ["10", "57"]
    assert source.list_calls == 1


def test_410_gone_lists_again_and_reports_what_changed_in_the_gap(
    source: ScriptedSource, stop: threading.Event
) -> None:
    source.lists += [
        [page(obj("a", "3"), obj("b", "4"), version="10")],
        [page(obj("a", "20", gpus=2), obj("c", "21"), version="30")],
    ]
    source.streams.append([gone()])
    informer, readers = started(source, stop)
    readers.change(), readers.change(), readers.snapshot()
    gap = {readers.change() for _ in range(3)}
    assert gap == {Change("b", 1, None), Change("a", 1, 2), Change("c", None, 1)}
    # Stale by moments is not unknown: readers never saw None in between.
    assert readers.snapshot() == {"a": 2, "c": 1}
    assert source.watched_from[:2] == ["10", "30"]
    assert informer.has_synced()


def test_an_expired_list_is_read_again_from_the_start(source: ScriptedSource, stop: threading.Event) -> None:
    # The continue token of page 1 expired before page 2 was read (410 on the continuation).
    expired = ExpiredError("the provided continue parameter is too old")
    source.lists += [
        [page(obj("a", "3"), version="10", token="stale"), expired],
        [page(obj("a", "3"), obj("b", "4"), version="12")],
    ]
    informer = Informer("gpus", source, gpus, stop=stop, first_backoff_seconds=0.01)
    readers = Readers(informer)
    informer.start()
    assert readers.snapshot() == {"a": 1, "b": 1}
    assert informer.has_synced() and source.list_calls == 2


def test_a_dropped_watch_makes_facts_unknown_until_the_list_is_read_again(
    source: ScriptedSource, stop: threading.Event
) -> None:
    source.lists += [[page(obj("a", "3"), version="10")], [page(obj("a", "3"), obj("b", "9"), version="40")]]
    source.streams.append([ConnectionResetError("connection reset by peer")])
    _, readers = started(source, stop)
    assert readers.snapshot() == {"a": 1}
    assert readers.snapshot() is None
    assert readers.snapshot() == {"a": 1, "b": 1}
    assert source.watched_from[:2] == ["10", "40"]


def test_a_resource_the_server_does_not_serve_is_unknown_and_not_retried(
    source: ScriptedSource, stop: threading.Event
) -> None:
    source.lists.append(NotServedError("the server could not find the requested resource"))
    informer = Informer("claims", source, gpus, stop=stop)
    readers = Readers(informer)
    assert not informer.sync()
    assert readers.snapshot() is None
    assert not informer.served and not informer.has_synced()
    informer.start()
    informer.thread.join(WAIT)
    assert not informer.thread.is_alive()
    assert source.list_calls == 1


def test_a_failing_handler_does_not_stop_the_watch(source: ScriptedSource, stop: threading.Event) -> None:
    source.lists.append([page(version="10")])
    source.streams.append([event("ADDED", obj("a", "11")), event("ADDED", obj("b", "12"))])
    informer = Informer("gpus", source, gpus, stop=stop)

    def broken(change: Change[int]) -> None:
        raise ValueError(f"bug in a handler for {change.key}")

    informer.on_change(broken)
    readers = Readers(informer)
    informer.sync()
    informer.start()
    assert [readers.change().key, readers.change().key] == ["a", "b"]
