"""The HTTP shell: FastAPI for health, readiness and metrics; a raw ASGI path for the admission endpoints.

Every pod creation in a cluster waits on /mutate and /validate, so those two bypass FastAPI's routing,
request and response objects (about 100 µs a request on 2 cores) and go straight from the ASGI body
to `review.review`. Everything else is ordinary FastAPI.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from webhook import review
from webhook.facts import NO_FACTS, ClusterFacts
from webhook.metrics import Metrics
from webhook.policy import Policy
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
    ready: bool = False
    # Whether the certificate served is valid; with certificates from a Secret, false until it is read.
    certificate_valid: Callable[[], bool] = lambda: True

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


class AdmissionApp:
    """ASGI entry point: admission POSTs handled here, everything else passed to FastAPI."""

    def __init__(self, state: State, fallback: ASGIApp) -> None:
        self.state = state
        self.fallback = fallback

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = ENDPOINTS.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None or scope["method"] != "POST":
            await self.fallback(scope, receive, send)
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


def create_app(state: State) -> AdmissionApp:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # uvicorn loads the certificate before startup: reaching here means it is valid and served.
        state.ready = True
        log.info("ready", extra={"fields": {"policy": state.policy.hash}})
        yield
        state.ready = False

    api = FastAPI(title="gpuguard", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @api.get("/healthz", response_class=PlainTextResponse)
    def healthz() -> str:
        return "ok"

    @api.get("/readyz", response_class=PlainTextResponse)
    def readyz() -> Response:
        if state.ready and state.certificate_valid():
            return PlainTextResponse(f"ok policy={state.policy.hash}")
        return PlainTextResponse("not ready", status_code=503)

    @api.get("/metrics")
    def metrics() -> Response:
        body = state.metrics.render(state.store.status())
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @api.get("/policy")
    def policy() -> dict[str, object]:
        status = state.store.status()
        return {
            "hash": status.hash,
            "source": status.source,
            "loadedAt": status.loaded_at,
            "lastError": status.last_error,
            "errors": status.errors,
            "enabled": state.policy.enabled,
            "unavailableLookups": list(state.facts.unavailable),
        }

    return AdmissionApp(state, api)
