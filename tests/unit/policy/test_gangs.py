"""Gangs and the registry of workload kinds: a device failure in one member of a JobSet restarts the
JobSet (without spending maxRestarts); a LeaderWorkerSet recreates its group; every kind's templates
get the pod-template rules. The real API server's acceptance of these objects is tests/e2e/test_gangs.py.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import yaml

from tests.harness.manifests import EXAMPLES, GPU, apply, container, job, make_policy, mutate_review, patch_of
from webhook.policy import engine, gangs
from webhook.policy.kinds import BUILTIN_KINDS, parse_path
from webhook.policy.model import PolicyError, default_policy
from webhook.policy.workload import locate_all

JSON = dict[str, Any]
POLICY = default_policy()


def jobset(*replicated: JSON, failure_policy: JSON | None = None, annotations: JSON | None = None) -> JSON:
    metadata: JSON = {"name": "train"}
    if annotations:
        metadata["annotations"] = annotations
    spec: JSON = {"replicatedJobs": list(replicated)}
    if failure_policy is not None:
        spec["failurePolicy"] = failure_policy
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": metadata, "spec": spec}


def replicated(name: str = "workers", *, replicas: int = 1, parallelism: int = 2, **template: Any) -> JSON:
    job_spec = job(**template)["spec"] | {"parallelism": parallelism, "completions": parallelism}
    return {"name": name, "replicas": replicas, "template": {"spec": job_spec}}


def failure_message(rule_index: int, code: int = 74) -> str:
    """The Job controller's Failed condition message for a pod failed by a podFailurePolicy rule."""
    return f"Container main for pod ml/train-workers-0-0 failed with exit code {code} matching FailJob rule at index {rule_index}"


def jobset_rules(obj: JSON) -> list[JSON]:
    rules: list[JSON] = obj["spec"].get("failurePolicy", {}).get("rules", [])
    return rules


def job_rules(obj: JSON, index: int = 0) -> list[JSON]:
    rules: list[JSON] = obj["spec"]["replicatedJobs"][index]["template"]["spec"]["podFailurePolicy"]["rules"]
    return rules


def mutate(obj: JSON, policy: Any = POLICY, **kwargs: Any) -> engine.Result:
    return engine.mutate(obj, policy, namespace="ml", **kwargs)


def converges(obj: JSON, policy: Any = POLICY) -> JSON:
    first = mutate(obj, policy)
    again = mutate(first.obj, policy)
    assert not again.changed, [d.message for d in again.decisions]
    result: JSON = first.obj
    return result


# --- the registry --------------------------------------------------------------------------------------


def test_template_paths_parse() -> None:
    assert parse_path("spec.template") == ("spec", "template")
    assert parse_path("spec.groups[].template") == ("spec", "groups", "[]", "template")
    assert parse_path("spec.replicaSpecs.*.template") == ("spec", "replicaSpecs", "*", "template")
    for bad in ("", "spec..template", "*.spec", "spec.a b", "spec.[]"):
        with pytest.raises(ValueError):
            parse_path(bad)


@pytest.mark.parametrize(
    ("example", "labels"),
    [
        ("gpu-jobset-trainer.yaml", ["replicatedJobs[dataset-initializer]", "replicatedJobs[node]"]),
        (
            "gpu-leaderworkerset-vllm.yaml",
            ["leaderWorkerTemplate.leaderTemplate", "leaderWorkerTemplate.workerTemplate"],
        ),
        ("gpu-pytorchjob.yaml", ["pytorchReplicaSpecs.Master", "pytorchReplicaSpecs.Worker"]),
        ("gpu-raycluster.yaml", ["headGroupSpec", "workerGroupSpecs[gpu-group]"]),
        ("gpu-training-job.yaml", [""]),
    ],
)
def test_every_template_of_an_example_is_found(example: str, labels: list[str]) -> None:
    obj = yaml.safe_load((EXAMPLES / example).read_text())
    assert [view.label for view in locate_all(obj)] == labels


def test_each_kind_is_one_entry() -> None:
    keys = [(kind.group, kind.kind) for kind in BUILTIN_KINDS]
    assert len(keys) == len(set(keys))
    assert all(kind.resource and kind.versions for kind in BUILTIN_KINDS)


