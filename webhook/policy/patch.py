"""A deterministic JSON Patch (RFC 6902) from the difference of two JSON documents.

Modelled on the differ the Go admission projects share (gomodules.xyz/jsonpatch): only add, remove and
replace; objects compared key by key in sorted order; lists compared by index, the surplus tail removed
from the end backwards and the new tail added. Every patch it emits applies to the original. Python's
`jsonpatch.make_patch` is avoided on purpose: it emits `move` ops whose order depends on the hash seed.
"""

from __future__ import annotations

from typing import Any

Operation = dict[str, Any]
_ABSENT = object()


def escape(token: str) -> str:
    """RFC 6901: `~` first, then `/`; `nvidia.com/gpu` becomes `nvidia.com~1gpu`."""
    if "~" not in token and "/" not in token:
        return token  # most keys: no copy
    return token.replace("~", "~0").replace("/", "~1")


def _same(a: Any, b: Any) -> bool:
    # JSON equality: 1 and True and 1.0 are different documents to the API server.
    return type(a) is type(b) and a == b


def diff(original: Any, mutated: Any) -> list[Operation]:
    operations: list[Operation] = []
    _diff(original, mutated, "", operations)
    return operations


def _diff(original: Any, mutated: Any, path: str, out: list[Operation]) -> None:
    if isinstance(original, dict) and isinstance(mutated, dict):
        # What both share (the engine copies only what rules write) is most of a document: find the keys
        # whose values are not the very same object first, in one pass without a call or a path string,
        # and sort only those (the order is that of all the keys, less ones that give no operation).
        differing = [key for key, after in mutated.items() if original.get(key, _ABSENT) is not after]
        differing += original.keys() - mutated.keys()
        for key in sorted(differing):
            if key not in mutated:
                out.append({"op": "remove", "path": f"{path}/{escape(key)}"})
            elif key not in original:
                out.append({"op": "add", "path": f"{path}/{escape(key)}", "value": mutated[key]})
            else:
                before, after = original[key], mutated[key]
                # Equal scalars need no call or path string either.
                if type(before) is type(after) and type(before) not in (dict, list) and before == after:
                    continue
                _diff(before, after, f"{path}/{escape(key)}", out)
    elif isinstance(original, list) and isinstance(mutated, list):
        common = min(len(original), len(mutated))
        for index in range(common):
            if original[index] is not mutated[index]:
                _diff(original[index], mutated[index], f"{path}/{index}", out)
        for index in range(len(original) - 1, common - 1, -1):
            out.append({"op": "remove", "path": f"{path}/{index}"})
        for index in range(common, len(mutated)):
            out.append({"op": "add", "path": f"{path}/{index}", "value": mutated[index]})
    elif not _same(original, mutated):
        out.append({"op": "replace", "path": path, "value": mutated})
