"""Which requests gpuguard's webhooks still see in each `admission.mode`, and the patch that says so in
their configurations (the leader's order of writes is test_nativesync.py's). What the API server does
with the conditions is tests/e2e/test_hybrid.py's."""

from __future__ import annotations

import jsonpatch
import pytest

from tests.harness.manifests import make_policy
from webhook.policy.native import compile_policy
from webhook.policy.nativenarrow import CONDITION_NAME, CONFIGURATION_KINDS, condition_patch, narrowing
from webhook.policy.nativesync import namespace_owner
from webhook.policy.workload import JSON

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


def test_in_hybrid_a_native_policy_stands_aside_where_the_webhook_would_answer_otherwise() -> None:
    def conditions(mode: str) -> dict[tuple[str, str], list[str]]:
        objects = compile_policy(make_policy({"admission": {"mode": mode}})).objects
        return {
            (o["kind"], o["metadata"]["name"]): [c["name"] for c in o["spec"]["matchConditions"]]
            for o in objects
            if "matchConditions" in o["spec"]
        }

    hybrid, native = conditions("hybrid"), conditions("native")
    aside = {key for key, found in hybrid.items() if "not-left-to-the-webhook" in found}
    # Every one: a DRA claim's device class decides whether a workload is an accelerator one for each
    # rule but trusted device software, which stands aside for updates and '..' hostPaths.
    assert aside == set(hybrid)
    # Native mode has no webhook to leave anything to: the same policies, none standing aside.
    assert set(native) == set(hybrid)
    assert not any("not-left-to-the-webhook" in found for found in native.values())


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
