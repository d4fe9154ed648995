"""AdmissionReview in, AdmissionReview out: bytes to bytes, no framework.

Whatever arrives, the answer is a well-formed AdmissionReview echoing the request's uid wherever it
can be read (from the body's first bytes when the body is not JSON gpuguard can parse): a malformed
review is answered 400, an internal error fails open (allowed, with a warning), because a bug in
gpuguard must never block a cluster's pod creation (docs/design/2026-12-02-fail-open-admission.md).
Nothing taken from the body is repr'd or logged as it came: a value nested a thousand deep must not
turn an answer into a crash or lose its log line.
"""

from __future__ import annotations

import base64
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from webhook.policy import engine, patch
from webhook.policy.facts import LOOKUPS, ClusterFacts
from webhook.policy.fields import FieldTree, NotPartial, PartialDecoder, narrow
from webhook.policy.model import Policy
from webhook.policy.workload import as_dict

Endpoint = Literal["mutate", "validate"]
SUPPORTED_VERSIONS = ("admission.k8s.io/v1", "admission.k8s.io/v1beta1")
MAX_WARNING_CHARS = 119  # kubectl prints each warning on one line; the API server truncates long ones
INTERNAL_ERROR_WARNING = "gpuguard: internal error, admitted unchanged (see the webhook log)"
TOO_DEEP_WARNING = "gpuguard: object nests too deeply to be a Kubernetes object, admitted unchanged"
# Where the uid sits in what kube-apiserver sends: `request` opens with it (AdmissionRequest.UID comes
# first), so the first bytes of a body too large or too deep to parse still name it.
UID_SCAN_BYTES = 64 * 1024
_REQUEST_UID = re.compile(rb'"request"\s*:\s*\{\s*"uid"\s*:\s*"([^"\\]{1,256})"')
Result = Literal["allowed", "denied", "error"]

log = logging.getLogger("gpuguard.review")


