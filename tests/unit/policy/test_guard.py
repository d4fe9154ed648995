"""Rule 5, the accelerator-node guard: low-priority pods bound for accelerator nodes are denied."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness.manifests import (
    JSON,
    container,
    cronjob,
    defaulted_gpu_pod,
    gpu_pod,
    job,
    make_policy,
    pod,
    templated,
    validate_review,
)
from webhook.policy import engine
from webhook.policy.facts import ClusterFacts, PriorityClassInfo
from webhook.policy.model import Policy

GKE_L4 = {"cloud.google.com/gke-accelerator": "nvidia-l4"}


def required_affinity(key: str, operator: str, values: list[str] | None = None) -> JSON:
    expression: JSON = {"key": key, "operator": operator}
    if values is not None:
        expression["values"] = values
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [expression]}]
            }
        }
    }


def cpu_pod(**spec_fields: Any) -> JSON:
    return pod(container("shipper", limits={"cpu": "500m"}), **spec_fields)


def denials(obj: JSON, policy: Policy, **kwargs: Any) -> list[str]:
    return engine.validate(obj, policy, **kwargs).denials


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        pytest.param(
            cpu_pod(nodeSelector=GKE_L4), "nodeSelector cloud.google.com/gke-accelerator", id="node-selector"
        ),
        pytest.param(gpu_pod(), "requests nvidia.com/gpu", id="gpu-request"),
        pytest.param(
            cpu_pod(affinity=required_affinity("nvidia.com/gpu.present", "In", ["true"])),
            "node affinity nvidia.com/gpu.present",
            id="required-affinity-in",
        ),
        pytest.param(
            cpu_pod(affinity=required_affinity("feature.node.kubernetes.io/pci-10de.present", "Exists")),
            "node affinity feature.node.kubernetes.io/pci-10de.present",
            id="required-affinity-exists",
        ),
        pytest.param(
            cpu_pod(tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]),
            "tolerates nvidia.com/gpu",
            id="accelerator-taint-toleration",
        ),
        pytest.param(
            pod(
                container("main", claims=["gpu"]),
                resourceClaims=[{"name": "gpu", "resourceClaimName": "a100"}],
            ),
            "requests DRA claim gpu",
            id="dra-claim",
        ),
    ],
)
def test_low_priority_bound_for_accelerator_nodes_is_denied(policy: Policy, obj: JSON, reason: str) -> None:
    (message,) = denials(obj, policy)
    assert message.startswith(
        "priority 0 (no class) < 1000 on accelerator nodes: set priorityClassName gpu-workload"
    )
    assert reason in message


@pytest.mark.parametrize(
    "obj",
    [
        pytest.param(cpu_pod(), id="plain-cpu-pod"),
        pytest.param(cpu_pod(nodeSelector={"disktype": "ssd"}), id="other-node-selector"),
        pytest.param(
            cpu_pod(affinity=required_affinity("nvidia.com/gpu.present", "NotIn", ["true"])),
            id="affinity-notin",
        ),
        pytest.param(
            cpu_pod(affinity=required_affinity("nvidia.com/gpu.present", "DoesNotExist")),
            id="affinity-doesnotexist",
        ),
        pytest.param(
            cpu_pod(
                affinity={
                    "nodeAffinity": {
                        "preferredDuringSchedulingIgnoredDuringExecution": [
                            {
                                "weight": 1,
                                "preference": {
                                    "matchExpressions": [
                                        {"key": "nvidia.com/gpu.present", "operator": "Exists"}
                                    ]
                                },
                            }
                        ]
                    }
                }
            ),
            id="preferred-affinity-only",
        ),
        pytest.param(
            cpu_pod(
                tolerations=[{"key": "sku", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}]
            ),
            id="unlisted-taint-key",
        ),
    ],
)
def test_not_bound_for_accelerator_nodes_is_allowed(policy: Policy, obj: JSON) -> None:
    result = engine.validate(obj, policy)
    assert result.denials == []
    assert result.decisions == ()


@pytest.mark.parametrize(
    ("spec_fields", "denied"),
    [
        pytest.param({"priority": 999}, True, id="below-threshold"),
        pytest.param({"priority": 1000}, False, id="at-threshold"),
        pytest.param({"priorityClassName": "gpu-workload"}, False, id="class-from-policy-no-integer"),
        pytest.param(
            {"priorityClassName": "gpu-workload", "priority": 0}, True, id="resolved-integer-is-the-truth"
        ),
    ],
)
def test_pod_priority_against_the_threshold(
    policy: Policy, spec_fields: dict[str, Any], denied: bool
) -> None:
    assert bool(denials(cpu_pod(nodeSelector=GKE_L4, **spec_fields), policy)) is denied


def test_threshold_is_configurable() -> None:
    policy = make_policy({"rules": {"acceleratorNodeGuard": {"minPriority": 10}}})
    assert denials(cpu_pod(nodeSelector=GKE_L4, priority=9), policy)
    assert not denials(cpu_pod(nodeSelector=GKE_L4, priority=10), policy)


@pytest.mark.parametrize(
    ("obj", "namespace"),
    [
        pytest.param(cpu_pod(nodeSelector=GKE_L4, owner="DaemonSet"), "default", id="daemonset-pod"),
        pytest.param(
            pod(
                container(limits={"cpu": "1"}),
                nodeSelector=GKE_L4,
                annotations={"kubernetes.io/config.mirror": "x"},
            ),
            "default",
            id="mirror-pod",
        ),
        pytest.param(
            cpu_pod(nodeSelector=GKE_L4, priorityClassName="system-node-critical", priority=2000001000),
            "default",
            id="system-node-critical",
        ),
        pytest.param(
            cpu_pod(nodeSelector=GKE_L4, priorityClassName="system-cluster-critical"),
            "default",
            id="system-class-without-integer",
        ),
        pytest.param(cpu_pod(nodeSelector=GKE_L4), "kube-system", id="namespace-mode-off"),
        pytest.param(templated("DaemonSet", nodeSelector=GKE_L4), "default", id="daemonset-object"),
    ],
)
def test_exemptions(policy: Policy, obj: JSON, namespace: str) -> None:
    # Exempt means not looked at: no denial, and no notice about an unknown class either.
    assert engine.validate(obj, policy, namespace=namespace).decisions == ()


def test_daemonset_pod_exemption_needs_the_controller_reference(policy: Policy) -> None:
    obj = cpu_pod(nodeSelector=GKE_L4, owner="DaemonSet")
    obj["metadata"]["ownerReferences"][0]["controller"] = False
    assert denials(obj, policy)


@pytest.mark.parametrize(
    ("obj", "denied"),
    [
        pytest.param(
            templated("Deployment", priorityClassName="gpu-workload"), False, id="deployment-policy-class"
        ),
        pytest.param(templated("Deployment", priorityClassName="batch-low"), True, id="deployment-low-class"),
        pytest.param(templated("StatefulSet"), True, id="statefulset-no-class"),
        pytest.param(job(template={"priorityClassName": "batch-low"}), True, id="job-low-class"),
        pytest.param(
            cronjob(template={"priorityClassName": "gpu-workload"}), False, id="cronjob-policy-class"
        ),
    ],
)
def test_template_class_resolved_via_policy_priority_classes(obj: JSON, denied: bool) -> None:
    policy = make_policy({"priorityClasses": {"gpu-workload": 10000, "batch-low": 100}})
    assert bool(denials(obj, policy)) is denied


def test_unknown_class_gives_a_notice_not_a_denial(policy: Policy) -> None:
    result = engine.validate(templated("Deployment", priorityClassName="mystery"), policy)
    assert result.denials == []
    assert [(d.outcome, d.message) for d in result.decisions] == [
        ("notice", "acceleratorNodeGuard cannot check class mystery: add it to the policy's priorityClasses")
    ]
    response = validate_review(templated("Deployment", priorityClassName="mystery"), policy)
    assert response["allowed"] is True
    assert any("cannot check class mystery" in w for w in response["warnings"])


def test_cluster_facts_resolve_template_classes(policy: Policy) -> None:
    facts = ClusterFacts(priority_classes={"mystery": PriorityClassInfo(5000), "tiny": PriorityClassInfo(1)})
    assert denials(templated("Deployment", priorityClassName="mystery"), policy, facts=facts) == []
    assert denials(templated("Deployment", priorityClassName="tiny"), policy, facts=facts)


def test_suggestion_depends_on_whether_the_policy_class_is_high_enough() -> None:
    # A policy whose own class is below the guard is refused at load time (test_policy); offline, a
    # class the policy does not value is not suggested either.
    policy = make_policy({"rules": {"priority": {"className": "unvalued"}}})
    (message,) = denials(cpu_pod(nodeSelector=GKE_L4), policy)
    assert "set a priorityClassName with value >= 1000" in message


@pytest.mark.parametrize(
    ("old", "new", "denied"),
    [
        pytest.param(
            templated("Deployment"), templated("Deployment", nodeSelector=GKE_L4), False, id="predates"
        ),
        pytest.param(
            templated("Deployment", priorityClassName="gpu-workload"),
            templated("Deployment"),
            True,
            id="introduced",
        ),
        pytest.param(None, templated("Deployment"), True, id="no-old-object"),
        pytest.param(
            templated("Deployment", priorityClassName="gpu-workload"),
            templated("Deployment", priorityClassName="gpu-workload", replicas=3),
            False,
            id="still-fine",
        ),
    ],
)
def test_update_denies_only_what_it_introduces(
    policy: Policy, old: JSON | None, new: JSON, denied: bool
) -> None:
    assert bool(denials(new, policy, operation="UPDATE", old=old)) is denied


def test_pod_update_is_never_denied(policy: Policy) -> None:
    # A pod's priority cannot change after creation (its images can, which trustedDeviceSoftware checks).
    obj = cpu_pod(nodeSelector=GKE_L4)
    assert engine.validate(obj, policy, operation="UPDATE", old=obj).decisions == ()
    assert denials(obj, policy, operation="UPDATE", old=obj) == []


@pytest.mark.parametrize("operation", ["DELETE", "CONNECT"])
def test_delete_and_connect_are_not_validated(policy: Policy, operation: str) -> None:
    assert denials(cpu_pod(nodeSelector=GKE_L4), policy, operation=operation) == []


@pytest.mark.parametrize(("mode", "outcome"), [("warn", "would-deny"), ("audit", "would-deny")])
def test_warn_and_audit_deny_nothing(mode: str, outcome: str) -> None:
    policy = make_policy({"rules": {"acceleratorNodeGuard": {"mode": mode}}})
    result = engine.validate(cpu_pod(nodeSelector=GKE_L4), policy)
    assert result.denials == []
    assert [d.outcome for d in result.decisions] == [outcome]


def test_mutated_gpu_pod_passes_validation(policy: Policy) -> None:
    # What the API server does: the validating phase sees the mutated pod (class set, stale priority gone).
    out = engine.mutate(defaulted_gpu_pod(), policy).obj
    assert denials(defaulted_gpu_pod(), policy)
    assert denials(out, policy) == []


def test_denial_through_review_is_403_with_our_message(policy: Policy) -> None:
    response = validate_review(cpu_pod(nodeSelector=GKE_L4), policy, uid="deny-me")
    assert response["uid"] == "deny-me"
    assert response["allowed"] is False
    assert response["status"]["code"] == 403
    assert response["status"]["reason"] == "Forbidden"
    assert response["status"]["message"].startswith(
        "gpuguard acceleratorNodeGuard: priority 0 (no class) < 1000"
    )
    assert "patch" not in response and "patchType" not in response
