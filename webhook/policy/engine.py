"""The pure policy engine: plain dicts and a policy in, a mutated copy and decisions out.

`mutate` and `validate` never touch the network, the clock or a framework, so the server, the CLI and
the tests all run the very same code. The caller builds the JSON Patch from `original` and `obj`.

The rules together converge: run on their own output, they change nothing (the API server may call
again after any mutation). The tests prove it, over generated workloads, the examples and the corpus
(tests/unit/test_properties.py, tests/unit/test_hot_path.py); re-running every rule on each request to
check it again cost a third of the engine's time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from webhook.policy.facts import NO_FACTS, ClusterFacts
from webhook.policy.fields import FieldTree, Subtree
from webhook.policy.model import Mode, Policy, RuleId
from webhook.policy.rules import MUTATORS, VALIDATORS, Report
from webhook.policy.workload import JSON, Workload, accelerator_requests, as_dict, locate

RULES_ANNOTATION = "gpuguard.io/rules"
POLICY_ANNOTATION = "gpuguard.io/policy"

Outcome = Literal["applied", "would-apply", "denied", "would-deny", "notice"]
OUTCOME_FOR_MODE: dict[tuple[bool, Mode], Outcome] = {
    (False, "enforce"): "applied",
    (False, "warn"): "would-apply",
    (False, "audit"): "would-apply",
    (True, "enforce"): "denied",
    (True, "warn"): "would-deny",
    (True, "audit"): "would-deny",
}


@dataclass(frozen=True)
class Decision:
    rule: RuleId
    mode: Mode
    outcome: Outcome
    message: str


@dataclass(frozen=True)
class Result:
    original: Any
    obj: Any
    decisions: tuple[Decision, ...] = ()
    skipped: str | None = None

    @property
    def changed(self) -> bool:
        return self.obj is not self.original

    @property
    def applied_rules(self) -> list[RuleId]:
        return list(dict.fromkeys(d.rule for d in self.decisions if d.outcome == "applied"))

    @property
    def denials(self) -> list[str]:
        return [d.message for d in self.decisions if d.outcome == "denied"]

    @property
    def denied(self) -> list[Decision]:
        return [d for d in self.decisions if d.outcome == "denied"]


def clone(value: Any) -> Any:
    """A deep copy of JSON data, several times faster than copy.deepcopy (no call per scalar)."""
    if type(value) is dict:
        return {key: clone(item) if type(item) in _CONTAINERS else item for key, item in value.items()}
    if type(value) is list:
        return [clone(item) if type(item) in _CONTAINERS else item for item in value]
    return value


_CONTAINERS = (dict, list)


# Every field a rule writes, as a tree (webhook.policy.fields): `mutate` copies these parts and shares the
# rest of the object with the original, so the differ, which skips what both share, walks only them. A
# rule writing anywhere else would edit the caller's object: tests/unit/test_hot_path.py records every
# write the rules make and fails on one outside this tree.
_CONTAINER_WRITES: FieldTree = {"lifecycle": None}
_POD_SPEC_WRITES: FieldTree = {
    "containers": (_CONTAINER_WRITES,),
    "initContainers": (_CONTAINER_WRITES,),
    "restartPolicy": None,
    "tolerations": None,
    "terminationGracePeriodSeconds": None,
    "priorityClassName": None,
    "priority": None,
    "preemptionPolicy": None,
    "affinity": None,
}
_JOB_SPEC_WRITES: FieldTree = {
    "podFailurePolicy": None,
    "podReplacementPolicy": None,
    "template": {"spec": _POD_SPEC_WRITES},
}
WRITTEN_FIELDS: FieldTree = {
    "metadata": {"annotations": None},
    "spec": _POD_SPEC_WRITES | _JOB_SPEC_WRITES | {"jobTemplate": {"spec": _JOB_SPEC_WRITES}},
}


def copy_written(value: Any, fields: Subtree = WRITTEN_FIELDS) -> Any:
    """`value` with what `fields` names copied (wholly where the tree keeps a value whole), the rest shared."""
    if fields is None:
        return clone(value)
    if type(fields) is tuple:
        return [copy_written(item, fields[0]) for item in value] if type(value) is list else value
    if type(value) is not dict:
        return value
    assert isinstance(fields, dict)
    copied = dict(value)
    for key, below in fields.items():
        item = copied.get(key)
        if type(item) in _CONTAINERS:  # scalars are shared as they are: nothing edits one in place
            copied[key] = copy_written(item, below)
    return copied


def _mutation_skip_reason(
    workload: Workload | None, policy: Policy, operation: str, facts: ClusterFacts
) -> str | None:
    if not policy.enabled:
        return "policy disabled"
    if operation != "CREATE":
        return f"{operation} is never mutated"
    if workload is None:
        return "kind not handled"
    if workload.is_pod:
        owner = workload.controller_kind()
        if owner == "DaemonSet":
            return "DaemonSet pod"
        if owner == "Job":
            return "pod of a Job: handled through the Job's template"
        if workload.is_mirror_pod():
            return "mirror pod"
    if not accelerator_requests(workload, policy.accelerators, facts):
        return "not an accelerator workload"
    return None


def _decisions(rule: RuleId, mode: Mode, report: Report, *, denial: bool) -> list[Decision]:
    outcome = OUTCOME_FOR_MODE[(denial, mode)]
    return [Decision(rule, mode, outcome, change) for change in report.changes] + [
        Decision(rule, mode, "notice", notice) for notice in report.notices
    ]


def _mark(obj: JSON, applied: list[RuleId], policy: Policy) -> None:
    """Names the rules applied and the policy's hash, cumulatively, so reinvocation converges."""
    metadata = obj.setdefault("metadata", {})
    if not isinstance(metadata, dict):
        return
    annotations = as_dict(metadata.get("annotations"))
    if annotations is None:
        annotations = metadata["annotations"] = {}
    previous = str(annotations.get(RULES_ANNOTATION, "")).split(",")
    annotations[RULES_ANNOTATION] = ",".join(r for r in MUTATORS if r in applied or r in previous)
    annotations[POLICY_ANNOTATION] = policy.hash


