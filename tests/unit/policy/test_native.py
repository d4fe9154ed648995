"""The policy compiled into native admission policies: the pure parts (bindings, literals, patterns).

What the API server does with the expressions is proven on a real one in tests/e2e/test_native.py.
"""

from __future__ import annotations

import fnmatch
import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest

from webhook.cli import main
from webhook.policy import hostpaths, images, nativegaps
from webhook.policy.engine import RULES_ANNOTATION
from webhook.policy.model import MUTATING_RULES, RULE_IDS, LabelSelector, default_policy, parse_policy
from webhook.policy.native import NAME_LABEL, compile_policy, regions
from webhook.policy.nativecel import glob_regex, literal
from webhook.policy.nativevalidating import REFERENCE

SELECTORS_POLICY = """
mode: enforce
rules:
  priority: {mode: warn}
namespaces:
  - names: [team-a, team-b]
    mode: audit
  - selector: {matchLabels: {tier: batch, env: prod}}
    rules: {readinessTolerations: "off", acceleratorNodeGuard: warn}
  - selector: {matchExpressions: [{key: sandbox, operator: Exists}]}
    mode: warn
  - names: [team-c]
    rules: {trustedDeviceSoftware: "off"}
"""

NAMESPACES = [
    (name, labels)
    for name in ("team-a", "team-c", "kube-system", "default", "other")
    for labels in (
        {},
        {"tier": "batch"},
        {"tier": "batch", "env": "prod"},
        {"tier": "batch", "env": "prod", "sandbox": "1"},
        {"sandbox": ""},
        {"env": "prod", "sandbox": "x"},
    )
]


def _selects(requirements: list[dict[str, object]], name: str, labels: dict[str, str]) -> bool:
    selector = LabelSelector.model_validate({"matchExpressions": requirements})
    return selector.matches({**labels, NAME_LABEL: name})


@pytest.mark.parametrize("text", [SELECTORS_POLICY, ""], ids=["selectors", "default"])
def test_every_namespace_falls_in_exactly_one_region_with_the_engines_mode(text: str) -> None:
    policy = parse_policy(text)
    split = regions(policy)
    for name, labels in NAMESPACES:
        holding = [r for r in split if _selects(r.requirements, name, labels)]
        assert len(holding) == 1, (name, labels, [r.description for r in holding])
        for rule in RULE_IDS:
            assert policy.mode_under(rule, holding[0].override) == policy.mode_for(rule, name, labels)


def test_bindings_carry_each_regions_mode_and_a_mutation_outside_enforce_is_named() -> None:
    policy = parse_policy(SELECTORS_POLICY)
    compiled = compile_policy(policy)
    bindings = [o for o in compiled.objects if o["kind"].endswith("Binding")]
    guard = [b for b in bindings if b["spec"]["policyName"] == "gpuguard-accelerator-node-guard"]
    for name, labels in NAMESPACES:
        if name == "kube-system":
            assert not any(
                _selects(b["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"], name, labels)
                for b in bindings
            ), "the namespaces deploy/'s webhooks never see"
            continue
        matching = [
            b
            for b in guard
            if _selects(b["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"], name, labels)
        ]
        mode = policy.mode_for("acceleratorNodeGuard", name, labels)
        expected = {"enforce": [["Deny"]], "warn": [["Warn"]], "audit": [["Audit"]], "off": []}[mode]
        assert [b["spec"]["validationActions"] for b in matching] == expected, (name, labels)
    # priority warns everywhere it is on: no MAP carries it, and the output says so per region.
    assert "priority" not in [rule for obj in _maps(compiled.objects) for rule in _carried(obj)]
    named = [g.what for g in compiled.gaps if g.rule == "priority"]
    assert any("warn mode in every other namespace" in what for what in named)
    assert any("audit mode in namespaces team-a, team-b" in what for what in named)


def test_a_disabled_policy_compiles_to_nothing_and_says_so() -> None:
    compiled = compile_policy(parse_policy("enabled: false"))
    assert compiled.objects == []
    assert [g.rule for g in compiled.gaps] == ["all"]


def _maps(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == "MutatingAdmissionPolicy"]


def _carried(obj: dict[str, Any]) -> list[str]:
    """The rules a MAP applies, as it names them."""
    return str(obj["metadata"]["annotations"][RULES_ANNOTATION]).split(",")


def test_a_class_the_policy_does_not_value_leaves_the_priority_rule_to_the_webhook() -> None:
    compiled = compile_policy(parse_policy("rules: {priority: {className: elsewhere}}"))
    assert [_carried(obj) for obj in _maps(compiled.objects)] == [
        ["readinessTolerations", "podFailurePolicy", "gracefulTermination", "driverCompatibility"]
    ]
    assert any("not in the policy's priorityClasses" in g.what for g in compiled.gaps)


