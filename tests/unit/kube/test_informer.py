"""The informer against scripted list and watch streams: what readers see for each thing a real API
server does (ADDED, MODIFIED, DELETED, BOOKMARK, 410 Gone, a watch that drops, a resource not served).

The source plays the API server: each `watch_list` plays the next scripted list stream (none scripted:
the server cannot stream lists), each `list_page` answers from the pages scripted for the next list,
each `watch` plays the next scripted stream and then parks until the test stops the informer. Tests
wait on what the informer delivers (a queue), never on time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import tracemalloc
from collections.abc import Callable, Hashable, Iterator, Mapping
from functools import partial
from typing import Any

import pytest

from webhook.kube.informer import (
    Change,
    ExpiredError,
    Informer,
    ListPage,
    NotServedError,
    StreamingNotSupportedError,
    listed_events,
)

WAIT = 10.0
Stream = list[Any]  # events, exceptions to raise, and (GatedSource) gates to wait at


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
        # Per streamed list: its events; none scripted, the server cannot stream lists.
        self.list_streams: list[Stream] = []
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
    def watch_list(self, timeout_seconds: int) -> Iterator[Iterator[dict[str, Any]]]:
        if not self.list_streams:
            raise StreamingNotSupportedError("sendInitialEvents is forbidden")
        self.list_calls += 1
        yield self._play(self.list_streams.pop(0))

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


# --- versions of the items, and lists under a new converter ---------------------------------------


def test_a_published_snapshot_never_changes_afterwards(source: ScriptedSource, stop: threading.Event) -> None:
    source.lists.append([page(obj("a", "3"), version="10")])
    source.streams.append([event("MODIFIED", obj("a", "11", gpus=2)), event("ADDED", obj("b", "12"))])
    informer, readers = started(source, stop)
    first = readers.snapshot()
    readers.snapshot(), readers.snapshot()
    assert first == {"a": 1}
    assert informer.current() == {"a": 2, "b": 1} == informer.snapshot()
    assert readers.change() and readers.change() and readers.change()


def _bytes_allocated(run: Callable[[], object]) -> int:
    """Peak bytes allocated while `run` runs: deterministic, unlike its duration on a shared machine."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        run()
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("listener", [True, False])
def test_publishing_a_change_costs_the_same_for_10_or_20000_objects(
    stop: threading.Event, listener: bool
) -> None:
    """A copy of the items per change (what `dict(items)` did) allocates about 1 MB at 20,000 objects."""
    allocated = {}
    for count in (10, 20_000):
        source = ScriptedSource(stop)
        source.lists.append([page(*(obj(f"node-{i:05d}", "3") for i in range(count)), version="10")])
        informer = Informer("gpus", source, gpus, stop=stop)
        if listener:
            informer.on_snapshot(lambda snapshot: None)
        informer.sync()
        change = event("MODIFIED", obj("node-00001", "11", gpus=8))
        with informer._lock:  # as the watch applies an event: under the informer's lock
            informer._apply(change)  # warm: the first apply creates what later ones reuse
            allocated[count] = _bytes_allocated(partial(informer._apply, event("ADDED", obj("new", "12"))))
    assert allocated[20_000] <= allocated[10] + 2048, allocated


class Gate:
    """A point in a scripted stream where the watch waits until the test opens it."""

    def __init__(self) -> None:
        self.opened = threading.Event()


def test_reconvert_lists_again_and_the_watch_resumes_from_that_list(stop: threading.Event) -> None:
    source = GatedSource(stop)
    gate = Gate()
    source.lists += [
        [page(obj("a", "3", gpus=1), version="10")],
        [page(obj("a", "3", gpus=1), obj("b", "15", gpus=2), version="20")],
    ]
    # The first watch is blocked when the new list is read; the event it then delivers predates that list.
    source.streams += [[gate, event("ADDED", obj("b", "15", gpus=2))], [event("ADDED", obj("c", "21"))]]
    informer = Informer("gpus", source, gpus, stop=stop)
    readers = Readers(informer)
    informer.sync()
    informer.start()
    assert readers.snapshot() == {"a": 1}

    assert informer.reconvert(lambda raw: (raw["metadata"]["name"], 10 * raw["status"]["gpus"]))
    assert readers.snapshot() == {"a": 10, "b": 20}
    gate.opened.set()
    assert readers.snapshot() == {"a": 10, "b": 20, "c": 10}  # c under the new converter; no stale b
    assert source.watched_from[:2] == ["10", "20"]
    assert source.list_calls == 2


def test_a_reconversion_that_cannot_list_is_retried_by_the_informer(stop: threading.Event) -> None:
    source = GatedSource(stop)
    gate = Gate()
    source.lists += [
        [page(obj("a", "3"), version="10")],
        ConnectionRefusedError("API server restarting"),
        [page(obj("a", "3"), version="30")],
    ]
    source.streams += [[gate, event("ADDED", obj("b", "25"))]]
    informer = Informer("gpus", source, gpus, stop=stop, first_backoff_seconds=0.01)
    readers = Readers(informer)
    informer.sync()
    informer.start()
    assert readers.snapshot() == {"a": 1}
    assert not informer.reconvert(lambda raw: (raw["metadata"]["name"], -1))
    assert readers.snapshot() is None  # unknown until the list is read
    gate.opened.set()
    assert readers.snapshot() == {"a": -1}  # listed again by the informer, with the new converter
    assert source.watched_from[:2] == ["10", "30"]


class GatedSource(ScriptedSource):
    def _play(self, stream: Stream | None) -> Iterator[dict[str, Any]]:
        for item in stream or [None]:
            if isinstance(item, Gate):
                item.opened.wait(WAIT)
            elif item is None:
                self.stop.wait()
            elif isinstance(item, Exception):
                raise item
            else:
                yield item


