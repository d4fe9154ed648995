"""Node selection as the scheduler reads it, and a minimum on an integer node label merged into it.

A pod may land on a node when its `nodeSelector` labels all match AND, if it has a required node
affinity, ANY of its `nodeSelectorTerms` matches; a term matches when ALL its matchExpressions and
matchFields do, and an empty term matches no node. So a requirement that must hold wherever the pod
lands goes into every non-empty term (ANDed there); a pod without required terms gets one holding it
alone; empty terms stay empty, since filling one would let the pod onto nodes it could never reach.
`Gt`/`Lt` compare a label parsed as an integer, and a label that does not parse never matches.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from webhook.policy.workload import JSON, as_dict, dicts, text

REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
_INTEGER = re.compile(r"[+-]?[0-9]+")  # what Go's strconv.ParseInt accepts


def integer(value: object) -> int | None:
    return int(value) if isinstance(value, str) and _INTEGER.fullmatch(value) else None


def _values(expression: JSON) -> list[Any]:
    values = expression.get("values")
    return values if isinstance(values, list) else []


def expression_matches(expression: JSON, labels: Mapping[str, str]) -> bool:
    key, operator, values = text(expression.get("key")), expression.get("operator"), _values(expression)
    present = key in labels
    if operator == "In":
        return present and labels[key] in values
    if operator == "NotIn":
        return not present or labels[key] not in values
    if operator == "Exists":
        return present
    if operator == "DoesNotExist":
        return not present
    if operator in ("Gt", "Lt") and present and len(values) == 1:
        label, bound = integer(labels[key]), integer(values[0])
        if label is None or bound is None:
            return False
        return label > bound if operator == "Gt" else label < bound
    return False


def _field_matches(expression: JSON, node_name: str) -> bool:
    # metadata.name is the only field a node selector term may name.
    if expression.get("key") != "metadata.name":
        return False
    inside = node_name in _values(expression)
    return (
        inside if expression.get("operator") == "In" else expression.get("operator") == "NotIn" and not inside
    )


def is_empty(term: JSON) -> bool:
    return not any(dicts(term.get("matchExpressions"))) and not any(dicts(term.get("matchFields")))


def term_matches(term: JSON, node_name: str, labels: Mapping[str, str]) -> bool:
    if is_empty(term):
        return False
    return all(expression_matches(e, labels) for e in dicts(term.get("matchExpressions"))) and all(
        _field_matches(e, node_name) for e in dicts(term.get("matchFields"))
    )


def required_terms(pod_spec: JSON) -> list[Any] | None:
    """The required nodeSelectorTerms as written ([] when present but empty); None without any."""
    affinity = as_dict(pod_spec.get("affinity")) or {}
    required = as_dict((as_dict(affinity.get("nodeAffinity")) or {}).get(REQUIRED))
    if required is None:
        return None
    terms = required.get("nodeSelectorTerms")
    return terms if isinstance(terms, list) else []


def selects(pod_spec: JSON, node_name: str, labels: Mapping[str, str]) -> bool:
    """Whether the pod's required node selection admits this node (taints and resources aside)."""
    selector = as_dict(pod_spec.get("nodeSelector")) or {}
    if any(labels.get(key) != value for key, value in selector.items()):
        return False
    terms = required_terms(pod_spec)
    return terms is None or any(term_matches(term, node_name, labels) for term in dicts(terms))


# --- a minimum on an integer label ------------------------------------------------------------------


def at_least(key: str, minimum: int) -> JSON:
    """The expression `key >= minimum`, as node affinity spells it."""
    return {"key": key, "operator": "Gt", "values": [str(minimum - 1)]}


def _on_key(term: JSON, key: str) -> Iterator[JSON]:
    return (e for e in dicts(term.get("matchExpressions")) if e.get("key") == key)


def _guarantees(expression: JSON, minimum: int) -> bool:
    values = [integer(v) for v in _values(expression)]
    if expression.get("operator") == "Gt":
        return len(values) == 1 and values[0] is not None and values[0] >= minimum - 1
    if expression.get("operator") == "In":
        return bool(values) and all(v is not None and v >= minimum for v in values)
    return False


def _excludes(expression: JSON, minimum: int) -> bool:
    """No label value with an integer >= minimum satisfies the expression."""
    operator, values = expression.get("operator"), [integer(v) for v in _values(expression)]
    if operator == "In":
        return all(v is None or v < minimum for v in values)
    if operator == "Lt":
        return len(values) != 1 or values[0] is None or values[0] <= minimum
    if operator == "Gt":
        return len(values) != 1 or values[0] is None
    return operator == "DoesNotExist"