def test_a_custom_kind_from_the_policy_gets_the_template_rules() -> None:
    policy = make_policy(
        {
            "workloadKinds": [
                {
                    "group": "example.com",
                    "version": "v1",
                    "kind": "Trainer",
                    "resource": "trainers",
                    "podTemplates": ["spec.workers[].template"],
                    "batch": True,
                }
            ]
        }
    )
    template = {"spec": {"containers": [container(gpus=1)]}}
    obj = {
        "apiVersion": "example.com/v1",
        "kind": "Trainer",
        "metadata": {"name": "t"},
        "spec": {"workers": [{"name": "a", "template": template}]},
    }
    out = converges(obj, policy)
    spec = out["spec"]["workers"][0]["template"]["spec"]
    assert spec["priorityClassName"] == "gpu-workload"
    assert {t["tolerationSeconds"] for t in spec["tolerations"]} == {1800}  # batch: true
    assert not mutate(obj).changed  # the default policy does not know the kind


@pytest.mark.parametrize(
    "entry",
    [
        {
            "group": "apps",
            "version": "v1",
            "kind": "Deployment",
            "resource": "deployments",
            "podTemplates": ["spec.template"],
        },
        {
            "group": "example.com",
            "version": "v1",
            "kind": "Trainer",
            "resource": "trainers",
            "podTemplates": [],
        },
        {
            "group": "example.com",
            "version": "v1",
            "kind": "Trainer",
            "resource": "trainers",
            "podTemplates": ["spec..x"],
        },
    ],
)
def test_a_custom_kind_that_cannot_work_is_refused(entry: JSON) -> None:
    with pytest.raises(PolicyError):
        make_policy({"workloadKinds": [entry]})


# --- JobSet -------------------------------------------------------------------------------------------


def test_a_gang_jobset_restarts_on_exactly_gpuguards_rules() -> None:
    user_rule = {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [3]}}
    obj = jobset(
        replicated(template={}, podFailurePolicy={"rules": [user_rule]}),
        failure_policy={"maxRestarts": 2},
    )
    out = converges(obj)
    rules = job_rules(out)
    assert rules[0] == user_rule  # the user's first
    assert [r["action"] for r in rules[1:]] == ["FailJob", "FailJob"]
    assert rules[1]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    assert rules[2]["onExitCodes"]["values"] == [74, 75]
    [restart] = jobset_rules(out)
    assert restart["action"] == "RestartJobSetAndIgnoreMaxRestarts"
    assert restart["onJobFailureReasons"] == ["PodFailurePolicy"]
    assert restart["targetReplicatedJobs"] == ["workers"]
    assert out["spec"]["failurePolicy"]["maxRestarts"] == 2
    patterns = [re.compile(p) for p in restart["onJobFailureMessagePatterns"]]

    def matches(message: str) -> bool:  # Go's RE2 and Python's re agree on these patterns
        return any(pattern.search(message) for pattern in patterns)

    assert matches(failure_message(1)) and matches(failure_message(2))
    assert not matches(failure_message(0, code=3))  # the user's own FailJob still fails the JobSet
    assert not matches(failure_message(12))


def test_the_users_jobset_rules_come_first_and_a_catch_all_is_named() -> None:
    mine = {"name": "anyFailure", "action": "FailJobSet"}
    obj = jobset(replicated(template={}), failure_policy={"rules": [mine]})
    result = mutate(obj)
    assert jobset_rules(result.obj)[0] == mine
    assert jobset_rules(result.obj)[1]["name"] == "gpuguardDeviceFailure"
    assert any("anyFailure comes first" in d.message for d in result.decisions if d.outcome == "notice")


def test_replicated_jobs_with_rules_at_other_indexes_get_rules_of_their_own() -> None:
    user_rule = {"action": "Ignore", "onExitCodes": {"operator": "In", "values": [9]}}
    obj = jobset(
        replicated("a", template={}), replicated("b", template={}, podFailurePolicy={"rules": [user_rule]})
    )
    out = converges(obj)
    first, second = jobset_rules(out)
    assert (first["name"], first["targetReplicatedJobs"]) == ("gpuguardDeviceFailure", ["a"])
    assert (second["name"], second["targetReplicatedJobs"]) == ("gpuguardDeviceFailure2", ["b"])
    assert second["onJobFailureMessagePatterns"] == [
        "matching FailJob rule at index 1$",
        "matching FailJob rule at index 2$",
    ]


