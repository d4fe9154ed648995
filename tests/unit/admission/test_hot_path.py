"""The admission hot path costs what the rules read, not what the API server sends
(docs/design/2026-12-02-performance-floors.md).

A real pod arrives as ~10 KB: managedFields, env, volumes, defaulted fields. /mutate cuts the object
down to `review.RULE_FIELDS` before the engine copies it and the differ walks it, so a request padded
with 10,000 fields where no rule looks costs a small request plus the JSON decoding of the padding.
These tests guard that from both sides:

- the padding adds no Python work at all (a deterministic count of function calls) and no more than
  its decoding in time (a generous bound that a full-object copy or a wide model overshoots many times);
- the cut loses nothing: every field the rules touch lies inside RULE_FIELDS (recorded from the rules
  themselves, on dicts that log each access), and answers are the ones the whole object would get.

The full bench (throughput, latency, memory against a bare TLS echo) is `bench/run`, not part of the suite.
"""

from __future__ import annotations

import base64
import copy
import sys
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import orjson
import pytest
import yaml

from tests.harness import REPO_ROOT, corpus
from tests.harness.manifests import admission_review_json
from webhook.admission import review
from webhook.policy import engine, patch
from webhook.policy.facts import NO_FACTS, ClusterFacts, NodeInfo, PriorityClassInfo
from webhook.policy.fields import NotPartial, PartialDecoder, Subtree, narrow
from webhook.policy.kinds import BUILTIN
from webhook.policy.model import Policy, default_policy, parse_policy
from webhook.policy.workload import split_api_version

JSON = dict[str, Any]
NAMESPACE = "ml-team"
PADDING_FIELDS = 10_000


# --- objects as the API server sends them -----------------------------------------------------------


def _gpu_container(name: str = "trainer", gpus: int = 8, **extra: Any) -> JSON:
    return {
        "name": name,
        "image": "nvcr.io/nvidia/pytorch:24.05-py3",
        "command": ["torchrun", "train.py"],
        "env": [{"name": f"SETTING_{i}", "value": str(i)} for i in range(6)],
        "resources": {"limits": {"cpu": "8", "nvidia.com/gpu": str(gpus)}, "requests": {"cpu": "4"}},
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
        "imagePullPolicy": "IfNotPresent",
        **extra,
    }


