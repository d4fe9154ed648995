"""`gpuguard review`: AdmissionReviews answered as the server answers them, and made from manifests."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from tests.harness.manifests import (
    EXAMPLES,
    Gpuguard,
    admission_review,
    apply,
    assert_same_json,
    container,
    defaulted_gpu_pod,
    pod,
)
from webhook.cli import inputs
from webhook.cli.review import admission_review as review_of
from webhook.policy import engine

JOB = EXAMPLES / "gpu-training-job.yaml"
SAMPLE = EXAMPLES / "reviews" / "gpu-training-job.json"


def response_of(text: str) -> dict[str, Any]:
    answer: dict[str, Any] = json.loads(text)
    assert answer["kind"] == "AdmissionReview"
    response: dict[str, Any] = answer["response"]
    return response


def test_review_answers_a_mutate_review(gpuguard: Gpuguard, tmp_path: Path) -> None:
    request = tmp_path / "review.json"
    request.write_bytes(admission_review(defaulted_gpu_pod(), uid="cli-1"))
    run = gpuguard("review", str(request))
    assert run.code == 0
    response = response_of(run.out)
    assert (response["uid"], response["allowed"], response["patchType"]) == ("cli-1", True, "JSONPatch")
    assert isinstance(response["patch"], str)  # base64, as the API server receives it


def test_review_validate_denies(gpuguard: Gpuguard) -> None:
    cpu_pod = pod(container(limits={"cpu": "1"}), nodeSelector={"nvidia.com/gpu.present": "true"})
    run = gpuguard("review", "--validate", "-", stdin=admission_review(cpu_pod, uid="cli-2"))
    assert run.code == 1
    response = response_of(run.out)
    assert (response["uid"], response["allowed"], response["status"]["code"]) == ("cli-2", False, 403)
    assert response["status"]["message"].startswith("gpuguard acceleratorNodeGuard: ")


def test_decode_shows_the_patch_as_json(gpuguard: Gpuguard, tmp_path: Path, policy: Any) -> None:
    obj = defaulted_gpu_pod()
    request = tmp_path / "review.json"
    request.write_bytes(admission_review(obj))
    plain = response_of(gpuguard("review", str(request)).out)
    decoded = response_of(gpuguard("review", "--decode", str(request)).out)
    assert decoded["patch"] == json.loads(base64.b64decode(plain["patch"]))
    assert_same_json(apply(obj, decoded["patch"]), engine.mutate(obj, policy).obj)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        pytest.param(b"garbage", "body is not JSON", id="not-json"),
        pytest.param(b"[1, 2]", "body is not a JSON object", id="array"),
        pytest.param(b'{"kind": "AdmissionReview"}', "request.uid is missing", id="no-request"),
    ],
)
def test_garbage_is_a_usage_error(gpuguard: Gpuguard, body: bytes, reason: str) -> None:
    run = gpuguard("review", "-", stdin=body)
    assert (run.code, run.out) == (2, "")
    assert run.err.startswith(f"gpuguard: stdin: not an AdmissionReview: {reason}"), run.err


def test_a_plain_manifest_gets_a_hint(gpuguard: Gpuguard) -> None:
    run = gpuguard("review", str(JOB))
    assert run.code == 2
    assert run.err == (
        f"gpuguard: {JOB}: a Job manifest, not the AdmissionReview `gpuguard review` expects:"
        f" `gpuguard review --from-manifest {JOB}` wraps it in one, `gpuguard mutate -f {JOB}` mutates it"
        " directly\n"
    )


def test_from_manifest_makes_the_review_the_api_server_would_send(gpuguard: Gpuguard, policy: Any) -> None:
    made = gpuguard("review", "--from-manifest", str(JOB), "-n", "research")
    assert made.code == 0
    request = json.loads(made.out)["request"]
    assert request["kind"] == {"group": "batch", "version": "v1", "kind": "Job"}
    assert request["resource"] == {"group": "batch", "version": "v1", "resource": "jobs"}
    assert (request["namespace"], request["name"], request["operation"]) == (
        "research",
        "llm-finetune",
        "CREATE",
    )
    # Answering it gives what mutating the manifest gives.
    answered = response_of(gpuguard("review", "--decode", "-", stdin=made.out).out)
    manifest = inputs.read_manifests([str(JOB)])[0].obj
    assert_same_json(
        apply(manifest, answered["patch"]), engine.mutate(manifest, policy, namespace="research").obj
    )
    # The same manifest always makes the same review: a sample can be checked in.
    assert gpuguard("review", "--from-manifest", str(JOB), "-n", "research").out == made.out


def test_from_manifest_core_kinds_have_no_group() -> None:
    manifest = inputs.read_manifests([str(EXAMPLES / "cpu-pod-on-gpu-node.yaml")])[0]
    request = review_of(manifest, "CREATE")["request"]
    assert request["kind"] == {"group": "", "version": "v1", "kind": "Pod"}
    assert request["resource"]["resource"] == "pods"


def test_from_manifest_takes_one_object(gpuguard: Gpuguard) -> None:
    run = gpuguard("review", "--from-manifest", str(EXAMPLES))
    assert run.code == 2
    objects = len(inputs.read_manifests([str(EXAMPLES)]))
    assert objects > 1
    assert f"holds {objects} objects; an AdmissionReview carries exactly one" in run.err


def test_the_checked_in_sample_is_what_from_manifest_makes(gpuguard: Gpuguard) -> None:
    # examples/reviews/gpu-training-job.json, the README's curl example body: regenerate it with
    #   gpuguard review --from-manifest examples/gpu-training-job.yaml > examples/reviews/gpu-training-job.json
    made = gpuguard("review", "--from-manifest", str(JOB))
    assert made.out == SAMPLE.read_text()


def test_file_or_from_manifest_is_required(gpuguard: Gpuguard) -> None:
    run = gpuguard("review")
    assert run.code == 2 and "give FILE" in run.err
