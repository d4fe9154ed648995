"""The policy compiled into the API server's own admission policies: MutatingAdmissionPolicies (MAP),
ValidatingAdmissionPolicies (VAP) and their bindings, as plain dicts.

Each rule, or the part of it CEL can decide from the object alone, becomes one policy; the namespace
modes become its bindings. What needs more (cluster facts, warnings from a mutation, the driver rule's
node-affinity merge) is named in `Compiled.gaps`, never dropped: those decisions stay the webhook's.

The expressions mirror webhook.policy.rules one to one and write what the webhook writes, the
`gpuguard.io/rules` and `gpuguard.io/policy` annotations included; tests/e2e/test_native.py proves
on a real API server that an object stored through these policies equals the one stored through the
webhook. Everything here is JSON Patch: the policies match several kinds at once, and an apply
configuration would need each kind's own type.
"""

from __future__ import annotations

import itertools
import json
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from webhook.policy import hostpaths
from webhook.policy.engine import POLICY_ANNOTATION, RULES_ANNOTATION
from webhook.policy.model import (
    MUTATING_RULES,
    SYSTEM_PRIORITY_PREFIX,
    LabelSelector,
    Mode,
    NamespaceOverride,
    Policy,
    RuleId,
)
from webhook.policy.rules import (
    DEFAULT_GRACE_PERIOD_SECONDS,
    MAX_POD_FAILURE_POLICY_RULES,
    READINESS_TAINT_KEYS,
)
from webhook.policy.workload import JSON, MIRROR_POD_ANNOTATION, SYSTEM_CRITICAL_PRIORITY

API_VERSION = "admissionregistration.k8s.io/v1"
NAME_LABEL = "kubernetes.io/metadata.name"
# The namespaces deploy/'s webhooks never see: the control plane's and gpuguard's own.
UNWATCHED_NAMESPACES = ("kube-system", "kube-node-lease", "gpuguard", "gpuguard-node")
MANAGED_BY = {"app.kubernetes.io/managed-by": "gpuguard"}
VALIDATION_ACTIONS: dict[Mode, list[str]] = {"enforce": ["Deny"], "warn": ["Warn"], "audit": ["Audit"]}

EMPTY, EQUAL, UNNAMED = "''", "'Equal'", "'?'"  # CEL strings, for defaults inside f-strings
Requirement = dict[str, Any]  # a label selector requirement: key, operator, values


@dataclass(frozen=True)
class Gap:
    """A decision the native policies leave to the webhook."""

    rule: str
    what: str


@dataclass(frozen=True)
class Compiled:
    objects: list[JSON]  # every policy, then its bindings
    gaps: list[Gap]


# --- CEL text -------------------------------------------------------------------------------------