def mutate(
    obj: Any,
    policy: Policy,
    *,
    namespace: str | None = None,
    operation: str = "CREATE",
    group: str | None = None,
    kind: str | None = None,
    facts: ClusterFacts | None = None,
) -> Result:
    facts = facts or NO_FACTS
    workload = locate(obj, group=group, kind=kind, namespace=namespace) if isinstance(obj, dict) else None
    skipped = _mutation_skip_reason(workload, policy, operation, facts)
    if skipped is not None or workload is None:
        return Result(obj, obj, skipped=skipped)

    working = copy_written(obj)
    view = locate(working, group=workload.group, kind=workload.kind, namespace=workload.namespace)
    assert view is not None  # the clone has the same shape as the object that located
    modes = policy.modes_for(workload.namespace, facts.labels_of(workload.namespace))
    decisions: list[Decision] = []
    applied: list[RuleId] = []
    for rule, mutator in MUTATORS.items():
        mode = modes[rule]
        if mode == "off":
            continue
        if mode == "enforce":
            report = mutator(view, policy, facts)
            if report.changes:
                applied.append(rule)
        else:
            # Dry-run modes compute the change on a scratch copy and keep only the description.
            scratch = locate(
                copy_written(working), group=workload.group, kind=workload.kind, namespace=workload.namespace
            )
            assert scratch is not None
            report = mutator(scratch, policy, facts)
        decisions += _decisions(rule, mode, report, denial=False)

    if not applied:
        return Result(obj, obj, tuple(decisions))
    _mark(working, applied, policy)
    return Result(obj, working, tuple(decisions))


def validate(
    obj: Any,
    policy: Policy,
    *,
    namespace: str | None = None,
    operation: str = "CREATE",
    group: str | None = None,
    kind: str | None = None,
    old: Any = None,
    facts: ClusterFacts | None = None,
) -> Result:
    """Every validating rule on `obj`; on UPDATE each rule sees `old` too, to deny only what changed."""
    facts = facts or NO_FACTS
    workload = (
        locate(obj, group=group, kind=kind, namespace=namespace, daemonsets=True)
        if isinstance(obj, dict)
        else None
    )
    if operation not in ("CREATE", "UPDATE") or workload is None:
        return Result(obj, obj, skipped="nothing to validate")
    previous = None
    if operation == "UPDATE" and isinstance(old, dict):
        previous = locate(
            old, group=workload.group, kind=workload.kind, namespace=workload.namespace, daemonsets=True
        )
    modes = policy.modes_for(workload.namespace, facts.labels_of(workload.namespace))
    decisions: list[Decision] = []
    for rule, validator in VALIDATORS.items():
        mode = modes[rule]
        if mode != "off":
            decisions += _decisions(rule, mode, validator(workload, previous, policy, facts), denial=True)
    return Result(obj, obj, tuple(decisions))
