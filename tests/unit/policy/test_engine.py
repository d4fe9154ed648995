"""webhook.policy.engine: what is mutated at all, the marks it leaves, and idempotence."""

from __future__ import annotations

import pytest

from tests.harness.manifests import (
    GPU,
    JSON,
    POLICY_ANNOTATION,
    RULES_ANNOTATION,
    container,
    cronjob,
    defaulted_gpu_pod,
    job,
    make_policy,
    mutate_review,
    mutated,
    patch_of,
    pod,
    spec_of,
    templated,
)
from webhook.policy import engine
from webhook.policy.model import Policy


@pytest.mark.parametrize(
    ("obj", "operation", "reason"),
    [
        pytest.param(defaulted_gpu_pod(owner="Job"), "CREATE", "pod of a Job", id="job-owned-pod"),
        pytest.param(
            defaulted_gpu_pod(owner="DaemonSet"), "CREATE", "DaemonSet pod", id="daemonset-owned-pod"
        ),
        pytest.param(
            defaulted_gpu_pod(annotations={"kubernetes.io/config.mirror": "abc"}),
            "CREATE",
            "mirror pod",
            id="mirror",
        ),
        pytest.param(templated("DaemonSet"), "CREATE", "kind not handled", id="daemonset"),
        pytest.param(
            pod(container(limits={"cpu": "2"})), "CREATE", "not an accelerator workload", id="cpu-pod"
        ),
        pytest.param(defaulted_gpu_pod(), "UPDATE", "UPDATE is never mutated", id="update"),
        pytest.param(defaulted_gpu_pod(), "DELETE", "DELETE is never mutated", id="delete"),
        pytest.param(defaulted_gpu_pod(), "CONNECT", "CONNECT is never mutated", id="connect"),
        pytest.param(job(), "UPDATE", "UPDATE is never mutated", id="job-update"),
        pytest.param(
            {"apiVersion": "v1", "kind": "ConfigMap", "data": {}},
            "CREATE",
            "kind not handled",
            id="configmap",
        ),
    ],
)
def test_untouched(policy: Policy, obj: JSON, operation: str, reason: str) -> None:
    result = engine.mutate(obj, policy, operation=operation)
    assert result.obj is obj
    assert not result.changed
    assert result.skipped is not None and reason in result.skipped
    assert result.decisions == ()


@pytest.mark.parametrize("operation", ["UPDATE", "DELETE", "CONNECT"])
def test_non_create_operations_pass_untouched_through_review(policy: Policy, operation: str) -> None:
    old = defaulted_gpu_pod()
    obj = None if operation == "DELETE" else defaulted_gpu_pod()
    response = mutate_review(obj, policy, operation=operation, old=old)
    assert response["allowed"] is True
    assert "patch" not in response
    assert "warnings" not in response


def test_replicaset_owned_pod_is_mutated(policy: Policy) -> None:
    # Only Job, DaemonSet and mirror pods are someone else's business; ReplicaSet pods are plain pods.
    assert (
        mutated(defaulted_gpu_pod(owner="ReplicaSet"), policy)["spec"]["priorityClassName"] == "gpu-workload"
    )


def test_generate_name_pod_without_name(policy: Policy) -> None:
    obj = defaulted_gpu_pod(name=None, generate_name="train-")
    response = mutate_review(obj, policy)
    ops = patch_of(response)
    assert ops, "a generateName pod must be mutated like any other"
    assert not any(op["path"].startswith("/metadata/name") for op in ops)
    assert {op["path"] for op in ops} >= {"/metadata/annotations", "/spec/priorityClassName"}


def test_disabled_policy_passes_everything(policy: Policy) -> None:
    off = make_policy({"enabled": False})
    for obj in (defaulted_gpu_pod(), job(), templated("Deployment")):
        result = engine.mutate(obj, off)
        assert (result.changed, result.skipped) == (False, "policy disabled")
        assert engine.validate(obj, off).decisions == ()