def test_every_policy_is_bound_and_every_binding_names_a_policy() -> None:
    compiled = compile_policy(default_policy())
    policies = {o["metadata"]["name"] for o in compiled.objects if not o["kind"].endswith("Binding")}
    bound = {o["spec"]["policyName"] for o in compiled.objects if o["kind"].endswith("Binding")}
    assert policies == bound
    assert {g.rule for g in compiled.gaps} >= {"driverCompatibility", "acceleratorNodeGuard"}


def test_literals_are_cel() -> None:
    assert literal({"a": [1, "x\n'\""], "b": True}) == '{"a": dyn([1, "x\\n\'\\""]), "b": dyn(true)}'


GLOBS = ["nvidia.com/mig-*", "café_*", "*/gpu", "a?c", "[ab]x", "[!ab]x", "x[", "gpu.intel.com/*", "*tpu*"]
NAMES = [
    "nvidia.com/mig-1g",
    "vendor/gpu",
    "abc",
    "ax",
    "cx",
    "x[",
    "gpu.intel.com/i915",
    "google.com/tpu",
    "a.c/x",
]


@pytest.mark.parametrize(("glob", "name"), list(itertools.product(GLOBS, NAMES)))
def test_globs_translate_as_fnmatch_reads_them(glob: str, name: str) -> None:
    assert bool(re.fullmatch(glob_regex(glob), name)) == fnmatch.fnmatchcase(name, glob)


@pytest.mark.parametrize(
    "image",
    [
        "nvcr.io/nvidia/k8s-device-plugin:v0.17.0",
        "busybox",
        "rocm/k8s-device-plugin",
        "localhost:5000/x/y@sha256:" + "a" * 64,
        "Nvcr.io/nvidia/x",
        "nvcr.io/Nvidia/x",
        "x::1",
        "",
        " busybox",
        "a/b:" + "t" * 129,
    ],
)
def test_the_reference_grammar_is_the_parsers(image: str) -> None:
    assert bool(re.fullmatch(REFERENCE, image)) == (images.parse(image) is not None)


def test_host_path_patterns_are_matched_component_by_component() -> None:
    for pattern in default_policy().rules.trustedDeviceSoftware.hostPaths:
        parts = hostpaths.components(pattern) or ()
        for glob in parts:
            assert re.fullmatch(glob_regex(glob), glob.replace("*", "0"))


