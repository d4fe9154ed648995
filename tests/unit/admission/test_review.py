"""webhook.admission.review: AdmissionReview bytes in, a well-formed AdmissionReview out, whatever arrives."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from tests.harness.manifests import (
    V1,
    V1BETA1,
    admission_request,
    admission_review,
    apply,
    assert_same_json,
    container,
    defaulted_gpu_pod,
    job,
    patch_of,
    pod,
    response_of,
    templated,
    well_formed,
)
from webhook.admission import review
from webhook.policy import engine
from webhook.policy.model import Policy


@pytest.mark.parametrize("api_version", [V1, V1BETA1])
def test_mutate_answers_in_the_callers_version_with_a_patch(policy: Policy, api_version: str) -> None:
    obj = defaulted_gpu_pod()
    answer = review.review(
        admission_review(obj, api_version=api_version, uid="u-123"), endpoint="mutate", policy=policy
    )
    body = well_formed(answer.body)
    assert body["apiVersion"] == api_version
    response = body["response"]
    assert (response["uid"], response["allowed"], response["patchType"]) == ("u-123", True, "JSONPatch")
    assert_same_json(apply(obj, patch_of(response)), engine.mutate(obj, policy).obj)


@pytest.mark.parametrize(
    "obj",
    [
        pytest.param(job(), id="job"),
        pytest.param(templated("Deployment"), id="deployment"),
        pytest.param(defaulted_gpu_pod(name=None, generate_name="gen-"), id="generate-name"),
    ],
)
def test_patch_gives_exactly_the_mutated_object(policy: Policy, obj: dict[str, Any]) -> None:
    response = response_of(review.review(admission_review(obj), endpoint="mutate", policy=policy))
    assert_same_json(apply(obj, patch_of(response)), engine.mutate(obj, policy).obj)


def test_nothing_to_change_means_no_patch(policy: Policy) -> None:
    response = response_of(
        review.review(admission_review(pod(container())), endpoint="mutate", policy=policy)
    )
    assert response == {"uid": "0f6a1d5e-uid", "allowed": True}


def test_validate_never_patches(policy: Policy) -> None:
    response = response_of(
        review.review(admission_review(defaulted_gpu_pod()), endpoint="validate", policy=policy)
    )
    assert "patch" not in response and "patchType" not in response


def _review_with(**changes: Any) -> bytes:
    document: dict[str, Any] = {
        "apiVersion": V1,
        "kind": "AdmissionReview",
        "request": admission_request(defaulted_gpu_pod(), uid="echo-me"),
    }
    return orjson.dumps(document | changes)


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"\xff\xfe garbage", id="garbage"),
        pytest.param(b"[]", id="array"),
        pytest.param(b"null", id="null"),
        pytest.param(b'"AdmissionReview"', id="string"),
        pytest.param(b'{"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1"}', id="no-request"),
        pytest.param(
            b'{"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1", "request": []}',
            id="request-list",
        ),
        pytest.param(
            b'{"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1", "request": {"uid": ""}}',
            id="empty-uid",
        ),
        pytest.param(
            b'{"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1", "request": {"uid": 7}}',
            id="int-uid",
        ),
    ],
)
def test_unanswerable_bodies_get_a_400_review(policy: Policy, body: bytes) -> None:
    for endpoint in ("mutate", "validate"):
        response = response_of(review.review(body, endpoint=endpoint, policy=policy))
        assert response["uid"] == ""
        assert response["allowed"] is False
        assert response["status"]["code"] == 400


@pytest.mark.parametrize(
    "changes",
    [
        pytest.param({"kind": "Pod"}, id="wrong-kind"),
        pytest.param({"apiVersion": "admission.k8s.io/v2"}, id="wrong-api-version"),
    ],
)
def test_refusals_still_echo_a_readable_uid(policy: Policy, changes: dict[str, Any]) -> None:
    # The module's promise: the answer echoes the request's uid, empty only when there is none to echo.
    response = response_of(review.review(_review_with(**changes), endpoint="mutate", policy=policy))
    assert response["allowed"] is False
    assert response["status"]["code"] == 400
    assert response["uid"] == "echo-me"


def test_internal_errors_fail_open(monkeypatch: pytest.MonkeyPatch, policy: Policy) -> None:
    def broken(*_: Any, **__: Any) -> engine.Result:
        raise RuntimeError("bug")

    monkeypatch.setattr(engine, "mutate", broken)
    answer = review.review(admission_review(defaulted_gpu_pod(), uid="u-1"), endpoint="mutate", policy=policy)
    response = response_of(answer)
    assert response == {"uid": "u-1", "allowed": True, "warnings": [review.INTERNAL_ERROR_WARNING]}
    assert answer.allowed is True


def test_request_kind_decides_the_workload_kind(policy: Policy) -> None:
    obj = job()
    del obj["apiVersion"], obj["kind"]  # the API server's object always names it, but request.kind rules
    request = admission_request(job())
    request["object"] = obj
    body = orjson.dumps({"apiVersion": V1, "kind": "AdmissionReview", "request": request})
    response = response_of(review.review(body, endpoint="mutate", policy=policy))
    assert any(op["path"] == "/spec/podFailurePolicy" for op in patch_of(response))


def test_summary_names_generate_name_objects(policy: Policy) -> None:
    obj = defaulted_gpu_pod(name=None, generate_name="gen-")
    answer = review.review(admission_review(obj), endpoint="mutate", policy=policy)
    assert answer.summary["name"] == "gen-"
    assert answer.summary["patched"] is True


def test_annotation_keys_are_escaped_in_patch_paths(policy: Policy) -> None:
    obj = defaulted_gpu_pod(annotations={"example.com/owner": "ml", "a~b": "c"})
    ops = patch_of(response_of(review.review(admission_review(obj), endpoint="mutate", policy=policy)))
    paths = {op["path"] for op in ops if op["path"].startswith("/metadata")}
    assert paths == {"/metadata/annotations/gpuguard.io~1rules", "/metadata/annotations/gpuguard.io~1policy"}
    assert apply(obj, ops)["metadata"]["annotations"]["a~b"] == "c"
