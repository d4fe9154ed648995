"""bench/map/ writes gpuguard's readiness-toleration rule as a MutatingAdmissionPolicy; its constants are
copies of the default policy's (CEL cannot read the policy), so these tests fail when the two drift apart.
That the policy mutates on a real API server is proven by the bench and its smoke test
(tests/e2e/test_bench_admission.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from webhook.policy.model import Policy
from webhook.policy.rules import READINESS_TAINT_KEYS

MANIFEST = Path(__file__).resolve().parents[2] / "bench" / "map" / "readiness-tolerations.yaml"


@pytest.fixture(scope="module")
def documents() -> dict[str, Any]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc}


def _glob_as_re2(pattern: str) -> str:
    """A policy glob as the RE2 alternative the manifest spells it: '*' is any run of characters, the other
    regular-expression metacharacters stand for themselves."""
    return ".*".join(re.sub(r"([.^$+?()\[\]{}|\\])", r"\\\1", part) for part in pattern.split("*"))


def _expression(policy: dict[str, Any], section: str, name: str) -> str:
    return str(next(item["expression"] for item in policy["spec"][section] if item["name"] == name))


def test_accelerator_pattern_is_the_default_policys(documents: dict[str, Any], policy: Policy) -> None:
    condition = _expression(documents["MutatingAdmissionPolicy"], "matchConditions", "accelerator-pod")
    (pattern,) = re.findall(r"matches\(r'([^']+)'\)", condition)

    expected = "^(" + "|".join(_glob_as_re2(glob) for glob in policy.accelerators.resources) + ")$"
    assert pattern == expected
    names = [
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
    assert {n: bool(re.fullmatch(pattern, n)) for n in names} == {
        n: policy.accelerators.is_accelerator_resource(n) for n in names
    }


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
