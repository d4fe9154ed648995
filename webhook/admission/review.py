"""AdmissionReview in, AdmissionReview out: bytes to bytes, no framework.

Whatever arrives, the answer is a well-formed AdmissionReview echoing the request's uid (empty when
there is none to echo): a malformed review is answered 400, an internal error fails open (allowed,
with a warning), because a bug in gpuguard must never block a cluster's pod creation.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

import orjson

from webhook.policy import engine, patch
from webhook.policy.facts import LOOKUPS, ClusterFacts
from webhook.policy.model import Policy
from webhook.policy.workload import as_dict

Endpoint = Literal["mutate", "validate"]
SUPPORTED_VERSIONS = ("admission.k8s.io/v1", "admission.k8s.io/v1beta1")
MAX_WARNING_CHARS = 119  # kubectl prints each warning on one line; the API server truncates long ones
INTERNAL_ERROR_WARNING = "gpuguard: internal error, admitted unchanged (see the webhook log)"

log = logging.getLogger("gpuguard.review")


# The parts of an object the rules read or write, as a tree: a mapping selects those keys of a mapping, a
# one-item tuple applies its tree to every item of a list, None keeps the value whole. /mutate runs the
# engine on the object cut down to this tree, and diffs that: managedFields, env, volumes and the like
# (most of a real pod) are then never copied or walked, so a request costs what the rules read, not what
# the API server sends. A rule that reads or writes a field outside the tree would silently see it absent:
# tests/unit/test_hot_path.py records every access the rules make and fails on one outside it.
FieldTree: TypeAlias = dict[str, "FieldTree | tuple[FieldTree] | None"]
_CONTAINER: FieldTree = {
    "name": None,
    "image": None,
    "resources": None,
    "lifecycle": None,
    "restartPolicy": None,
}
_POD_SPEC: FieldTree = {
    "containers": (_CONTAINER,),
    "initContainers": (_CONTAINER,),
    "resourceClaims": None,
    "restartPolicy": None,
    "tolerations": None,
    "terminationGracePeriodSeconds": None,
    "priorityClassName": None,
    "priority": None,
    "preemptionPolicy": None,
    "nodeSelector": None,
    "nodeName": None,
    "affinity": None,
}
_JOB_SPEC: FieldTree = {
    "podFailurePolicy": None,
    "backoffLimitPerIndex": None,
    "podReplacementPolicy": None,
    "parallelism": None,
    "completionMode": None,
    "template": {"metadata": {"annotations": None}, "spec": _POD_SPEC},
}
# One tree for every kind (workload.POD_SPEC_PATHS): a key a kind does not have is simply not there.
RULE_FIELDS: FieldTree = {
    "apiVersion": None,
    "kind": None,
    "metadata": {
        "name": None,
        "generateName": None,
        "namespace": None,
        "annotations": None,
        "ownerReferences": None,
    },
    "spec": _POD_SPEC | _JOB_SPEC | {"jobTemplate": {"spec": _JOB_SPEC}},
}


def narrow(value: Any, fields: FieldTree | tuple[FieldTree] | None = RULE_FIELDS) -> Any:
    """`value` cut down to `fields`, sharing what is kept whole; anything malformed is kept as it is."""
    if fields is None:
        return value
    if type(fields) is tuple:
        if type(value) is not list:
            return value
        return [narrow(item, fields[0]) for item in value]
    if type(value) is not dict:
        return value
    assert isinstance(fields, dict)
    kept = {key: narrow(item, fields[key]) for key, item in value.items() if key in fields}
    # Never empty what was not: `x or {}` and `if not x` must read the cut mapping as they read the whole.
    return kept if kept or not value else value


class BadReview(ValueError):
    """The body is not an AdmissionReview gpuguard can answer; `uid` is echoed when one was readable."""

    def __init__(self, message: str, uid: str = "") -> None:
        super().__init__(message)
        self.uid = uid


@dataclass(frozen=True)
class Answer:
    body: bytes
    allowed: bool
    decisions: tuple[engine.Decision, ...] = ()
    dry_run: bool = False
    summary: dict[str, Any] = field(default_factory=dict)


def _short(text: str) -> str:
    return text if len(text) <= MAX_WARNING_CHARS else text[: MAX_WARNING_CHARS - 1] + "…"


def warnings_for(decisions: Iterable[engine.Decision]) -> list[str]:
    """What kubectl prints: warn-mode findings, and notices from rules that are not in audit mode."""
    warnings: list[str] = []
    for decision in decisions:
        if decision.outcome == "notice" and decision.mode != "audit":
            warnings.append(_short(f"gpuguard: {decision.message}"))
        elif decision.mode == "warn" and decision.outcome == "would-apply":
            warnings.append(_short(f"gpuguard (warn) would {decision.message}"))
        elif decision.mode == "warn" and decision.outcome == "would-deny":
            warnings.append(_short(f"gpuguard (warn) would deny: {decision.message}"))
    return list(dict.fromkeys(warnings))


def fallback_warning(unavailable: Sequence[str]) -> str:
    """Says decisions fell back to the policy alone; the list of lookups is what gets shortened."""
    lookups = "all" if len(unavailable) == len(LOOKUPS) else ", ".join(unavailable)
    head, tail = "gpuguard: cluster lookups unavailable (", "); decided from the policy alone"
    room = MAX_WARNING_CHARS - len(head) - len(tail)
    return head + (lookups if len(lookups) <= room else lookups[: room - 1] + "…") + tail


def audit_annotations_for(decisions: Iterable[engine.Decision]) -> dict[str, str]:
    """One audit annotation per rule; the API server stores it as `<webhook name>/<rule>`."""
    by_rule: dict[str, list[str]] = {}
    for decision in decisions:
        by_rule.setdefault(decision.rule, []).append(f"{decision.outcome}: {decision.message}")
    return {rule: "; ".join(lines) for rule, lines in by_rule.items()}


def _response(api_version: str, uid: str, *, allowed: bool, **fields: Any) -> bytes:
    response = {"uid": uid, "allowed": allowed} | {key: value for key, value in fields.items() if value}
    return orjson.dumps({"apiVersion": api_version, "kind": "AdmissionReview", "response": response})


def rejected(
    message: str, *, code: int = 400, uid: str = "", api_version: str = SUPPORTED_VERSIONS[0]
) -> Answer:
    body = _response(api_version, uid, allowed=False, status={"code": code, "message": message})
    return Answer(body, allowed=False, summary={"uid": uid, "error": message, "code": code})


def _parse(body: bytes) -> tuple[str, dict[str, Any]]:
    try:
        review = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadReview(f"body is not JSON: {exc}") from exc
    if not isinstance(review, dict):
        raise BadReview("body is not a JSON object")
    request = as_dict(review.get("request"))
    uid = request.get("uid") if request is not None else None
    if request is None or not isinstance(uid, str) or not uid:
        raise BadReview("request.uid is missing")
    if review.get("kind") != "AdmissionReview":
        raise BadReview(f"kind must be AdmissionReview, got {review.get('kind')!r}", uid)
    api_version = review.get("apiVersion")
    if api_version not in SUPPORTED_VERSIONS:
        message = f"apiVersion must be one of {', '.join(SUPPORTED_VERSIONS)}, got {api_version!r}"
        raise BadReview(message, uid)
    return api_version, request


def _object_name(obj: object) -> str:
    # Pods created with generateName have no name yet in the mutating phase.
    metadata = as_dict((as_dict(obj) or {}).get("metadata")) or {}
    return str(metadata.get("name") or metadata.get("generateName") or "")


def _summary(endpoint: Endpoint, request: dict[str, Any], result: engine.Result) -> dict[str, Any]:
    kind = as_dict(request.get("kind")) or {}
    by_outcome: dict[str, list[str]] = {}
    for decision in result.decisions:
        by_outcome.setdefault(decision.outcome, []).append(f"{decision.rule}: {decision.message}")
    return {
        "uid": request.get("uid"),
        "endpoint": endpoint,
        "kind": kind.get("kind"),
        "namespace": request.get("namespace"),
        "name": request.get("name") or _object_name(request.get("object")),
        "operation": request.get("operation"),
        "dryRun": bool(request.get("dryRun")),
        "skipped": result.skipped,
        **by_outcome,
    }


def review(body: bytes, *, endpoint: Endpoint, policy: Policy, facts: ClusterFacts | None = None) -> Answer:
    """Answers one AdmissionReview for /mutate or /validate."""
    try:
        api_version, request = _parse(body)
    except BadReview as exc:
        return rejected(str(exc), uid=exc.uid)
    uid: str = request["uid"]
    try:
        return _answer(api_version, request, endpoint=endpoint, policy=policy, facts=facts)
    except Exception:
        log.exception("internal error answering %s review %s; failing open", endpoint, uid)
        body = _response(api_version, uid, allowed=True, warnings=[INTERNAL_ERROR_WARNING])
        return Answer(body, allowed=True, summary={"uid": uid, "endpoint": endpoint, "error": "internal"})


def _answer(
    api_version: str,
    request: dict[str, Any],
    *,
    endpoint: Endpoint,
    policy: Policy,
    facts: ClusterFacts | None,
) -> Answer:
    kind = as_dict(request.get("kind")) or {}
    context: dict[str, Any] = {
        "namespace": request.get("namespace") if isinstance(request.get("namespace"), str) else None,
        "operation": request.get("operation") if isinstance(request.get("operation"), str) else "",
        "group": kind.get("group") if isinstance(kind.get("group"), str) else None,
        "kind": kind.get("kind") if isinstance(kind.get("kind"), str) else None,
        "facts": facts,
    }
    obj = request.get("object")
    if endpoint == "mutate":
        result = engine.mutate(narrow(obj), policy, **context)
    else:
        # Validation copies nothing and walks only what it reads: the whole object costs it nothing more.
        result = engine.validate(obj, policy, old=request.get("oldObject"), **context)
    warnings = warnings_for(result.decisions)
    if facts is not None and facts.unavailable and result.skipped is None:
        warnings.append(fallback_warning(facts.unavailable))
    fields: dict[str, Any] = {
        "warnings": warnings,
        "auditAnnotations": audit_annotations_for(result.decisions),
    }
    denials = result.denied
    if denials:
        message = "; ".join(f"gpuguard {denial.rule}: {denial.message}" for denial in denials)
        fields["status"] = {"code": 403, "reason": "Forbidden", "message": message}
    elif result.changed:
        operations = patch.diff(result.original, result.obj)
        fields["patch"] = base64.b64encode(orjson.dumps(operations)).decode()
        fields["patchType"] = "JSONPatch"
    allowed = not denials
    body = _response(api_version, request["uid"], allowed=allowed, **fields)
    summary = _summary(endpoint, request, result) | {"allowed": allowed, "patched": "patch" in fields}
    return Answer(body, allowed, result.decisions, bool(request.get("dryRun")), summary)
