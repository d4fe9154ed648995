"""Reviews built to break the parser: deep nesting anywhere, bodies that are not JSON gpuguard can parse.
Each gets a well-formed AdmissionReview that echoes the uid wherever it can be read, counts as an error
when no decision was made, and keeps its log line."""

from __future__ import annotations

import json
import logging
from typing import Any

import orjson
import pytest

from tests.harness.manifests import admission_review, defaulted_gpu_pod, well_formed
from webhook.admission import review
from webhook.policy.model import Policy
from webhook.runtime.logs import JSONFormatter


def nested(depth: int) -> str:
    return "[" * depth + "0" + "]" * depth


def review_text(uid: str = "hostile") -> str:
    return orjson.dumps(orjson.loads(admission_review(defaulted_gpu_pod(), uid=uid))).decode()


def answer(body: str | bytes, policy: Policy, endpoint: review.Endpoint = "mutate") -> review.Answer:
    return review.review(body.encode() if isinstance(body, str) else body, endpoint=endpoint, policy=policy)


def logged(summary: dict[str, Any]) -> dict[str, Any]:
    """The decision log line the app writes for `summary`, as it reaches stderr."""
    record = logging.LogRecord("gpuguard.admission", logging.INFO, __file__, 0, "admission", (), None)
    record.fields = summary
    line: dict[str, Any] = json.loads(JSONFormatter().format(record))
    return line


@pytest.mark.parametrize("endpoint", ["mutate", "validate"])
def test_a_kind_nested_a_thousand_deep_gets_a_400_review(policy: Policy, endpoint: review.Endpoint) -> None:
    body = '{"apiVersion":"admission.k8s.io/v1","kind":' + nested(1000) + ',"request":{"uid":"deep-kind"}}'
    reply = answer(body, policy, endpoint)
    response = well_formed(reply.body)["response"]
    assert (response["uid"], response["allowed"], response["status"]["code"]) == ("deep-kind", False, 400)
    assert response["status"]["message"] == "kind must be AdmissionReview, got a JSON array"
    assert reply.result == "error"


def test_a_body_too_deep_to_parse_still_echoes_its_uid(policy: Policy) -> None:
    body = review_text("deep-body").replace('"object":', '"filler":' + nested(1100) + ',"object":', 1)
    response = well_formed(answer(body, policy).body)["response"]
    assert (response["uid"], response["allowed"], response["status"]["code"]) == ("deep-body", False, 400)


def test_the_uid_is_read_only_where_the_api_server_puts_it(policy: Policy) -> None:
    # `"uid"` first in `request`, as kube-apiserver writes it; nothing else is taken for it.
    assert review.uid_in(b'{"kind":"AdmissionReview","request":{"uid":"abc-1","kind":[[[') == "abc-1"
    assert review.uid_in(b'{"request":{"kind":{},"uid":"late"}') == ""
    assert review.uid_in(b'{"object":{"metadata":{"uid":"object-uid"}}') == ""


@pytest.mark.parametrize("depth", [100, 400])
def test_a_deep_value_inside_a_field_the_rules_read_is_still_mutated(policy: Policy, depth: int) -> None:
    body = review_text().replace('"tolerations":[', '"tolerations":[' + nested(depth) + ",", 1)
    reply = answer(body, policy)
    response = well_formed(reply.body)["response"]
    assert (response["uid"], response["allowed"], response["patchType"]) == ("hostile", True, "JSONPatch")
    assert reply.result == "allowed"


def test_a_value_deeper_than_any_kubernetes_object_fails_open_saying_so(
    policy: Policy, caplog: pytest.LogCaptureFixture
) -> None:
    body = review_text().replace('"tolerations":[', '"tolerations":[' + nested(900) + ",", 1)
    reply = answer(body, policy)
    response = well_formed(reply.body)["response"]
    assert (response["uid"], response["allowed"]) == ("hostile", True)
    assert response["warnings"] == [review.TOO_DEEP_WARNING]
    assert reply.result == "error"
    # One log line, not a traceback thousands of frames long.
    assert all(record.exc_info is None for record in caplog.records)
    assert logged(reply.summary)["error"] == "too deep"


def test_a_deep_namespace_keeps_the_decision_log_line(policy: Policy) -> None:
    body = review_text("deep-namespace").replace('"namespace":"default"', '"namespace":' + nested(300), 1)
    reply = answer(body, policy)
    line = logged(reply.summary)
    assert line["uid"] == "deep-namespace"
    assert line["namespace"] == "<a JSON array>"
    assert well_formed(reply.body)["response"]["uid"] == "deep-namespace"


def test_the_log_formatter_writes_a_line_whatever_a_field_holds() -> None:
    deep: Any = 0
    for _ in range(300):
        deep = [deep]
    line = logged({"uid": "u", "odd": deep})
    assert line["uid"] == "u"
    assert line["odd"].startswith("<not written: ")


@pytest.mark.parametrize(
    ("body", "result"),
    [
        pytest.param(b"{not json", "error", id="malformed"),
        pytest.param(b'{"kind":"AdmissionReview"}', "error", id="no-request"),
    ],
)
def test_a_body_that_is_no_review_counts_as_an_error_not_a_denial(
    policy: Policy, body: bytes, result: str
) -> None:
    reply = answer(body, policy)
    assert (reply.allowed, reply.result) == (False, result)