def _selector_value(pod_spec: JSON, key: str) -> object:
    return (as_dict(pod_spec.get("nodeSelector")) or {}).get(key)


def guarantees_minimum(pod_spec: JSON, key: str, minimum: int) -> bool:
    """Every node the pod may land on has `key` >= minimum."""
    pinned = integer(_selector_value(pod_spec, key))
    if pinned is not None and pinned >= minimum:
        return True
    terms = required_terms(pod_spec)
    if terms is None:
        return False
    return all(
        any(_guarantees(e, minimum) for e in _on_key(term, key))
        for term in dicts(terms)
        if not is_empty(term)
    )


def excluding_reason(pod_spec: JSON, key: str, minimum: int) -> str | None:
    """What in the pod's own node selection rules out every node with `key` >= minimum, if anything."""
    pinned = _selector_value(pod_spec, key)
    if pinned is not None and (integer(pinned) is None or (integer(pinned) or 0) < minimum):
        return f"nodeSelector {key}={pinned}"
    terms = [term for term in dicts(required_terms(pod_spec) or []) if not is_empty(term)]
    if not terms:
        return None
    reasons = []
    for term in terms:
        excluding = next((e for e in _on_key(term, key) if _excludes(e, minimum)), None)
        if excluding is None:
            return None
        values = ",".join(str(v) for v in _values(excluding))
        reasons.append(f"{excluding.get('operator')} {values}".strip())
    return f"every node affinity term ({'; '.join(reasons)} on {key})"


def _affinity_part(pod_spec: JSON, name: str) -> tuple[JSON, JSON] | None:
    """(affinity, affinity[name]) as they are, or new empty ones not attached yet; None when malformed."""
    affinity = pod_spec.get("affinity")
    affinity = {} if affinity is None else affinity
    part = affinity.get(name) if isinstance(affinity, dict) else None
    part = {} if part is None else part
    return (affinity, part) if isinstance(affinity, dict) and isinstance(part, dict) else None


def _attach(pod_spec: JSON, affinity: JSON, name: str, part: JSON) -> None:
    affinity[name] = part
    pod_spec["affinity"] = affinity


def require_minimum(pod_spec: JSON, key: str, minimum: int) -> bool:
    """Merges `key` >= minimum into the required node affinity; True when something changed."""
    found = None if guarantees_minimum(pod_spec, key, minimum) else _affinity_part(pod_spec, "nodeAffinity")
    if found is None:
        return False  # already guaranteed, or malformed (the API server's validation will say so)
    affinity, node_affinity = found
    required = node_affinity.get(REQUIRED)
    if required is None:
        node_affinity[REQUIRED] = {"nodeSelectorTerms": [{"matchExpressions": [at_least(key, minimum)]}]}
        _attach(pod_spec, affinity, "nodeAffinity", node_affinity)
        return True
    changed = False
    for term in dicts((as_dict(required) or {}).get("nodeSelectorTerms")):
        if is_empty(term) or any(_guarantees(e, minimum) for e in _on_key(term, key)):
            continue
        expressions = term.get("matchExpressions")
        if expressions is None:
            term["matchExpressions"] = [at_least(key, minimum)]
        elif isinstance(expressions, list):
            expressions.append(at_least(key, minimum))
        else:
            continue
        changed = True
    return changed


# --- one value of a label across the pods of a Job -------------------------------------------------

# Set by the Job controller on each of its pods; unique per Job, so `matchLabelKeys` (which the API
# server resolves from the pod's own labels when the pod is created) scopes the term to one Job's pods,
# including Jobs created with generateName whose name is unknown at admission.
JOB_UID_LABEL = "batch.kubernetes.io/controller-uid"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"


def same_label_across_job(topology_key: str) -> JSON:
    return {
        "labelSelector": {"matchExpressions": [{"key": JOB_NAME_LABEL, "operator": "Exists"}]},
        "matchLabelKeys": [JOB_UID_LABEL],
        "topologyKey": topology_key,
    }


def require_same_label_across_job(pod_spec: JSON, topology_key: str) -> bool:
    """Adds a required pod affinity putting every pod of the Job in one `topology_key` domain."""
    found = _affinity_part(pod_spec, "podAffinity")
    if found is None:
        return False
    affinity, pod_affinity = found
    terms = pod_affinity.get(REQUIRED)
    terms = [] if terms is None else terms
    if not isinstance(terms, list) or any(
        term.get("topologyKey") == topology_key and JOB_UID_LABEL in (term.get("matchLabelKeys") or [])
        for term in dicts(terms)
    ):
        return False
    terms.append(same_label_across_job(topology_key))
    pod_affinity[REQUIRED] = terms
    _attach(pod_spec, affinity, "podAffinity", pod_affinity)
    return True
