"""Hypothesis properties of the engine and the review: idempotence, exact patches, robustness."""

from __future__ import annotations

import base64
import json
from typing import Any

import orjson
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.harness.manifests import (
    GPU,
    JSON,
    NOT_READY,
    SUPPORTED_VERSIONS,
    UNREACHABLE,
    admission_review,
    apply,
    assert_same_json,
    job_errors,
    make_policy,
    pod_spec_errors,
    well_formed,
)
from webhook.admission import review
from webhook.policy import engine
from webhook.policy.facts import ClusterFacts, PriorityClassInfo
from webhook.policy.model import Policy, default_policy

POLICIES: list[Policy] = [
    default_policy(),
    make_policy(
        {
            "rules": {
                "podFailurePolicy": {
                    "onFailureJobs": "convert",
                    "deviceFailureAction": "FailIndex",
                    "nonRetriableExitCodes": [1, 137],
                    "ignoreDisruptions": False,
                },
                "gracefulTermination": {
                    "preStop": {"action": "exec", "seconds": 40, "command": ["/drain"]},
                    "minGracePeriodSeconds": 45,
                    "marginSeconds": 30,
                },
            }
        }
    ),
    make_policy({"rules": {"priority": {"mode": "warn"}, "readinessTolerations": {"mode": "audit"}}}),
    make_policy({"rules": {"readinessTolerations": {"servingSeconds": 300, "batchSeconds": 300}}}),
    make_policy(
        {
            "rules": {
                "driverCompatibility": {
                    "images": [{"image": "registry.example/*", "minDriverMajor": 535}],
                    "multiNode": {"sameDriverVersion": True, "completionModes": ["Indexed", "NonIndexed"]},
                }
            }
        }
    ),
]
FACTS: list[ClusterFacts | None] = [
    None,
    ClusterFacts(
        priority_classes={
            "gpu-workload": PriorityClassInfo(10000, "Never"),
            "research": PriorityClassInfo(50),
        }
    ),
    ClusterFacts(priority_classes={"research": PriorityClassInfo(50)}),
    ClusterFacts(
        priority_classes={
            "cluster-default": PriorityClassInfo(0, global_default=True),
            "gpu-workload": PriorityClassInfo(10000),
        }
    ),
]

# --- well-formed workload shapes -------------------------------------------------------------------------

