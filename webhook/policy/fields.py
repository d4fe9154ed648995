"""The parts of a JSON document a reader needs, as a tree, and two ways to keep only those parts.

A tree maps the keys to keep at one level to what to keep below them: a mapping selects those keys of
a mapping, a one-item tuple applies its tree to every item of a list, None keeps the value whole.

`narrow` cuts decoded data down to a tree. `PartialDecoder` goes from the JSON bytes straight to what
`narrow` would have made, without building the rest: msgspec skips what the tree leaves out as it
parses, so a 10 KB pod of which the rules read 1 KB costs the decoding of about that 1 KB. Where it
cannot promise the same result as `narrow` (a level that is not what the tree expects, a level that
would come out empty, anything msgspec refuses), it says so and the caller decodes the whole document.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias, Union

import msgspec

FieldTree: TypeAlias = dict[str, "FieldTree | tuple[FieldTree] | None"]
Subtree: TypeAlias = "FieldTree | tuple[FieldTree] | None"


def narrow(value: Any, fields: Subtree) -> Any:
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


class NotPartial(ValueError):
    """The document cannot be decoded partially with the same result as `narrow`: decode all of it."""


Convert = Callable[[Any], Any]


def _each(convert: Convert) -> Convert:
    return lambda items: [convert(item) for item in items]


def _struct(tree: FieldTree, name: str) -> tuple[type[msgspec.Struct], Convert]:
    """A msgspec Struct type for one level of `tree`, and the function making its dict.

    Every field may be absent (UNSET: the key is left out, as `narrow` leaves it out) or null (kept as
    None, as `narrow` keeps any value that is not a mapping or a list).
    """
    fields: list[tuple[str, Any, Any]] = []
    nested: dict[str, Convert] = {}
    for key, below in tree.items():
        kind: Any
        if below is None:
            kind = Any
        elif isinstance(below, tuple):
            item_type, item_convert = _struct(below[0], f"{name}_{key}")
            kind = Union[list[item_type], None]  # type: ignore[valid-type]  # noqa: UP007
            nested[key] = _each(item_convert)
        else:
            level_type, nested[key] = _struct(below, f"{name}_{key}")
            kind = Union[level_type, None]  # noqa: UP007
        fields.append((key, Union[kind, msgspec.UnsetType], msgspec.UNSET))  # noqa: UP007
    # gc=False: decoded levels hold no cycles, and the collector need not track them.
    struct = msgspec.defstruct(name, fields, frozen=True, gc=False)
    names = tuple(tree)
    unset = msgspec.UNSET

    def convert(value: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in names:
            item = getattr(value, key)
            if item is unset:
                continue
            below = nested.get(key)
            out[key] = item if below is None or item is None else below(item)
        if not out:
            raise NotPartial("a level holds none of the keys the tree keeps: it may hold others")
        return out

    return struct, convert


class PartialDecoder:
    """JSON bytes to exactly what `narrow(orjson.loads(data), tree)` makes, for documents whose every cut
    level is a JSON object keeping at least one of its keys; `NotPartial` for any other.

    Two differences from orjson on data no API server sends: integers beyond 64 bits stay integers
    (orjson makes floats of them), and strings in skipped parts are not checked for valid UTF-8.
    """

    def __init__(self, tree: FieldTree, name: str) -> None:
        struct, self._convert = _struct(tree, name)
        self._decoder = msgspec.json.Decoder(struct)

    def decode(self, data: bytes | bytearray) -> dict[str, Any]:
        try:
            decoded = self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            # Too deep for msgspec is what orjson refuses too: the whole decoding says so in its words.
            raise NotPartial(str(exc)) from exc
        result: dict[str, Any] = self._convert(decoded)
        return result
