"""Policy YAML as gpuguard reads it: YAML 1.2 booleans, and bounded before anything is built from it.

A policy arrives from whoever may edit a ConfigMap or a mounted file, and is read on a thread the server
depends on, so reading it must neither take the process down nor stall it:

- Only `true` and `false` are booleans (YAML 1.2). YAML 1.1 also reads `yes`, `no`, `on` and `off` as
  booleans, which would make `mode: no` mean "off" and `enabled: off` a boolean nobody wrote; here they
  stay the strings they look like, so a bare `off` is the mode `off` and `enabled: no` is refused.
- The text, the nesting depth and the number of values after alias expansion are bounded: a deeply
  nested document would exhaust the interpreter's recursion, and a few kilobytes of aliases (a "billion
  laughs") expand into millions of values, all of which validation would walk.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

# The default policy is 5 KB, nests 5 deep (a selector expression's values 6) and holds about 150 values;
# ten thousand namespace names take about 100 KB and 10,000 values. Reading the largest text these
# bounds let through takes about a second of pure-Python parsing.
MAX_TEXT_BYTES = 512 * 1024
MAX_DEPTH = 32
MAX_VALUES = 50_000  # scalars, lists and mappings, each alias counted as what it expands to

_BOOL_TAG = "tag:yaml.org,2002:bool"


class PolicyTextError(ValueError):
    """Text that is not a policy document gpuguard will read; the message says which bound or rule."""


class _PolicyLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 booleans and a bound on how deep the document nests."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        # The composer recurses once per level: refuse before the interpreter's own limit is reached.
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
                raise PolicyTextError(f"policy nests deeper than {MAX_DEPTH} levels (line {mark.line + 1})")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


# YAML 1.1's booleans dropped, YAML 1.2's put back: copies, so PyYAML's own loaders keep theirs.
_PolicyLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_PolicyLoader.add_implicit_resolver(
    _BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def _check_expansion(root: Node) -> None:
    """Refuses a document whose aliases expand past MAX_VALUES values or MAX_DEPTH levels, or loop.

    Each node is measured once (aliases share nodes), so this costs the size of the text, not of the
    expansion.
    """
    measured: dict[int, tuple[int, int]] = {}  # id(node) -> (values, depth) once expanded
    in_progress: set[int] = set()

    def measure(node: Node) -> tuple[int, int]:
        key = id(node)
        if key in measured:
            return measured[key]
        if key in in_progress:
            raise PolicyTextError("policy holds an alias that refers to itself")
        in_progress.add(key)
        children: list[Node] = []
        if isinstance(node, SequenceNode):
            children = list(node.value)
        elif isinstance(node, MappingNode):
            children = [part for pair in node.value for part in pair]
        values, depth = 1, 1
        for child in children:
            child_values, child_depth = measure(child)
            values += child_values
            depth = max(depth, child_depth + 1)
            if values > MAX_VALUES:
                raise PolicyTextError(f"policy expands to more than {MAX_VALUES} values (aliases included)")
            if depth > MAX_DEPTH:
                raise PolicyTextError(f"policy nests deeper than {MAX_DEPTH} levels once aliases expand")
        in_progress.discard(key)
        measured[key] = (values, depth)
        return values, depth

    measure(root)


def load_policy_yaml(text: str) -> Any:
    """The one YAML document in `text` (None when empty), or PolicyTextError / yaml.YAMLError."""
    size = len(text.encode("utf-8", errors="replace"))
    if size > MAX_TEXT_BYTES:
        raise PolicyTextError(f"policy is {size} bytes, more than the {MAX_TEXT_BYTES} a policy may hold")
    loader = _PolicyLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None
        _check_expansion(root)
        return loader.construct_document(root)
    finally:
        loader.dispose()