RESOURCE_NAMES = st.sampled_from(
    [GPU, "amd.com/gpu", "nvidia.com/mig-1g.5gb", "gpu.intel.com/i915", "cpu", "memory", "example.com/nic"]
)
QUANTITIES = st.one_of(st.integers(min_value=0, max_value=8), st.sampled_from(["1", "500m", "2Gi"]))
RESOURCES = st.fixed_dictionaries(
    {},
    optional={
        "limits": st.dictionaries(RESOURCE_NAMES, QUANTITIES, max_size=3),
        "requests": st.dictionaries(RESOURCE_NAMES, QUANTITIES, max_size=3),
        "claims": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["gpu", "nic"])}), max_size=2),
    },
)
LIFECYCLES = st.sampled_from(
    [
        {"preStop": {"exec": {"command": ["/bin/save"]}}},
        {"preStop": {"sleep": {"seconds": 5}}},
        {"postStart": {"exec": {"command": ["/bin/warm"]}}},
        {},
    ]
)
TOLERATIONS = st.sampled_from(
    [
        {"key": NOT_READY, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
        {"key": UNREACHABLE, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
        {"key": NOT_READY, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 120},
        {"key": UNREACHABLE, "operator": "Exists", "effect": "NoExecute"},
        {"key": NOT_READY, "operator": "Exists", "effect": "NoSchedule"},
        {"operator": "Exists"},
        {"operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
        {"key": GPU, "operator": "Exists", "effect": "NoSchedule"},
    ]
)


DRIVER_MAJOR = "nvidia.com/cuda.driver-version.major"
AFFINITIES: list[JSON] = [
    {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}
    for terms in (
        [{"matchExpressions": [{"key": "disk", "operator": "In", "values": ["ssd"]}]}],
        [{}, {"matchExpressions": [{"key": DRIVER_MAJOR, "operator": "Gt", "values": ["600"]}]}],
        [{"matchExpressions": [{"key": DRIVER_MAJOR, "operator": "In", "values": ["470"]}]}],
        [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}],
    )
] + [{"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{"topologyKey": "zone"}]}}]


@st.composite
def containers(draw: st.DrawFn, prefix: str, *, init: bool = False) -> list[JSON]:
    result = []
    for index in range(draw(st.integers(min_value=0 if init else 1, max_value=3 if not init else 2))):
        item: JSON = {"name": f"{prefix}{index}", "image": "registry.example/app:1"}
        if draw(st.booleans()):
            item["resources"] = draw(RESOURCES)
        if draw(st.booleans()):
            item["lifecycle"] = draw(LIFECYCLES)
        if init and draw(st.booleans()):
            item["restartPolicy"] = "Always"
        result.append(item)
    return result


@st.composite
def pod_specs(draw: st.DrawFn) -> JSON:
    spec: JSON = {"containers": draw(containers("c"))}
    init = draw(containers("i", init=True))
    if init:
        spec["initContainers"] = init
    optional: dict[str, st.SearchStrategy[Any]] = {
        "restartPolicy": st.sampled_from(["Always", "Never", "OnFailure"]),
        "tolerations": st.lists(TOLERATIONS, max_size=4),
        "terminationGracePeriodSeconds": st.integers(min_value=0, max_value=4000),
        "priorityClassName": st.sampled_from(
            ["", "research", "gpu-workload", "cluster-default", "system-node-critical"]
        ),
        "priority": st.sampled_from([0, 50, 10000, 2000001000]),
        "preemptionPolicy": st.sampled_from(["PreemptLowerPriority", "Never"]),
        "resourceClaims": st.lists(
            st.fixed_dictionaries({"name": st.just("gpu"), "resourceClaimTemplateName": st.just("one-gpu")}),
            max_size=1,
        ),
        "nodeSelector": st.sampled_from(
            [
                {"cloud.google.com/gke-accelerator": "nvidia-l4"},
                {"disk": "ssd"},
                {"nvidia.com/cuda.driver-version.major": "570"},
            ]
        ),
        "affinity": st.sampled_from(AFFINITIES),
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            spec[key] = draw(strategy)
    return spec


@st.composite
def failure_rules(draw: st.DrawFn) -> JSON:
    if draw(st.booleans()):
        return {
            "action": "Ignore",
            "onPodConditions": [{"type": draw(st.sampled_from(["DisruptionTarget", "Custom"]))}],
        }
    on_exit: JSON = {
        "operator": draw(st.sampled_from(["In", "NotIn"])),
        "values": sorted(draw(st.sets(st.integers(min_value=1, max_value=255), min_size=1, max_size=3))),
    }
    if draw(st.booleans()):
        on_exit["containerName"] = "c0"
    return {"action": draw(st.sampled_from(["Count", "FailJob", "Ignore"])), "onExitCodes": on_exit}


@st.composite
def job_specs(draw: st.DrawFn) -> JSON:
    spec: JSON = {"template": {"spec": draw(pod_specs())}}
    if draw(st.booleans()):
        spec["podFailurePolicy"] = {"rules": draw(st.lists(failure_rules(), max_size=21))}
    if draw(st.booleans()):
        spec["podReplacementPolicy"] = draw(st.sampled_from(["TerminatingOrFailed", "Failed"]))
    if draw(st.booleans()):
        spec |= {"completionMode": "Indexed", "completions": 2, "backoffLimitPerIndex": 1}
    if draw(st.booleans()):
        spec["parallelism"] = draw(st.integers(min_value=0, max_value=4))
    return spec


@st.composite
def workloads(draw: st.DrawFn) -> JSON:
    kind = draw(st.sampled_from(["Pod", "Job", "CronJob", "Deployment", "StatefulSet", "ReplicaSet"]))
    metadata: JSON = draw(
        st.sampled_from(
            [
                {"name": "w"},
                {"generateName": "w-"},
                {"name": "w", "annotations": {"a/b": "~"}},
                {"name": "w", "annotations": {"gpuguard.io/min-driver-major": "550"}},
                {"name": "w", "annotations": {"gpuguard.io/min-driver-major": "x"}},
            ]
        )
    )
    if kind == "Pod":
        return {"apiVersion": "v1", "kind": kind, "metadata": metadata, "spec": draw(pod_specs())}
    if kind == "Job":
        return {"apiVersion": "batch/v1", "kind": kind, "metadata": metadata, "spec": draw(job_specs())}
    if kind == "CronJob":
        spec = {"schedule": "@daily", "jobTemplate": {"spec": draw(job_specs())}}
        return {"apiVersion": "batch/v1", "kind": kind, "metadata": metadata, "spec": spec}
    spec = {"selector": {"matchLabels": {"app": "w"}}, "template": {"spec": draw(pod_specs())}}
    return {"apiVersion": "apps/v1", "kind": kind, "metadata": metadata, "spec": spec}


def _spec_and_job(obj: JSON) -> tuple[JSON, JSON | None]:
    if obj["kind"] == "Pod":
        return obj["spec"], None
    if obj["kind"] == "CronJob":
        job_spec = obj["spec"]["jobTemplate"]["spec"]
        return job_spec["template"]["spec"], job_spec
    spec = obj["spec"]["template"]["spec"]
    return spec, obj["spec"] if obj["kind"] == "Job" else None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.sampled_from(POLICIES), st.sampled_from(FACTS))
def test_mutate_is_idempotent_and_the_review_patch_is_exact(
    obj: JSON, policy: Policy, facts: ClusterFacts | None
) -> None:
    obj = orjson.loads(orjson.dumps(obj))  # as from the wire: no dict shared between two places
    snapshot = orjson.dumps(obj)
    first = engine.mutate(obj, policy, namespace="default", facts=facts)
    assert orjson.dumps(obj) == snapshot, "mutate edited its input"

    second = engine.mutate(first.obj, policy, namespace="default", facts=facts)
    assert not second.changed, (
        f"not idempotent: {[d.message for d in second.decisions if d.outcome == 'applied']}"
    )

    answer = review.review(admission_review(obj), endpoint="mutate", policy=policy, facts=facts)
    response = well_formed(answer.body)["response"]
    assert response["allowed"] is True
    operations = json.loads(base64.b64decode(response["patch"])) if "patch" in response else []
    assert_same_json(apply(obj, operations), first.obj)

    # Whatever gpuguard changed must still pass the API server's checks it was valid for before.
    spec_in, job_in = _spec_and_job(obj)
    spec_out, job_out = _spec_and_job(first.obj)
    if not pod_spec_errors(spec_in):
        assert pod_spec_errors(spec_out) == []
    if job_in is not None and job_out is not None:
        if not job_errors(job_in, spec_in):
            assert job_errors(job_out, spec_out) == []
        rules_in = (job_in.get("podFailurePolicy") or {}).get("rules", [])
        rules_out = (job_out.get("podFailurePolicy") or {}).get("rules", [])
        assert rules_out[: len(rules_in)] == rules_in, "user rules must stay first and unchanged"
        assert len(rules_out) <= max(20, len(rules_in))
    grace_in = spec_in.get("terminationGracePeriodSeconds", 30)
    assert spec_out.get("terminationGracePeriodSeconds", 30) >= grace_in, "grace period lowered"
    class_out = spec_out.get("priorityClassName", "")
    if class_out.startswith("system-"):
        assert class_out == spec_in.get("priorityClassName"), "gpuguard assigned a system class"


# --- robustness: anything in, a well-formed AdmissionReview out --------------------------------------------

JSON_VALUES = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=8),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Usually `strategy`, sometimes a value of the wrong type."""
    return st.one_of(strategy, strategy, JSON_VALUES)


@st.composite
def reviews(draw: st.DrawFn) -> JSON:
    obj = draw(st.one_of(workloads(), JSON_VALUES))
    request_fields: dict[str, st.SearchStrategy[Any]] = {
        "uid": maybe(st.text(min_size=1, max_size=12)),
        "kind": maybe(
            st.fixed_dictionaries(
                {
                    "group": maybe(st.sampled_from(["", "batch", "apps"])),
                    "kind": maybe(st.sampled_from(["Pod", "Job"])),
                }
            )
        ),
        "namespace": maybe(st.sampled_from(["default", "kube-system", ""])),
        "operation": maybe(st.sampled_from(["CREATE", "UPDATE", "DELETE", "CONNECT"])),
        "object": st.just(obj),
        "oldObject": maybe(st.just(obj)),
        "dryRun": maybe(st.booleans()),
        "name": maybe(st.text(max_size=5)),
    }
    request = draw(st.fixed_dictionaries({}, optional=request_fields))
    document = draw(
        st.fixed_dictionaries(
            {},
            optional={
                "apiVersion": maybe(st.sampled_from([*SUPPORTED_VERSIONS, "admission.k8s.io/v2", "v1"])),
                "kind": maybe(st.sampled_from(["AdmissionReview", "AdmissionRequest", "Pod"])),
                "request": maybe(st.just(request)),
            },
        )
    )
    return document


def _assert_answers(body: bytes, sent: Any) -> None:
    for endpoint in ("mutate", "validate"):
        answer = review.review(body, endpoint=endpoint, policy=POLICIES[0])
        response = well_formed(answer.body)["response"]
        request = sent.get("request") if isinstance(sent, dict) else None
        uid = request.get("uid") if isinstance(request, dict) else None
        if isinstance(uid, str) and uid:
            assert response["uid"] == uid
        else:
            assert response["uid"] == ""
        assert answer.allowed is response["allowed"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reviews())
@example({"apiVersion": "admission.k8s.io/v1", "kind": "Pod", "request": {"uid": "abc"}})
def test_any_review_shape_gets_a_well_formed_answer(document: JSON) -> None:
    _assert_answers(json.dumps(document).encode(), document)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_get_a_well_formed_answer(body: bytes) -> None:
    _assert_answers(body, None)


@settings(max_examples=200, deadline=None)
@given(JSON_VALUES)
def test_random_json_gets_a_well_formed_answer(document: Any) -> None:
    _assert_answers(json.dumps(document).encode(), document)


# --- robustness of the engine itself: a manifest is data from a user ----------------------------------------

WILD_TOLERATION = st.fixed_dictionaries(
    {}, optional={"key": maybe(st.just(GPU)), "operator": maybe(st.just("Exists")), "effect": JSON_VALUES}
)
WILD_EXPRESSION = st.fixed_dictionaries(
    {}, optional={"key": maybe(st.just("nvidia.com/gpu.present")), "operator": maybe(st.just("In"))}
)
WILD_RULE = st.fixed_dictionaries(
    {},
    optional={
        "action": JSON_VALUES,
        "onExitCodes": maybe(
            st.fixed_dictionaries(
                {}, optional={"operator": maybe(st.just("In")), "values": maybe(st.just([74]))}
            )
        ),
        "onPodConditions": maybe(
            st.lists(st.fixed_dictionaries({"type": maybe(st.just("DisruptionTarget"))}))
        ),
    },
)


@st.composite
def wild_jobs(draw: st.DrawFn) -> JSON:
    container: JSON = {"name": "c", "resources": {"limits": {GPU: 1}}}
    for key, strategy in (("lifecycle", JSON_VALUES), ("resources", maybe(st.just({"limits": {GPU: 1}})))):
        if draw(st.booleans()):
            container[key] = draw(strategy)
    template: JSON = {"containers": draw(maybe(st.just([container])))}
    wild_fields = {
        "restartPolicy": maybe(st.sampled_from(["Never", "OnFailure"])),
        "tolerations": maybe(st.lists(maybe(WILD_TOLERATION), max_size=3)),
        "affinity": maybe(
            st.builds(
                lambda expressions: {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [{"matchExpressions": expressions}]
                        }
                    }
                },
                st.lists(maybe(WILD_EXPRESSION), max_size=2),
            )
        ),
        "terminationGracePeriodSeconds": JSON_VALUES,
        "priorityClassName": JSON_VALUES,
        "resourceClaims": JSON_VALUES,
        "nodeSelector": JSON_VALUES,
    }
    for key, strategy in wild_fields.items():
        if draw(st.booleans()):
            template[key] = draw(strategy)
    spec: JSON = {"template": {"spec": template}}
    if draw(st.booleans()):
        spec["podFailurePolicy"] = draw(
            maybe(st.fixed_dictionaries({"rules": maybe(st.lists(maybe(WILD_RULE), max_size=3))}))
        )
    metadata = draw(
        maybe(st.fixed_dictionaries({"name": st.just("j")}, optional={"annotations": JSON_VALUES}))
    )
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": spec}


# Derandomized: the same examples every run, so a failure here is never a flake.
@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(wild_jobs())
def test_engine_never_raises_on_malformed_manifests(obj: JSON) -> None:
    # The CLI calls the engine directly; only the server has the fail-open net behind it.
    result = engine.mutate(obj, POLICIES[0], namespace="default")
    engine.mutate(result.obj, POLICIES[0], namespace="default")
    engine.validate(obj, POLICIES[0], namespace="default")
    engine.validate(result.obj, POLICIES[0], namespace="default", operation="UPDATE", old=obj)
