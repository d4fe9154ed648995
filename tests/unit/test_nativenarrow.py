"""Which requests gpuguard's webhooks still see in each `admission.mode`, the patch that says so in their
configurations, and the leader's order of writes: the webhooks narrowed only once the native objects
have settled, widened again before any of them changes. What the API server does with the conditions is
tests/e2e/test_hybrid.py's."""

from __future__ import annotations

import copy
import threading
from typing import Any

import jsonpatch
import pytest

from webhook.controllers.nativesync import KEY, NativePolicies, owned_informers
from webhook.policy.model import Policy
from webhook.policy.nativenarrow import CONDITION_NAME, CONFIGURATION_KINDS, condition_patch, narrowing
from webhook.policy.nativesync import RESOURCES, namespace_owner, wanted
from webhook.policy.workload import JSON

from .builders import make_policy
from .wired import Listed, registry

MUTATING, VALIDATING = CONFIGURATION_KINDS
HYBRID = {"admission": {"mode": "hybrid"}}
OWNER = namespace_owner("gpuguard", "6c1f0e4e-uid")


def configuration(kind: str, *conditions: JSON) -> JSON:
    webhook: JSON = {"name": f"{kind.lower()}.gpuguard.io", "clientConfig": {}}
    if conditions:
        webhook["matchConditions"] = list(conditions)
    return {"kind": kind, "metadata": {"name": "gpuguard", "resourceVersion": "7"}, "webhooks": [webhook]}


def test_webhook_mode_leaves_the_webhooks_as_registered_and_native_mode_calls_none() -> None:
    assert narrowing(make_policy({})).conditions == {MUTATING: None, VALIDATING: None}
    assert narrowing(make_policy({"admission": {"mode": "native"}})).conditions == {
        MUTATING: "false",
        VALIDATING: "false",
    }


def test_hybrid_sends_the_webhooks_what_needs_cluster_facts_or_the_webhooks_own_warnings() -> None:
    found = narrowing(make_policy(HYBRID))
    assert all(isinstance(c, str) and c not in ("true", "false") for c in found.conditions.values())
    assert "other workload kinds" in found.sent[MUTATING]
    validated = " ".join(found.sent[VALIDATING])
    for what in ("naming a node", "priority class the policy does not list", "DRA claims", "driver minimum"):
        assert what in validated


def test_a_mutating_rule_in_a_mode_no_mutating_policy_has_leaves_the_mutating_webhook_whole() -> None:
    found = narrowing(
        make_policy({**HYBRID, "namespaces": [{"names": ["team-a"], "rules": {"priority": "warn"}}]})
    )
    assert found.conditions[MUTATING] is None
    assert found.sent[MUTATING] == ["everything: priority is in warn mode somewhere"]
    assert isinstance(found.conditions[VALIDATING], str)


@pytest.mark.parametrize(
    ("present", "expression", "result"),
    [
        ((), "x", [{"name": CONDITION_NAME, "expression": "x"}]),
        (
            ({"name": "theirs", "expression": "a"},),
            "x",
            [{"name": "theirs", "expression": "a"}, {"name": CONDITION_NAME, "expression": "x"}],
        ),
        (
            ({"name": CONDITION_NAME, "expression": "old"},),
            "x",
            [{"name": CONDITION_NAME, "expression": "x"}],
        ),
        (
            ({"name": "theirs", "expression": "a"}, {"name": CONDITION_NAME, "expression": "x"}),
            None,
            [{"name": "theirs", "expression": "a"}],
        ),
    ],
)
def test_the_patch_touches_gpuguards_condition_alone_at_the_version_read(
    present: tuple[JSON, ...], expression: str | None, result: list[JSON]
) -> None:
    stored = configuration(MUTATING, *present)
    operations = condition_patch(stored, expression)
    assert operations[0] == {"op": "test", "path": "/metadata/resourceVersion", "value": "7"}
    assert {"op": "test", "path": "/webhooks/0/name", "value": stored["webhooks"][0]["name"]} in operations
    patched = jsonpatch.apply_patch(stored, operations)
    assert patched["webhooks"][0].get("matchConditions", []) == result
    assert condition_patch(patched, expression) == []
    # Another resourceVersion: the patch fails instead of writing over what was read.
    moved = {**stored, "metadata": {**stored["metadata"], "resourceVersion": "8"}}
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        jsonpatch.apply_patch(moved, operations)


# --- the leader: the order of its writes ------------------------------------------------------------


