"""The admission endpoints as raw ASGI, in front of the probes app (FastAPI) that answers the rest.

Every pod creation in a cluster waits on /mutate and /validate, so those two bypass FastAPI's routing,
request and response objects (about 100 µs a request on 2 cores) and go straight from the ASGI body
to `review.review`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from webhook.admission import review
from webhook.metrics import Metrics
from webhook.policy.facts import NO_FACTS, ClusterFacts
from webhook.policy.model import Policy
from webhook.policy_store import PolicyStore

# The API server refuses requests over 3 MiB for etcd, but a review wraps object and oldObject: cap a
# little above twice that, like controller-runtime (7 MiB), so no legitimate review is turned away.
MAX_BODY_BYTES = 7 * 1024 * 1024
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


async def _read_body(receive: Receive) -> bytes | None:
    """The request body, or None when it exceeds MAX_BODY_BYTES or the client went away."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _send_json(send: Send, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = ENDPOINTS.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None:
            await self.fallback(scope, receive, send)
            return
        if scope["method"] != "POST":
            await _send_method_not_allowed(send)
            return
        started = time.perf_counter()
        body = await _read_body(receive)
        if body is None:
            answer = review.rejected(f"request body exceeds {MAX_BODY_BYTES} bytes", code=413)
        else:
            answer = review.review(body, endpoint=endpoint, policy=self.state.policy, facts=self.state.facts)
        await _send_json(send, answer.body)
        elapsed = time.perf_counter() - started
        # A dry run must answer like the real request but leave no trace in the decision counters.
        decisions = () if answer.dry_run else answer.decisions
        result = "allowed" if answer.allowed else "denied"
        self.state.metrics.observe(endpoint, result, elapsed, decisions)
        fields: dict[str, Any] = answer.summary | {"latencyMs": round(elapsed * 1000, 3)}
        log.info("admission %s", result, extra={"fields": fields})
