"""The driver minimum natively: the node affinity a MutatingAdmissionPolicy adds, and the
ValidatingAdmissionPolicy that refuses a node selection admitting older drivers."""

from __future__ import annotations

from webhook.policy.model import Policy
from webhook.policy.nativecel import (
    SPEC,
    TEMPLATE_RESOURCES,
    Cel,
    all_of,
    cel_map,
    field_or,
    glob_regex,
    literal,
    policy_name,
    spec_of,
)
from webhook.policy.nativemutating import RuleMutation
from webhook.policy.nativevalidating import NOT_AN_EXEMPT_POD, REFERENCE, image_reference, validating_policy
from webhook.policy.workload import JSON


class Driver:
    """rules.driver_requirement and nodeaffinity's minimum on an integer label, for one root object."""

    def __init__(self, policy: Policy, root: str) -> None:
        rule = policy.rules.driverCompatibility
        self.key = literal(rule.nodeLabels.driverMajor)
        self.spec = spec_of(root)
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
            f"({field_or(self.spec, 'containers', '[]')} + {field_or(self.spec, 'initContainers', '[]')})"
        )
        for requirement in rule.images:
            by_image.append(
                f"({containers}.exists(c, has(c.image) && c.image.matches({literal(REFERENCE)}) &&"
                f" {image_reference('c.image')}.matches({literal(glob_regex(requirement.image))})) ?"
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
            f"({self.has_required()} && ({field_or(self.required(), 'nodeSelectorTerms', '[]')}).all(t,"
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
        terms = f"({field_or(self.required(), 'nodeSelectorTerms', '[]')}).filter(t, !{_empty_term('t')})"
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


def driver_compatibility(policy: Policy) -> RuleMutation:
    driver = Driver(policy, "object")
    at_least = cel_map({"key": driver.key, "operator": "'Gt'", "values": "[string(variables.minimum - 1)]"})
    required = cel_map({"nodeSelectorTerms": f"[{cel_map({'matchExpressions': f'[{at_least}]'})}]"})
    spec = "variables.spec"
    node_affinity = f"{spec}.affinity.nodeAffinity"
    required_path = "variables.path + '/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution'"
    terms = f"{node_affinity}.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms"
    edits = (
        f"variables.minimum == 0 || variables.guaranteed ? [] :"
        f" !has({spec}.affinity) ? [JSONPatch{{op: 'add', path: variables.path + '/affinity',"
        f" value: {cel_map({'nodeAffinity': cel_map({'requiredDuringSchedulingIgnoredDuringExecution': required})})}}}] :"
        f" !has({node_affinity[: -len('.nodeAffinity')]}.nodeAffinity) ? [JSONPatch{{op: 'add', path: variables.path +"
        f" '/affinity/nodeAffinity', value: {cel_map({'requiredDuringSchedulingIgnoredDuringExecution': required})}}}] :"
        f" !has({node_affinity}.requiredDuringSchedulingIgnoredDuringExecution) ? [JSONPatch{{op: 'add',"
        f" path: {required_path}, value: {required}}}] :"
        f" !has({terms}) ? [] : lists.range(size({terms})).filter(i, !{_empty_term(terms + '[i]')} &&"
        f" !{driver.term_guarantees(terms + '[i]', 'variables.minimum')}).map(i, has({terms}[i].matchExpressions) ?"
        f" JSONPatch{{op: 'add', path: {required_path} + '/nodeSelectorTerms/' + string(i) + '/matchExpressions/-',"
        f" value: {at_least}}} : JSONPatch{{op: 'add', path: {required_path} + '/nodeSelectorTerms/' + string(i) +"
        f" '/matchExpressions', value: [{at_least}]}})"
    )
    variables = [
        {"name": "minima", "expression": driver.minima},
        {"name": "minimum", "expression": driver.minimum("variables.minima")},
        {"name": "guaranteed", "expression": driver.guarantees("variables.minimum")},
        {"name": "edits", "expression": edits},
    ]
    guards = tuple(condition["expression"] for condition in driver.could_state())
    return RuleMutation("driverCompatibility", variables, guards=guards)


def driver_compatibility_check(policy: Policy, cel: Cel) -> JSON:
    """rules.driver_compatibility_check, the lookup of current nodes aside."""
    now, before = Driver(policy, "object"), Driver(policy, "oldObject")

    def violates(driver: Driver, minimum: str) -> str:
        return f"({driver.problem} || ({minimum} > 0 && ({driver.excluded(minimum)} || !{driver.guarantees(minimum)})))"

    return validating_policy(
        policy_name("driverCompatibility"),
        {"": ["pods"], **TEMPLATE_RESOURCES},
        # Most workloads state no minimum: that test first.
        [
            {
                "name": "an-accelerator-workload-that-may-state-a-minimum",
                "expression": all_of(
                    [
                        *(condition["expression"] for condition in now.could_state()),
                        NOT_AN_EXEMPT_POD["expression"],
                        f"[{SPEC}].exists(s, {cel.accelerator_workload('s')})",
                    ]
                ),
            }
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
