"""Manifests written as YAML that every reader reads back as written: `gpuguard mutate | kubectl apply`.

PyYAML quotes a string only when its own YAML 1.1 reader would take it for something else, so it writes
"0o17" and "1e3" bare, and a YAML 1.2 reader (or kubectl's, which also reads Go number literals) reads
back the numbers 15 and 1000: an env value or a label silently changed. Here a string is quoted whenever
any of those readers could take it for a null, a boolean, a number or a date. Quoting more than needed
changes nothing a reader sees; quoting less changes user data.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

# Booleans and nulls of YAML 1.1 (y/n included, as go-yaml reads them) and YAML 1.2, the merge key, and
# the special floats, signed or not; compared case-insensitively, which only ever quotes a little more.
_WORDS = frozenset(
    [
        "~",
        "null",
        "y",
        "n",
        "yes",
        "no",
        "on",
        "off",
        "true",
        "false",
        "<<",
        "=",
        "inf",
        "infinity",
        "nan",
        ".inf",
        ".nan",
    ]
)
# Anything that starts like a number: decimal, octal (0o17, 017), hex (0x1F), binary, exponents (1e3),
# digit separators (1_000; some YAML 1.2 readers take a bare `_` for a number too), sexagesimal (1:30),
# dates and timestamps (2001-12-14T21:59:43Z).
_NUMBER_LIKE = re.compile(r"[-+]?[._0-9][0-9A-Za-z_.:+\- ]*")


# Line breaks outside ASCII: PyYAML folds a quoted string at NEL (U+0085) or the Unicode line and
# paragraph separators, and a reader takes the fold for a space. Double quotes escape them (`\N`).
_UNICODE_BREAKS = re.compile("[\x85\u2028\u2029]")


def could_be_read_as_another_type(value: str) -> bool:
    return value.lower().lstrip("+-") in _WORDS or _NUMBER_LIKE.fullmatch(value) is not None


class _ManifestDumper(yaml.SafeDumper):
    pass


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    if could_be_read_as_another_type(value) or _UNICODE_BREAKS.search(value):
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style='"')
    return dumper.represent_str(value)


_ManifestDumper.add_representer(str, _represent_str)


def dump(obj: Any) -> str:
    """One YAML document, keys in the object's order, block style."""
    return yaml.dump(
        obj, Dumper=_ManifestDumper, sort_keys=False, default_flow_style=False, allow_unicode=True
    )
