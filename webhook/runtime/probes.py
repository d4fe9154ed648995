"""Health, readiness, metrics and status over HTTP (FastAPI), for every gpuguard process alike.

`/healthz` says the process serves; `/readyz` runs the named readiness checks the composition root
registered (the listener started, the certificate valid, caches synced, ...) and answers 503 while any
fails; `/metrics` is Prometheus text; `/policy` the active policy's status.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response

log = logging.getLogger("gpuguard.probes")


@dataclass
class Probes:
    # What /readyz appends to "ok" (for example the policy hash), and what /metrics and /policy serve.
    detail: Callable[[], str]
    metrics: Callable[[], str]
    status: Callable[[], Mapping[str, object]]
    checks: dict[str, Callable[[], bool]] = field(default_factory=dict)
    started: bool = False
    # Called once the listener serves (a worker of several publishes it at once).
    on_started: Callable[[], None] = lambda: None

    def add_readiness_check(self, name: str, check: Callable[[], bool]) -> None:
        self.checks[name] = check

    def failing(self, *, skipping: Collection[str] = ()) -> list[str]:
        """The readiness checks that fail now, but for those named in `skipping` (not even run);
        "started" until the listener serves."""
        failing = [] if self.started else ["started"]
        return failing + [name for name, check in self.checks.items() if name not in skipping and not check()]


def create_app(probes: Probes) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # uvicorn loads the certificate before startup: reaching here means it is valid and served.
        probes.started = True
        probes.on_started()
        log.info("ready", extra={"fields": {"detail": probes.detail()}})
        yield
        probes.started = False

    api = FastAPI(title="gpuguard", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @api.get("/healthz", response_class=PlainTextResponse)
    def healthz() -> str:
        return "ok"

    @api.get("/readyz", response_class=PlainTextResponse)
    def readyz() -> Response:
        if probes.failing():
            return PlainTextResponse("not ready", status_code=503)
        return PlainTextResponse(f"ok {probes.detail()}")

    @api.get("/metrics")
    def metrics() -> Response:
        return Response(probes.metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @api.get("/policy")
    def policy() -> Mapping[str, object]:
        return probes.status()

    return api


class ProbeServer:
    """The probes over plain HTTP on a thread of their own, for the processes whose work runs on other
    threads (the controllers, the node agent). SIGTERM and SIGINT set `stop`, which those threads watch."""

    def __init__(self, probes: Probes, host: str, port: int, stop: threading.Event) -> None:
        import uvicorn  # only to run

        self.stop = stop
        self.server = uvicorn.Server(
            uvicorn.Config(
                create_app(probes), host=host, port=port, log_config=None, access_log=False, lifespan="on"
            )
        )
        self.thread = threading.Thread(target=self.server.run, name="probes", daemon=True)

    def start(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.stop.set())
        signal.signal(signal.SIGINT, lambda *_: self.stop.set())
        self.thread.start()

    def shutdown(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
