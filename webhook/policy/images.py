"""Container image references, read the way the container runtime reads them.

A pod may say `rocm/k8s-device-plugin`, `docker.io/rocm/k8s-device-plugin:latest` or
`index.docker.io/rocm/k8s-device-plugin`: the runtime pulls the same repository for all three, so
every check compares the normalised form (distribution/reference's rules: a first component with a
`.` or `:`, or `localhost`, is a registry; otherwise the registry is Docker Hub, and a single name
lives under `library/`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DOCKER_HUB = "docker.io"
_DOCKER_HUB_ALIASES = frozenset({"docker.io", "index.docker.io", "registry-1.docker.io"})
_PATH_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_DOMAIN = re.compile(
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*|\[[0-9A-Fa-f:]+\])(?::[0-9]+)?"
)
_TAG = re.compile(r"[\w][\w.-]{0,127}")
_DIGEST = re.compile(r"[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[0-9a-fA-F]{32,}")
SHA256_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class ImageRef:
    registry: str  # lower case; docker.io for Docker Hub
    repository: str  # the path below the registry: library/busybox, nvidia/k8s-device-plugin
    tag: str | None
    digest: str | None

    @property
    def name(self) -> str:
        """registry/repository: what a trusted-image prefix is compared with."""
        return f"{self.registry}/{self.repository}"

    @property
    def pinned(self) -> bool:
        """Pinned by a sha256 digest: the bytes the node runs are the bytes someone checked."""
        return self.digest is not None and SHA256_DIGEST.fullmatch(self.digest) is not None

    def __str__(self) -> str:
        tag = f":{self.tag}" if self.tag else ("" if self.digest else ":latest")
        return f"{self.name}{tag}{'@' + self.digest if self.digest else ''}"


def _is_domain(component: str) -> bool:
    return "." in component or ":" in component or component == "localhost" or component != component.lower()


def parse(image: object) -> ImageRef | None:
    """The normalised reference, or None when `image` is not one a runtime would pull."""
    if not isinstance(image, str) or not image or image != image.strip():
        return None
    name, _, digest = image.partition("@")
    tag: str | None = None
    last_slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > last_slash:
        name, tag = name[:colon], name[colon + 1 :]
        if not _TAG.fullmatch(tag):
            return None
    if digest and not _DIGEST.fullmatch(digest):
        return None
    first, slash, rest = name.partition("/")
    if slash and _is_domain(first):
        if not _DOMAIN.fullmatch(first):
            return None
        registry, path = first.lower(), rest
    else:
        registry, path = DOCKER_HUB, name
    if registry in _DOCKER_HUB_ALIASES:
        registry = DOCKER_HUB
        if "/" not in path:
            path = f"library/{path}"
    if not all(_PATH_COMPONENT.fullmatch(part) for part in path.split("/")):
        return None
    return ImageRef(registry, path, tag, digest or None)


def normalise_prefix(prefix: str) -> str:
    """A trusted-image prefix in normalised form; raises ValueError saying what is wrong with it.

    `registry/` trusts a whole registry, `registry/path/` every repository below path, and a prefix
    without the trailing slash exactly one repository (whatever its tag or digest).
    """
    if "@" in prefix:
        raise ValueError(f"{prefix!r}: a prefix names repositories, not a digest")
    body = prefix.rstrip("/")
    first, _, rest = body.partition("/")
    if not _is_domain(first) or not _DOMAIN.fullmatch(first):
        raise ValueError(f"{prefix!r} names no registry: write it in full, e.g. docker.io/{body}/")
    if ":" in rest:
        raise ValueError(f"{prefix!r}: a prefix names repositories, not a tag")
    if rest and not all(_PATH_COMPONENT.fullmatch(part) for part in rest.split("/")):
        raise ValueError(f"{prefix!r}: {rest!r} is not a repository path (lower case, no empty parts)")
    registry = DOCKER_HUB if first.lower() in _DOCKER_HUB_ALIASES else first.lower()
    if not rest:
        return f"{registry}/"
    return f"{registry}/{rest}{'/' if prefix.endswith('/') else ''}"


def trusted_by(ref: ImageRef, prefix: str) -> bool:
    """Whether the normalised `prefix` (see normalise_prefix) covers the image's repository."""
    return ref.name.startswith(prefix) if prefix.endswith("/") else ref.name == prefix
