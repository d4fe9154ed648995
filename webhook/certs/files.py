"""The serving files' layout and names, without `cryptography`.

Split from tls.py so that `gpuguard serve` reusing existing certificates never imports `cryptography`
(about 10 MB of resident memory in every replica); only generating or rotating certificates does.
"""

from __future__ import annotations

import datetime
import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CA_FILE = "ca.crt"
CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"
CA_KEY_FILE = "ca.key"
DEFAULT_SANS = ("localhost", "127.0.0.1")
# A DNS name in a certificate: labels of letters, digits and inner hyphens, optionally a leading `*.`.
_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
MAX_DNS_NAME = 253
# Separates the three steps of a CA rotation (see tls.Schedule).
DEFAULT_ROTATION_DELAY = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class ServingFiles:
    ca: Path
    cert: Path
    key: Path
    created: bool

    @classmethod
    def in_dir(cls, cert_dir: Path, *, created: bool) -> ServingFiles:
        return cls(cert_dir / CA_FILE, cert_dir / CERT_FILE, cert_dir / KEY_FILE, created=created)


def existing_serving_files(cert_dir: Path) -> ServingFiles | None:
    files = ServingFiles.in_dir(cert_dir, created=False)
    return files if files.cert.is_file() and files.key.is_file() else None


def serving_names(names: Sequence[str]) -> list[str]:
    """`names` first (the first becomes the CN), then localhost and 127.0.0.1 for local checks."""
    return list(dict.fromkeys([*names, *DEFAULT_SANS]))


def dns_names_for_service(service: str, namespace: str) -> list[str]:
    return [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ]


def check_subject_name(name: str) -> str:
    """`name` when a certificate can carry it as a subject alternative name (a DNS name, a `*.` wildcard
    or an IP address); ValueError saying why not otherwise."""
    try:
        ipaddress.ip_address(name)
        return name
    except ValueError:
        pass
    labels = name.removeprefix("*.").split(".")
    if 0 < len(name) <= MAX_DNS_NAME and all(_DNS_LABEL.fullmatch(label) for label in labels):
        return name
    raise ValueError(
        f"{name!r} is neither an IP address nor a DNS name (letters, digits, hyphens and dots,"
        " optionally a leading *.; no scheme, port or path)"
    )
