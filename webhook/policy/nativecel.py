"""CEL text for the native admission policies: literals, globs as RE2, the pod spec of each workload kind,
the accelerator tests every rule shares, and the names and resource rules of the policies."""

from __future__ import annotations

import json
import re
import string
from collections.abc import Sequence
from typing import Any

from webhook.policy.model import Policy, RuleId
from webhook.policy.workload import JSON, MIRROR_POD_ANNOTATION

API_VERSION = "admissionregistration.k8s.io/v1"
MANAGED_BY = {"app.kubernetes.io/managed-by": "gpuguard"}

EMPTY, EQUAL, UNNAMED = "''", "'Equal'", "'?'"  # CEL strings, for defaults inside f-strings


def literal(value: Any) -> str:
    """`value` (JSON data) as a CEL literal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | str):
        return json.dumps(value)  # JSON's string escapes are CEL's
    if isinstance(value, list):
        return "[" + ", ".join(literal(item) for item in value) + "]"
    if isinstance(value, dict):
        return cel_map({str(k): literal(v) for k, v in value.items()})
    raise TypeError(f"no CEL literal for {value!r}")


def cel_map(entries: dict[str, str]) -> str:
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


def spec_of(root: str) -> str:
    return SPEC.replace("object.", f"{root}.")


def field_or(obj: str, name: str, default: str) -> str:
    return f"(has({obj}.{name}) ? {obj}.{name} : {default})"


def _uses_resources(container: str, resources: str) -> str:
    resource = f"{container}.resources"
    return (
        f"(has({resource}) && ((has({resource}.limits) && {resource}.limits.exists(n, n.matches({resources})))"
        f" || (has({resource}.requests) && {resource}.requests.exists(n, n.matches({resources})))))"
    )


class Cel:
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
        lists = f"[{field_or(spec, 'containers', '[]')}, {field_or(spec, 'initContainers', '[]')}]"
        found = f"{lists}.exists(l, l.exists(c, {_uses_resources('c', self.resources)}))"
        if self.claims:
            found = f"(has({spec}.resourceClaims) && size({spec}.resourceClaims) > 0) || {found}"
        return found


def all_of(tests: Sequence[str]) -> str:
    """`tests` as one CEL condition that stops at the first false one. The API server evaluates every match
    condition of a policy whatever the others answered, so tests kept apart are all paid for: joined,
    cheapest first, the costly ones run only for what the cheap ones let through."""
    return " && ".join(f"({test})" for test in tests)


def controlled_by(root: str, kinds: Sequence[str]) -> str:
    return (
        f"(has({root}.metadata.ownerReferences) && {root}.metadata.ownerReferences.exists(r,"
        f" has(r.controller) && r.controller == true && r.kind in {literal(list(kinds))}))"
    )


def mirror(root: str) -> str:
    return f"(has({root}.metadata.annotations) && {literal(MIRROR_POD_ANNOTATION)} in {root}.metadata.annotations)"


TEMPLATE_RESOURCES = {"batch": ["jobs", "cronjobs"], "apps": ["deployments", "statefulsets", "replicasets"]}


def resource_rules(groups: dict[str, list[str]], operations: list[str]) -> list[JSON]:
    return [
        {"apiGroups": [group], "apiVersions": ["v1"], "operations": operations, "resources": resources}
        for group, resources in groups.items()
    ]


def policy_name(rule: RuleId) -> str:
    """gpuguard-<rule in kebab case>: readinessTolerations is gpuguard-readiness-tolerations."""
    return "gpuguard-" + re.sub(r"(?<!^)(?=[A-Z])", "-", rule).lower()
