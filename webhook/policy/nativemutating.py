"""The mutating rules as a MutatingAdmissionPolicy: each rule's edits worked out in variables of its own,
all applied as one JSON Patch with the marks the webhook writes (`gpuguard.io/rules`, the policy hash)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from webhook.policy.engine import POLICY_ANNOTATION, RULES_ANNOTATION
from webhook.policy.model import MUTATING_RULES, Policy, RuleId
from webhook.policy.nativecel import (
    API_VERSION,
    EMPTY,
    EQUAL,
    JOB,
    JOB_PATH,
    MANAGED_BY,
    SPEC,
    SPEC_PATH,
    TEMPLATE_RESOURCES,
    Cel,
    all_of,
    cel_map,
    controlled_by,
    field_or,
    literal,
    mirror,
    pointer,
    resource_rules,
)
from webhook.policy.rules import (
    DEFAULT_GRACE_PERIOD_SECONDS,
    MAX_POD_FAILURE_POLICY_RULES,
    READINESS_TAINT_KEYS,
)
from webhook.policy.workload import JSON


def _marks(applied: str, policy: Policy) -> str:
    """The JSON Patches that add the rules `applied` (CEL: a list of rule ids) to gpuguard.io/rules, in
    the webhook's order, and write the policy's hash, as engine._mark writes them."""
    annotations = "object.metadata.annotations"
    previous = (
        f"(has({annotations}) && {literal(RULES_ANNOTATION)} in {annotations} ?"
        f" {annotations}[{literal(RULES_ANNOTATION)}].split(',') : [])"
    )
    named = f"{literal(list(MUTATING_RULES))}.filter(r, r in {applied} || r in {previous}).join(',')"
    base = "/metadata/annotations/"
    return (
        f"(has({annotations}) ? [] : [JSONPatch{{op: 'add', path: '/metadata/annotations', value: {{}}}}]) + ["
        f"JSONPatch{{op: 'add', path: {literal(base + pointer(RULES_ANNOTATION))}, value: {named}}}, "
        f"JSONPatch{{op: 'add', path: {literal(base + pointer(POLICY_ANNOTATION))},"
        f" value: {literal(policy.hash)}}}]"
    )


def _closing(text: str, start: int) -> int:
    """The index of the brace closing the one at `start`, CEL string literals skipped."""
    depth, i = 0, start
    while i < len(text):
        char = text[i]
        if char in "'\"":
            i += 1
            while text[i] != char:
                i += 2 if text[i] == "\\" else 1
        elif char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise ValueError(f"unbalanced braces in {text!r}")


def _as_data(expression: str) -> str:
    """`expression` with each JSONPatch{op, path, value} written as a plain map: only a mutation may
    build JSONPatch values, and the edits are worked out in variables (`_as_patches` turns them back)."""
    start = expression.find("JSONPatch{")
    while start >= 0:
        end = _closing(expression, start + len("JSONPatch"))
        body = _as_data(expression[start + len("JSONPatch{") : end])
        op, _, rest = body.partition(", path: ")
        path, found, value = rest.partition(", value: ")
        entries = f"'op': dyn({op.removeprefix('op: ')}), 'path': dyn({path})" + (
            f", 'value': dyn({value})" if found else ""
        )
        expression = expression[:start] + "{" + entries + "}" + expression[end + 1 :]
        start = expression.find("JSONPatch{", start + 1)
    return expression


# The one mutation of every policy: the edits its variables worked out, as JSON Patch operations.
_AS_PATCHES = (
    "variables.changes.map(p, 'value' in p ? JSONPatch{op: p.op, path: p.path, value: p.value} :"
    " JSONPatch{op: p.op, path: p.path})"
)


@dataclass(frozen=True)
class RuleMutation:
    """One mutating rule's part of a MAP: its variables, the last named `edits`, reading the shared `spec`
    and `path`; `guards`, CEL on the request alone that must hold for the rule to apply (its kinds, a
    cheap test of its own, in hybrid not being left to the webhook), tested before its variables."""

    rule: RuleId
    variables: list[JSON]
    pods: bool = True
    guards: tuple[str, ...] = ()

    def guarded(self, *guards: str) -> RuleMutation:
        return replace(self, guards=(*self.guards, *guards))


# The pod spec and its JSON Pointer, read by most rules: one variable each, evaluated once per mutation.
SHARED: list[JSON] = [{"name": "spec", "expression": SPEC}, {"name": "path", "expression": SPEC_PATH}]


def _own_name(rule: RuleId, name: str) -> str:
    return f"{rule}_{name}"


def _own_variables(part: RuleMutation) -> list[JSON]:
    """The rule's variables under names of its own (`<rule>_<name>`), its reads of them renamed alike,
    so that rules sharing a policy do not read each other's, and written as data (`_as_data`)."""
    names = {v["name"] for v in part.variables}

    def rename(expression: str) -> str:
        return re.sub(
            r"\bvariables\.(\w+)",
            lambda m: f"variables.{_own_name(part.rule, m[1])}" if m[1] in names else m[0],
            expression,
        )

    return [
        {"name": _own_name(part.rule, v["name"]), "expression": _as_data(rename(v["expression"]))}
        for v in part.variables
    ]


