"""An in-process stand-in for the API server, for the unit tests of what talks to it through the client.

It sits at the Kubernetes client's lowest seam, urllib3's pool manager: everything above it is the real
client (the generated calls, parameter serialisation, RESTResponse, ApiException from a status), and
no socket is opened. It keeps objects by their path and answers as the API server does for what
gpuguard's clients use: get; list (pages, a namespaced resource across namespaces, field selector on
the name, label selector by equality); a streamed list through watch, and a watch from a version held
open with nothing happening until `close`; create; replace at a resourceVersion (409 on a stale one);
JSON Patch with its `test` operations; delete with a resourceVersion precondition. Tests read
`requests` to see what was sent (`wait_for` one sent from another thread), and `refuse` makes the next
requests to a path fail.

The real API server's behaviour is tests/e2e's business; this answers only as far as the tests here ask.
"""

from __future__ import annotations

import copy
import io
import itertools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import jsonpatch
import orjson
import urllib3
from kubernetes.client import ApiClient, Configuration

JSON = dict[str, Any]
HOST = "https://apiserver.test"
INITIAL_EVENTS_END = "k8s.io/initial-events-end"


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    body: Any


@dataclass
class FakeApiServer:
    objects: dict[str, JSON] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    # (method, path) → statuses the next such requests get instead of an answer, first first; the
    # method "" stands for any.
    refusals: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    unreachable: bool = False
    # Set by `close`: the watches held open until then end, as when the server goes away.
    closed: threading.Event = field(default_factory=threading.Event)
    _versions: Iterator[int] = field(default_factory=lambda: itertools.count(100))
    # Held while answering or storing (informers ask from their own threads); notified on each request.
    _lock: threading.Condition = field(default_factory=threading.Condition)

    def api_client(self) -> ApiClient:
        configuration = Configuration(host=HOST)
        api = ApiClient(configuration)
        api.rest_client.pool_manager = _PoolManager(self)
        return api

    def put(self, path: str, obj: JSON) -> JSON:
        """Stores `obj` at `path` as if created by someone else; returns it with its resourceVersion."""
        stored = copy.deepcopy(obj)
        with self._lock:
            stored.setdefault("metadata", {})["resourceVersion"] = str(next(self._versions))
            self.objects[path] = stored
        return stored

    def refuse(self, path: str, *statuses: int, method: str = "") -> None:
        """The next requests to `path` (of `method`, or any) are answered with `statuses`, one each."""
        with self._lock:
            self.refusals.setdefault((method, path), []).extend(statuses)

    def close(self) -> None:
        self.closed.set()

    def sent(self, method: str) -> list[Request]:
        with self._lock:
            return [request for request in self.requests if request.method == method]

    def wait_for(
        self,
        method: str,
        path: str,
        *,
        where: Callable[[Request], bool] = lambda _: True,
        timeout: float = 10.0,
    ) -> Request:
        """The first `method` request to `path` (that `where` accepts), waiting for it to arrive from
        another thread."""

        def arrived() -> Request | None:
            return next((r for r in self.requests if (r.method, r.path) == (method, path) and where(r)), None)

        with self._lock:
            request = self._lock.wait_for(arrived, timeout)
        assert request is not None, f"no {method} {path} within {timeout} s"
        return request

    # --- answering ----------------------------------------------------------------------------------

    def answer(self, request: Request) -> tuple[int, Any] | threading.Event:
        """The status and body of the answer, or, for a watch from a version, the event it is held
        open until."""
        with self._lock:
            self.requests.append(request)
            self._lock.notify_all()
            pending = self.refusals.get((request.method, request.path)) or self.refusals.get(
                ("", request.path)
            )
            if pending:
                return _status(pending.pop(0), "refused by the test")
            if request.method == "GET":
                if request.path in self.objects:
                    return 200, self.objects[request.path]
                if not _is_collection(request.path):
                    return _status(404, "not found")
                if request.query.get("watch") != "true":
                    return self._list(request)
                if request.query.get("sendInitialEvents") != "true":
                    return self.closed
                return 200, self._streamed_list(request)
            if request.method == "POST":
                return self._create(request)
            if request.method == "PUT":
                return self._replace(request)
            if request.method == "PATCH":
                return self._patch(request)
            if request.method == "DELETE":
                return self._delete(request)
            return _status(405, "method not allowed")

    def _members(self, request: Request) -> list[JSON]:
        """The collection's objects; a namespaced resource listed without a namespace, in all of them."""
        members = [obj for path, obj in sorted(self.objects.items()) if _in_collection(path, request.path)]
        selector = request.query.get("fieldSelector", "")
        if selector.startswith("metadata.name="):
            members = [obj for obj in members if obj["metadata"].get("name") == selector.split("=", 1)[1]]
        for requirement in filter(None, request.query.get("labelSelector", "").split(",")):
            key, _, value = requirement.partition("=")
            members = [obj for obj in members if (obj["metadata"].get("labels") or {}).get(key) == value]
        return members

    def _list(self, request: Request) -> tuple[int, Any]:
        members = self._members(request)
        limit = int(request.query.get("limit") or len(members) or 1)
        start = int(request.query.get("continue") or 0)
        page = members[start : start + limit]
        metadata: JSON = {"resourceVersion": str(next(self._versions))}
        if start + limit < len(members):
            metadata["continue"] = str(start + limit)
        return 200, {"kind": "List", "metadata": metadata, "items": page}

    def _streamed_list(self, request: Request) -> bytes:
        end = {
            "metadata": {
                "resourceVersion": str(next(self._versions)),
                "annotations": {INITIAL_EVENTS_END: "true"},
            }
        }
        events = [{"type": "ADDED", "object": obj} for obj in self._members(request)]
        return b"".join(
            orjson.dumps(event) + b"\n" for event in [*events, {"type": "BOOKMARK", "object": end}]
        )

    def _create(self, request: Request) -> tuple[int, Any]:
        body: JSON = request.body
        path = f"{request.path}/{body['metadata']['name']}"
        if path in self.objects:
            return _status(409, "already exists")
        return 201, self.put(path, body)

    def _replace(self, request: Request) -> tuple[int, Any]:
        current = self.objects.get(request.path)
        if current is None:
            return _status(404, "not found")
        if request.body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
            return _status(409, "the object has been modified")
        return 200, self.put(request.path, request.body)

    def _patch(self, request: Request) -> tuple[int, Any]:
        current = self.objects.get(request.path)
        if current is None:
            return _status(404, "not found")
        try:
            patched = jsonpatch.apply_patch(current, request.body)
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
            return _status(422, str(exc))
        return 200, self.put(request.path, patched)

    def _delete(self, request: Request) -> tuple[int, Any]:
        current = self.objects.get(request.path)
        if current is None:
            return _status(404, "not found")
        wanted = ((request.body or {}).get("preconditions") or {}).get("resourceVersion")
        if wanted is not None and wanted != current["metadata"]["resourceVersion"]:
            return _status(409, "precondition failed")
        return 200, self.objects.pop(request.path)