def literal(value: Any) -> str:
    """`value` (JSON data) as a CEL literal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | str):
        return json.dumps(value)  # JSON's string escapes are CEL's
    if isinstance(value, list):
        return "[" + ", ".join(literal(item) for item in value) + "]"
    if isinstance(value, dict):
        return _map({str(k): literal(v) for k, v in value.items()})
    raise TypeError(f"no CEL literal for {value!r}")


def _map(entries: dict[str, str]) -> str:
    """A CEL map literal of CEL expressions. The API server checks literals for one element type, and
    dyn() lets a toleration hold strings and a number."""
    return "{" + ", ".join(f"{literal(k)}: dyn({v})" for k, v in entries.items()) + "}"


def glob_regex(pattern: str) -> str:
    """An fnmatch glob as an anchored RE2 expression (CEL's `matches`)."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        char = pattern[i]
        i += 1
        if char == "*":
            out.append(".*")
        elif char == "?":
            out.append(".")
        elif char == "[":
            end = pattern.find("]", i + 1 if pattern[i : i + 1] in ("!", "]") else i)
            if end < 0:
                out.append(r"\[")
                continue
            body = pattern[i:end].replace("\\", r"\\")
            i = end + 1
            out.append("[^" + body[1:] + "]" if body.startswith("!") else "[" + body + "]")
        else:
            out.append("\\" + char if char in string.punctuation and char != "/" else char)
    return "^" + "".join(out) + "$"


def _any_glob(patterns: Sequence[str]) -> str:
    # No pattern matches nothing; RE2 has no (?!), but a start after a character never matches.
    return "|".join(glob_regex(p)[1:-1] for p in patterns) or "x^"


def pointer(key: str) -> str:
    """A JSON Pointer token for `key`."""
    return key.replace("~", "~0").replace("/", "~1")


# The pod spec, its JSON Pointer, and the Job spec of each kind the rules handle (workload.POD_SPEC_PATHS).
SPEC = (
    "(request.kind.kind == 'Pod' ? object.spec : request.kind.kind == 'CronJob' ?"
    " object.spec.jobTemplate.spec.template.spec : object.spec.template.spec)"
)
SPEC_PATH = (
    "(request.kind.kind == 'Pod' ? '/spec' : request.kind.kind == 'CronJob' ?"
    " '/spec/jobTemplate/spec/template/spec' : '/spec/template/spec')"
)
JOB_PATH = "(request.kind.kind == 'CronJob' ? '/spec/jobTemplate/spec' : '/spec')"
JOB = "(request.kind.kind == 'CronJob' ? object.spec.jobTemplate.spec : object.spec)"


def _spec_of(root: str) -> str:
    return SPEC.replace("object.", f"{root}.")


def _field(obj: str, name: str, default: str) -> str:
    return f"(has({obj}.{name}) ? {obj}.{name} : {default})"


def _uses_resources(container: str, resources: str) -> str:
    resource = f"{container}.resources"
    return (
        f"(has({resource}) && ((has({resource}.limits) && {resource}.limits.exists(n, n.matches({resources})))"
        f" || (has({resource}.requests) && {resource}.requests.exists(n, n.matches({resources})))))"
    )


class _Cel:
    """The expressions shared by every policy, for one policy's constants."""

    def __init__(self, policy: Policy) -> None:
        accelerators = policy.accelerators
        self.resources = literal("^(" + _any_glob(accelerators.resources) + ")$")
        self.claims = accelerators.resourceClaims

    def uses_accelerators(self, container: str, spec: str) -> str:
        """A container asks for an accelerator resource, or (offline reading) for any of the pod's claims."""
        found = _uses_resources(container, self.resources)
        if not self.claims:
            return found
        claims = f"{container}.resources.claims"
        return (
            f"({found} || (has({container}.resources) && has({claims}) && has({spec}.resourceClaims) &&"
            f" {claims}.exists(c, {spec}.resourceClaims.exists(r, r.name == c.name))))"
        )

    def accelerator_workload(self, spec: str) -> str:
        """workload.accelerator_requests, with any DRA claim counting (the device class is a cluster fact)."""
        lists = f"[{_field(spec, 'containers', '[]')}, {_field(spec, 'initContainers', '[]')}]"
        found = f"{lists}.exists(l, l.exists(c, {_uses_resources('c', self.resources)}))"
        if self.claims:
            found = f"(has({spec}.resourceClaims) && size({spec}.resourceClaims) > 0) || {found}"
        return found


def _controlled_by(root: str, kinds: Sequence[str]) -> str:
    return (
        f"(has({root}.metadata.ownerReferences) && {root}.metadata.ownerReferences.exists(r,"
        f" has(r.controller) && r.controller == true && r.kind in {literal(list(kinds))}))"
    )


def _mirror(root: str) -> str:
    return f"(has({root}.metadata.annotations) && {literal(MIRROR_POD_ANNOTATION)} in {root}.metadata.annotations)"


def _marks(rule: RuleId, policy: Policy) -> str:
    """The JSON Patches that name `rule` in gpuguard.io/rules (kept in rule order) and the policy's hash,
    as engine._mark writes them."""
    annotations = "object.metadata.annotations"
    previous = (
        f"(has({annotations}) && {literal(RULES_ANNOTATION)} in {annotations} ?"
        f" {annotations}[{literal(RULES_ANNOTATION)}].split(',') : [])"
    )
    named = f"{literal(list(MUTATING_RULES))}.filter(r, r == {literal(rule)} || r in {previous}).join(',')"
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


# --- the mutating rules ---------------------------------------------------------------------------

_TEMPLATE_RESOURCES = {"batch": ["jobs", "cronjobs"], "apps": ["deployments", "statefulsets", "replicasets"]}


def _resource_rules(groups: dict[str, list[str]], operations: list[str]) -> list[JSON]:
    return [
        {"apiGroups": [group], "apiVersions": ["v1"], "operations": operations, "resources": resources}
        for group, resources in groups.items()
    ]


def policy_name(rule: RuleId) -> str:
    """gpuguard-<rule in kebab case>: readinessTolerations is gpuguard-readiness-tolerations."""
    return "gpuguard-" + re.sub(r"(?<!^)(?=[A-Z])", "-", rule).lower()


def _mutating_policy(
    rule: RuleId,
    policy: Policy,
    cel: _Cel,
    variables: list[JSON],
    *,
    pods: bool = True,
    conditions: Sequence[JSON] = (),
) -> JSON:
    """The MAP of one rule: its variables end in `edits`, applied with the marks when there are any."""
    groups = {"": ["pods"], **_TEMPLATE_RESOURCES} if pods else {"batch": _TEMPLATE_RESOURCES["batch"]}
    changes = {"name": "changes", "expression": _with_marks("variables.edits", rule, policy)}
    return {
        "apiVersion": API_VERSION,
        "kind": "MutatingAdmissionPolicy",
        "metadata": {"name": policy_name(rule), "labels": dict(MANAGED_BY)},
        "spec": {
            # As deploy/'s mutating webhook: a policy that cannot evaluate admits the workload unmutated.
            "failurePolicy": "Ignore",
            # Every mutation recognises its own work, so running again after a later mutation is safe,
            # and needed when that mutation adds what a rule looks at.
            "reinvocationPolicy": "IfNeeded",
            "matchConstraints": {"resourceRules": _resource_rules(groups, ["CREATE"])},
            "matchConditions": [*_mutation_conditions(cel, pods=pods), *conditions],
            "variables": [
                {"name": v["name"], "expression": _as_data(v["expression"])} for v in [*variables, changes]
            ],
            "mutations": [{"patchType": "JSONPatch", "jsonPatch": {"expression": _AS_PATCHES}}],
        },
    }


def _mutation_conditions(cel: _Cel, pods: bool) -> list[JSON]:
    """engine._mutation_skip_reason: DaemonSet, Job and mirror pods pass by; only accelerator workloads."""
    conditions = []
    if pods:
        conditions.append(
            {
                "name": "not-daemonset-job-or-mirror-pod",
                "expression": f"request.kind.kind != 'Pod' || !({_controlled_by('object', ['DaemonSet', 'Job'])}"
                f" || {_mirror('object')})",
            }
        )
    conditions.append(
        {"name": "accelerator-workload", "expression": f"[{SPEC}].exists(s, {cel.accelerator_workload('s')})"}
    )
    return conditions


def _with_marks(changes: str, rule: RuleId, policy: Policy) -> str:
    return f"size({changes}) > 0 ? {changes} + {_marks(rule, policy)} : []"


def _tolerates(toleration: str, key: str) -> str:
    """rules._tolerates_readiness_taint."""
    t = toleration
    return (
        f"({_field(t, 'effect', EMPTY)} in ['', 'NoExecute'] && {_field(t, 'key', EMPTY)} in ['', {literal(key)}]"
        f" && ({_field(t, 'operator', EQUAL)} == 'Exists' || ({_field(t, 'operator', EQUAL)} == 'Equal'"
        f" && {_field(t, 'value', EMPTY)} == '')))"
    )


def readiness_tolerations(policy: Policy, cel: _Cel) -> JSON:
    rule = policy.rules.readinessTolerations
    default = rule.apiServerDefaultSeconds
    variables = [
        {"name": "spec", "expression": SPEC},
        {"name": "path", "expression": SPEC_PATH},
        {
            "name": "batch",
            "expression": "request.kind.kind == 'Pod' ? "
            + _field("variables.spec", "restartPolicy", "'Always'")
            + " != 'Always' : request.kind.kind in ['Job', 'CronJob']",
        },
        {
            "name": "seconds",
            "expression": f"variables.batch ? {rule.batchSeconds} : {rule.servingSeconds}",
        },
        {"name": "tolerations", "expression": _field("variables.spec", "tolerations", "[]")},
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
        entry = _map(
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
    return _mutating_policy("readinessTolerations", policy, cel, variables)


def pod_failure_policy(policy: Policy, cel: _Cel) -> JSON:
    rule = policy.rules.podFailurePolicy
    job = "variables.job"
    spec = "variables.spec"
    variables: list[JSON] = [
        {"name": "job", "expression": JOB},
        {"name": "jobPath", "expression": JOB_PATH},
        {"name": "spec", "expression": f"{job}.template.spec"},
        {"name": "restartPolicy", "expression": _field(spec, "restartPolicy", EMPTY)},
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
            exit_codes = _map({"operator": "'In'", "values": values})
            wanted.append(
                f"(size({values}) == 0 ? [] : [{_map({'action': action, 'onExitCodes': exit_codes})}])"
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
    return _mutating_policy("podFailurePolicy", policy, cel, variables, pods=False)


def graceful_termination(policy: Policy, cel: _Cel) -> JSON:
    rule = policy.rules.gracefulTermination
    pre_stop: JSON = (
        {"sleep": {"seconds": rule.preStop.seconds}}
        if rule.preStop.action == "sleep"
        else {"exec": {"command": list(rule.preStop.command)}}
    )
    spec = "variables.spec"
    variables: list[JSON] = [{"name": "spec", "expression": SPEC}, {"name": "path", "expression": SPEC_PATH}]
    edits = []
    for field, sidecars_only in (("containers", False), ("initContainers", True)):
        items = f"{_field(spec, field, '[]')}"
        wanted = f"{items}[i]"
        condition = cel.uses_accelerators(wanted, spec)
        if sidecars_only:
            condition = f"{_field(wanted, 'restartPolicy', EMPTY)} == 'Always' && {condition}"
        edits.append(
            f"lists.range(size({items})).filter(i, {condition} && !(has({wanted}.lifecycle) &&"
            f" has({wanted}.lifecycle.preStop))).map(i, has({wanted}.lifecycle) ?"
            f" JSONPatch{{op: 'add', path: variables.path + '/{field}/' + string(i) + '/lifecycle/preStop',"
            f" value: {literal(pre_stop)}}} :"
            f" JSONPatch{{op: 'add', path: variables.path + '/{field}/' + string(i) + '/lifecycle',"
            f" value: {literal({'preStop': pre_stop})}}})"
        )
    wanted_seconds = rule.grace_period_seconds
    current = _field(spec, "terminationGracePeriodSeconds", str(DEFAULT_GRACE_PERIOD_SECONDS))
    edits.append(
        f"({current} < {wanted_seconds} ? [JSONPatch{{op: 'add', path: variables.path +"
        f" '/terminationGracePeriodSeconds', value: {wanted_seconds}}}] : [])"
    )
    variables.append({"name": "edits", "expression": " + ".join(edits)})
    return _mutating_policy("gracefulTermination", policy, cel, variables)


def priority(policy: Policy, cel: _Cel) -> JSON:
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
    return _mutating_policy(
        "priority",
        policy,
        cel,
        [
            {"name": "spec", "expression": SPEC},
            {"name": "path", "expression": SPEC_PATH},
            {"name": "edits", "expression": edits},
        ],
    )


# rules._exempt_pod, and a pod's priority and affinity cannot change after its creation.
_NOT_AN_EXEMPT_POD: JSON = {
    "name": "not-an-exempt-pod",
    "expression": "request.kind.kind != 'Pod' || (request.operation == 'CREATE' &&"
    f" !{_controlled_by('object', ['DaemonSet'])} && !{_mirror('object')})",
}


class _Driver:
    """rules.driver_requirement and nodeaffinity's minimum on an integer label, for one root object."""

    def __init__(self, policy: Policy, root: str) -> None:
        rule = policy.rules.driverCompatibility
        self.key = literal(rule.nodeLabels.driverMajor)
        self.spec = _spec_of(root)
        pod_metadata = f"{root}.metadata"
        template = (
            f"(request.kind.kind == 'CronJob' ? {root}.spec.jobTemplate.spec.template : {root}.spec.template)"
        )
        name = literal(rule.annotation)

        def annotated(metadata: str) -> str:
            return f"(has({metadata}.annotations) && {name} in {metadata}.annotations)"

        template_annotated = (
            f"(request.kind.kind != 'Pod' && has({template}.metadata) && {annotated(template + '.metadata')})"
        )
        # The annotation on the pod template (what the pods carry), else on the object itself.
        self.stated = f"({template_annotated} || {annotated(pod_metadata)})"
        self.annotation = (
            f"({template_annotated} ? {template}.metadata.annotations[{name}] : {annotated(pod_metadata)} ?"
            f" {pod_metadata}.annotations[{name}] : '')"
        )
        number = f"{self.annotation}.trim()"
        self.valid = f"({self.stated} && {number}.matches('^[0-9]{{1,5}}$') && int({number}) > 0)"
        self.problem = f"({self.stated} && !{self.valid})"
        by_image = []
        containers = (
            f"({_field(self.spec, 'containers', '[]')} + {_field(self.spec, 'initContainers', '[]')})"
        )
        for requirement in rule.images:
            by_image.append(
                f"({containers}.exists(c, has(c.image) && c.image.matches({literal(_REFERENCE)}) &&"
                f" {_image_reference('c.image')}.matches({literal(glob_regex(requirement.image))})) ?"
                f" [{requirement.minDriverMajor}] : [])"
            )
        self.by_image = by_image
        minima = " + ".join([f"({self.valid} ? [int({number})] : [])", *by_image])
        self.minima = f"({minima})"

    def could_state(self) -> list[JSON]:
        """A match condition leaving out, cheaply, the workloads that state no minimum (most of them);
        none when the policy's image map could state one for any workload."""
        if self.by_image:
            return []
        return [{"name": "states-a-driver-minimum", "expression": self.stated}]

    def minimum(self, minima: str) -> str:
        """The highest of `minima`, 0 for none."""
        return f"(size({minima}) == 0 ? 0 : {minima}.filter(x, {minima}.all(y, y <= x))[0])"

    def required(self) -> str:
        return f"{self.spec}.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"

    def has_required(self) -> str:
        return (
            f"(has({self.spec}.affinity) && has({self.spec}.affinity.nodeAffinity) && has({self.required()}))"
        )

    def term_guarantees(self, term: str, minimum: str) -> str:
        gt = (
            f"(e.operator == 'Gt' && has(e.values) && size(e.values) == 1 && {_INTEGER_TEST.format('e.values[0]')}"
            f" && int(e.values[0]) >= {minimum} - 1)"
        )
        in_ = (
            f"(e.operator == 'In' && has(e.values) && size(e.values) > 0 && e.values.all(v,"
            f" {_INTEGER_TEST.format('v')} && int(v) >= {minimum}))"
        )
        return f"(has({term}.matchExpressions) && {term}.matchExpressions.exists(e, e.key == {self.key} && ({gt} || {in_})))"

    def pinned(self) -> str:
        return f"(has({self.spec}.nodeSelector) && {self.key} in {self.spec}.nodeSelector)"

    def guarantees(self, minimum: str) -> str:
        """nodeaffinity.guarantees_minimum."""
        value = f"{self.spec}.nodeSelector[{self.key}]"
        pinned = f"({self.pinned()} && {_INTEGER_TEST.format(value)} && int({value}) >= {minimum})"
        terms = (
            f"({self.has_required()} && ({_field(self.required(), 'nodeSelectorTerms', '[]')}).all(t,"
            f" {_empty_term('t')} || {self.term_guarantees('t', minimum)}))"
        )
        return f"({pinned} || {terms})"

    def excluded(self, minimum: str) -> str:
        """nodeaffinity.excluding_reason is not None."""
        value = f"{self.spec}.nodeSelector[{self.key}]"
        pinned = f"({self.pinned()} && !({_INTEGER_TEST.format(value)} && int({value}) >= {minimum}))"
        ints = _INTEGER_TEST.format("v")
        excludes = (
            f"(e.operator == 'In' && (!has(e.values) || e.values.all(v, !{ints} || int(v) < {minimum}))) ||"
            f" (e.operator == 'Lt' && (!has(e.values) || size(e.values) != 1 || !{_INTEGER_TEST.format('e.values[0]')}"
            f" || int(e.values[0]) <= {minimum})) ||"
            f" (e.operator == 'Gt' && (!has(e.values) || size(e.values) != 1 || !{_INTEGER_TEST.format('e.values[0]')}))"
            " || e.operator == 'DoesNotExist'"
        )
        terms = f"({_field(self.required(), 'nodeSelectorTerms', '[]')}).filter(t, !{_empty_term('t')})"
        every_term = (
            f"({self.has_required()} && size({terms}) > 0 && {terms}.all(t, has(t.matchExpressions) &&"
            f" t.matchExpressions.exists(e, e.key == {self.key} && ({excludes}))))"
        )
        return f"({pinned} || {every_term})"


_INTEGER_TEST = "{0}.matches('^[+-]?[0-9]+$')"  # what Go's strconv.ParseInt (and nodeaffinity.integer) accept


def _empty_term(term: str) -> str:
    return (
        f"(!(has({term}.matchExpressions) && size({term}.matchExpressions) > 0) &&"
        f" !(has({term}.matchFields) && size({term}.matchFields) > 0))"
    )


def driver_compatibility(policy: Policy, cel: _Cel) -> JSON:
    driver = _Driver(policy, "object")
    at_least = _map({"key": driver.key, "operator": "'Gt'", "values": "[string(variables.minimum - 1)]"})
    required = _map({"nodeSelectorTerms": f"[{_map({'matchExpressions': f'[{at_least}]'})}]"})
    spec = "variables.spec"
    node_affinity = f"{spec}.affinity.nodeAffinity"
    required_path = "variables.path + '/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution'"
    terms = f"{node_affinity}.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms"
    edits = (
        f"variables.minimum == 0 || variables.guaranteed ? [] :"
        f" !has({spec}.affinity) ? [JSONPatch{{op: 'add', path: variables.path + '/affinity',"
        f" value: {_map({'nodeAffinity': _map({'requiredDuringSchedulingIgnoredDuringExecution': required})})}}}] :"
        f" !has({node_affinity[: -len('.nodeAffinity')]}.nodeAffinity) ? [JSONPatch{{op: 'add', path: variables.path +"
        f" '/affinity/nodeAffinity', value: {_map({'requiredDuringSchedulingIgnoredDuringExecution': required})}}}] :"
        f" !has({node_affinity}.requiredDuringSchedulingIgnoredDuringExecution) ? [JSONPatch{{op: 'add',"
        f" path: {required_path}, value: {required}}}] :"
        f" !has({terms}) ? [] : lists.range(size({terms})).filter(i, !{_empty_term(terms + '[i]')} &&"
        f" !{driver.term_guarantees(terms + '[i]', 'variables.minimum')}).map(i, has({terms}[i].matchExpressions) ?"
        f" JSONPatch{{op: 'add', path: {required_path} + '/nodeSelectorTerms/' + string(i) + '/matchExpressions/-',"
        f" value: {at_least}}} : JSONPatch{{op: 'add', path: {required_path} + '/nodeSelectorTerms/' + string(i) +"
        f" '/matchExpressions', value: [{at_least}]}})"
    )
    variables = [
        {"name": "spec", "expression": SPEC},
        {"name": "path", "expression": SPEC_PATH},
        {"name": "minima", "expression": driver.minima},
        {"name": "minimum", "expression": driver.minimum("variables.minima")},
        {"name": "guaranteed", "expression": driver.guarantees("variables.minimum")},
        {"name": "edits", "expression": edits},
    ]
    return _mutating_policy("driverCompatibility", policy, cel, variables, conditions=driver.could_state())


def driver_compatibility_check(policy: Policy, cel: _Cel) -> JSON:
    """rules.driver_compatibility_check, the lookup of current nodes aside."""
    now, before = _Driver(policy, "object"), _Driver(policy, "oldObject")

    def violates(driver: _Driver, minimum: str) -> str:
        return f"({driver.problem} || ({minimum} > 0 && ({driver.excluded(minimum)} || !{driver.guarantees(minimum)})))"

    return _validating_policy(
        policy_name("driverCompatibility"),
        {"": ["pods"], **_TEMPLATE_RESOURCES},
        [
            _NOT_AN_EXEMPT_POD,
            {
                "name": "accelerator-workload",
                "expression": f"[{SPEC}].exists(s, {cel.accelerator_workload('s')})",
            },
            *now.could_state(),
        ],
        [
            {"name": "minima", "expression": now.minima},
            {"name": "minimum", "expression": now.minimum("variables.minima")},
            {
                "name": "minimumBefore",
                "expression": f"request.operation == 'UPDATE' ? {before.minimum(before.minima)} : 0",
            },
            {"name": "violates", "expression": violates(now, "variables.minimum")},
            {
                "name": "violatedBefore",
                "expression": f"request.operation == 'UPDATE' && {violates(before, 'variables.minimumBefore')}",
            },
        ],
        [
            {
                "expression": "!variables.violates || variables.violatedBefore",
                "messageExpression": f"'driverCompatibility: needs {policy.rules.driverCompatibility.nodeLabels.driverMajor} >= '"
                " + string(variables.minimum) + ', but its node selection admits older drivers or none'",
                "reason": "Forbidden",
            }
        ],
    )


# --- the validating rules -------------------------------------------------------------------------


def _validating_policy(
    name: str,
    groups: dict[str, list[str]],
    conditions: list[JSON],
    variables: list[JSON],
    validations: list[JSON],
) -> JSON:
    return {
        "apiVersion": API_VERSION,
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name, "labels": dict(MANAGED_BY)},
        "spec": {
            # As deploy/'s validating webhook: a policy that cannot evaluate admits the workload.
            "failurePolicy": "Ignore",
            "matchConstraints": {"resourceRules": _resource_rules(groups, ["CREATE", "UPDATE"])},
            "matchConditions": conditions,
            "variables": variables,
            "validations": validations,
        },
    }


def _guard_violation(root: str, policy: Policy, cel: _Cel) -> str:
    """rules.accelerator_node_guard on `root` (object or oldObject), the nodeName lookup aside."""
    accelerators = policy.accelerators
    spec = _spec_of(root)
    labels = literal(list(accelerators.nodeLabels))
    taints = literal(list(accelerators.taintKeys))
    required = f"{spec}.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
    bound = " || ".join(
        [
            cel.accelerator_workload(spec),
            f"(has({spec}.nodeSelector) && {spec}.nodeSelector.exists(k, k in {labels}))",
            f"(has({spec}.affinity) && has({spec}.affinity.nodeAffinity) && has({required}) &&"
            f" has({required}.nodeSelectorTerms) && {required}.nodeSelectorTerms.exists(t,"
            f" has(t.matchExpressions) && t.matchExpressions.exists(e, e.key in {labels} &&"
            " e.operator in ['In', 'Exists', 'Gt', 'Lt'])))",
            f"(has({spec}.tolerations) && {spec}.tolerations.exists(t, has(t.key) && t.key in {taints}))",
        ]
    )
    name = _field(spec, "priorityClassName", EMPTY)
    classes = literal(dict(policy.priorityClasses))
    resolved = (
        f"(request.kind.kind == 'Pod' && has({spec}.priority) ? {spec}.priority : {name} == '' ? 0 :"
        f" {name} in {classes} ? {classes}[{name}] : {SYSTEM_CRITICAL_PRIORITY})"
    )
    threshold = policy.rules.acceleratorNodeGuard.minPriority
    return (
        f"(!{name}.startsWith({literal(SYSTEM_PRIORITY_PREFIX)}) && ({bound}) &&"
        f" {resolved} < {min(threshold, SYSTEM_CRITICAL_PRIORITY)})"
    )


def accelerator_node_guard(policy: Policy, cel: _Cel) -> JSON:
    threshold = policy.rules.acceleratorNodeGuard.minPriority
    # An update is denied only for what it introduces: an existing workload stays manageable.
    violates = "variables.violates && (request.operation == 'CREATE' || !variables.violatedBefore)"
    message = (
        f"'acceleratorNodeGuard: priority below {threshold} on accelerator nodes:"
        f" set a priorityClassName with value >= {threshold}'"
    )
    return _validating_policy(
        policy_name("acceleratorNodeGuard"),
        {"": ["pods"], **_TEMPLATE_RESOURCES},
        [_NOT_AN_EXEMPT_POD],
        [
            {"name": "violates", "expression": _guard_violation("object", policy, cel)},
            {
                "name": "violatedBefore",
                "expression": f"request.operation == 'UPDATE' && {_guard_violation('oldObject', policy, cel)}",
            },
        ],
        [{"expression": f"!({violates})", "messageExpression": message, "reason": "Forbidden"}],
    )


def _image_name(image: str) -> str:
    """images.parse(...).name: registry/repository as the runtime reads `image` (tag and digest dropped)."""
    name = f"{image}.split('@')[0]"
    untagged = f"({name}.lastIndexOf(':') > {name}.lastIndexOf('/') ? {name}.substring(0, {name}.lastIndexOf(':')) : {name})"
    first = f"{untagged}.split('/')[0]"
    has_domain = (
        f"({untagged}.contains('/') && ({first}.contains('.') || {first}.contains(':') ||"
        f" {first} == 'localhost' || {first} != {first}.lowerAscii()))"
    )
    registry = f"({has_domain} ? {first}.lowerAscii() : 'docker.io')"
    path = f"({has_domain} ? {untagged}.substring(size({first}) + 1) : {untagged})"
    hub = "['docker.io', 'index.docker.io', 'registry-1.docker.io']"
    return (
        f"({registry} in {hub} ? 'docker.io/' + ({path}.contains('/') ? {path} : 'library/' + {path}) :"
        f" {registry} + '/' + {path})"
    )


def _image_reference(image: str) -> str:
    """str(images.parse(image)): the normalised name, its tag (:latest without tag or digest), its digest."""
    name = f"{image}.split('@')[0]"
    tagged = f"{name}.lastIndexOf(':') > {name}.lastIndexOf('/')"
    tag = f"({tagged} ? {name}.substring({name}.lastIndexOf(':')) : {image}.contains('@') ? '' : ':latest')"
    digest = f"({image}.contains('@') ? '@' + {image}.split('@')[1] : '')"
    return f"({_image_name(image)} + {tag} + {digest})"


# images.py's grammar, in RE2: what is no image reference is never trusted.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*|\[[0-9A-Fa-f:]+\])(?::[0-9]+)?"
_REFERENCE = (
    rf"^(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*(?::[\w][\w.-]{{0,127}})?"
    r"(?:@[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[0-9a-fA-F]{32,})?$"
)


def _device_mount(container: str, host_paths: str) -> str:
    """rules.device_mount: a mount reaching one of the policy's hostPaths (a '..' anywhere counts)."""
    joined = f"{host_paths}[m.name].split('/') + (has(m.subPath) ? m.subPath.split('/') : [])"
    parts = f"({joined}).filter(p, p != '' && p != '.')"
    # hostpaths.components reads /var/run as /run; every pattern names /run (the model normalises them).
    on_run = f"(size({parts}) >= 2 && {parts}[0] == 'var' && {parts}[1] == 'run')"
    normal = f"({on_run} ? ['run'] + {parts}.slice(2, size({parts})) : {parts})"
    reaches = (
        f"variables.patterns.exists(pat, lists.range(size({normal}) < size(pat) ? size({normal}) :"
        f" size(pat)).all(i, {normal}[i].matches(pat[i])))"
    )
    return (
        f"{_field(container, 'volumeMounts', '[]')}.exists(m, has(m.name) && m.name in {host_paths} &&"
        f" {host_paths}[m.name].startsWith('/') && ({parts}.exists(p, p == '..') || {reaches}))"
    )


def _checked_containers(root: str) -> str:
    """rules._checked_containers, each as {role, name, image, volumeMounts}."""
    spec = _spec_of(root)
    tagged = [
        f"{_field(spec, field, '[]')}.map(c, {_map({'role': literal(role), 'name': _field('c', 'name', UNNAMED), 'image': _field('c', 'image', EMPTY), 'volumeMounts': _field('c', 'volumeMounts', '[]')})})"
        for field, role in (
            ("containers", "container"),
            ("initContainers", "init container"),
            ("ephemeralContainers", "ephemeral container"),
        )
    ]
    # A controller's pods come from a template checked on its own; at their creation only ephemeral
    # containers are left.
    from_template = (
        f"request.kind.kind == 'Pod' && request.operation == 'CREATE' && has({root}.metadata.ownerReferences)"
        f" && {root}.metadata.ownerReferences.exists(r, has(r.controller) && r.controller == true)"
    )
    return f"({from_template} ? {tagged[2]} : {tagged[0]} + {tagged[1]} + {tagged[2]})"


def trusted_device_software(policy: Policy) -> JSON:
    rule = policy.rules.trustedDeviceSoftware
    patterns = [[glob_regex(part) for part in hostpaths.components(p) or ()] for p in rule.hostPaths]
    image = "c.image"
    name = _image_name(image)
    trusted = (
        f"({image}.matches({literal(_REFERENCE)}) && {literal(list(rule.trustedImages))}.exists(p,"
        f" p.endsWith('/') ? {name}.startsWith(p) : {name} == p)"
        + (f" && {image}.matches('@sha256:[0-9a-f]{{64}}$')" if rule.requireDigest else "")
        + ")"
    )
    variables: list[JSON] = [{"name": "patterns", "expression": literal(patterns)}]
    for root, suffix in (("object", ""), ("oldObject", "Before")):
        volumes = f"{_field(_spec_of(root), 'volumes', '[]')}.filter(v, has(v.hostPath))"
        host_paths = f"variables.hostPaths{suffix}"
        offenders = (
            f"{_checked_containers(root)}.filter(c, {_device_mount('c', host_paths)} && !{trusted})"
            ".map(c, c.role + ' ' + c.name + ': image ' + c.image)"
        )
        if root == "oldObject":
            offenders = f"request.operation == 'UPDATE' ? {offenders} : []"
        variables += [
            {
                "name": f"hostPaths{suffix}",
                "expression": f"{volumes}.transformMapEntry(i, v, {{v.name: {_field('v.hostPath', 'path', EMPTY)}}})",
            },
            {"name": f"untrusted{suffix}", "expression": offenders},
        ]
    # What the object already ran before an update is not the update's doing.
    variables.append(
        {
            "name": "introduced",
            "expression": "variables.untrusted.filter(f, !(f in variables.untrustedBefore))",
        }
    )
    message = (
        "'trustedDeviceSoftware: ' + variables.introduced.join(', ') + ' is not from a trusted source, and it"
        f" mounts a device-software hostPath; trusted images: {', '.join(rule.trustedImages) or '(none)'}'"
    )
    return _validating_policy(
        policy_name("trustedDeviceSoftware"),
        {
            "": ["pods", "pods/ephemeralcontainers"],
            "batch": ["jobs", "cronjobs"],
            "apps": ["deployments", "statefulsets", "replicasets", "daemonsets"],
        },
        [
            {"name": "not-a-mirror-pod", "expression": f"request.kind.kind != 'Pod' || !{_mirror('object')}"},
            # No hostPath, no device software: most workloads stop here.
            {
                "name": "mounts-a-host-path",
                "expression": f"[{SPEC}].exists(s, has(s.volumes) && s.volumes.exists(v, has(v.hostPath)))",
            },
        ],
        variables,
        [
            {
                "expression": "size(variables.introduced) == 0",
                "messageExpression": message,
                "reason": "Forbidden",
            }
        ],
    )


# --- bindings: the namespace modes as mutually exclusive selectors --------------------------------


def _requirements(selector: LabelSelector) -> list[Requirement]:
    return [{"key": k, "operator": "In", "values": [v]} for k, v in selector.matchLabels.items()] + [
        {"key": r.key, "operator": r.operator, **({"values": list(r.values)} if r.values else {})}
        for r in selector.matchExpressions
    ]


_NEGATED = {"In": "NotIn", "NotIn": "In", "Exists": "DoesNotExist", "DoesNotExist": "Exists"}


def _outside(selector: LabelSelector) -> list[list[Requirement]]:
    """Namespaces the selector does not match, as disjoint conjunctions: not r1, or r1 and not r2, ..."""
    requirements = _requirements(selector)
    return [
        [*requirements[:i], {**requirements[i], "operator": _NEGATED[requirements[i]["operator"]]}]
        for i in range(len(requirements))
    ]


@dataclass(frozen=True)
class Region:
    """Namespaces no other region holds, and the namespace entry that is most specific there."""

    requirements: list[Requirement]
    override: NamespaceOverride | None
    description: str


def regions(policy: Policy) -> list[Region]:
    """The namespaces split as Policy.namespace_override decides: a name first, then the first
    matching selector, then none; each region a conjunction of label requirements."""
    named = sorted({name for o in policy.namespaces for name in o.names})
    not_named = [{"key": NAME_LABEL, "operator": "NotIn", "values": named}] if named else []
    found = [
        Region(
            [{"key": NAME_LABEL, "operator": "In", "values": list(o.names)}],
            o,
            f"namespaces {', '.join(o.names)}",
        )
        for o in policy.namespaces
        if o.names
    ]
    earlier: list[list[list[Requirement]]] = []
    for index, override in enumerate(policy.namespaces):
        if override.selector is None:
            continue
        own = _requirements(override.selector)
        for parts in itertools.product(*earlier):
            found.append(
                Region(
                    [*not_named, *(r for part in parts for r in part), *own],
                    override,
                    f"namespaces[{index}].selector",
                )
            )
        earlier.append(_outside(override.selector))
    for parts in itertools.product(*earlier):
        found.append(
            Region([*not_named, *(r for part in parts for r in part)], None, "every other namespace")
        )
    return found


def _binding(kind: str, policy_name: str, index: int, region: Region, extra: JSON) -> JSON:
    unwatched = {"key": NAME_LABEL, "operator": "NotIn", "values": list(UNWATCHED_NAMESPACES)}
    return {
        "apiVersion": API_VERSION,
        "kind": f"{kind}Binding",
        "metadata": {"name": f"{policy_name}-{index}", "labels": dict(MANAGED_BY)},
        "spec": {
            "policyName": policy_name,
            "matchResources": {"namespaceSelector": {"matchExpressions": [*region.requirements, unwatched]}},
            **extra,
        },
    }


def _bindings(policy: Policy, rule: RuleId, obj: JSON, gaps: list[Gap]) -> list[JSON]:
    kind = str(obj["kind"])
    name = str(obj["metadata"]["name"])
    bindings: list[JSON] = []
    for region in regions(policy):
        mode = policy.mode_under(rule, region.override)
        if mode == "off":
            continue
        if kind == "MutatingAdmissionPolicy":
            if mode != "enforce":
                gaps.append(
                    Gap(
                        rule,
                        f"{mode} mode in {region.description}: a MutatingAdmissionPolicy cannot warn or record",
                    )
                )
                continue
            extra: JSON = {}
        else:
            extra = {"validationActions": VALIDATION_ACTIONS[mode]}
        bindings.append(_binding(kind, name, len(bindings), region, extra))
    return bindings


# --- the whole policy -----------------------------------------------------------------------------

# What no native policy decides, whatever the policy says: cluster facts and the webhook's own outputs.
ALWAYS_WEBHOOK = (
    Gap(
        "podFailurePolicy",
        "the warning on an OnFailure Job left alone (onFailureJobs: skip) and on rules left out past 20",
    ),
    Gap(
        "priority",
        "a pod already naming the cluster's globalDefault class, the class's existence and preemptionPolicy"
        " (cluster facts); pods get the value from the policy's priorityClasses",
    ),
    Gap("driverCompatibility", "the warning when no current node has a new-enough driver (cluster facts)"),
    Gap(
        "trustedDeviceSoftware",
        "a hostPath with a '..' component counts as device software whatever it resolves to (CEL resolves"
        " no paths); an update is excused per container (role, name, image), not per whole message",
    ),
    Gap(
        "acceleratorNodeGuard",
        "a pod naming an accelerator node (nodeName), classes the policy's priorityClasses do not list (taken"
        " as passing), DRA claims of any device class (every claim counts)",
    ),
)


def compile_policy(policy: Policy) -> Compiled:
    gaps: list[Gap] = []
    if not policy.enabled:
        return Compiled([], [Gap("all", "enabled is false: nothing to compile")])
    cel = _Cel(policy)
    built: list[tuple[RuleId, JSON]] = [
        ("readinessTolerations", readiness_tolerations(policy, cel)),
        ("podFailurePolicy", pod_failure_policy(policy, cel)),
        ("gracefulTermination", graceful_termination(policy, cel)),
        ("driverCompatibility", driver_compatibility(policy, cel)),
        ("acceleratorNodeGuard", accelerator_node_guard(policy, cel)),
        ("driverCompatibility", driver_compatibility_check(policy, cel)),
        ("trustedDeviceSoftware", trusted_device_software(policy)),
    ]
    if policy.priority_value(policy.rules.priority.className) is not None:
        built.insert(3, ("priority", priority(policy, cel)))
    else:
        gaps.append(
            Gap("priority", "pods: the class is not in the policy's priorityClasses, so its value is unknown")
        )
    if policy.rules.driverCompatibility.multiNode.sameDriverVersion:
        gaps.append(
            Gap("driverCompatibility", "multiNode.sameDriverVersion: one driver version across a Job's pods")
        )
    gaps[:0] = ALWAYS_WEBHOOK
    policies: list[JSON] = []
    bindings: list[JSON] = []
    for rule, obj in built:
        own = _bindings(policy, rule, obj, gaps)
        if own:
            policies.append(obj)
            bindings += own
    return Compiled(policies + bindings, gaps)