def nested(name: str, version: str, *, depth: int, gpus: int = 1) -> dict[str, Any]:
    raw = obj(name, version, gpus=gpus)
    raw["metadata"]["annotations"] = {"record": "[" * depth + "]" * depth}
    return raw


def parsing(raw: dict[str, Any]) -> tuple[Hashable, int] | None:
    """A converter that reads an annotation as JSON, as the node health converter reads its record."""
    json.loads(raw["metadata"].get("annotations", {}).get("record", "[]"))
    return gpus(raw)


def test_one_object_the_converter_raises_on_never_stops_the_list(
    stop: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    # A 2 kB annotation, 1,000 brackets deep: json.loads raises RecursionError. Today's readers would
    # never see the other nodes, and a new replica would never become ready.
    source = ScriptedSource(stop)
    source.lists.append([page(obj("gpu-1", "3"), nested("gpu-evil", "4", depth=1000), version="10")])
    informer = Informer("nodes", source, parsing, stop=stop)
    with caplog.at_level(logging.ERROR, "gpuguard.informer"):
        assert informer.sync()
    assert informer.has_synced()
    assert informer.snapshot() == {"gpu-1": 1}
    (logged,) = caplog.records
    assert "gpu-evil" in logged.getMessage() and "resourceVersion 4" in logged.getMessage()


def test_an_unreadable_change_keeps_the_last_value_and_is_logged_once_per_version(
    source: ScriptedSource, stop: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    source.lists.append([page(obj("a", "3"), obj("b", "4"), version="10")])
    source.streams.append(
        [
            event("MODIFIED", nested("a", "11", depth=5000, gpus=2)),
            event("MODIFIED", nested("a", "11", depth=5000, gpus=2)),  # the same version, again
            event("MODIFIED", nested("a", "12", depth=5000, gpus=3)),
            event("ADDED", obj("c", "13")),
            event("MODIFIED", obj("a", "14", gpus=4)),
        ]
    )
    informer = Informer("gpus", source, parsing, stop=stop, first_backoff_seconds=0.01)
    readers = Readers(informer)
    with caplog.at_level(logging.ERROR, "gpuguard.informer"):
        assert informer.sync()
        informer.start()
        readers.change(), readers.change(), readers.snapshot()
        assert readers.change() == Change("c", None, 1)  # the watch went on past the unreadable events
        assert readers.snapshot() == {"a": 1, "b": 1, "c": 1}  # a kept its last readable value
        assert readers.change() == Change("a", 1, 4)
    assert [r.getMessage().split(" which")[0] for r in caplog.records] == [
        "gpus: skipping a at resourceVersion 11,",
        "gpus: skipping a at resourceVersion 12,",
    ]
    assert source.list_calls == 1


def test_a_streamed_list_is_one_snapshot_at_the_version_of_its_end_bookmark(
    source: ScriptedSource, stop: threading.Event
) -> None:
    source.list_streams.append(list(listed_events([obj("a", "3"), obj("b", "4", gpus=2)], "12")))
    source.streams.append([event("MODIFIED", obj("a", "13", gpus=0))])
    informer, readers = started(source, stop)
    assert readers.snapshot() == {"a": 1, "b": 2}
    assert {readers.change().key, readers.change().key} == {"a", "b"}
    assert readers.change() == Change("a", 1, 0)  # the watch went on from the bookmark's version
    assert source.watched_from[0] == "12"
    assert informer.streams_lists


def test_a_bookmark_inside_a_streamed_list_does_not_end_it(
    source: ScriptedSource, stop: threading.Event
) -> None:
    *adds, end = listed_events([obj("a", "3"), obj("b", "4")], "12")
    source.list_streams.append([adds[0], bookmark("10"), adds[1], end])
    informer, readers = started(source, stop)
    assert readers.snapshot() == {"a": 1, "b": 1}
    assert informer.resource_version == "12"


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param([event("ADDED", obj("a", "3")), event("MODIFIED", obj("a", "4"))], id="a plain watch"),
        pytest.param([event("ADDED", obj("a", "3"))], id="no end of the list"),
    ],
)
def test_a_server_that_cannot_stream_lists_is_listed_by_pages_from_then_on(
    source: ScriptedSource, stop: threading.Event, answer: Stream
) -> None:
    # A server that ignores sendInitialEvents answers a plain watch; one that refuses it says so (the
    # other tests): both are listed by pages, and never asked to stream again.
    source.list_streams.append(answer)
    source.lists.append([page(obj("a", "3"), obj("b", "5"), version="9")])
    source.lists.append([page(obj("a", "3"), version="20")])
    source.streams.append([gone()])
    informer, readers = started(source, stop)
    assert readers.snapshot() == {"a": 1, "b": 1}
    assert not informer.streams_lists
    assert readers.snapshot() == {"a": 1}  # the 410 listed again, by pages
    assert source.list_calls == 3


def test_an_error_in_a_streamed_list_is_retried_as_a_stream(
    source: ScriptedSource, stop: threading.Event
) -> None:
    source.list_streams.append([event("ADDED", obj("a", "3")), OSError("connection reset")])
    source.list_streams.append(list(listed_events([obj("a", "3")], "9")))
    informer = Informer("gpus", source, gpus, stop=stop, first_backoff_seconds=0.01)
    readers = Readers(informer)
    assert not informer.sync()
    assert readers.snapshot() is None
    informer.start()
    assert readers.snapshot() == {"a": 1}
    assert informer.streams_lists
