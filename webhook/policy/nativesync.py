"""What the controllers' leader keeps in the cluster for `admission.mode`: the native admission policies
(webhook.policy.native) the mode wants, and the writes that take the objects gpuguard owns there.

Pure: the leader (webhook.controllers.nativesync) reads what it owns, asks `plan` what to write, and
writes it at the resourceVersion read. Ownership is a label of its own, not native.py's
`app.kubernetes.io/managed-by`: the output of `gpuguard policy compile` applied by hand carries that one
too, and is the operator's, never deleted or overwritten here.

The API server defaults fields of what it stores (`matchPolicy`, empty selectors, ...), so a stored
object never equals the one sent. Each object carries instead the hash of what was sent: an object is
rewritten when the hash of what the policy wants differs (the policy changed), or when it no longer holds
every field that was sent (someone edited it), never because the server filled in a default.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from webhook.policy.model import Policy
from webhook.policy.native import Compiled, compile_policy, fail_closed
from webhook.policy.workload import JSON

OWNER_LABEL = "gpuguard.io/owner"
OWNER = "gpuguard-controllers"
HASH_ANNOTATION = "gpuguard.io/object-hash"
# The kinds it writes and their resources, policies before bindings: the order creates and updates go
# in, so a binding never names a policy older than itself for longer than it must.
RESOURCES: dict[str, str] = {
    "MutatingAdmissionPolicy": "mutatingadmissionpolicies",
    "ValidatingAdmissionPolicy": "validatingadmissionpolicies",
    "MutatingAdmissionPolicyBinding": "mutatingadmissionpolicybindings",
    "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings",
}

Key = tuple[str, str]  # kind, name


@dataclass(frozen=True)
class Owned:
    """One object gpuguard owns, as the cluster holds it."""

    kind: str
    name: str
    hash: str
    resource_version: str
    fields: JSON  # its labels, annotations, ownerReferences and spec, as stored

    @property
    def key(self) -> Key:
        return self.kind, self.name


@dataclass(frozen=True)
class Write:
    verb: Literal["create", "update", "delete"]
    kind: str
    name: str
    body: JSON | None = None  # create, update: the whole object (an update carries resource_version)
    resource_version: str = ""  # update, delete: the version read; the write fails if it changed


def _hash(obj: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def owned_object(obj: JSON, owner: JSON) -> JSON:
    """`obj` (a compiled object) marked as gpuguard's, owned by `owner` (an ownerReference), with the
    hash of what it says."""
    metadata = obj["metadata"]
    marked = {
        **obj,
        "metadata": {
            **metadata,
            "labels": {**metadata.get("labels", {}), OWNER_LABEL: OWNER},
            "ownerReferences": [owner],
        },
    }
    marked["metadata"]["annotations"] = {**metadata.get("annotations", {}), HASH_ANNOTATION: _hash(marked)}
    return marked


def namespace_owner(name: str, uid: str) -> JSON:
    """The ownerReference to gpuguard's Namespace: uninstalling gpuguard deletes the Namespace, and the
    garbage collector the objects, though no controller is left to (they are cluster-scoped, and so is
    a Namespace; no blockOwnerDeletion, which would need rights on the Namespace's finalizers)."""
    return {"apiVersion": "v1", "kind": "Namespace", "name": name, "uid": uid}


# The webhook configuration whose failurePolicy each kind of compiled policy follows.
FOLLOWS: dict[str, str] = {
    "MutatingAdmissionPolicy": "MutatingWebhookConfiguration",
    "ValidatingAdmissionPolicy": "ValidatingWebhookConfiguration",
}


def failing_closed(configurations: Mapping[str, JSON | None]) -> frozenset[str]:
    """The kinds of compiled policy that fail closed: those whose webhook configuration (as stored, by
    kind) has a webhook with `failurePolicy: Fail` (deploy/fail-closed/, the chart's `failurePolicy`).
    The operator chose to refuse a workload rather than admit it unchecked; a native policy that cannot
    evaluate (a CEL runtime error, the cost limit) would otherwise admit it unchecked where the webhook
    it stands in for would refuse it. A configuration not installed leaves its kind failing open."""
    return frozenset(
        kind
        for kind, configuration in FOLLOWS.items()
        if any(
            w.get("failurePolicy") == "Fail"
            for w in (configurations.get(configuration) or {}).get("webhooks") or []
        )
    )


def wanted(
    policy: Policy,
    owner: JSON,
    compile: Callable[[Policy], Compiled] = compile_policy,
    closed: frozenset[str] = frozenset(),
) -> list[JSON]:
    """The objects `policy` wants in the cluster: none in webhook mode (and none when the kill switch
    is off: compile_policy gives none), else every compiled object, marked, the policies of the kinds
    `closed` names failing closed. Raises what compiling raises: the caller keeps what it has."""
    if policy.admission.mode == "webhook":
        return []
    return [owned_object(obj, owner) for obj in fail_closed(compile(policy).objects, closed)]


def owned(raw: Mapping[str, Any]) -> Owned | None:
    """An object as listed, if it is gpuguard's (the informers list by OWNER_LABEL; this checks again)."""
    metadata = raw.get("metadata")
    kind = raw.get("kind")
    if not isinstance(metadata, dict) or kind not in RESOURCES:
        return None
    if (metadata.get("labels") or {}).get(OWNER_LABEL) != OWNER:
        return None
    return Owned(
        kind=str(kind),
        name=str(metadata.get("name", "")),
        hash=str((metadata.get("annotations") or {}).get(HASH_ANNOTATION, "")),
        resource_version=str(metadata.get("resourceVersion", "")),
        fields={"metadata": _kept(metadata), "spec": raw.get("spec")},
    )


def holds(stored: Any, sent: Any) -> bool:
    """Whether `stored` still says everything `sent` said: the API server only adds defaults to what it
    is sent (maps gain keys; lists keep their length and order), so anything else is someone's edit."""
    if isinstance(sent, dict):
        return isinstance(stored, dict) and all(k in stored and holds(stored[k], v) for k, v in sent.items())
    if isinstance(sent, list):
        return (
            isinstance(stored, list)
            and len(stored) == len(sent)
            and all(holds(s, v) for s, v in zip(stored, sent, strict=True))
        )
    return bool(stored == sent)


def _kept(metadata: JSON) -> JSON:
    return {key: metadata[key] for key in ("labels", "annotations", "ownerReferences") if key in metadata}


def _order(kind: str) -> int:
    return list(RESOURCES).index(kind)


def plan(want: Iterable[JSON], have: Iterable[Owned]) -> list[Write]:
    """The writes that take `have` (what gpuguard owns) to `want`: creates and updates, policies first,
    then deletes, bindings first (a policy outlives the bindings naming it). Nothing when they agree."""
    current = {o.key: o for o in have}
    wanted_keys: set[Key] = set()
    writes: list[Write] = []
    for obj in sorted(want, key=lambda o: _order(o["kind"])):
        kind, name = str(obj["kind"]), str(obj["metadata"]["name"])
        wanted_keys.add((kind, name))
        found = current.get((kind, name))
        if found is None:
            writes.append(Write("create", kind, name, obj))
        elif found.hash != obj["metadata"]["annotations"][HASH_ANNOTATION] or not holds(
            found.fields, {"metadata": _kept(obj["metadata"]), "spec": obj["spec"]}
        ):
            body = {**obj, "metadata": {**obj["metadata"], "resourceVersion": found.resource_version}}
            writes.append(Write("update", kind, name, body, found.resource_version))
    gone = sorted(
        (o for o in current.values() if o.key not in wanted_keys), key=lambda o: (-_order(o.kind), o.name)
    )
    writes += [Write("delete", o.kind, o.name, resource_version=o.resource_version) for o in gone]
    return writes