def _in_collection(path: str, collection: str) -> bool:
    parent = path.rpartition("/")[0]
    if parent == collection:
        return True
    # /api/v1/pods holds /api/v1/namespaces/<any>/pods/<name>.
    base, _, resource = collection.rpartition("/")
    namespaces, _, rest = parent.partition(base + "/namespaces/")
    return not namespaces and rest.count("/") == 1 and rest.endswith("/" + resource)


def _is_collection(path: str) -> bool:
    """/api/v1/nodes or /apis/g/v1/namespaces/ns/kinds is a collection; one more segment, an object."""
    parts = path.strip("/").split("/")
    below_version = parts[2:] if parts[0] == "api" else parts[3:]
    return len(below_version) % 2 == 1


def _status(code: int, message: str) -> tuple[int, JSON]:
    return code, {"kind": "Status", "status": "Failure", "code": code, "message": message}


class _Body(io.BytesIO):
    """A body urllib3 sees end, as it sees a connection's: closed once read to the end."""

    def isclosed(self) -> bool:
        return self.tell() >= len(self.getbuffer())


class _HeldBody(_Body):
    """An open watch on which nothing happens: a read returns (nothing) only once `until` is set."""

    def __init__(self, until: threading.Event) -> None:
        super().__init__(b"")
        self.until = until

    def read(self, size: int | None = -1, /) -> bytes:
        self.until.wait()
        return b""

    def read1(self, size: int | None = -1, /) -> bytes:
        return self.read(size)

    def isclosed(self) -> bool:
        return self.until.is_set()


class _PoolManager(urllib3.PoolManager):
    """Where the client's requests, encoded by urllib3 itself, would reach the wire: answered by `server`."""

    def __init__(self, server: FakeApiServer) -> None:
        super().__init__()
        self.server = server

    # PoolManager's own signature, which urllib3 declares over RequestMethods' the same way.
    def urlopen(  # type: ignore[override]
        self, method: str, url: str, redirect: bool = True, **kw: Any
    ) -> urllib3.BaseHTTPResponse:
        if self.server.unreachable:
            raise urllib3.exceptions.MaxRetryError(self, url, reason=None)  # type: ignore[arg-type]
        parts = urlsplit(url)
        body = kw.get("body")
        decoded = orjson.loads(body) if body else None
        answer = self.server.answer(Request(method, parts.path, dict(parse_qsl(parts.query)), decoded))
        payload: _Body
        if isinstance(answer, threading.Event):
            status, payload = 200, _HeldBody(answer)
        else:
            status, content = answer
            payload = _Body(content if isinstance(content, bytes) else orjson.dumps(content))
        return urllib3.HTTPResponse(
            body=payload,
            status=status,
            headers={"Content-Type": "application/json"},
            preload_content=False,
        )
