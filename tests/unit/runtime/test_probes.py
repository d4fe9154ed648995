"""The probes app every gpuguard process serves: /readyz answers 503 until the listener serves and while
a readiness check fails, /metrics is Prometheus text, /policy the active policy's status.

In process, between the app's own startup and shutdown (what uvicorn runs around serving); the
processes' tests reach the same endpoints over a real listener.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx

from webhook.runtime.probes import Probes, create_app


def probes(**checks: bool) -> Probes:
    made = Probes(
        detail=lambda: "policy=abc123",
        metrics=lambda: "gpuguard_up 1\n",
        status=lambda: {"hash": "abc123", "source": "default"},
    )
    for name, passes in checks.items():
        made.add_readiness_check(name, answering(passes))
    return made


def answering(passes: bool) -> Callable[[], bool]:
    return lambda: passes


def answers(served: Probes, *paths: str) -> list[httpx.Response]:
    """GETs `paths` in turn from the probes app, between its startup and its shutdown."""
    app = create_app(served)

    async def get_all() -> list[httpx.Response]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://probes") as client:
                return [await client.get(path) for path in paths]

    return asyncio.run(get_all())


def test_not_ready_until_the_listener_serves_then_ready_with_the_detail() -> None:
    served = probes()
    started: list[bool] = []
    served.on_started = lambda: started.append(served.started)
    assert served.failing() == ["started"]
    ready, healthy = answers(served, "/readyz", "/healthz")
    assert started == [True]  # published once, when already started
    assert (ready.status_code, ready.text) == (200, "ok policy=abc123")
    assert healthy.text == "ok"
    # Shut down: not ready again.
    assert served.failing() == ["started"]


def test_a_failing_readiness_check_makes_readyz_answer_503() -> None:
    not_ready, healthy = answers(probes(certificate=True, caches=False), "/readyz", "/healthz")
    assert (not_ready.status_code, not_ready.text) == (503, "not ready")
    assert healthy.status_code == 200  # it still serves


def test_checks_skipped_are_neither_counted_nor_run() -> None:
    served = probes(caches=False)
    runs = 0

    def workers_ready() -> bool:
        nonlocal runs
        runs += 1
        return False

    served.add_readiness_check("workers", workers_ready)
    served.started = True
    assert served.failing() == ["caches", "workers"] and runs == 1
    assert served.failing(skipping=("workers",)) == ["caches"] and runs == 1


def test_metrics_are_prometheus_text_and_policy_the_status() -> None:
    metrics, status = answers(probes(), "/metrics", "/policy")
    assert metrics.text == "gpuguard_up 1\n"
    assert metrics.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert status.json() == {"hash": "abc123", "source": "default"}
