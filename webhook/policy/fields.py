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
from typing import Any, TypeAlias, TypedDict, Union

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


Check = Callable[[Any], None]
_TYPED_DICT: Any = TypedDict  # called with a computed mapping, which mypy's TypedDict() does not allow


def _level(tree: FieldTree, name: str) -> tuple[Any, Check]:
    """A TypedDict for one level of `tree` (msgspec decodes it into a plain dict of just those keys), and
    the check that no level it decodes came out empty.

    Every key may be absent (left out, as `narrow` leaves it out) or null (kept as None, as `narrow` keeps
    any value that is not a mapping or a list). A level holding none of the tree's keys would decode to
    {} where `narrow` keeps the whole value: the check refuses it.
    """
    annotations: dict[str, Any] = {}
    below_levels: list[tuple[str, Check]] = []
    below_lists: list[tuple[str, Check]] = []
    for key, below in tree.items():
        if below is None:
            annotations[key] = Any
        elif isinstance(below, tuple):
            item_type, item_check = _level(below[0], f"{name}_{key}")
            annotations[key] = Union[list[item_type], None]  # type: ignore[valid-type]  # noqa: UP007
            below_lists.append((key, item_check))
        else:
            level_type, level_check = _level(below, f"{name}_{key}")
            annotations[key] = Union[level_type, None]  # noqa: UP007
            below_levels.append((key, level_check))
    typed = _TYPED_DICT(name, annotations, total=False)

    def check(level: dict[str, Any]) -> None:
        if not level:
            raise NotPartial("a level holds none of the keys the tree keeps: it may hold others")
        for key, check_below in below_levels:
            item = level.get(key)
            if item is not None:
                check_below(item)
        for key, check_item in below_lists:
            items = level.get(key)
            if items is not None:
                for item in items:
                    check_item(item)

    return typed, check


class PartialDecoder:
    """JSON bytes to exactly what `narrow(orjson.loads(data), tree)` makes, for documents whose every cut
    level is a JSON object keeping at least one of its keys; `NotPartial` for any other.

    Two differences from orjson on data no API server sends: integers beyond 64 bits stay integers
    (orjson makes floats of them), and strings in skipped parts are not checked for valid UTF-8.
    """

    def __init__(self, tree: FieldTree, name: str) -> None:
        typed, self._check = _level(tree, name)
        self._decoder = msgspec.json.Decoder(typed)

    def decode(self, data: bytes | bytearray) -> dict[str, Any]:
        try:
            decoded: dict[str, Any] = self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            # Too deep for msgspec is what orjson refuses too: the whole decoding says so in its words.
            raise NotPartial(str(exc)) from exc
        self._check(decoded)
        return decoded