def _defaulted_tolerations(seconds: int = 300) -> list[JSON]:
    return [
        {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": seconds}
        for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
    ]


def _managed_fields(obj: JSON) -> list[JSON]:
    def tree(value: Any) -> Any:
        if isinstance(value, dict):
            return {f"f:{key}": tree(item) for key, item in value.items()}
        return {}

    fields = tree({"metadata": obj["metadata"], "spec": obj["spec"]})
    return [{"manager": "kubectl", "operation": "Update", "fieldsType": "FieldsV1", "fieldsV1": fields}]


def _with_managed_fields(obj: JSON) -> JSON:
    obj["metadata"]["managedFields"] = _managed_fields(obj)
    return obj


def _pod(spec: JSON, **metadata: Any) -> JSON:
    meta = {"name": "trainer-0", "namespace": NAMESPACE, "labels": {"app": "trainer"}, **metadata}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def _template(spec: JSON) -> JSON:
    return {"metadata": {"labels": {"app": "trainer"}}, "spec": spec}


def gpu_pod() -> JSON:
    spec = {
        "containers": [_gpu_container(), {"name": "sidecar-logs", "image": "fluent-bit:3"}],
        "initContainers": [{"name": "fetch", "image": "busybox:1.36"}],
        "volumes": [{"name": "data", "emptyDir": {}}],
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 30,
        "dnsPolicy": "ClusterFirst",
        "schedulerName": "default-scheduler",
        "tolerations": [*_defaulted_tolerations(), {"key": "nvidia.com/gpu", "operator": "Exists"}],
        "nodeSelector": {"nvidia.com/gpu.product": "H100"},
        "priority": 0,
        "preemptionPolicy": "PreemptLowerPriority",
        "enableServiceLinks": True,
    }
    return _with_managed_fields(_pod(spec, annotations={"example.com/team": "ml"}))


def objects() -> Iterator[tuple[str, JSON]]:
    """Workloads that reach every branch of the rules, then the repository's examples and the corpus."""
    yield "gpu pod", gpu_pod()
    yield (
        "pod with its own choices",
        _pod(
            {
                "containers": [
                    _gpu_container(
                        lifecycle={"preStop": {"exec": {"command": ["drain"]}}}, ports=[{"containerPort": 80}]
                    )
                ],
                "restartPolicy": "Never",
                "priorityClassName": "low",
                "priority": 10,
                "terminationGracePeriodSeconds": 120,
                "tolerations": _defaulted_tolerations(45),
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {
                                    "matchExpressions": [
                                        {"key": "nvidia.com/gpu.present", "operator": "Exists"}
                                    ]
                                }
                            ]
                        }
                    }
                },
            }
        ),
    )
    yield (
        "dra pod with gpu sidecar",
        _pod(
            {
                "containers": [
                    {"name": "main", "image": "app:1", "resources": {"claims": [{"name": "gpu"}]}, "env": []}
                ],
                "initContainers": [
                    _gpu_container("gpu-sidecar", 1, restartPolicy="Always"),
                    {"name": "init", "image": "busybox", "resources": {"limits": {"nvidia.com/gpu": "1"}}},
                ],
                "resourceClaims": [
                    {"name": "gpu", "resourceClaimTemplateName": "gpu-template"},
                    {"name": "other", "resourceClaimName": "gpu-claim"},
                ],
                "tolerations": None,
            },
            annotations=None,
        ),
    )
    yield (
        "pod bound to a node",
        _pod(
            {"containers": [{"name": "cpu", "image": "app:1"}], "nodeName": "gpu-node-1", "priority": 0},
            name=None,
            generateName="web-",
            ownerReferences=[
                {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web", "controller": True}
            ],
        ),
    )
    for owner in ("DaemonSet", "Job"):
        yield (
            f"pod of a {owner}",
            _pod(
                {"containers": [_gpu_container()]},
                ownerReferences=[
                    {"apiVersion": "v1", "kind": owner, "name": "x", "uid": "1", "controller": True}
                ],
            ),
        )
    yield (
        "mirror pod",
        _pod({"containers": [_gpu_container()]}, annotations={"kubernetes.io/config.mirror": "x"}),
    )
    for restart in ("Never", "OnFailure"):
        spec = {"containers": [_gpu_container()], "restartPolicy": restart}
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": f"train-{restart.lower()}", "namespace": NAMESPACE},
            "spec": {"backoffLimit": 4, "completionMode": "NonIndexed", "template": _template(spec)},
        }
        yield f"job {restart}", _with_managed_fields(job)
    yield (
        "indexed job with rules",
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "indexed"},
            "spec": {
                "completionMode": "Indexed",
                "backoffLimitPerIndex": 1,
                "podReplacementPolicy": "Failed",
                "podFailurePolicy": {
                    "rules": [
                        {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [74]}},
                        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
                    ]
                },
                "template": _template({"containers": [_gpu_container()], "restartPolicy": "Never"}),
            },
        },
    )
    yield (
        "cronjob",
        {
            "apiVersion": "batch/v1",
            "kind": "CronJob",
            "metadata": {"name": "nightly", "namespace": NAMESPACE},
            "spec": {
                "schedule": "0 3 * * *",
                "jobTemplate": {
                    "spec": {
                        "template": _template(
                            {"containers": [_gpu_container()], "restartPolicy": "OnFailure"}
                        )
                    }
                },
            },
        },
    )
    for kind in ("Deployment", "StatefulSet"):
        spec = {"containers": [_gpu_container(gpus=1)], "tolerations": [{"key": "nvidia.com/gpu"}]}
        yield (
            kind.lower(),
            _with_managed_fields(
                {
                    "apiVersion": "apps/v1",
                    "kind": kind,
                    "metadata": {"name": "serve", "namespace": NAMESPACE},
                    "spec": {
                        "replicas": 2,
                        "selector": {"matchLabels": {"app": "serve"}},
                        "template": _template(spec),
                    },
                }
            ),
        )
    yield (
        "pod needing a newer driver",
        _pod(
            {
                "containers": [_gpu_container()],
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {
                                    "matchExpressions": [
                                        {
                                            "key": "nvidia.com/gpu.product",
                                            "operator": "In",
                                            "values": ["H100"],
                                        }
                                    ]
                                },
                                {},
                            ]
                        }
                    }
                },
            },
            annotations={"gpuguard.io/min-driver-major": "550"},
        ),
    )
    indexed = {"containers": [_gpu_container()], "restartPolicy": "Never"}
    yield (
        "indexed job stating a driver",
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "allreduce", "namespace": NAMESPACE},
            "spec": {
                "parallelism": 4,
                "completions": 4,
                "completionMode": "Indexed",
                "template": {
                    "metadata": {"annotations": {"gpuguard.io/min-driver-major": "570"}},
                    "spec": indexed,
                },
            },
        },
    )
    yield (
        "malformed",
        _pod(
            {
                "containers": [_gpu_container(), "not-a-container"],
                "initContainers": {"not": "a list"},
                "tolerations": 7,
            },
            annotations=["not", "a", "mapping"],
        ),
    )
    # The corpus when this run has it: the examples alone already reach every rule.
    files = sorted((REPO_ROOT / "examples").glob("*.yaml")) + corpus.FILES
    for path in files:
        for index, doc in enumerate(yaml.safe_load_all(path.read_text(encoding="utf-8"))):
            if isinstance(doc, dict) and isinstance(doc.get("metadata"), dict) and "spec" in doc:
                yield f"{path.name}[{index}]", doc