def test_non_retriable_codes_fail_the_jobset() -> None:
    policy = make_policy({"rules": {"podFailurePolicy": {"nonRetriableExitCodes": [42]}}})
    out = converges(jobset(replicated(template={})), policy)
    restart, fail = jobset_rules(out)
    assert fail["action"] == "FailJobSet"
    assert fail["onJobFailureMessagePatterns"] == ["matching FailJob rule at index 2$"]
    assert "matching FailJob rule at index 2$" not in restart["onJobFailureMessagePatterns"]


@pytest.mark.parametrize(
    ("obj", "policy"),
    [
        (jobset(replicated(template={}), annotations={"gpuguard.io/gang": "false"}), POLICY),
        (jobset(replicated(parallelism=1, template={})), POLICY),  # one pod in all: nothing to hang on
        (
            jobset(replicated(template={})),
            make_policy({"rules": {"podFailurePolicy": {"gang": {"jobSets": "never"}}}}),
        ),
    ],
    ids=["annotation", "one-pod", "never"],
)
def test_an_independent_jobset_keeps_the_per_pod_rules(obj: JSON, policy: Any) -> None:
    out = converges(obj, policy)
    assert [r["action"] for r in job_rules(out)] == ["Ignore", "Count"]
    assert "failurePolicy" not in out["spec"]


def test_a_replicated_job_can_say_it_stands_alone() -> None:
    alone = replicated("loader", template={})
    alone["template"]["metadata"] = {"annotations": {"gpuguard.io/gang": "false"}}
    out = converges(jobset(replicated(template={}), alone))
    assert [r["action"] for r in job_rules(out, 1)] == ["Ignore", "Count"]
    assert jobset_rules(out)[0]["targetReplicatedJobs"] == ["workers"]


def test_a_jobset_without_restart_policy_gets_never() -> None:
    obj = jobset(replicated(template={}))
    del obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["restartPolicy"]
    out = converges(obj)
    assert (
        out["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    )
    assert jobset_rules(out)


def test_no_room_for_the_rules_means_no_jobset_rule() -> None:
    full = [{"action": "Count", "onExitCodes": {"operator": "In", "values": [i]}} for i in range(1, 21)]
    result = mutate(jobset(replicated(template={}, podFailurePolicy={"rules": full})))
    assert "failurePolicy" not in result.obj["spec"]
    assert any("left out" in d.message for d in result.decisions)


def test_a_jobsets_child_job_is_left_as_its_template_made_it() -> None:
    child = job(parallelism=2, completions=2, completionMode="Indexed")
    child["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "jobset.x-k8s.io/v1alpha2",
            "kind": "JobSet",
            "name": "train",
            "uid": "1",
            "controller": True,
        }
    ]
    result = mutate(child)
    assert not result.changed and result.skipped == "made from its JobSet's template: handled there"


def test_the_review_path_sends_the_whole_jobsets_patch() -> None:
    obj = jobset(replicated(template={}))
    patched = apply(copy.deepcopy(obj), patch_of(mutate_review(obj, POLICY)))
    # The whole object was decoded: the patch is the engine's, replicated Jobs and failurePolicy alike.
    assert patched == engine.mutate(obj, POLICY, namespace="default").obj


# --- Indexed Jobs ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("choice", "parallelism", "completions", "gang"),
    [
        ("never", 4, 4, False),
        ("auto", 4, 4, True),
        ("auto", 4, 8, False),
        ("always", 4, 8, True),
        ("always", 1, 1, False),
    ],
)
def test_an_indexed_job_is_a_gang_by_the_policys_choice(
    choice: str, parallelism: int, completions: int, gang: bool
) -> None:
    policy = make_policy({"rules": {"podFailurePolicy": {"gang": {"indexedJobs": choice}}}})
    obj = job(parallelism=parallelism, completions=completions, completionMode="Indexed")
    out = converges(obj, policy)
    actions = [r["action"] for r in out["spec"]["podFailurePolicy"]["rules"]]
    assert actions == (["FailJob", "FailJob"] if gang else ["Ignore", "Count"])


