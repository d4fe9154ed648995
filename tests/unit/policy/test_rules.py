"""The four mutating rules, checked against the API server's defaulting and validation of what they touch."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness.manifests import (
    DEFAULTED_TOLERATIONS,
    GPU,
    JSON,
    NOT_READY,
    UNREACHABLE,
    apply,
    container,
    cronjob,
    defaulted_gpu_pod,
    gpu_pod,
    job,
    job_errors,
    job_spec_of,
    make_policy,
    mutate_review,
    mutated,
    patch_of,
    pod,
    pod_spec_errors,
    spec_of,
    templated,
)
from webhook.policy import engine
from webhook.policy.facts import ClusterFacts, PriorityClassInfo
from webhook.policy.model import Policy


def toleration(
    key: str | None, seconds: int | None = None, *, effect: str | None = "NoExecute", operator: str = "Exists"
) -> JSON:
    result: JSON = {"operator": operator}
    if key is not None:
        result["key"] = key
    if effect is not None:
        result["effect"] = effect
    if seconds is not None:
        result["tolerationSeconds"] = seconds
    return result


GPU_TAINT = toleration(GPU, effect="NoSchedule")

# --- rule 1: readiness tolerations --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("before", "after"),
    [
        pytest.param(
            [toleration(NOT_READY, 300), toleration(UNREACHABLE, 300)],
            [toleration(NOT_READY, 1800), toleration(UNREACHABLE, 1800)],
            id="defaulted-300s-replaced-in-place",
        ),
        pytest.param(
            [toleration(NOT_READY, 120), toleration(UNREACHABLE, 60)],
            [toleration(NOT_READY, 120), toleration(UNREACHABLE, 60)],
            id="deliberate-values-kept",
        ),
        pytest.param(
            [toleration(NOT_READY), toleration(UNREACHABLE)],
            [toleration(NOT_READY), toleration(UNREACHABLE)],
            id="no-seconds-tolerate-forever-kept",
        ),
        pytest.param(
            [toleration(None, effect=None)], [toleration(None, effect=None)], id="wildcard-empty-key-exists"
        ),
        pytest.param(
            [{"key": "", "operator": "Exists"}],
            [{"key": "", "operator": "Exists"}],
            id="wildcard-key-empty-string",
        ),
        pytest.param([toleration(None)], [toleration(None)], id="wildcard-noexecute"),
        pytest.param(
            [toleration(None, 300)], [toleration(None, 300)], id="wildcard-with-300s-was-written-on-purpose"
        ),
        pytest.param(
            [toleration(None, effect=None), toleration(NOT_READY, 300), toleration(UNREACHABLE, 300)],
            [toleration(None, effect=None), toleration(NOT_READY, 300), toleration(UNREACHABLE, 300)],
            id="wildcard-first-wins-over-defaulted",
        ),
        pytest.param(
            [toleration(NOT_READY, 120), toleration(NOT_READY, 300), toleration(UNREACHABLE, 300)],
            [toleration(NOT_READY, 120), toleration(NOT_READY, 300), toleration(UNREACHABLE, 1800)],
            id="first-match-deliberate-wins",
        ),
        pytest.param(
            [toleration(NOT_READY, 300), toleration(NOT_READY, 300), toleration(UNREACHABLE, 300)],
            [toleration(NOT_READY, 1800), toleration(NOT_READY, 300), toleration(UNREACHABLE, 1800)],
            id="first-match-only-replaced",
        ),
        pytest.param(
            [toleration(NOT_READY, 300)],
            [toleration(NOT_READY, 1800), toleration(UNREACHABLE, 1800)],
            id="one-defaulted-one-missing",
        ),
        pytest.param(
            [toleration(NOT_READY, effect="NoSchedule")],
            [
                toleration(NOT_READY, effect="NoSchedule"),
                toleration(NOT_READY, 1800),
                toleration(UNREACHABLE, 1800),
            ],
            id="noschedule-does-not-count",
        ),
        pytest.param(
            [{"key": NOT_READY, "operator": "Equal", "effect": "NoExecute", "tolerationSeconds": 300}],
            [
                {"key": NOT_READY, "operator": "Equal", "effect": "NoExecute", "tolerationSeconds": 1800},
                toleration(UNREACHABLE, 1800),
            ],
            id="equal-without-value-matches",
        ),
        pytest.param(
            [GPU_TAINT, toleration(NOT_READY, 300), toleration(UNREACHABLE, 300)],
            [GPU_TAINT, toleration(NOT_READY, 1800), toleration(UNREACHABLE, 1800)],
            id="other-tolerations-kept-in-place",
        ),
        pytest.param(
            [], [toleration(NOT_READY, 1800), toleration(UNREACHABLE, 1800)], id="empty-list-filled"
        ),
    ],
)
def test_readiness_tolerations_on_a_batch_pod(policy: Policy, before: list[JSON], after: list[JSON]) -> None:
    obj = gpu_pod(restart_policy="Never", tolerations=before)
    result = engine.mutate(obj, policy)
    assert result.obj["spec"]["tolerations"] == after
    assert obj["spec"]["tolerations"] == before  # the input is never edited
    assert pod_spec_errors(result.obj["spec"]) == []


def test_defaulted_tolerations_are_replaced_not_appended_in_the_patch(policy: Policy) -> None:
    response = mutate_review(defaulted_gpu_pod(), policy)
    toleration_ops = [op for op in patch_of(response) if op["path"].startswith("/spec/tolerations")]
    assert toleration_ops == [
        {"op": "replace", "path": "/spec/tolerations/0/tolerationSeconds", "value": 600},
        {"op": "replace", "path": "/spec/tolerations/1/tolerationSeconds", "value": 600},
    ]


@pytest.mark.parametrize("kind", ["Deployment", "StatefulSet", "ReplicaSet"])
def test_template_without_tolerations_gets_the_whole_list(policy: Policy, kind: str) -> None:
    obj = templated(kind)
    ops = patch_of(mutate_review(obj, policy))
    assert {
        "op": "add",
        "path": "/spec/template/spec/tolerations",
        "value": [toleration(NOT_READY, 600), toleration(UNREACHABLE, 600)],
    } in ops
    assert not any(op["path"].startswith("/spec/template/spec/tolerations/") for op in ops)


@pytest.mark.parametrize(
    ("obj", "seconds"),
    [
        pytest.param(gpu_pod(restart_policy="Never"), 1800, id="pod-never"),
        pytest.param(gpu_pod(restart_policy="OnFailure"), 1800, id="pod-onfailure"),
        pytest.param(gpu_pod(restart_policy="Always"), 600, id="pod-always"),
        pytest.param(gpu_pod(), 600, id="pod-restartpolicy-missing"),
        pytest.param(job(), 1800, id="job"),
        pytest.param(cronjob(), 1800, id="cronjob"),
        pytest.param(templated("Deployment"), 600, id="deployment"),
        pytest.param(templated("StatefulSet"), 600, id="statefulset"),
        pytest.param(templated("ReplicaSet"), 600, id="replicaset"),
    ],
)
def test_batch_and_serving_seconds(policy: Policy, obj: JSON, seconds: int) -> None:
    tolerations = spec_of(mutated(obj, policy))["tolerations"]
    assert tolerations == [toleration(NOT_READY, seconds), toleration(UNREACHABLE, seconds)]


def test_policy_seconds_equal_to_the_api_default_leave_defaults_alone() -> None:
    policy = make_policy({"rules": {"readinessTolerations": {"servingSeconds": 300}}})
    result = engine.mutate(defaulted_gpu_pod(), policy)
    assert result.obj["spec"]["tolerations"] == list(DEFAULTED_TOLERATIONS)
    assert not [d for d in result.decisions if d.rule == "readinessTolerations"]


def test_api_default_seconds_is_configurable() -> None:
    # A cluster whose apiserver defaults 200 s: a 300 s toleration there was written on purpose.
    policy = make_policy({"rules": {"readinessTolerations": {"apiServerDefaultSeconds": 200}}})
    result = engine.mutate(defaulted_gpu_pod(), policy)
    assert result.obj["spec"]["tolerations"] == list(DEFAULTED_TOLERATIONS)
    changed = engine.mutate(
        defaulted_gpu_pod(tolerations=[toleration(NOT_READY, 200), toleration(UNREACHABLE, 200)]), policy
    )
    assert changed.obj["spec"]["tolerations"] == [toleration(NOT_READY, 600), toleration(UNREACHABLE, 600)]


# --- rule 2: podFailurePolicy ----------------------------------------------------------------------------

DISRUPTION_RULE: JSON = {
    "action": "Ignore",
    "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
}
DEVICE_RULE: JSON = {"action": "Count", "onExitCodes": {"operator": "In", "values": [74, 75]}}


def user_rule(code: int) -> JSON:
    return {"action": "FailJob", "onExitCodes": {"containerName": "main", "operator": "In", "values": [code]}}


def test_job_gets_disruption_and_device_rules_with_failed_replacement(policy: Policy) -> None:
    out = mutated(job(), policy)
    assert out["spec"]["podFailurePolicy"] == {"rules": [DISRUPTION_RULE, DEVICE_RULE]}
    assert out["spec"]["podReplacementPolicy"] == "Failed"
    assert job_errors(out["spec"], spec_of(out)) == []


def test_terminating_or_failed_from_api_defaulting_becomes_failed_in_the_same_patch(policy: Policy) -> None:
    # SetDefaults_Job gave a Job without podFailurePolicy TerminatingOrFailed; re-defaulting keeps it, so
    # the patch that adds podFailurePolicy must set Failed itself or the Job is rejected.
    obj = job(podReplacementPolicy="TerminatingOrFailed", backoffLimit=6)
    ops = patch_of(mutate_review(obj, policy))
    assert {"op": "replace", "path": "/spec/podReplacementPolicy", "value": "Failed"} in ops
    assert any(op["op"] == "add" and op["path"] == "/spec/podFailurePolicy" for op in ops)
    patched = apply(obj, ops)
    assert job_errors(patched["spec"], spec_of(patched)) == []


def test_onfailure_job_is_skipped_with_a_notice(policy: Policy) -> None:
    result = engine.mutate(job(restart_policy="OnFailure"), policy)
    assert "podFailurePolicy" not in result.obj["spec"]
    assert spec_of(result.obj)["restartPolicy"] == "OnFailure"
    assert "podReplacementPolicy" not in result.obj["spec"]
    notices = [d for d in result.decisions if d.rule == "podFailurePolicy"]
    assert [(d.outcome, d.message) for d in notices] == [
        ("notice", "podFailurePolicy skipped: it needs restartPolicy Never, this Job has OnFailure")
    ]
    assert "tolerations" in spec_of(result.obj)  # the other rules still apply


def test_onfailure_job_is_converted_when_the_policy_says_so() -> None:
    policy = make_policy({"rules": {"podFailurePolicy": {"onFailureJobs": "convert"}}})
    out = mutated(job(restart_policy="OnFailure"), policy)
    assert spec_of(out)["restartPolicy"] == "Never"
    assert out["spec"]["podFailurePolicy"]["rules"] == [DISRUPTION_RULE, DEVICE_RULE]
    assert job_errors(out["spec"], spec_of(out)) == []


def test_a_job_whose_restart_policy_is_invalid_gets_no_pod_failure_policy(policy: Policy) -> None:
    # Always is refused for a Job by the API server's own validation: gpuguard leaves that answer to it.
    result = engine.mutate(job(restart_policy="Always"), policy)
    assert spec_of(result.obj)["restartPolicy"] == "Always"
    assert "podFailurePolicy" not in result.obj["spec"]
    assert [d for d in result.decisions if d.rule == "podFailurePolicy"] == []


@pytest.mark.parametrize(
    ("existing", "added"),
    [
        pytest.param(17, [DISRUPTION_RULE, DEVICE_RULE], id="17-room-for-both"),
        pytest.param(18, [DISRUPTION_RULE, DEVICE_RULE], id="18-exactly-fits"),
        pytest.param(19, [DISRUPTION_RULE], id="19-room-for-one"),
        pytest.param(20, [], id="20-full"),
    ],
)
def test_never_more_than_20_rules_and_user_rules_first(
    policy: Policy, existing: int, added: list[JSON]
) -> None:
    user_rules = [user_rule(code) for code in range(1, existing + 1)]
    obj = job(podFailurePolicy={"rules": user_rules}, podReplacementPolicy="Failed")
    result = engine.mutate(obj, policy)
    rules = result.obj["spec"]["podFailurePolicy"]["rules"]
    assert len(rules) <= 20
    assert rules[:existing] == user_rules
    assert rules[existing:] == added
    notices = [d.message for d in result.decisions if d.rule == "podFailurePolicy" and d.outcome == "notice"]
    assert bool(notices) == (existing + 2 > 20)
    assert job_errors(result.obj["spec"], spec_of(result.obj)) == []


def test_existing_disruption_rule_is_not_duplicated(policy: Policy) -> None:
    ignore_disruptions = {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
    obj = job(podFailurePolicy={"rules": [ignore_disruptions]}, podReplacementPolicy="Failed")
    assert mutated(obj, policy)["spec"]["podFailurePolicy"]["rules"] == [ignore_disruptions, DEVICE_RULE]


@pytest.mark.parametrize(
    ("user_codes", "container_name", "device_values"),
    [
        pytest.param([74], None, [75], id="one-code-covered"),
        pytest.param([1, 74, 75], None, None, id="all-codes-covered"),
        pytest.param([74, 75], "main", [74, 75], id="container-rule-does-not-cover"),
    ],
)
def test_codes_an_earlier_rule_catches_are_not_repeated(
    policy: Policy, user_codes: list[int], container_name: str | None, device_values: list[int] | None
) -> None:
    on_exit: JSON = {"operator": "In", "values": user_codes}
    if container_name:
        on_exit["containerName"] = container_name
    first = {"action": "FailJob", "onExitCodes": on_exit}
    out = mutated(job(podFailurePolicy={"rules": [first]}, podReplacementPolicy="Failed"), policy)
    expected = [first, DISRUPTION_RULE]
    if device_values is not None:
        expected.append({"action": "Count", "onExitCodes": {"operator": "In", "values": device_values}})
    assert out["spec"]["podFailurePolicy"]["rules"] == expected


def test_codes_are_sorted_unique_and_never_zero_under_in() -> None:
    policy = make_policy(
        {
            "rules": {
                "podFailurePolicy": {
                    "deviceFailureExitCodes": [75, 3, 75, 74],
                    "nonRetriableExitCodes": [2, 1],
                }
            }
        }
    )
    out = mutated(job(), policy)
    rules = out["spec"]["podFailurePolicy"]["rules"]
    assert rules[1:] == [
        {"action": "Count", "onExitCodes": {"operator": "In", "values": [3, 74, 75]}},
        {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [1, 2]}},
    ]
    assert job_errors(out["spec"], spec_of(out)) == []


@pytest.mark.parametrize(
    ("job_fields", "action"),
    [
        pytest.param({}, "Count", id="no-backoff-limit-per-index-falls-back-to-count"),
        pytest.param(
            {"completionMode": "Indexed", "completions": 4, "backoffLimitPerIndex": 1},
            "FailIndex",
            id="per-index",
        ),
    ],
)
def test_fail_index_needs_backoff_limit_per_index(job_fields: dict[str, Any], action: str) -> None:
    policy = make_policy({"rules": {"podFailurePolicy": {"deviceFailureAction": "FailIndex"}}})
    out = mutated(job(**job_fields), policy)
    assert out["spec"]["podFailurePolicy"]["rules"][-1]["action"] == action
    assert job_errors(out["spec"], spec_of(out)) == []


def test_ignore_disruptions_off_adds_no_disruption_rule() -> None:
    policy = make_policy({"rules": {"podFailurePolicy": {"ignoreDisruptions": False}}})
    assert mutated(job(), policy)["spec"]["podFailurePolicy"]["rules"] == [DEVICE_RULE]


def test_cronjob_job_template_gets_the_policy(policy: Policy) -> None:
    out = mutated(cronjob(), policy)
    job_spec = job_spec_of(out)
    assert job_spec is out["spec"]["jobTemplate"]["spec"]
    assert job_spec["podFailurePolicy"]["rules"] == [DISRUPTION_RULE, DEVICE_RULE]
    assert job_spec["podReplacementPolicy"] == "Failed"
    assert "podFailurePolicy" not in out["spec"]


@pytest.mark.parametrize(
    "obj",
    [
        pytest.param(templated("Deployment"), id="deployment"),
        pytest.param(gpu_pod(restart_policy="Never"), id="bare-pod"),
    ],
)
def test_only_jobs_get_a_pod_failure_policy(policy: Policy, obj: JSON) -> None:
    out = mutated(obj, policy)
    assert "podFailurePolicy" not in out["spec"]
    assert "podFailurePolicy" not in out["metadata"]["annotations"]["gpuguard.io/rules"]


# --- rule 3: graceful termination ------------------------------------------------------------------------

SLEEP_10: JSON = {"preStop": {"sleep": {"seconds": 10}}}


def test_prestop_only_on_accelerator_containers(policy: Policy) -> None:
    obj = pod(container("gpu", gpus=1), container("sidecar-cpu", limits={"cpu": "1"}))
    containers = mutated(obj, policy)["spec"]["containers"]
    assert containers[0]["lifecycle"] == SLEEP_10
    assert "lifecycle" not in containers[1]


def test_existing_prestop_is_kept(policy: Policy) -> None:
    own = {"preStop": {"exec": {"command": ["/bin/checkpoint"]}}}
    obj = pod(container("gpu", gpus=1, lifecycle=own))
    assert mutated(obj, policy)["spec"]["containers"][0]["lifecycle"] == own


def test_prestop_added_next_to_other_hooks(policy: Policy) -> None:
    post_start = {"postStart": {"exec": {"command": ["/bin/warm"]}}}
    obj = pod(container("gpu", gpus=1, lifecycle=post_start))
    assert mutated(obj, policy)["spec"]["containers"][0]["lifecycle"] == {**post_start, **SLEEP_10}


def test_plain_init_containers_never_get_prestop_but_gpu_sidecars_do(policy: Policy) -> None:
    obj = pod(
        container("main", gpus=1),
        init_containers=[
            container("warmup", gpus=1),  # plain init container: lifecycle is forbidden there
            container("gpu-sidecar", gpus=1, restart_policy="Always"),
            container("log-sidecar", restart_policy="Always"),
        ],
    )
    spec = mutated(obj, policy)["spec"]
    init = {c["name"]: c for c in spec["initContainers"]}
    assert "lifecycle" not in init["warmup"]
    assert init["gpu-sidecar"]["lifecycle"] == SLEEP_10
    assert "lifecycle" not in init["log-sidecar"]
    assert pod_spec_errors(spec) == []


def test_gpu_only_in_an_init_container_still_makes_the_pod_an_accelerator_workload(policy: Policy) -> None:
    obj = pod(container("main"), init_containers=[container("warmup", gpus=1)])
    spec = mutated(obj, policy)["spec"]
    assert all("lifecycle" not in c for c in [*spec["containers"], *spec["initContainers"]])
    assert spec["terminationGracePeriodSeconds"] == 60
    assert pod_spec_errors(spec) == []


def test_exec_prestop_from_the_policy() -> None:
    policy = make_policy(
        {
            "rules": {
                "gracefulTermination": {"preStop": {"action": "exec", "seconds": 15, "command": ["/drain"]}}
            }
        }
    )
    lifecycle = mutated(gpu_pod(), policy)["spec"]["containers"][0]["lifecycle"]
    assert lifecycle == {"preStop": {"exec": {"command": ["/drain"]}}}


@pytest.mark.parametrize(
    ("before", "after"),
    [
        pytest.param(None, 60, id="missing-is-30-raised"),
        pytest.param(30, 60, id="api-default-raised"),
        pytest.param(0, 60, id="zero-raised"),
        pytest.param(59, 60, id="just-below"),
        pytest.param(60, 60, id="equal-kept"),
        pytest.param(3600, 3600, id="longer-never-lowered"),
    ],
)
def test_grace_period_raised_never_lowered(policy: Policy, before: int | None, after: int) -> None:
    fields = {} if before is None else {"terminationGracePeriodSeconds": before}
    spec = spec_of(mutated(gpu_pod(**fields), policy))
    assert spec["terminationGracePeriodSeconds"] == after
    assert pod_spec_errors(spec) == []


def test_grace_covers_prestop_plus_margin() -> None:
    policy = make_policy(
        {
            "rules": {
                "gracefulTermination": {
                    "preStop": {"seconds": 50},
                    "minGracePeriodSeconds": 60,
                    "marginSeconds": 25,
                }
            }
        }
    )
    spec = mutated(gpu_pod(terminationGracePeriodSeconds=30), policy)["spec"]
    assert spec["terminationGracePeriodSeconds"] == 75
    assert spec["containers"][0]["lifecycle"] == {"preStop": {"sleep": {"seconds": 50}}}


def test_dra_claim_containers_get_prestop(policy: Policy) -> None:
    obj = pod(
        container("uses-claim", claims=["gpu"]),
        container("no-claim"),
        resourceClaims=[{"name": "gpu", "resourceClaimTemplateName": "single-gpu"}],
    )
    containers = mutated(obj, policy)["spec"]["containers"]
    assert containers[0]["lifecycle"] == SLEEP_10
    assert "lifecycle" not in containers[1]


# --- rule 4: priority ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["Deployment", "StatefulSet", "ReplicaSet"])
def test_template_gets_the_class_name_only_and_loses_stale_priority(policy: Policy, kind: str) -> None:
    obj = templated(kind, priority=5, preemptionPolicy="Never")
    spec = spec_of(mutated(obj, policy))
    assert spec["priorityClassName"] == "gpu-workload"
    assert "priority" not in spec
    assert "preemptionPolicy" not in spec


def test_template_with_cluster_facts_still_gets_the_name_only(policy: Policy) -> None:
    facts = ClusterFacts(priority_classes={"gpu-workload": PriorityClassInfo(10000, "Never")})
    spec = spec_of(mutated(job(), policy, facts=facts))
    assert spec["priorityClassName"] == "gpu-workload"
    assert "priority" not in spec and "preemptionPolicy" not in spec


def test_bare_pod_without_facts_drops_priority_for_the_plugin_to_recompute(policy: Policy) -> None:
    ops = patch_of(mutate_review(defaulted_gpu_pod(), policy))
    assert {"op": "add", "path": "/spec/priorityClassName", "value": "gpu-workload"} in ops
    assert {"op": "remove", "path": "/spec/priority"} in ops
    assert {"op": "remove", "path": "/spec/preemptionPolicy"} in ops


@pytest.mark.parametrize(
    ("info", "preemption"),
    [
        pytest.param(PriorityClassInfo(10000, "Never"), "Never", id="class-with-preemption-policy"),
        pytest.param(PriorityClassInfo(10000, None), None, id="class-without-preemption-policy"),
    ],
)
def test_bare_pod_with_facts_gets_consistent_priority(
    policy: Policy, info: PriorityClassInfo, preemption: str | None
) -> None:
    facts = ClusterFacts(priority_classes={"gpu-workload": info, "other": PriorityClassInfo(5)})
    spec = mutated(defaulted_gpu_pod(), policy, facts=facts)["spec"]
    assert spec["priorityClassName"] == "gpu-workload"
    assert spec["priority"] == 10000
    assert spec.get("preemptionPolicy") == preemption


def test_class_missing_from_known_facts_is_not_injected(policy: Policy) -> None:
    facts = ClusterFacts(priority_classes={"other": PriorityClassInfo(5)})
    result = engine.mutate(defaulted_gpu_pod(), policy, facts=facts)
    spec = result.obj["spec"]
    assert "priorityClassName" not in spec
    assert (spec["priority"], spec["preemptionPolicy"]) == (0, "PreemptLowerPriority")
    assert [(d.outcome, d.message) for d in result.decisions if d.rule == "priority"] == [
        ("notice", "priority class gpu-workload does not exist in the cluster: not set")
    ]


@pytest.mark.parametrize(
    "obj",
    [
        pytest.param(gpu_pod(priorityClassName="research"), id="pod"),
        pytest.param(templated("Deployment", priorityClassName="research"), id="deployment"),
        pytest.param(job(template={"priorityClassName": "research"}), id="job"),
        pytest.param(cronjob(template={"priorityClassName": "research"}), id="cronjob"),
    ],
)
def test_a_chosen_class_is_kept(policy: Policy, obj: JSON) -> None:
    result = engine.mutate(obj, policy)
    assert spec_of(result.obj)["priorityClassName"] == "research"
    assert "priority" not in result.applied_rules


def test_global_default_stamped_by_the_plugin_counts_as_unset(policy: Policy) -> None:
    facts = ClusterFacts(
        priority_classes={
            "cluster-default": PriorityClassInfo(0, global_default=True),
            "gpu-workload": PriorityClassInfo(10000),
        }
    )
    obj = defaulted_gpu_pod(priorityClassName="cluster-default")
    spec = mutated(obj, policy, facts=facts)["spec"]
    assert (spec["priorityClassName"], spec["priority"]) == ("gpu-workload", 10000)


def test_system_classes_are_never_assigned(policy: Policy) -> None:
    for obj in (gpu_pod(), defaulted_gpu_pod(), job(), cronjob(), templated("Deployment")):
        name = spec_of(engine.mutate(obj, policy).obj).get("priorityClassName", "")
        assert not name.startswith("system-")