OBJECTS = list(objects())


def policies() -> dict[str, Policy]:
    return {
        "default": default_policy(),
        "warn": parse_policy("mode: warn\n"),
        "convert": parse_policy(
            "rules:\n"
            "  podFailurePolicy: {onFailureJobs: convert, deviceFailureAction: FailIndex, nonRetriableExitCodes: [3]}\n"
            "  gracefulTermination: {preStop: {action: exec, seconds: 5, command: [drain]}}\n"
        ),
        "drivers": parse_policy(
            "rules:\n"
            "  driverCompatibility:\n"
            "    images: [{image: 'nvcr.io/nvidia/pytorch:*', minDriverMajor: 560}]\n"
            "    multiNode: {sameDriverVersion: true}\n"
        ),
    }


POLICIES = policies()
FACTS = {
    "offline": NO_FACTS,
    "cluster": ClusterFacts(
        priority_classes={
            "gpu-workload": PriorityClassInfo(10_000, "PreemptLowerPriority"),
            "low": PriorityClassInfo(10),
        },
        namespace_labels={NAMESPACE: {"team": "ml"}},
        nodes={"gpu-node-1": NodeInfo({"nvidia.com/gpu.present": "true"}, ("nvidia.com/gpu",))},
        claims={(NAMESPACE, "gpu-claim"): ("gpu.nvidia.com",)},
        claim_templates={(NAMESPACE, "gpu-template"): ("gpu.nvidia.com",)},
    ),
}


def admission_review(obj: JSON) -> JSON:
    """The review of `obj` in the namespace the cluster facts know."""
    return admission_review_json(obj, namespace=NAMESPACE)


