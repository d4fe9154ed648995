"""The admission app's body deadline, in-process: a body that does not arrive in time is answered 408
with the uid read so far, and a cancellation from elsewhere (the server stopping) is not mistaken for the
deadline. The real server's slow clients are tests/integration/test_server_bounds.py's."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from tests.harness.manifests import admission_review, defaulted_gpu_pod, well_formed
from webhook.admission import app
from webhook.admission.app import AdmissionApp, State
from webhook.policy.model import Policy
from webhook.runtime.policy_store import PolicyStore

SCOPE: dict[str, Any] = {"type": "http", "path": "/mutate", "method": "POST", "headers": []}


async def _unused(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("the admission endpoints never reach the fallback")


def _stalled_after(first: bytes, sent: list[dict[str, Any]]) -> tuple[Any, Any]:
    """An ASGI receive that gives `first` (more to come) and then never anything, and a send into `sent`."""
    messages = [{"type": "http.request", "body": first, "more_body": True}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # the rest of the body never comes
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    return receive, send


def test_a_body_not_received_in_time_is_answered_408_with_its_uid(
    policy: Policy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(app, "BODY_READ_SECONDS", 0.05)
    sent: list[dict[str, Any]] = []
    receive, send = _stalled_after(admission_review(defaulted_gpu_pod(), uid="late")[:500], sent)
    admission = AdmissionApp(State(PolicyStore(policy, source="embedded")), _unused)

    asyncio.run(asyncio.wait_for(admission(SCOPE, receive, send), timeout=30))

    response = well_formed(sent[-1]["body"])["response"]
    assert (response["uid"], response["allowed"], response["status"]["code"]) == ("late", False, 408)
    assert admission.budget.held == 0


def test_a_cancellation_from_elsewhere_is_not_taken_for_the_deadline(policy: Policy) -> None:
    sent: list[dict[str, Any]] = []
    receive, send = _stalled_after(orjson.dumps({"request": {"uid": "stopped"}})[:20], sent)
    admission = AdmissionApp(State(PolicyStore(policy, source="embedded")), _unused)

    async def scenario() -> None:
        reading = asyncio.create_task(admission(SCOPE, receive, send))
        while admission.budget.held == 0:  # the reservation taken: the body is being read
            await asyncio.sleep(0)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        assert sent == [] and admission.budget.held == 0

    asyncio.run(asyncio.wait_for(scenario(), timeout=30))
