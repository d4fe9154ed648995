"""The policy's error wording: what a user reads when a policy is refused.

PyYAML's and pydantic's complaints rewritten as one line each that a user can act on: every problem at
its path in one notation (`namespaces[1].names`), unknown keys and values with the closest valid one
suggested, and the name patterns in the words of the Kubernetes API's own errors.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Sequence
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

# The Kubernetes name patterns the policy's names must match (the schema's), worded below as the API's
# own errors word them.
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


def yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's complaint and where (line and column), without its `in "<unicode string>"`: the caller
    names the source, which PyYAML never knows for text."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return str(exc)

    def at(mark: yaml.Mark) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    problem, start = exc.problem_mark, exc.context_mark
    context = exc.context or ""
    # Where the construct that failed began (an unclosed `[`), when that is somewhere else.
    if (
        context
        and start is not None
        and (problem is None or (start.line, start.column) != (problem.line, problem.column))
    ):
        context += f" (from {at(start)})"
    what = ", ".join(part for part in (context, exc.problem) if part)
    mark = problem or start
    return f"{at(mark)}: {what}" if mark is not None else what


def describe_errors(error: ValidationError, model: type[BaseModel]) -> str:
    """`error` (from validating `model`) as one line a user can act on: each problem at its path in one
    notation (`namespaces[1].names`), unknown keys and values with the closest valid one suggested."""
    return "; ".join(_describe(item, model) for item in error.errors())


def _describe(item: ErrorDetails, model: type[BaseModel]) -> str:
    location = list(item["loc"])
    # A wrong key of a mapping is reported at the key, with a "[key]" marker after it.
    is_key = bool(location) and location[-1] == "[key]"
    if is_key:
        location.pop()
    given = item.get("input")
    if item["type"] == "extra_forbidden":
        fields = _fields_at(model, location[:-1])
        message = "unknown key" + (
            _did_you_mean(str(location[-1]), fields) or f" (expected one of: {', '.join(fields)})"
        )
    elif item["type"] == "literal_error":
        expected = str(item.get("ctx", {}).get("expected", ""))
        message = f"unknown {'key' if is_key else 'value'} {given!r}, expected {expected}"
        message += _did_you_mean(str(given), re.findall(r"'([^']*)'", expected))
    elif item["type"] in ("value_error", "assertion_error") and "error" in item.get("ctx", {}):
        message = str(item["ctx"]["error"])
    elif item["type"] == "missing":
        message = "required"
    elif item["type"] == "string_pattern_mismatch":
        pattern = str(item.get("ctx", {}).get("pattern", ""))
        message = f"{given!r} is not {_PATTERN_WORDS.get(pattern, f'matching {pattern}')}"
    else:
        message = item["msg"].replace("Input should be", "must be")
        if isinstance(given, str | int | float | bool):
            message += f", got {given!r}"
    path = field_path(location)
    return f"{path}: {message}" if path else message


# What the name patterns mean, in the words of the Kubernetes API's own errors.
_PATTERN_WORDS = {
    DNS_LABEL: "a valid name: lower-case letters, digits and '-', starting and ending with a letter or digit",
    DNS_SUBDOMAIN: "a valid name: lower-case letters, digits, '-' and '.', starting and ending with a letter or digit",
}


def field_path(location: Sequence[int | str]) -> str:
    """("namespaces", 1, "names") -> namespaces[1].names; a key that is not a plain word is quoted."""
    path = ""
    for part in location:
        if isinstance(part, int):
            path += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z0-9_-]+", part):
            path += f".{part}" if path else part
        else:
            path += f"[{json.dumps(part)}]"
    return path


def _did_you_mean(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _fields_at(model: type[BaseModel], location: Sequence[int | str]) -> list[str]:
    """The field names of the model found at `location` below `model` (none when it is no model)."""
    annotation: Any = model
    for part in location:
        if isinstance(part, int):
            continue  # an item of a list: its type is the model found inside the list's annotation
        found = _model_in(annotation)
        if found is None or part not in found.model_fields:
            return []
        annotation = found.model_fields[part].annotation
    found = _model_in(annotation)
    return list(found.model_fields) if found is not None else []


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model an annotation holds: itself, or inside `list[...]`, `X | None`, `Annotated[...]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in get_args(annotation):
        found = _model_in(argument)
        if found is not None:
            return found
    return None
