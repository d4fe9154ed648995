"""Host paths, and whether a hostPath mount reaches what a device-software path pattern names.

A pattern is a host path whose components may hold glob characters (`/dev/nvidia*`). A mount reaches it
when every component the two have in common matches: the mount is the path (`/dev/nvidia0`), lies
inside it (`/var/lib/kubelet/device-plugins/kubelet.sock`), or is a directory above it (`/dev`,
`/var/lib/kubelet`, `/`), because a container holding a parent directory holds everything below it.
Nothing follows symlinks here, except `/var/run`, which is `/run` on every distribution a kubelet runs on.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

Components = tuple[str, ...]


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


def reaches(mount: Components, pattern: Components) -> bool:
    return all(fnmatchcase(part, glob) for part, glob in zip(mount, pattern, strict=False))


def render(parts: Components) -> str:
    return "/" + "/".join(parts)
