"""The validating rules as ValidatingAdmissionPolicies: the accelerator node guard and trusted device
software (image references read as the container runtime reads them)."""

from __future__ import annotations

from webhook.policy import hostpaths
from webhook.policy.model import SYSTEM_PRIORITY_PREFIX, Policy
from webhook.policy.nativecel import (
    API_VERSION,
    EMPTY,
    MANAGED_BY,
    SPEC,
    TEMPLATE_RESOURCES,
    UNNAMED,
    Cel,
    cel_map,
    controlled_by,
    field_or,
    glob_regex,
    literal,
    mirror,
    policy_name,
    resource_rules,
    spec_of,
)
from webhook.policy.workload import JSON, SYSTEM_CRITICAL_PRIORITY

# rules._exempt_pod, and a pod's priority and affinity cannot change after its creation.
NOT_AN_EXEMPT_POD: JSON = {
    "name": "not-an-exempt-pod",
    "expression": "request.kind.kind != 'Pod' || (request.operation == 'CREATE' &&"
    f" !{controlled_by('object', ['DaemonSet'])} && !{mirror('object')})",
}


def validating_policy(
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
            "matchConstraints": {"resourceRules": resource_rules(groups, ["CREATE", "UPDATE"])},
            "matchConditions": conditions,
            "variables": variables,
            "validations": validations,
        },
    }


def _guard_violation(root: str, policy: Policy, cel: Cel) -> str:
    """rules.accelerator_node_guard on `root` (object or oldObject), the nodeName lookup aside."""
    accelerators = policy.accelerators
    spec = spec_of(root)
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
    name = field_or(spec, "priorityClassName", EMPTY)
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


def accelerator_node_guard(policy: Policy, cel: Cel) -> JSON:
    threshold = policy.rules.acceleratorNodeGuard.minPriority
    # An update is denied only for what it introduces: an existing workload stays manageable.
    violates = "variables.violates && (request.operation == 'CREATE' || !variables.violatedBefore)"
    message = (
        f"'acceleratorNodeGuard: priority below {threshold} on accelerator nodes:"
        f" set a priorityClassName with value >= {threshold}'"
    )
    return validating_policy(
        policy_name("acceleratorNodeGuard"),
        {"": ["pods"], **TEMPLATE_RESOURCES},
        [NOT_AN_EXEMPT_POD],
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


def image_reference(image: str) -> str:
    """str(images.parse(image)): the normalised name, its tag (:latest without tag or digest), its digest."""
    name = f"{image}.split('@')[0]"
    tagged = f"{name}.lastIndexOf(':') > {name}.lastIndexOf('/')"
    tag = f"({tagged} ? {name}.substring({name}.lastIndexOf(':')) : {image}.contains('@') ? '' : ':latest')"
    digest = f"({image}.contains('@') ? '@' + {image}.split('@')[1] : '')"
    return f"({_image_name(image)} + {tag} + {digest})"


# images.py's grammar, in RE2: what is no image reference is never trusted.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*|\[[0-9A-Fa-f:]+\])(?::[0-9]+)?"
REFERENCE = (
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
        f"{field_or(container, 'volumeMounts', '[]')}.exists(m, has(m.name) && m.name in {host_paths} &&"
        f" {host_paths}[m.name].startsWith('/') && ({parts}.exists(p, p == '..') || {reaches}))"
    )


def _checked_containers(root: str) -> str:
    """rules._checked_containers, each as {role, name, image, volumeMounts}."""
    spec = spec_of(root)
    tagged = [
        f"{field_or(spec, field, '[]')}.map(c, {cel_map({'role': literal(role), 'name': field_or('c', 'name', UNNAMED), 'image': field_or('c', 'image', EMPTY), 'volumeMounts': field_or('c', 'volumeMounts', '[]')})})"
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
        f"({image}.matches({literal(REFERENCE)}) && {literal(list(rule.trustedImages))}.exists(p,"
        f" p.endsWith('/') ? {name}.startsWith(p) : {name} == p)"
        + (f" && {image}.matches('@sha256:[0-9a-f]{{64}}$')" if rule.requireDigest else "")
        + ")"
    )
    variables: list[JSON] = [{"name": "patterns", "expression": literal(patterns)}]
    for root, suffix in (("object", ""), ("oldObject", "Before")):
        volumes = f"{field_or(spec_of(root), 'volumes', '[]')}.filter(v, has(v.hostPath))"
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
                "expression": f"{volumes}.transformMapEntry(i, v, {{v.name: {field_or('v.hostPath', 'path', EMPTY)}}})",
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
    return validating_policy(
        policy_name("trustedDeviceSoftware"),
        {
            "": ["pods", "pods/ephemeralcontainers"],
            "batch": ["jobs", "cronjobs"],
            "apps": ["deployments", "statefulsets", "replicasets", "daemonsets"],
        },
        [
            {"name": "not-a-mirror-pod", "expression": f"request.kind.kind != 'Pod' || !{mirror('object')}"},
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