@pytest.mark.parametrize(
    ("obj", "changed"),
    [
        pytest.param(
            pod(
                container("main", claims=["gpu"]),
                resourceClaims=[{"name": "gpu", "resourceClaimName": "a100"}],
            ),
            True,
            id="dra-claim-name",
        ),
        pytest.param(
            pod(container("main"), resourceClaims=[{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]),
            True,
            id="dra-claim-template-no-container-claims",
        ),
        pytest.param(pod(container("main", gpus=1, resource="nvidia.com/mig-1g.5gb")), True, id="mig-glob"),
        pytest.param(pod(container("main", gpus=1, resource="gpu.intel.com/i915")), True, id="intel-glob"),
        pytest.param(
            pod(container("main", gpus=1, resource="aws.amazon.com/neuroncore")), True, id="neuron-glob"
        ),
        pytest.param(
            pod(container("main", gpus=1, resource="deviceclass.resource.kubernetes.io/gpu.example.com")),
            True,
            id="dra-extended-resource",
        ),
        pytest.param(pod(container("main", requests={GPU: 1})), True, id="requests-only"),
        pytest.param(
            pod(container("main", limits={"nvidia.com/gpumem": 1000})), False, id="not-a-glob-match"
        ),
        pytest.param(pod(container("main", limits={"cpu": "4", "memory": "1Gi"})), False, id="cpu-only"),
    ],
)
def test_what_makes_an_accelerator_workload(policy: Policy, obj: JSON, changed: bool) -> None:
    assert engine.mutate(obj, policy).changed is changed


def test_resource_claims_can_be_switched_off() -> None:
    policy = make_policy({"accelerators": {"resourceClaims": False}})
    obj = pod(
        container("main", claims=["gpu"]), resourceClaims=[{"name": "gpu", "resourceClaimName": "a100"}]
    )
    assert engine.mutate(obj, policy).skipped == "not an accelerator workload"


@pytest.mark.parametrize(
    "obj",
    [
        pytest.param(defaulted_gpu_pod(), id="pod"),
        pytest.param(job(), id="job"),
        pytest.param(cronjob(), id="cronjob"),
        pytest.param(templated("Deployment"), id="deployment"),
        pytest.param(templated("StatefulSet"), id="statefulset"),
        pytest.param(templated("ReplicaSet"), id="replicaset"),
    ],
)
def test_every_template_kind_is_mutated_marked_and_idempotent(policy: Policy, obj: JSON) -> None:
    out = mutated(obj, policy)
    annotations = out["metadata"]["annotations"]
    expected_rules = ["readinessTolerations", "gracefulTermination", "priority"]
    if obj["kind"] in ("Job", "CronJob"):
        expected_rules.insert(1, "podFailurePolicy")
    assert annotations[RULES_ANNOTATION] == ",".join(expected_rules)
    assert annotations[POLICY_ANNOTATION] == policy.hash
    spec = spec_of(out)
    assert spec["priorityClassName"] == "gpu-workload"
    assert spec["containers"][0]["lifecycle"]["preStop"] == {"sleep": {"seconds": 10}}
    again = engine.mutate(out, policy)
    assert not again.changed
    assert again.obj is out


def test_annotations_are_cumulative_and_keep_user_annotations(policy: Policy) -> None:
    obj = defaulted_gpu_pod(annotations={"team": "ml", RULES_ANNOTATION: "podFailurePolicy"})
    annotations = mutated(obj, policy)["metadata"]["annotations"]
    assert annotations["team"] == "ml"
    assert (
        annotations[RULES_ANNOTATION] == "readinessTolerations,podFailurePolicy,gracefulTermination,priority"
    )


def test_nothing_applied_means_no_marks(policy: Policy) -> None:
    # Everything already done by hand: the engine must not annotate an object it leaves alone.
    obj = pod(
        container(gpus=1, lifecycle={"preStop": {"sleep": {"seconds": 5}}}),
        tolerations=[{"operator": "Exists"}],
        priorityClassName="mine",
        terminationGracePeriodSeconds=90,
    )
    result = engine.mutate(obj, policy)
    assert not result.changed
    assert result.obj is obj
    assert "annotations" not in result.obj["metadata"]


def test_input_is_never_edited(policy: Policy) -> None:
    obj = job(podReplacementPolicy="TerminatingOrFailed")
    snapshot = repr(obj)
    engine.mutate(obj, policy)
    engine.validate(obj, policy)
    assert repr(obj) == snapshot


def test_request_kind_overrides_the_object(policy: Policy) -> None:
    # The API server says what it is sending (request.kind); the object's own apiVersion may be absent.
    obj = job()
    del obj["apiVersion"], obj["kind"]
    assert engine.mutate(obj, policy).skipped == "kind not handled"
    assert engine.mutate(obj, policy, group="batch", kind="Job").changed


def _gpu_job_template(**fields: object) -> JSON:
    obj = job()
    spec_of(obj).update(fields)  # set as given, None included
    return obj


@pytest.mark.parametrize(
    "obj",
    [
        pytest.param(
            job(
                podFailurePolicy={
                    "rules": [{"action": "Count", "onExitCodes": {"operator": "In", "values": 74}}]
                }
            ),
            id="exit-code-values-not-a-list",
        ),
        pytest.param(
            _gpu_job_template(tolerations=[{"key": ["nvidia.com/gpu"], "operator": "Exists"}]),
            id="toleration-key-a-list",
        ),
        pytest.param(
            _gpu_job_template(
                affinity={
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {"matchExpressions": [{"key": {"k": "v"}, "operator": "In"}]}
                            ]
                        }
                    }
                }
            ),
            id="affinity-key-a-mapping",
        ),
        pytest.param(_gpu_job_template(tolerations=None), id="tolerations-null"),
    ],
)
def test_malformed_manifests_do_not_crash_the_engine(policy: Policy, obj: JSON) -> None:
    # workload.py: "never assumes a field has the right type: a manifest is data from a user". The CLI
    # calls the engine directly, with no fail-open net behind it.
    result = engine.mutate(obj, policy)
    assert not engine.mutate(result.obj, policy).changed
    engine.validate(obj, policy)
    engine.validate(result.obj, policy)


def test_null_tolerations_mean_none(policy: Policy) -> None:
    # YAML `tolerations:` with nothing under it is null: the whole list is added, as for a missing one.
    out = mutated(_gpu_job_template(tolerations=None), policy)
    assert [t["key"] for t in spec_of(out)["tolerations"]] == [
        "node.kubernetes.io/not-ready",
        "node.kubernetes.io/unreachable",
    ]