def padded(request: JSON, fields: int = PADDING_FIELDS) -> JSON:
    """`request` with `fields` more fields where no rule looks: unknown top-level keys, managedFields."""
    result = copy.deepcopy(request)
    result["request"]["x-unknown"] = {f"field-{i:05d}": i for i in range(fields // 2)}
    result["request"]["object"]["metadata"].setdefault("managedFields", []).append(
        {"manager": "padding", "fieldsV1": {f"f:field-{i:05d}": {} for i in range(fields - fields // 2)}}
    )
    return result


def _mutate(body: bytes, policy: Policy | None = None, facts: ClusterFacts = NO_FACTS) -> review.Answer:
    return review.review(body, endpoint="mutate", policy=policy or POLICIES["default"], facts=facts)


# --- the padding costs nothing beyond its decoding ---------------------------------------------------


def _python_calls(run: Callable[[], object]) -> int:
    calls = 0

    def profile(_: FrameType, event: str, __: object) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def _best_seconds(run: Callable[[], object], repeat: int) -> float:
    # The minimum of many runs: noise from other processes only ever adds time.
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def test_padding_gets_the_same_answer() -> None:
    small = admission_review(gpu_pod())
    assert _mutate(orjson.dumps(padded(small))).body == _mutate(orjson.dumps(small)).body


def test_padding_adds_no_python_work() -> None:
    """Deterministic: a full-object copy or diff would make one call per padding field."""
    small = orjson.dumps(admission_review(gpu_pod()))
    wide = orjson.dumps(padded(admission_review(gpu_pod())))
    _mutate(small)  # imports, caches
    small_calls = _python_calls(lambda: _mutate(small))
    wide_calls = _python_calls(lambda: _mutate(wide))
    assert wide_calls <= small_calls * 1.05 + 10, f"{wide_calls} calls with padding, {small_calls} without"


def test_padding_cost_is_reported(summary: Callable[[str, str], None]) -> None:
    """What padding costs beyond decoding it, as a figure: on a loaded machine a bound on it says more
    about the machine than about gpuguard. The behaviour it reflects (no per-field work) is asserted by
    test_padding_adds_no_python_work; the bench holds the latency floors.

    Measured on 2 cores, quiet: small request ~0.15 ms; padded ~1.1 ms of which decoding ~0.95 ms.
    """
    small = orjson.dumps(admission_review(gpu_pod()))
    wide = orjson.dumps(padded(admission_review(gpu_pod())))
    small_cost = _best_seconds(lambda: _mutate(small), 200)
    wide_cost = _best_seconds(lambda: _mutate(wide), 30)
    decoding = _best_seconds(lambda: orjson.loads(wide), 30)
    summary(
        "padding_cost",
        f"/mutate of a GPU pod padded with {PADDING_FIELDS} fields: {wide_cost * 1e6:.0f} µs, of which "
        f"decoding {decoding * 1e6:.0f} µs; unpadded {small_cost * 1e6:.0f} µs (best of 30 and 200 runs)",
    )


# --- the cut loses nothing ---------------------------------------------------------------------------

Access = tuple[str, ...]
EVERY_KEY = "*"  # the rule saw which keys a mapping has (iterated it, took its length)
TRUTH = "?"  # the rule asked whether a mapping is empty: narrow never empties one, so that is safe
ITEM = "[]"


class _Recorder:
    def __init__(self) -> None:
        self.accesses: set[Access] = set()

    def wrap(self, value: Any, path: Access = ()) -> Any:
        if type(value) is dict:
            return _RecordingDict(self, path, {k: self.wrap(v, (*path, k)) for k, v in value.items()})
        if type(value) is list:
            return _RecordingList(self, path, [self.wrap(v, (*path, ITEM)) for v in value])
        return value


class _RecordingDict(dict[str, Any]):
    """A dict that logs every key a rule reads or writes. Subclassing keeps isinstance(x, dict) true;
    engine.clone copies exact dicts only, so the rules act on these very objects."""

    def __init__(self, recorder: _Recorder, path: Access, items: dict[str, Any]) -> None:
        super().__init__(items)
        self._recorder = recorder
        self._path = path

    def _saw(self, key: object) -> None:
        self._recorder.accesses.add((*self._path, str(key)))

    def __getitem__(self, key: str) -> Any:
        self._saw(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self._saw(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self._saw(key)
        return super().__contains__(key)

    def __setitem__(self, key: str, value: Any) -> None:
        self._saw(key)
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self._saw(key)
        super().__delitem__(key)

    def setdefault(self, key: str, default: Any = None) -> Any:
        self._saw(key)
        return super().setdefault(key, default)

    def pop(self, key: str, *default: Any) -> Any:
        self._saw(key)
        return super().pop(key, *default)

    def __iter__(self) -> Iterator[str]:
        self._saw(EVERY_KEY)
        return super().__iter__()

    def __bool__(self) -> bool:
        self._saw(TRUTH)
        return super().__len__() > 0

    def __len__(self) -> int:
        self._saw(EVERY_KEY)
        return super().__len__()

    def keys(self) -> Any:
        self._saw(EVERY_KEY)
        return super().keys()

    def items(self) -> Any:
        self._saw(EVERY_KEY)
        return super().items()

    def values(self) -> Any:
        self._saw(EVERY_KEY)
        return super().values()

    def copy(self) -> dict[str, Any]:
        self._saw(EVERY_KEY)
        return dict(super().items())


class _RecordingList(list[Any]):
    def __init__(self, recorder: _Recorder, path: Access, items: list[Any]) -> None:
        super().__init__(items)
        self._recorder = recorder
        self._path = path

    def _saw(self) -> None:
        self._recorder.accesses.add((*self._path, ITEM))

    def __getitem__(self, index: Any) -> Any:
        self._saw()
        return super().__getitem__(index)

    def __iter__(self) -> Iterator[Any]:
        self._saw()
        return super().__iter__()

    def __len__(self) -> int:
        self._saw()
        return super().__len__()


def _covered(access: Access, fields: Subtree) -> bool:
    """Whether the narrowed object shows the rules exactly what the whole object would at `access`."""
    for step in access:
        if fields is None or step == TRUTH:
            return True  # kept whole, or only asked whether it is empty
        if isinstance(fields, tuple):
            if step != ITEM:
                return False
            fields = fields[0]
        elif step == EVERY_KEY or step not in fields:
            return False  # a cut mapping hides keys: the rule would see them absent
        else:
            fields = fields[step]
    return True


def _core(obj: JSON) -> bool:
    """Objects of custom resources (JobSets, Ray clusters) are decoded whole, never cut to RULE_FIELDS."""
    found = BUILTIN.get(split_api_version(obj.get("apiVersion")), str(obj.get("kind")))
    return found is None or found.core


def test_the_rules_touch_nothing_outside_rule_fields() -> None:
    uncovered: dict[Access, str] = {}
    for (name, obj), (policy_name, policy), (facts_name, facts) in (
        (o, p, f) for o in OBJECTS if _core(o[1]) for p in POLICIES.items() for f in FACTS.items()
    ):
        recorder = _Recorder()
        group, kind = split_api_version(obj.get("apiVersion")), obj.get("kind")
        context: dict[str, Any] = {"namespace": NAMESPACE, "group": group, "kind": kind, "facts": facts}
        engine.mutate(recorder.wrap(copy.deepcopy(obj)), policy, **context)
        # The guard reads the same cut object, on creates and on updates (the old object too).
        engine.validate(recorder.wrap(copy.deepcopy(obj)), policy, **context)
        old = recorder.wrap(copy.deepcopy(obj))
        engine.validate(recorder.wrap(copy.deepcopy(obj)), policy, operation="UPDATE", old=old, **context)
        for access in recorder.accesses:
            if not _covered(access, review.RULE_FIELDS):
                uncovered.setdefault(access, f"{name}, policy {policy_name}, facts {facts_name}")
    assert not uncovered, "add these to review.RULE_FIELDS: " + "; ".join(
        f"{'.'.join(access)} (first seen on {where})" for access, where in sorted(uncovered.items())
    )


def test_the_recorder_sees_a_read_outside_rule_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard above must be able to fail: a rule reading env is caught."""
    reads_env = _Recorder()
    pod = reads_env.wrap(gpu_pod())
    pod["spec"]["containers"][0].get("env")
    assert not all(_covered(access, review.RULE_FIELDS) for access in reads_env.accesses)


@pytest.mark.parametrize("facts_name", list(FACTS))
@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_answers_are_those_of_the_whole_object(policy_name: str, facts_name: str) -> None:
    policy, facts = POLICIES[policy_name], FACTS[facts_name]
    for name, obj in OBJECTS:
        group, kind = split_api_version(obj.get("apiVersion")), obj.get("kind")
        whole = engine.mutate(obj, policy, namespace=NAMESPACE, group=group, kind=kind, facts=facts)
        answer = _mutate(orjson.dumps(admission_review(obj)), policy, facts)
        response = orjson.loads(answer.body)["response"]
        assert answer.decisions == whole.decisions, name
        expected = patch.diff(whole.original, whole.obj) if whole.changed and not whole.denials else []
        sent = orjson.loads(base64.b64decode(response["patch"])) if "patch" in response else []
        assert sent == expected, name


@pytest.mark.parametrize("facts_name", list(FACTS))
@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_the_rules_converge_on_every_object(policy_name: str, facts_name: str) -> None:
    """The engine no longer re-runs the rules on each request to prove this: it is proven here, over every
    branch, example and corpus object (and by the property tests over generated ones)."""
    policy, facts = POLICIES[policy_name], FACTS[facts_name]
    for name, obj in OBJECTS:
        group, kind = split_api_version(obj.get("apiVersion")), obj.get("kind")
        first = engine.mutate(obj, policy, namespace=NAMESPACE, group=group, kind=kind, facts=facts)
        again = engine.mutate(first.obj, policy, namespace=NAMESPACE, group=group, kind=kind, facts=facts)
        assert not again.changed, f"{name}: {[d.message for d in again.decisions if d.outcome == 'applied']}"


def test_narrow_keeps_shape_and_never_empties() -> None:
    obj: JSON = {
        "kind": "Pod",
        "metadata": {"labels": {"a": "b"}, "managedFields": [{"x": 1}]},
        "spec": {"containers": [{"name": "a", "env": [1]}, "junk"], "tolerations": 7, "overhead": {}},
        "status": {},
    }
    cut = narrow(obj, review.RULE_FIELDS)
    assert cut == {
        "kind": "Pod",
        "metadata": obj["metadata"],  # nothing the rules read in it: kept whole rather than emptied
        "spec": {"containers": [{"name": "a"}, "junk"], "tolerations": 7},
    }
    assert cut["spec"]["tolerations"] is obj["spec"]["tolerations"]
    assert narrow(["not", "a", "mapping"], review.RULE_FIELDS) == ["not", "a", "mapping"]


@pytest.mark.parametrize("facts_name", list(FACTS))
@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_mutate_never_edits_the_object_it_is_given(policy_name: str, facts_name: str) -> None:
    """`mutate` copies only engine.WRITTEN_FIELDS and shares the rest with its input: a rule writing
    anywhere else, in any mode (dry runs write to a scratch copy of the same kind), edits the input."""
    policy, facts = POLICIES[policy_name], FACTS[facts_name]
    for name, obj in OBJECTS:
        given = copy.deepcopy(obj)
        group, kind = split_api_version(obj.get("apiVersion")), obj.get("kind")
        engine.mutate(given, policy, namespace=NAMESPACE, group=group, kind=kind, facts=facts)
        assert given == obj, name


def test_decoding_part_of_a_review_is_cutting_the_whole_one() -> None:
    """Malformed objects (a string where a container belongs) are refused and decoded whole; every
    other review decodes partially to what the whole decoding cut down would be."""
    decoder = PartialDecoder(review.REVIEW_FIELDS, "Review")
    partial = 0
    for name, obj in OBJECTS:
        for request in (admission_review(obj), padded(admission_review(obj), 10)):
            request["request"]["oldObject"] = copy.deepcopy(obj)
            body = orjson.dumps(request)
            try:
                cut = decoder.decode(body)
            except NotPartial:
                continue
            assert cut == narrow(orjson.loads(body), review.REVIEW_FIELDS), name
            partial += 1
    assert partial > len(OBJECTS), "most reviews must take the partial path"


@pytest.mark.parametrize(
    "body",
    [
        b'{"request": {"object": {"spec": {"containers": "not a list"}}}}',
        b'{"request": {"object": {"metadata": {"uid": "only keys the tree leaves out"}}}}',
        b'{"request": {"uid": "x"}} trailing',
        b"[1, 2]",
    ],
)
def test_a_review_partial_decoding_cannot_match_is_decoded_whole(body: bytes) -> None:
    with pytest.raises(NotPartial):
        PartialDecoder(review.REVIEW_FIELDS, "Review").decode(body)