def _reads(expressions: Sequence[str], variable: JSON) -> bool:
    return any(re.search(rf"\bvariables\.{variable['name']}\b", e) for e in expressions)


def mutating_policy(name: str, parts: Sequence[RuleMutation], policy: Policy, cel: Cel) -> JSON:
    """One MAP applying the rules of `parts` (rules bound alike, in the webhook's order) in one mutation.
    The API server encodes, patches, decodes and defaults the object for every mutation it runs, even one
    that patches nothing, and then runs every mutating plugin again: the rules share one mutation, and the
    policy matches only what some rule still changes (in the reinvocation too). Each rule sees the object
    as it came, as each sees it in the webhook (no rule edits what another reads); its guards keep it off
    what it must not touch while the others apply."""
    pods = any(part.pods for part in parts)
    groups = {"": ["pods"], **TEMPLATE_RESOURCES} if pods else {"batch": TEMPLATE_RESOURCES["batch"]}
    own = [(part, _own_variables(part)) for part in parts]
    edits = {part.rule: f"variables.{_own_name(part.rule, 'edits')}" for part in parts}
    read = [v["expression"] for _, variables in own for v in variables]
    shared = [v for v in SHARED if _reads(read, v)]
    variables = list(shared)
    for part, rule_variables in own:
        *worked_out, last = rule_variables
        guarded = (
            f"{all_of(part.guards)} ? ({last['expression']}) : []" if part.guards else last["expression"]
        )
        variables += [*worked_out, {**last, "expression": guarded}]
    applied = " + ".join(f"(size({e}) > 0 ? [{literal(rule)}] : [])" for rule, e in edits.items())
    variables += [
        {"name": "applied", "expression": applied},
        {
            "name": "changes",
            "expression": _as_data(" + ".join([*edits.values(), _marks("variables.applied", policy)])),
        },
    ]
    # A rule's guards before its variables: a rule's variables may fail on what its guards keep out (a
    # Job's fields on a pod), and a match condition binds them all at once.
    changes_some = " || ".join(
        f"({all_of([*part.guards, _bound(rule_variables, f'size({edits[part.rule]}) > 0')])})"
        for part, rule_variables in own
    )
    tests = [
        *_not_skipped(policy, pods),
        f"[{SPEC}].exists(s, {cel.accelerator_workload('s')})",
        _bound(shared, changes_some),
    ]
    return {
        "apiVersion": API_VERSION,
        "kind": "MutatingAdmissionPolicy",
        "metadata": {
            "name": name,
            "labels": dict(MANAGED_BY),
            "annotations": {RULES_ANNOTATION: ",".join(part.rule for part in parts)},
        },
        "spec": {
            # As deploy/'s mutating webhook: a policy that cannot evaluate admits the workload unmutated.
            "failurePolicy": "Ignore",
            # Every mutation recognises its own work, so running again after a later mutation is safe,
            # and needed when that mutation adds what a rule looks at.
            "reinvocationPolicy": "IfNeeded",
            "matchConstraints": {"resourceRules": resource_rules(groups, ["CREATE"])},
            "matchConditions": [{"name": CHANGES_AN_ACCELERATOR_WORKLOAD, "expression": all_of(tests)}],
            "variables": variables,
            "mutations": [{"patchType": "JSONPatch", "jsonPatch": {"expression": _AS_PATCHES}}],
        },
    }


