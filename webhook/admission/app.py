"""The admission endpoints as raw ASGI, in front of the probes app (FastAPI) that answers the rest.

Every pod creation in a cluster waits on /mutate and /validate, so those two bypass FastAPI's routing,
request and response objects (about 100 µs a request on 2 cores) and go straight from the ASGI body
to `review.review`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Receive, Scope, Send

from webhook.admission import review
from webhook.policy.facts import NO_FACTS, ClusterFacts
from webhook.policy.model import Policy
from webhook.runtime import logs
from webhook.runtime.metrics import Metrics
from webhook.runtime.policy_store import PolicyStore

# The API server refuses requests over 3 MiB for etcd, but a review wraps object and oldObject: cap a
# little above twice that, like controller-runtime (7 MiB), so no legitimate review is turned away.
MAX_BODY_BYTES = 7 * 1024 * 1024
# From the end of the headers to the end of the body (waiting for room in the budget below included).
# The API server sends a review in one go and gives up after timeoutSeconds (at most 30 s).
BODY_READ_SECONDS = 10.0
# Request bodies held at once, over every connection: without it, 80 clients sending 7 MiB bodies
# slowly hold half a gigabyte. A request waits (within BODY_READ_SECONDS) for room for its declared
# Content-Length before its body is read; a review from the API server is tens of kilobytes.
MAX_BUFFERED_BODY_BYTES = 32 * 1024 * 1024
ENDPOINTS: dict[str, review.Endpoint] = {"/mutate": "mutate", "/validate": "validate"}

log = logging.getLogger("gpuguard.admission")


@dataclass
class State:
    """What the endpoints read. Policy and facts are replaced whole, never edited in place, so a request
    that read them once sees one consistent policy and one consistent snapshot throughout."""

    store: PolicyStore
    facts: ClusterFacts = NO_FACTS
    metrics: Metrics = field(default_factory=Metrics)

    @property
    def policy(self) -> Policy:
        return self.store.policy


class BodyBudget:
    """Bytes of request bodies the endpoints hold at once; a reservation waits until there is room."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._waiting = 0
        self._changed = asyncio.Condition()

    async def reserve(self, size: int) -> None:
        # Room now (the usual case) is taken without the condition: on one event loop nothing runs
        # between the check and the take, and a waiter woken by a release re-checks as it would anyway.
        if self.held + size <= self.limit:
            self.held += size
            return
        async with self._changed:
            self._waiting += 1
            try:
                await self._changed.wait_for(lambda: self.held + size <= self.limit)
            finally:
                self._waiting -= 1
            self.held += size

    async def release(self, size: int) -> None:
        self.held -= size
        if self._waiting:
            async with self._changed:
                self._changed.notify_all()


class _Deadline:
    """What `asyncio.timeout` does for the block that reads a body, at a third of its cost (its context
    manager was a sixth of the app's own instructions per request): cancels the current task when
    `seconds` pass; the block catches the CancelledError and asks `passed()` whether it was this
    deadline's."""

    __slots__ = ("_cancelling", "_expired", "_handle", "_task")

    def __init__(self, seconds: float) -> None:
        # The loop from the task: each asyncio lookup of the running loop is a getpid() system call.
        task = asyncio.current_task()
        assert task is not None  # an ASGI app runs in a task
        loop = task.get_loop()
        self._task = task
        self._cancelling = task.cancelling()
        self._expired = False
        self._handle = loop.call_at(loop.time() + seconds, self._expire)

    def _expire(self) -> None:
        self._expired = True
        self._task.cancel()

    def passed(self) -> bool:
        """Whether the CancelledError being handled is this deadline's; if so it is taken back, as
        asyncio.timeout takes it back. A cancellation from elsewhere (the server stopping) is not."""
        return self._expired and self._task.uncancel() <= self._cancelling

    def cancel(self) -> None:
        self._handle.cancel()


@dataclass(frozen=True)
class Refusal:
    """A body that was not (entirely) read; the connection then closes, its rest still unread."""

    message: str
    code: int
    prefix: bytes  # what was read, for the uid


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _read_body(receive: Receive, body: bytearray) -> bytearray | Refusal | None:
    """The request body, read into `body` (one buffer, never joined: a body is held once, not twice);
    a Refusal past MAX_BODY_BYTES; None when the client went away."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        if len(body) > MAX_BODY_BYTES:
            return Refusal(
                f"request body exceeds {MAX_BODY_BYTES} bytes", 413, bytes(body[: review.UID_SCAN_BYTES])
            )
        if not message.get("more_body", False):
            return body


async def _send_json(send: Send, body: bytes, *, close: bool = False) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_method_not_allowed(send: Send) -> None:
    """The admission endpoints take a POSTed AdmissionReview; a GET (a browser, a curl without --data)
    is told so, rather than answered 404 as if the endpoint did not exist."""
    body = b'{"detail":"Method Not Allowed: POST an AdmissionReview"}'
    await send(
        {
            "type": "http.response.start",
            "status": 405,
            "headers": [
                (b"allow", b"POST"),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class AdmissionApp:
    """ASGI entry point: admission POSTs handled here, everything else passed to `fallback` (the probes)."""

    def __init__(self, state: State, fallback: ASGIApp) -> None:
        self.state = state
        self.fallback = fallback
        self.budget = BodyBudget(MAX_BUFFERED_BODY_BYTES)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = ENDPOINTS.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None:
            await self.fallback(scope, receive, send)
            return
        if scope["method"] != "POST":
            await _send_method_not_allowed(send)
            return
        started = time.perf_counter()
        declared = _declared_length(scope)
        reservation = 0
        received = bytearray()
        deadline = _Deadline(BODY_READ_SECONDS)
        try:
            try:
                if declared is not None and declared > MAX_BODY_BYTES:
                    # Too large by its own account: only what has arrived is read, for the uid.
                    message = await receive()
                    prefix = message.get("body", b"") if message["type"] == "http.request" else b""
                    body: bytearray | Refusal | None = Refusal(
                        f"request body exceeds {MAX_BODY_BYTES} bytes", 413, prefix
                    )
                else:
                    size = MAX_BODY_BYTES if declared is None else declared
                    await self.budget.reserve(size)
                    reservation = size
                    body = await _read_body(receive, received)
            except asyncio.CancelledError:
                if not deadline.passed():
                    raise
                late = f"request body not received within {BODY_READ_SECONDS:.0f} s"
                body = Refusal(late, 408, bytes(received[: review.UID_SCAN_BYTES]))
            finally:
                deadline.cancel()
            if body is None:
                return  # the client went away: nobody to answer
            if isinstance(body, Refusal):
                answer = review.rejected(body.message, code=body.code, uid=review.uid_in(body.prefix))
            else:
                answer = review.review(
                    body, endpoint=endpoint, policy=self.state.policy, facts=self.state.facts
                )
            await _send_json(send, answer.body, close=isinstance(body, Refusal))
        finally:
            if reservation:
                await self.budget.release(reservation)
        elapsed = time.perf_counter() - started
        # A dry run must answer like the real request but leave no trace in the decision counters.
        decisions = () if answer.dry_run else answer.decisions
        self.state.metrics.observe(endpoint, answer.result, elapsed, decisions)
        log_decision(answer, elapsed)


def log_decision(answer: review.Answer, seconds: float) -> None:
    """The decision log line: one per answered review, its summary and how long answering took."""
    logs.info(log, f"admission {answer.result}", answer.summary | {"latencyMs": round(seconds * 1000, 3)})
