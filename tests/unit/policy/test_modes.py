"""enforce / warn / audit / off as the API server sees them: patches, denials, warnings, audit annotations."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness.manifests import (
    JSON,
    POLICY_ANNOTATION,
    RULES_ANNOTATION,
    admission_review,
    apply,
    container,
    defaulted_gpu_pod,
    job,
    make_policy,
    mutate_review,
    patch_of,
    pod,
    validate_review,
)
from webhook.admission import review
from webhook.policy import engine
from webhook.policy.facts import ClusterFacts, PriorityClassInfo
from webhook.policy.model import RULE_IDS, Policy

CPU_ON_GPU_NODE = pod(container(limits={"cpu": "1"}), nodeSelector={"nvidia.com/gpu.product": "A100"})


def test_enforce_patches_and_records(policy: Policy) -> None:
    response = mutate_review(defaulted_gpu_pod(), policy)
    patched = apply(defaulted_gpu_pod(), patch_of(response))
    assert (
        patched["metadata"]["annotations"][RULES_ANNOTATION]
        == "readinessTolerations,gracefulTermination,priority"
    )
    assert patched["metadata"]["annotations"][POLICY_ANNOTATION] == policy.hash
    assert "warnings" not in response
    assert set(response["auditAnnotations"]) == {"readinessTolerations", "gracefulTermination", "priority"}
    assert response["auditAnnotations"]["priority"] == "applied: set priorityClassName gpu-workload"


def test_warn_changes_nothing_and_tells_the_user() -> None:
    policy = make_policy({"mode": "warn"})
    result = engine.mutate(defaulted_gpu_pod(), policy)
    assert not result.changed
    assert {d.outcome for d in result.decisions} == {"would-apply"}
    response = mutate_review(defaulted_gpu_pod(), policy)
    assert response["allowed"] is True
    assert "patch" not in response
    assert "gpuguard (warn) would set priorityClassName gpu-workload" in response["warnings"]
    assert "gpuguard (warn) would raise not-ready tolerationSeconds to 600" in response["warnings"]
    assert all(len(w) <= 120 for w in response["warnings"])


def test_warn_on_validate_allows_with_a_warning() -> None:
    policy = make_policy({"mode": "warn"})
    response = validate_review(CPU_ON_GPU_NODE, policy)
    assert response["allowed"] is True
    assert "status" not in response
    (warning,) = response["warnings"]
    assert warning.startswith("gpuguard (warn) would deny: priority 0 (no class) < 1000")
    assert len(warning) <= 120


@pytest.mark.parametrize("endpoint", ["mutate", "validate"])
def test_audit_records_only(endpoint: review.Endpoint) -> None:
    policy = make_policy({"mode": "audit"})
    obj = defaulted_gpu_pod() if endpoint == "mutate" else CPU_ON_GPU_NODE
    response = mutate_review(obj, policy) if endpoint == "mutate" else validate_review(obj, policy)
    assert response["allowed"] is True
    assert set(response) == {"uid", "allowed", "auditAnnotations"}
    annotations = response["auditAnnotations"]
    assert annotations and all("/" not in key and key in RULE_IDS for key in annotations)
    assert all(value.startswith(("would-apply: ", "would-deny: ")) for value in annotations.values())


@pytest.mark.parametrize("endpoint", ["mutate", "validate"])
def test_off_is_silent(endpoint: review.Endpoint) -> None:
    policy = make_policy({"mode": "off"})
    obj = defaulted_gpu_pod() if endpoint == "mutate" else CPU_ON_GPU_NODE
    response = mutate_review(obj, policy) if endpoint == "mutate" else validate_review(obj, policy)
    assert set(response) == {"uid", "allowed"}
    assert response["allowed"] is True


def test_audit_notices_stay_out_of_warnings() -> None:
    policy = make_policy({"mode": "audit"})
    response = mutate_review(job(restart_policy="OnFailure"), policy)
    assert "warnings" not in response
    assert "notice: podFailurePolicy skipped" in response["auditAnnotations"]["podFailurePolicy"]


def test_notices_reach_the_user_in_enforce_mode(policy: Policy) -> None:
    response = mutate_review(job(restart_policy="OnFailure"), policy)
    assert (
        "gpuguard: podFailurePolicy skipped: it needs restartPolicy Never, this Job has OnFailure"
        in response["warnings"]
    )
    assert "patch" in response


def test_long_warnings_are_cut_to_120_characters() -> None:
    long_name = "gpu-" + "x" * 200
    policy = make_policy({"rules": {"priority": {"className": long_name}}})
    facts = ClusterFacts(priority_classes={"other": PriorityClassInfo(1)})
    answer = review.review(
        admission_review(defaulted_gpu_pod()), endpoint="mutate", policy=policy, facts=facts
    )
    warnings = review.warnings_for(answer.decisions)
    assert warnings and all(len(w) <= 120 for w in warnings)
    assert any(w.startswith("gpuguard: priority class gpu-xxx") and w.endswith("…") for w in warnings)


def test_a_rule_in_warn_is_left_out_of_an_enforced_mutation() -> None:
    policy = make_policy({"rules": {"priority": {"mode": "warn"}}})
    response = mutate_review(defaulted_gpu_pod(), policy)
    patched = apply(defaulted_gpu_pod(), patch_of(response))
    assert "priorityClassName" not in patched["spec"]
    assert patched["spec"]["priority"] == 0
    assert patched["metadata"]["annotations"][RULES_ANNOTATION] == "readinessTolerations,gracefulTermination"
    assert response["warnings"] == ["gpuguard (warn) would set priorityClassName gpu-workload"]


NAMESPACED: dict[str, Any] = {
    "namespaces": [
        {"names": ["research"], "mode": "warn"},
        {"names": ["prod"], "mode": "audit", "rules": {"priority": "enforce"}},
    ]
}


@pytest.mark.parametrize(
    ("namespace", "applied", "patched"),
    [
        pytest.param(
            "default", {"readinessTolerations", "gracefulTermination", "priority"}, True, id="global"
        ),
        pytest.param("research", set(), False, id="namespace-warn"),
        pytest.param("prod", {"priority"}, True, id="namespace-rule-enforce"),
    ],
)
def test_namespace_overrides_follow_the_request_namespace(
    namespace: str, applied: set[str], patched: bool
) -> None:
    policy = make_policy(NAMESPACED)
    # The object names no namespace (controllers often leave it out): the request's is used.
    response = mutate_review(defaulted_gpu_pod(), policy, namespace=namespace)
    assert ("patch" in response) is patched
    if patched:
        annotations = apply(defaulted_gpu_pod(), patch_of(response))["metadata"]["annotations"]
        assert set(annotations[RULES_ANNOTATION].split(",")) == applied


def test_kube_system_is_off_by_default(policy: Policy) -> None:
    assert set(mutate_review(defaulted_gpu_pod(), policy, namespace="kube-system")) == {"uid", "allowed"}
    assert validate_review(CPU_ON_GPU_NODE, policy, namespace="kube-system")["allowed"] is True


# --- dry run ---------------------------------------------------------------------------------------------

DRY_RUN_CASES: list[Any] = [
    pytest.param("mutate", "enforce", defaulted_gpu_pod(), id="mutate-enforce"),
    pytest.param("mutate", "warn", defaulted_gpu_pod(), id="mutate-warn"),
    pytest.param("mutate", "audit", job(restart_policy="OnFailure"), id="mutate-audit"),
    pytest.param("validate", "enforce", CPU_ON_GPU_NODE, id="validate-enforce"),
    pytest.param("validate", "warn", CPU_ON_GPU_NODE, id="validate-warn"),
]


@pytest.mark.parametrize(("endpoint", "mode", "obj"), DRY_RUN_CASES)
def test_dry_run_gets_the_same_answer(endpoint: review.Endpoint, mode: str, obj: JSON) -> None:
    policy = make_policy({"mode": mode})
    real = review.review(admission_review(obj, dry_run=False), endpoint=endpoint, policy=policy)
    dry = review.review(admission_review(obj, dry_run=True), endpoint=endpoint, policy=policy)
    assert dry.body == real.body
    assert (dry.dry_run, real.dry_run) == (True, False)
