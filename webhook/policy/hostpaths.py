"""Host paths, and whether a hostPath mount reaches what a device-software path pattern names.

A pattern is a host path whose components may hold glob characters (`/dev/nvidia*`). A mount reaches it
when every component the two have in common matches: the mount is the path (`/dev/nvidia0`), lies
inside it (`/var/lib/kubelet/device-plugins/kubelet.sock`), or is a directory above it (`/dev`,
`/var/lib/kubelet`, `/`), because a container holding a parent directory holds everything below it.
Nothing follows symlinks here, except `/var/run`, which is `/run` on every distribution a kubelet runs on.
"""

from __future__ import annotations

import re
from fnmatch import translate

Components = tuple[str, ...]
# A pattern's components: plain ones compared as strings, glob ones as compiled expressions (admission
# checks every mount against every pattern, so nothing is translated per request).
Pattern = tuple["str | re.Pattern[str]", ...]


def components(path: str) -> Components | None:
    """The components of an absolute host path, `.` and `..` resolved; None for a relative path."""
    if not path.startswith("/"):
        return None
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if parts:
                parts.pop()
            continue
        parts.append(part)
    if parts[:2] == ["var", "run"]:
        parts = ["run", *parts[2:]]
    return tuple(parts)


def joined(path: str, sub_path: str) -> str:
    return f"{path.rstrip('/')}/{sub_path}" if sub_path else path


def compile_pattern(parts: Components) -> Pattern:
    return tuple(re.compile(translate(part)) if any(c in part for c in "*?[") else part for part in parts)


def reaches(mount: Components, pattern: Pattern) -> bool:
    for part, glob in zip(mount, pattern, strict=False):
        if not (part == glob if isinstance(glob, str) else glob.match(part)):
            return False
    return True


def render(parts: Components) -> str:
    return "/" + "/".join(parts)