class Recorded:
    """Native objects and webhook configurations written, in one log, the configurations kept patched."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.stored = {kind: configuration(kind) for kind in CONFIGURATION_KINDS}

    def create(self, resource: str, body: dict[str, Any]) -> None:
        self.calls.append(("create", resource))

    def replace(self, resource: str, name: str, body: dict[str, Any]) -> None:
        self.calls.append(("update", resource))

    def delete(self, resource: str, name: str, resource_version: str) -> None:
        self.calls.append(("delete", resource))

    def read(self, kind: str) -> JSON | None:
        return copy.deepcopy(self.stored[kind])

    def patch(self, kind: str, operations: list[JSON]) -> None:
        self.stored[kind] = jsonpatch.apply_patch(self.stored[kind], operations)
        self.calls.append(("patch", kind))

    def conditions(self) -> list[str | None]:
        return [
            next((c["expression"] for c in w.get("matchConditions", []) if c["name"] == CONDITION_NAME), None)
            for stored in self.stored.values()
            for w in stored["webhooks"]
        ]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def leader(policy: Policy, stored: list[JSON], recorded: Recorded, clock: Clock) -> NativePolicies:
    def listed(resource: str) -> Listed:
        return Listed(*(o for o in stored if RESOURCES[o["kind"]] == resource))

    informers = owned_informers(listed, threading.Event())
    for informer in informers:
        assert informer.sync()
    return NativePolicies(
        owned=informers,
        policy=lambda: policy,
        writes=recorded,
        owner=lambda: OWNER,
        registry=registry(),
        stop=threading.Event(),
        configurations=recorded,
        settle_seconds=5.0,
        clock=clock,
    )


def _stored(objects: list[JSON]) -> list[JSON]:
    return [{**o, "metadata": {**o["metadata"], "resourceVersion": "1"}} for o in objects]


def test_the_webhooks_are_narrowed_only_once_the_native_objects_have_settled() -> None:
    policy = make_policy(HYBRID)
    recorded, clock = Recorded(), Clock()
    assert leader(policy, [], recorded, clock).reconcile(KEY).requeue_after == 5.0
    assert recorded.calls and all(verb == "create" for verb, _ in recorded.calls)
    assert recorded.conditions() == [None, None]

    # The objects are there, but only just: the leader waits out the rest of the settling time.
    objects = _stored(wanted(policy, OWNER))
    settled = leader(policy, objects, recorded, clock)
    clock.now += 2.0
    assert settled.reconcile(KEY).requeue_after == pytest.approx(3.0)
    assert recorded.conditions() == [None, None]
    clock.now += 3.0
    assert settled.reconcile(KEY).requeue_after is None
    assert recorded.conditions() == list(narrowing(policy).conditions.values())
    assert settled.status()["narrowed"] == {MUTATING: True, VALIDATING: True}


def test_the_webhooks_are_widened_before_any_native_object_changes() -> None:
    policy = make_policy(HYBRID)
    recorded, clock = Recorded(), Clock()
    objects = _stored(wanted(policy, OWNER))
    settled = leader(policy, objects, recorded, clock)
    clock.now += 10.0
    settled.reconcile(KEY)
    assert recorded.conditions() == list(narrowing(policy).conditions.values())
    recorded.calls.clear()

    # Back to webhook: both configurations widened, then the objects deleted.
    leader(make_policy({}), objects, recorded, clock).reconcile(KEY)
    assert recorded.calls[:2] == [("patch", MUTATING), ("patch", VALIDATING)]
    assert {verb for verb, _ in recorded.calls[2:]} == {"delete"}
    assert recorded.conditions() == [None, None]


def test_a_policy_that_does_not_compile_leaves_the_webhooks_whole() -> None:
    policy = make_policy(HYBRID)
    recorded, clock = Recorded(), Clock()
    objects = _stored(wanted(policy, OWNER))
    settled = leader(policy, objects, recorded, clock)
    clock.now += 10.0
    settled.reconcile(KEY)
    assert None not in recorded.conditions()

    def broken(_: Policy) -> Any:
        raise ValueError("unbalanced braces")

    informers = owned_informers(
        lambda r: Listed(*(o for o in objects if RESOURCES[o["kind"]] == r)), threading.Event()
    )
    for informer in informers:
        assert informer.sync()
    NativePolicies(
        owned=informers,
        policy=lambda: policy,
        writes=recorded,
        owner=lambda: OWNER,
        registry=registry(),
        stop=threading.Event(),
        compile=broken,
        configurations=recorded,
        clock=clock,
    ).reconcile(KEY)
    assert recorded.conditions() == [None, None]
