"""The pure policy engine: plain dicts and a policy in, a mutated copy and decisions out.

`mutate` and `validate` never touch the network, the clock or a framework, so the server, the CLI and
the tests all run the very same code. The caller builds the JSON Patch from `original` and `obj`.

The rules together converge: run on their own output, they change nothing (the API server may call
again after any mutation). The tests prove it, over generated workloads, the examples and the corpus
(tests/unit/policy/test_properties.py, tests/unit/admission/test_hot_path.py); re-running every rule on each request to
check it again cost a third of the engine's time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from webhook.policy.facts import NO_FACTS, ClusterFacts
from webhook.policy.fields import FieldTree, Subtree
from webhook.policy.gangs import GROUP_MUTATORS
from webhook.policy.kinds import WorkloadKind
from webhook.policy.model import Mode, Policy, RuleId
from webhook.policy.rules import MUTATORS, VALIDATORS, Report
from webhook.policy.workload import JSON, Workload, accelerator_requests, as_dict, locate_all

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
# rule writing anywhere else would edit the caller's object: tests/unit/admission/test_hot_path.py records every
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


def copy_for_rules(obj: JSON, kind: WorkloadKind) -> JSON:
    """A copy the rules may edit: of the written fields for core kinds, of everything for the others
    (custom resources are rare at admission and hold their templates anywhere)."""
    result: JSON = copy_written(obj) if kind.core else clone(obj)
    return result


def _mutation_skip_reason(views: list[Workload], policy: Policy, operation: str) -> str | None:
    """Why the object is left alone whatever its templates ask for; None: it is mutated if one of them
    asks for an accelerator (which `mutate` finds out once, as it needs to know which)."""
    if not policy.enabled:
        return "policy disabled"
    if operation != "CREATE":
        return f"{operation} is never mutated"
    if not views:
        return "kind not handled"
    workload = views[0]
    owner = workload.controller_kind()
    if workload.is_pod:
        if owner == "DaemonSet":
            return "DaemonSet pod"
        if owner == "Job":
            return "pod of a Job: handled through the Job's template"
        if workload.is_mirror_pod():
            return "mirror pod"
    elif policy.workload_kinds.owns_templates_of(owner):
        # A second pass would add rules contradicting those its owner's template was given (a gang's
        # FailJob next to a lone pod's Ignore).
        return f"made from its {owner}'s template: handled there"
    return None


def _decisions(rule: RuleId, mode: Mode, report: Report, *, denial: bool, label: str = "") -> list[Decision]:
    outcome = OUTCOME_FOR_MODE[(denial, mode)]
    prefix = f"{label}: " if label else ""
    return [Decision(rule, mode, outcome, prefix + change) for change in report.changes] + [
        Decision(rule, mode, "notice", prefix + notice) for notice in report.notices
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


def _accelerator_views(obj: JSON, like: Workload, policy: Policy, wanted: list[int]) -> list[Workload]:
    """The views of `obj` (a copy of the located object) at the positions `wanted`."""
    views = locate_all(
        obj, group=like.group, kind=like.kind, namespace=like.namespace, kinds=policy.workload_kinds
    )
    return [views[index] for index in wanted]


def _run(
    rule: RuleId, views: list[Workload], policy: Policy, facts: ClusterFacts
) -> list[tuple[str, Report]]:
    """The rule on each template, then on the object as a whole; each report with its template's label."""
    reports = [(view.label, MUTATORS[rule](view, policy, facts)) for view in views]
    group = GROUP_MUTATORS.get(rule)
    if group is not None:
        reports.append(("", group(views, policy, facts)))
    return reports


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
    views = (
        locate_all(obj, group=group, kind=kind, namespace=namespace, kinds=policy.workload_kinds)
        if isinstance(obj, dict)
        else []
    )
    skipped = _mutation_skip_reason(views, policy, operation)
    # Templates that ask for no accelerator (a CPU launcher or Ray head) are left as they are.
    wanted = (
        []
        if skipped is not None
        else [i for i, view in enumerate(views) if accelerator_requests(view, policy.accelerators, facts)]
    )
    if skipped is None and not wanted:
        skipped = "not an accelerator workload"
    if skipped is not None:
        return Result(obj, obj, skipped=skipped)

    first = views[0]
    working = copy_for_rules(obj, first.workload_kind)
    located = _accelerator_views(working, first, policy, wanted)
    modes = policy.modes_for(first.namespace, facts.labels_of(first.namespace))
    decisions: list[Decision] = []
    applied: list[RuleId] = []
    for rule in MUTATORS:
        mode = modes[rule]
        if mode == "off":
            continue
        if mode == "enforce":
            reports = _run(rule, located, policy, facts)
            if any(report.changes for _, report in reports):
                applied.append(rule)
        else:
            # Dry-run modes compute the change on a scratch copy and keep only the description.
            scratch = copy_for_rules(working, first.workload_kind)
            reports = _run(rule, _accelerator_views(scratch, first, policy, wanted), policy, facts)
        for label, report in reports:
            decisions += _decisions(rule, mode, report, denial=False, label=label)

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
    """Every validating rule on each of `obj`'s templates; on UPDATE each rule sees the same template
    of `old` too, to deny only what changed."""
    facts = facts or NO_FACTS
    kinds = policy.workload_kinds
    views = (
        locate_all(obj, group=group, kind=kind, namespace=namespace, daemonsets=True, kinds=kinds)
        if isinstance(obj, dict)
        else []
    )
    if operation not in ("CREATE", "UPDATE") or not views:
        return Result(obj, obj, skipped="nothing to validate")
    first = views[0]
    previous: dict[str, Workload] = {}
    if operation == "UPDATE" and isinstance(old, dict):
        before = locate_all(
            old, group=first.group, kind=first.kind, namespace=first.namespace, daemonsets=True, kinds=kinds
        )
        previous = {view.label: view for view in before}
    modes = policy.modes_for(first.namespace, facts.labels_of(first.namespace))
    decisions: list[Decision] = []
    for rule, validator in VALIDATORS.items():
        mode = modes[rule]
        if mode == "off":
            continue
        for view in views:
            report = validator(view, previous.get(view.label), policy, facts)
            decisions += _decisions(rule, mode, report, denial=True, label=view.label)
    return Result(obj, obj, tuple(decisions))