def test_compile_prints_the_objects_and_what_is_left(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "compile"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# policy ")
    assert "# driverCompatibility" in out
    assert out.count("\n---\n") + out.startswith("---") >= 8


@pytest.mark.parametrize("choice", ["Ignore", "Fail"])
def test_compile_makes_every_policy_fail_as_the_operator_chooses(
    capsys: pytest.CaptureFixture[str], choice: str
) -> None:
    assert main(["policy", "compile", "--failure-policy", choice, "-o", "json"]) == 0
    objects = json.loads(capsys.readouterr().out)["items"]
    policies = [o for o in objects if not o["kind"].endswith("Binding")]
    assert {o["kind"] for o in policies} == {"MutatingAdmissionPolicy", "ValidatingAdmissionPolicy"}
    assert {o["spec"]["failurePolicy"] for o in policies} == {choice}


def test_compile_leaves_out_the_namespace_gpuguard_is_installed_in(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["policy", "compile", "--namespace", "gpu-system", "-o", "json"]) == 0
    bindings = [o for o in json.loads(capsys.readouterr().out)["items"] if o["kind"].endswith("Binding")]
    assert bindings
    assert all(
        "gpu-system" in b["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"][-1]["values"]
        for b in bindings
    )


@pytest.mark.parametrize(
    "text", [SELECTORS_POLICY, "", "rules: {podFailurePolicy: {onFailureJobs: convert}}"]
)
def test_every_variable_is_defined_before_it_is_read(text: str) -> None:
    for obj in compile_policy(parse_policy(text)).objects:
        spec = obj["spec"]
        defined: list[str] = []
        for variable in spec.get("variables", []):
            assert set(re.findall(r"variables\.(\w+)", variable["expression"])) <= set(defined), variable
            defined.append(variable["name"])
        later = [m["jsonPatch"]["expression"] for m in spec.get("mutations", [])] + [
            v[key] for v in spec.get("validations", []) for key in ("expression", "messageExpression")
        ]
        for expression in later:
            assert set(re.findall(r"variables\.(\w+)", expression)) <= set(defined), expression


def test_compile_says_what_is_lost_when_the_policy_runs_no_webhook(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    policy = tmp_path / "native.yaml"
    policy.write_text("admission: {mode: native}\n")
    assert main(["policy", "compile", "--policy", str(policy)]) == 0
    out = capsys.readouterr().out
    assert "is lost: admission.mode is native, no webhook runs" in out
    assert "LOST (ADMISSION.MODE NATIVE)" in out and "LEFT TO THE WEBHOOK" not in out
    assert "narrows gpuguard's webhooks to match nothing" in out


def test_compile_says_what_reaches_the_webhooks_in_hybrid(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    policy = tmp_path / "hybrid.yaml"
    policy.write_text("admission: {mode: hybrid}\n")
    assert main(["policy", "compile", "--policy", str(policy)]) == 0
    comments = [line for line in capsys.readouterr().out.splitlines() if line.startswith("#")]
    called = comments[comments.index("# The controllers' leader narrows gpuguard's webhooks to:") :]
    assert "#   ValidatingWebhookConfiguration:" in called
    assert "#     pods naming a node (whether it is an accelerator node is a cluster fact)" in called


def test_objects_made_from_a_group_template_are_left_to_their_owner() -> None:
    """engine._mutation_skip_reason: a JobSet's Jobs, a LeaderWorkerSet's StatefulSets, ... pass by."""
    policy = default_policy()
    owners = [kind.kind for kind in policy.workload_kinds.kinds if not kind.core]
    maps = [o for o in compile_policy(policy).objects if o["kind"] == "MutatingAdmissionPolicy"]
    assert maps and "JobSet" in owners and "LeaderWorkerSet" in owners
    for obj in maps:
        (condition,) = obj["spec"]["matchConditions"]
        assert all(f'"{owner}"' in condition["expression"] for owner in owners)


@pytest.mark.parametrize("text", [SELECTORS_POLICY, "", "admission: {mode: hybrid}"])
def test_match_conditions_read_no_variables(text: str) -> None:
    """The API server refuses `variables` in a match condition; a MAP's conditions bind what they read."""
    for obj in compile_policy(parse_policy(text)).objects:
        for condition in obj["spec"].get("matchConditions", []):
            assert "variables." not in condition["expression"], (obj["metadata"]["name"], condition["name"])


def test_the_mutating_rules_share_one_policy_that_matches_only_accelerator_workloads_some_rule_changes() -> (
    None
):
    """Each mutation the API server runs costs it an encode, a patch, a decode and a reinvocation, even an
    empty one: the rules bound alike share one MAP and one mutation, and its one condition holds back
    what every rule leaves as it is, each rule's edits tested last within its own part."""
    compiled = compile_policy(default_policy())
    (obj,) = _maps(compiled.objects)
    assert _carried(obj) == list(MUTATING_RULES)
    assert [
        b["spec"]["policyName"] for b in compiled.objects if b["kind"] == "MutatingAdmissionPolicyBinding"
    ] == [obj["metadata"]["name"]]
    assert len(obj["spec"]["mutations"]) == 1
    (condition,) = obj["spec"]["matchConditions"]
    assert condition["name"] == "changes-an-accelerator-workload"
    for rule in MUTATING_RULES:
        assert f"size(bound_{rule}_edits) > 0)" in condition["expression"], rule
    assert condition["expression"].endswith("size(bound_driverCompatibility_edits) > 0" + ")" * 9)


def test_rules_bound_to_different_namespaces_get_a_policy_each() -> None:
    """SELECTORS_POLICY turns readinessTolerations off where the batch selector matches and leaves priority
    to warn: one MAP for the rules enforced everywhere else, one for readinessTolerations, no rule twice."""
    policy = parse_policy(SELECTORS_POLICY)
    objects = compile_policy(policy).objects
    carried = {obj["metadata"]["name"]: _carried(obj) for obj in _maps(objects)}
    assert carried == {
        "gpuguard-mutations": ["readinessTolerations"],
        "gpuguard-mutations-2": ["podFailurePolicy", "gracefulTermination", "driverCompatibility"],
    }
    bindings = [o for o in objects if o["kind"] == "MutatingAdmissionPolicyBinding"]
    for name, labels in NAMESPACES:
        if name == "kube-system":
            continue
        applied = [
            rule
            for b in bindings
            if _selects(b["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"], name, labels)
            for rule in carried[b["spec"]["policyName"]]
        ]
        assert applied == [r for r in MUTATING_RULES if policy.mode_for(r, name, labels) == "enforce"], (
            name,
            labels,
        )


def test_in_hybrid_each_rule_stands_aside_alone_where_the_webhook_decides_it() -> None:
    """A request left to the webhook for one rule (a Job it treats as a gang) is still mutated natively by
    the others: the stand-aside guards that rule's edits and its part of the condition, not the policy."""
    policy = parse_policy("admission: {mode: hybrid}")
    (obj,) = _maps(compile_policy(policy).objects)
    (condition,) = obj["spec"]["matchConditions"]
    edits = {v["name"]: v["expression"] for v in obj["spec"]["variables"]}
    guards = {}
    for rule in MUTATING_RULES:
        aside = nativegaps.stand_aside(nativegaps.mutating(policy), rule)
        assert aside is not None, rule  # the default policy counts DRA claims, which each rule leaves
        guards[rule] = f"(!({aside}))"
        assert guards[rule] in edits[f"{rule}_edits"] and guards[rule] in condition["expression"], rule
    assert guards["priority"] not in edits["readinessTolerations_edits"]