CHANGES_AN_ACCELERATOR_WORKLOAD = "changes-an-accelerator-workload"
_BOUND = "bound_"  # a variable's name in a match condition, where `variables` is undeclared


def _bound(variables: list[JSON], expression: str) -> str:
    """`expression` with the variables it reads bound in turn, for a match condition (which sees no
    `variables`): a one-element comprehension evaluates each once, as the API server evaluates a
    variable, where writing each out wherever it is read would evaluate it again every time."""
    for variable in reversed(variables):
        expression = f"[{variable['expression']}].all({_BOUND}{variable['name']}, {expression})"
    return re.sub(r"\bvariables\.(\w+)", rf"{_BOUND}\1", expression)


def _not_skipped(policy: Policy, pods: bool) -> list[str]:
    """engine._mutation_skip_reason: DaemonSet, Job and mirror pods pass by, and objects made from the
    template of a kind gpuguard mutates whole."""
    tests = []
    if pods:
        tests.append(
            f"request.kind.kind != 'Pod' || !({controlled_by('object', ['DaemonSet', 'Job'])} || {mirror('object')})"
        )
    # A JobSet's Jobs, a LeaderWorkerSet's StatefulSets: made from templates mutated with their owner
    # (kinds.Registry.owns_templates_of; the webhook alone handles those owners' kinds).
    owners = [kind.kind for kind in policy.workload_kinds.kinds if not kind.core]
    tests.append(f"request.kind.kind == 'Pod' || !{controlled_by('object', owners)}")
    return tests


def _tolerates(toleration: str, key: str) -> str:
    """rules._tolerates_readiness_taint."""
    t = toleration
    return (
        f"({field_or(t, 'effect', EMPTY)} in ['', 'NoExecute'] && {field_or(t, 'key', EMPTY)} in ['', {literal(key)}]"
        f" && ({field_or(t, 'operator', EQUAL)} == 'Exists' || ({field_or(t, 'operator', EQUAL)} == 'Equal'"
        f" && {field_or(t, 'value', EMPTY)} == '')))"
    )


def readiness_tolerations(policy: Policy) -> RuleMutation:
    rule = policy.rules.readinessTolerations
    default = rule.apiServerDefaultSeconds
    variables = [
        {
            "name": "batch",
            "expression": "request.kind.kind == 'Pod' ? "
            + field_or("variables.spec", "restartPolicy", "'Always'")
            + " != 'Always' : request.kind.kind in ['Job', 'CronJob']",
        },
        {
            "name": "seconds",
            "expression": f"variables.batch ? {rule.batchSeconds} : {rule.servingSeconds}",
        },
        {"name": "tolerations", "expression": field_or("variables.spec", "tolerations", "[]")},
    ]
    replaced, appended = [], []
    for index, key in enumerate(READINESS_TAINT_KEYS):
        first = f"first{index}"
        variables.append(
            {
                "name": first,
                "expression": "lists.range(size(variables.tolerations)).filter(i,"
                f" {_tolerates('variables.tolerations[i]', key)})",
            }
        )
        found = f"variables.tolerations[variables.{first}[0]]"
        replaced.append(
            f"(size(variables.{first}) > 0 && has({found}.key) && {found}.key == {literal(key)} &&"
            f" has({found}.tolerationSeconds) && {found}.tolerationSeconds == {default} &&"
            f" variables.seconds != {default} ? [JSONPatch{{op: 'replace', path: variables.path +"
            f" '/tolerations/' + string(variables.{first}[0]) + '/tolerationSeconds',"
            f" value: variables.seconds}}] : [])"
        )
        entry = cel_map(
            {
                "key": literal(key),
                "operator": "'Exists'",
                "effect": "'NoExecute'",
                "tolerationSeconds": "variables.seconds",
            }
        )
        appended.append(f"(size(variables.{first}) == 0 ? [{entry}] : [])")
    variables.append({"name": "added", "expression": " + ".join(appended)})
    additions = (
        "(size(variables.added) == 0 ? [] : has(variables.spec.tolerations) ?"
        " variables.added.map(t, JSONPatch{op: 'add', path: variables.path + '/tolerations/-', value: t}) :"
        " [JSONPatch{op: 'add', path: variables.path + '/tolerations', value: variables.added}])"
    )
    variables.append({"name": "edits", "expression": " + ".join([*replaced, additions])})
    return RuleMutation("readinessTolerations", variables)