# The parts of an object the rules read or write (webhook.policy.fields explains the tree). Reviews are
# decoded down to this tree for both endpoints: managedFields, env, volumes and the like (most of a real
# pod) are skipped as the JSON is parsed, never built, copied or walked, so a request costs what the
# rules read, not what the API server sends. A rule that reads or writes a field outside the tree would
# silently see it absent: tests/unit/admission/test_hot_path.py records every access the rules make and fails on
# one outside it.
_CONTAINER: FieldTree = {
    "name": None,
    "image": None,
    "resources": None,
    "lifecycle": None,
    "restartPolicy": None,
    "volumeMounts": None,
}
_POD_SPEC: FieldTree = {
    "containers": (_CONTAINER,),
    "initContainers": (_CONTAINER,),
    "ephemeralContainers": (_CONTAINER,),
    "volumes": ({"name": None, "hostPath": None},),
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
# One tree for every core kind (kinds.BUILTIN_KINDS): a key a kind does not have is simply not there.
# Custom resources (JobSets, Ray clusters, a policy's own kinds) keep their templates anywhere: their
# objects are decoded whole.
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
# What the answer and the decision log read of the review around the objects.
REVIEW_FIELDS: FieldTree = {
    "apiVersion": None,
    "kind": None,
    "request": {
        "uid": None,
        "kind": None,
        "namespace": None,
        "name": None,
        "operation": None,
        "dryRun": None,
        "object": RULE_FIELDS,
        "oldObject": RULE_FIELDS,
    },
}
_PARTIAL = PartialDecoder(REVIEW_FIELDS, "AdmissionReview")


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
    # No decision was made: the body was not a review gpuguard could answer, or answering it failed.
    error: bool = False

    @property
    def result(self) -> Result:
        """What the request counts as in gpuguard_admission_requests_total."""
        return "error" if self.error else "allowed" if self.allowed else "denied"


def uid_in(prefix: bytes) -> str:
    """The request uid in the first bytes of a body that could not be parsed, or ""."""
    match = _REQUEST_UID.search(prefix[:UID_SCAN_BYTES])
    return match.group(1).decode("utf-8", errors="replace") if match else ""


def _describe(value: object) -> str:
    """A value from the body, safe to put in a message or a log line: short, never a deep repr."""
    if isinstance(value, str):
        return repr(value if len(value) <= 64 else value[:63] + "…")
    if value is None or isinstance(value, bool | int | float):
        return repr(value)
    return f"a JSON {'object' if isinstance(value, dict) else 'array'}"


def _text(value: object) -> str | None:
    """A string field of the request for the log line; anything else is described, not copied."""
    if value is None or isinstance(value, str):
        return value
    return f"<{_describe(value)}>"


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
    return Answer(body, allowed=False, summary={"uid": uid, "error": message, "code": code}, error=True)


def _of_core_kind(review: Any, policy: Policy) -> bool:
    """Whether the review's objects are of a kind RULE_FIELDS describes (anything else is decoded whole)."""
    kind = as_dict((as_dict((as_dict(review) or {}).get("request")) or {}).get("kind")) or {}
    group, name = kind.get("group"), kind.get("kind")
    found = (
        policy.workload_kinds.get(group, name) if isinstance(group, str) and isinstance(name, str) else None
    )
    return found is None or found.core


def _decode(body: bytes | bytearray, policy: Policy) -> tuple[Any, bool]:
    """The review, and whether its objects are already cut down to RULE_FIELDS."""
    try:
        partial = _PARTIAL.decode(body)
        if _of_core_kind(partial, policy):
            return partial, True
    except NotPartial:
        pass  # decoded whole below: the same review, or the error a user can read
    try:
        return orjson.loads(body), False
    except orjson.JSONDecodeError as exc:
        raise BadReview(f"body is not JSON: {exc}", uid_in(bytes(body[:UID_SCAN_BYTES]))) from exc


def _parse(body: bytes | bytearray, policy: Policy) -> tuple[str, dict[str, Any], bool]:
    review, narrowed = _decode(body, policy)
    if not isinstance(review, dict):
        raise BadReview("body is not a JSON object")
    request = as_dict(review.get("request"))
    uid = request.get("uid") if request is not None else None
    if request is None or not isinstance(uid, str) or not uid:
        raise BadReview("request.uid is missing")
    if review.get("kind") != "AdmissionReview":
        raise BadReview(f"kind must be AdmissionReview, got {_describe(review.get('kind'))}", uid)
    api_version = review.get("apiVersion")
    if api_version not in SUPPORTED_VERSIONS:
        message = f"apiVersion must be one of {', '.join(SUPPORTED_VERSIONS)}, got {_describe(api_version)}"
        raise BadReview(message, uid)
    return api_version, request, narrowed


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
        "kind": _text(kind.get("kind")),
        "namespace": _text(request.get("namespace")),
        "name": _text(request.get("name") or _object_name(request.get("object"))),
        "operation": _text(request.get("operation")),
        "dryRun": bool(request.get("dryRun")),
        "skipped": result.skipped,
        **by_outcome,
    }


def review(
    body: bytes | bytearray, *, endpoint: Endpoint, policy: Policy, facts: ClusterFacts | None = None
) -> Answer:
    """Answers one AdmissionReview for /mutate or /validate."""
    try:
        api_version, request, narrowed = _parse(body, policy)
    except BadReview as exc:
        return rejected(str(exc), uid=exc.uid)
    uid: str = request["uid"]
    if not narrowed and _of_core_kind({"request": request}, policy):
        for key in ("object", "oldObject"):
            if key in request:
                request[key] = narrow(request[key], RULE_FIELDS)
    try:
        return _answer(api_version, request, endpoint=endpoint, policy=policy, facts=facts)
    except (RecursionError, orjson.JSONEncodeError):
        # A value nested hundreds deep: the API server decodes objects into their typed schema before
        # calling, so no real Pod or Job nests like that. Fail open without a traceback thousands of
        # frames long in the log.
        log.warning("%s review %s: object nests too deeply; failing open", endpoint, uid)
        return _failed_open(api_version, uid, endpoint, TOO_DEEP_WARNING, "too deep")
    except Exception:
        log.exception("internal error answering %s review %s; failing open", endpoint, uid)
        return _failed_open(api_version, uid, endpoint, INTERNAL_ERROR_WARNING, "internal")


def _failed_open(api_version: str, uid: str, endpoint: Endpoint, warning: str, error: str) -> Answer:
    body = _response(api_version, uid, allowed=True, warnings=[warning])
    summary = {"uid": uid, "endpoint": endpoint, "error": error}
    return Answer(body, allowed=True, summary=summary, error=True)


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
        result = engine.mutate(obj, policy, **context)
    else:
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
