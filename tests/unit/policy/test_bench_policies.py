"""bench/map/ and bench/kyverno/ write gpuguard's readiness-toleration rule as a MutatingAdmissionPolicy and
as a Kyverno ClusterPolicy; their constants are copies of the default policy's (neither can read it), so
these tests fail when they drift apart. That they mutate as gpuguard does on a real API server is proven
by the bench and its smoke test (tests/e2e/test_bench_admission.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness import REPO_ROOT
from webhook.policy.model import Policy
from webhook.policy.rules import READINESS_TAINT_KEYS

BENCH = REPO_ROOT / "bench"
MANIFEST = BENCH / "map" / "readiness-tolerations.yaml"
KYVERNO = BENCH / "kyverno" / "readiness-tolerations.yaml"
NAMES = [
    "nvidia.com/gpu",
    "nvidia.com/mig-1g.10gb",
    "amd.com/gpu",
    "gpu.intel.com/i915",
    "aws.amazon.com/neuroncore",
    "example.com/vgpu-number",
    "deviceclass.resource.kubernetes.io/gpu.example.com",
    "cpu",
    "memory",
    "ephemeral-storage",
    "hugepages-2Mi",
    "example.com/foo",
    "nvidia.com/gpux",
]


@pytest.fixture(scope="module")
def documents() -> dict[str, Any]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc}


def _glob_as_re2(pattern: str) -> str:
    """A policy glob as the RE2 alternative the manifest spells it: '*' is any run of characters, the other
    regular-expression metacharacters stand for themselves."""
    return ".*".join(re.sub(r"([.^$+?()\[\]{}|\\])", r"\\\1", part) for part in pattern.split("*"))


def _expression(policy: dict[str, Any], section: str, name: str) -> str:
    return str(next(item["expression"] for item in policy["spec"][section] if item["name"] == name))


def _expected_pattern(policy: Policy) -> str:
    return "^(" + "|".join(_glob_as_re2(glob) for glob in policy.accelerators.resources) + ")$"


def _agrees(pattern: str, policy: Policy) -> bool:
    return {n: bool(re.fullmatch(pattern, n)) for n in NAMES} == {
        n: policy.accelerators.is_accelerator_resource(n) for n in NAMES
    }


def test_accelerator_pattern_is_the_default_policys(documents: dict[str, Any], policy: Policy) -> None:
    condition = _expression(documents["MutatingAdmissionPolicy"], "matchConditions", "accelerator-pod")
    (pattern,) = re.findall(r"matches\(r'([^']+)'\)", condition)

    assert pattern == _expected_pattern(policy)
    assert _agrees(pattern, policy)


def test_kyverno_policy_is_the_same_rule(policy: Policy) -> None:
    (rule,) = yaml.safe_load(KYVERNO.read_text())["spec"]["rules"]
    (pattern,) = re.findall(
        r"regex_match\('([^']+)'", " ".join(c["key"] for c in rule["preconditions"]["all"])
    )
    (foreach,) = rule["mutate"]["foreach"]
    readiness = policy.rules.readinessTolerations

    assert pattern == _expected_pattern(policy)
    assert _agrees(pattern, policy)
    conditions = {c["operator"]: c["value"] for c in foreach["preconditions"]["all"]}
    assert conditions == {"AnyIn": list(READINESS_TAINT_KEYS), "Equals": readiness.apiServerDefaultSeconds}
    assert (
        f"== 'Always' && `{readiness.servingSeconds}` || `{readiness.batchSeconds}`"
        in foreach["patchesJson6902"]
    )


def test_seconds_are_the_default_policys(documents: dict[str, Any], policy: Policy) -> None:
    rule = policy.rules.readinessTolerations
    seconds = _expression(documents["MutatingAdmissionPolicy"], "variables", "seconds")
    keys = _expression(documents["MutatingAdmissionPolicy"], "variables", "readinessKeys")
    (mutation,) = documents["MutatingAdmissionPolicy"]["spec"]["mutations"]

    assert re.search(r"== 'Always' \? (\d+) : (\d+)", seconds).groups() == (  # type: ignore[union-attr]
        str(rule.servingSeconds),
        str(rule.batchSeconds),
    )
    assert re.findall(r"'([^']+)'", keys) == list(READINESS_TAINT_KEYS)
    assert f"t.tolerationSeconds == {rule.apiServerDefaultSeconds} " in mutation["jsonPatch"]["expression"]


def test_binding_names_the_policy_and_spares_what_gpuguard_spares(documents: dict[str, Any]) -> None:
    policy, binding = documents["MutatingAdmissionPolicy"], documents["MutatingAdmissionPolicyBinding"]
    webhooks = Path(MANIFEST).parents[2] / "deploy" / "base" / "webhooks.yaml"
    (mutating,) = next(doc for doc in yaml.safe_load_all(webhooks.read_text()) if doc)["webhooks"]

    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["matchResources"]["namespaceSelector"] == mutating["namespaceSelector"]
    assert policy["spec"]["failurePolicy"] == mutating["failurePolicy"]