def pod_failure_policy(policy: Policy) -> RuleMutation:
    rule = policy.rules.podFailurePolicy
    job = "variables.job"
    spec = "variables.spec"
    variables: list[JSON] = [
        {"name": "job", "expression": JOB},
        {"name": "jobPath", "expression": JOB_PATH},
        {"name": "spec", "expression": f"{job}.template.spec"},
        {"name": "restartPolicy", "expression": field_or(spec, "restartPolicy", EMPTY)},
        {
            "name": "existing",
            "expression": f"has({job}.podFailurePolicy) && has({job}.podFailurePolicy.rules) ?"
            f" {job}.podFailurePolicy.rules : []",
        },
        # Codes an earlier `In` rule for all containers already catches (rules._covered_exit_codes).
        {
            "name": "covered",
            "expression": "variables.existing.filter(r, has(r.onExitCodes) && r.onExitCodes.operator == 'In' &&"
            " (!has(r.onExitCodes.containerName) || r.onExitCodes.containerName == '') &&"
            " has(r.onExitCodes.values)).map(r, r.onExitCodes.values).flatten()",
        },
    ]
    wanted: list[str] = []
    if rule.ignoreDisruptions:
        disruption = literal(
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
        )
        wanted.append(
            "(variables.existing.exists(r, has(r.onPodConditions) &&"
            f" r.onPodConditions.exists(p, p.type == 'DisruptionTarget')) ? [] : [{disruption}])"
        )
    device_action = literal(rule.deviceFailureAction)
    if rule.deviceFailureAction == "FailIndex":
        device_action = f"(has({job}.backoffLimitPerIndex) ? 'FailIndex' : 'Count')"
    for codes, action in (
        (rule.deviceFailureExitCodes, device_action),
        (rule.nonRetriableExitCodes, "'FailJob'"),
    ):
        if codes:
            values = f"{literal(list(codes))}.filter(c, !(c in variables.covered))"
            exit_codes = cel_map({"operator": "'In'", "values": values})
            wanted.append(
                f"(size({values}) == 0 ? [] : [{cel_map({'action': action, 'onExitCodes': exit_codes})}])"
            )
    variables.append({"name": "wanted", "expression": " + ".join(wanted) or "[]"})
    room = f"{MAX_POD_FAILURE_POLICY_RULES} - size(variables.existing)"
    variables.append(
        {
            "name": "added",
            "expression": f"{room} <= 0 ? [] : size(variables.wanted) <= {room} ? variables.wanted :"
            f" variables.wanted.slice(0, {room})",
        }
    )
    convert = rule.onFailureJobs == "convert"
    variables.append(
        {
            "name": "applies",
            "expression": "variables.restartPolicy == 'Never'"
            + (" || variables.restartPolicy == 'OnFailure'" if convert else ""),
        }
    )
    rules_path = "variables.jobPath + '/podFailurePolicy'"
    edits = (
        "!variables.applies ? [] : "
        + (
            "(variables.restartPolicy == 'OnFailure' ? [JSONPatch{op: 'replace', path: variables.jobPath +"
            " '/template/spec/restartPolicy', value: 'Never'}] : []) + "
            if convert
            else ""
        )
        + "(size(variables.added) == 0 ? [] : ("
        + f"!has({job}.podFailurePolicy) ? [JSONPatch{{op: 'add', path: {rules_path}, value: {{'rules': variables.added}}}}] :"
        + f" !has({job}.podFailurePolicy.rules) ? [JSONPatch{{op: 'add', path: {rules_path} + '/rules',"
        " value: variables.added}] :"
        + f" variables.added.map(r, JSONPatch{{op: 'add', path: {rules_path} + '/rules/-', value: r}}))"
        # With a podFailurePolicy only Failed is valid; the API server defaulted TerminatingOrFailed.
        + " + [JSONPatch{op: 'add', path: variables.jobPath + '/podReplacementPolicy', value: 'Failed'}])"
    )
    variables.append({"name": "edits", "expression": edits})
    # Its variables read a Job's fields, which a pod sharing the policy lacks.
    return RuleMutation(
        "podFailurePolicy", variables, pods=False, guards=("request.kind.kind in ['Job', 'CronJob']",)
    )