def test_the_annotation_makes_a_job_a_gang() -> None:
    obj = job(parallelism=2, completions=2, completionMode="Indexed")
    obj["metadata"]["annotations"] = {"gpuguard.io/gang": "true"}
    out = converges(obj)
    assert [r["action"] for r in out["spec"]["podFailurePolicy"]["rules"]] == ["FailJob", "FailJob"]


# --- LeaderWorkerSet and the operators' kinds -------------------------------------------------------


def lws(restart_policy: str | None = None) -> JSON:
    template: JSON = {"size": 2, "workerTemplate": {"spec": {"containers": [container(gpus=8)]}}}
    if restart_policy is not None:
        template["restartPolicy"] = restart_policy
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": "serve"},
        "spec": {"replicas": 1, "leaderWorkerTemplate": template},
    }


def test_a_leaderworkerset_recreates_its_group_where_nothing_was_chosen() -> None:
    out = converges(lws())
    assert out["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert (
        out["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["priorityClassName"] == "gpu-workload"
    )


@pytest.mark.parametrize("chosen", ["None", "Default"])
def test_a_leaderworkerset_restarting_pods_alone_is_warned(chosen: str) -> None:
    result = mutate(lws(chosen))
    assert result.obj["spec"]["leaderWorkerTemplate"]["restartPolicy"] == chosen
    assert any(d.outcome == "notice" and f"restartPolicy {chosen}" in d.message for d in result.decisions)


def test_a_cpu_leaderworkerset_is_not_touched() -> None:
    obj = lws()
    obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"] = [container()]
    assert mutate(obj).skipped == "not an accelerator workload"


def test_the_guard_names_the_template_it_denies() -> None:
    obj = yaml.safe_load((EXAMPLES / "gpu-pytorchjob.yaml").read_text())
    obj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["priorityClassName"] = "low"
    policy = make_policy({"priorityClasses": {"low": 10}})
    # The validating webhook sees the object after the mutating one, which gave Master its class.
    denials = engine.validate(mutate(obj, policy).obj, policy, namespace="ml").denials
    assert len(denials) == 1 and denials[0].startswith("pytorchReplicaSpecs.Worker: priority 10")


def test_a_cpu_ray_head_is_left_as_it_is() -> None:
    obj = yaml.safe_load((EXAMPLES / "gpu-raycluster.yaml").read_text())
    out = converges(obj)
    assert out["spec"]["headGroupSpec"] == obj["spec"]["headGroupSpec"]
    assert out["spec"]["workerGroupSpecs"][0]["template"]["spec"]["priorityClassName"] == "gpu-workload"
    assert (
        GPU in out["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]
    )


# --- the user's own JobSet rules ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "rule",
    [
        {"name": "deadlines", "action": "FailJobSet", "onJobFailureReasons": ["DeadlineExceeded"]},
        {"name": "oom", "action": "FailJobSet", "onJobFailureMessagePatterns": ["OOMKilled"]},
        {"name": "loaderOnly", "action": "FailJobSet", "targetReplicatedJobs": ["loader"]},
    ],
    ids=["other-reason", "own-message", "other-job"],
)
def test_a_users_rule_that_cannot_catch_a_device_failure_first_is_not_named(rule: JSON) -> None:
    result = mutate(jobset(replicated(template={}), failure_policy={"rules": [rule]}))
    assert [r["name"] for r in jobset_rules(result.obj)] == [rule["name"], gangs.RESTART_RULE]
    assert not [d.message for d in result.decisions if d.outcome == "notice"]


@pytest.mark.parametrize(
    ("rule", "named"),
    [
        ({"action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}, "(unnamed)"),
        ({"name": "workersFail", "action": "FailJobSet", "targetReplicatedJobs": ["workers"]}, "workersFail"),
    ],
    ids=["by-reason-unnamed", "by-target"],
)
def test_a_users_rule_that_catches_a_device_failure_first_is_named(rule: JSON, named: str) -> None:
    result = mutate(jobset(replicated(template={}), failure_policy={"rules": [rule]}))
    notices = [d.message for d in result.decisions if d.outcome == "notice"]
    assert notices == [
        f"failurePolicy rule {named} comes first and matches device failures of workers: gpuguard's "
        "restart rule after it never applies"
    ]