def graceful_termination(policy: Policy, cel: Cel) -> RuleMutation:
    rule = policy.rules.gracefulTermination
    pre_stop: JSON = (
        {"sleep": {"seconds": rule.preStop.seconds}}
        if rule.preStop.action == "sleep"
        else {"exec": {"command": list(rule.preStop.command)}}
    )
    spec = "variables.spec"
    edits = []
    for field, sidecars_only in (("containers", False), ("initContainers", True)):
        items = f"{field_or(spec, field, '[]')}"
        wanted = f"{items}[i]"
        condition = cel.uses_accelerators(wanted, spec)
        if sidecars_only:
            condition = f"{field_or(wanted, 'restartPolicy', EMPTY)} == 'Always' && {condition}"
        edits.append(
            f"lists.range(size({items})).filter(i, {condition} && !(has({wanted}.lifecycle) &&"
            f" has({wanted}.lifecycle.preStop))).map(i, has({wanted}.lifecycle) ?"
            f" JSONPatch{{op: 'add', path: variables.path + '/{field}/' + string(i) + '/lifecycle/preStop',"
            f" value: {literal(pre_stop)}}} :"
            f" JSONPatch{{op: 'add', path: variables.path + '/{field}/' + string(i) + '/lifecycle',"
            f" value: {literal({'preStop': pre_stop})}}})"
        )
    wanted_seconds = rule.grace_period_seconds
    current = field_or(spec, "terminationGracePeriodSeconds", str(DEFAULT_GRACE_PERIOD_SECONDS))
    edits.append(
        f"({current} < {wanted_seconds} ? [JSONPatch{{op: 'add', path: variables.path +"
        f" '/terminationGracePeriodSeconds', value: {wanted_seconds}}}] : [])"
    )
    return RuleMutation("gracefulTermination", [{"name": "edits", "expression": " + ".join(edits)}])


def priority(policy: Policy) -> RuleMutation:
    class_name = policy.rules.priority.className
    value = policy.priority_value(class_name)
    spec = "variables.spec"
    set_name = (
        f"JSONPatch{{op: 'add', path: variables.path + '/priorityClassName', value: {literal(class_name)}}}"
    )
    # On a pod the Priority plugin has already resolved spec.priority (0 without a class) and checks it
    # against the class again: the class's value travels with its name. Templates carry neither.
    pod = (
        f"[{set_name}, JSONPatch{{op: 'add', path: '/spec/priority', value: {value}}}]"
        if value is not None
        else "[]"
    )
    template = (
        f"[{set_name}]"
        f" + (has({spec}.priority) ? [JSONPatch{{op: 'remove', path: variables.path + '/priority'}}] : [])"
        f" + (has({spec}.preemptionPolicy) ? [JSONPatch{{op: 'remove', path: variables.path + '/preemptionPolicy'}}] : [])"
    )
    edits = (
        f"has({spec}.priorityClassName) && {spec}.priorityClassName != '' ? [] :"
        f" request.kind.kind == 'Pod' ? {pod} : {template}"
    )
    return RuleMutation("priority", [{"name": "edits", "expression": edits}])
