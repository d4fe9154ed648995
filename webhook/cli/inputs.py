"""What the commands read, read the way kubectl reads it, with every error naming the file.

Manifests (`-f`, repeatable: files, directories, `-` for stdin; `kind: List` expanded; objects only),
the policy (`--policy`: the policy YAML or the ConfigMap holding it), and cluster facts (`--facts`: the
output of `kubectl get priorityclasses,namespaces,nodes -o yaml`, read by the server's own converters).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from webhook.certs import files as certfiles
from webhook.cli.output import UsageError
from webhook.policy.errors import yaml_problem
from webhook.policy.facts import ClusterFacts
from webhook.policy.model import (
    CONFIGMAP_KEY,
    Policy,
    PolicyError,
    default_policy,
    parse_policy,
)

STDIN = "-"
# What kubectl reads from a directory given to -f.
MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")
DEFAULT_NAMESPACE = "default"


def display_name(source: str) -> str:
    return "stdin" if source == STDIN else source


def read_bytes(source: str) -> bytes:
    if source == STDIN:
        buffer = getattr(sys.stdin, "buffer", None)
        return buffer.read() if buffer is not None else sys.stdin.read().encode()
    try:
        return Path(source).read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{source}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{source}: is a directory, not a file") from None
    except OSError as exc:
        raise UsageError(f"{source}: {exc.strerror or exc}") from None


def read_text(source: str) -> str:
    data = read_bytes(source)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        byte = data[exc.start]
        raise UsageError(
            f"{display_name(source)}: not UTF-8 text (byte 0x{byte:02x} at offset {exc.start})"
        ) from None


def load_yaml_documents(source: str) -> list[Any]:
    """Every document of a YAML (or JSON) file, empty ones left out."""
    text = read_text(source)
    try:
        return [document for document in yaml.safe_load_all(text) if document is not None]
    except yaml.YAMLError as exc:
        raise UsageError(f"{display_name(source)}: not valid YAML: {yaml_problem(exc)}") from None


# --- manifests --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    obj: dict[str, Any]
    source: str  # the file it came from ("stdin" for -)
    namespace: str  # where it would be created: its own, else -n, else "default"

    @property
    def title(self) -> str:
        return title(self.obj)


def title(obj: dict[str, Any]) -> str:
    """`Kind/name` (the generateName prefix when the object has no name yet), as kubectl names objects."""
    metadata = obj.get("metadata")
    metadata = metadata if isinstance(metadata, dict) else {}
    return f"{obj.get('kind')}/{metadata.get('name') or metadata.get('generateName') or ''}"


def add_manifest_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-f",
        "--filename",
        "--file",
        dest="files",
        action="append",
        required=True,
        metavar="FILE",
        help="manifests: a file (multi-document YAML or JSON, kind: List expanded), a directory of"
        " .yaml/.yml/.json files, or - for stdin; repeat for more",
    )
    parser.add_argument(
        "-R", "--recursive", action="store_true", help="read directories given to -f recursively"
    )
    parser.add_argument(
        "-n",
        "--namespace",
        help="namespace of objects that name none (default: default); an object naming another one"
        " is refused, as kubectl refuses it",
    )


def manifest_files(sources: Sequence[str], *, recursive: bool = False) -> list[str]:
    """The files behind -f arguments: directories expanded to their manifest files, sorted."""
    found: list[str] = []
    for source in sources:
        path = Path(source)
        if source == STDIN or not path.is_dir():
            found.append(source)
            continue
        candidates = path.rglob("*") if recursive else path.iterdir()
        files = sorted(str(p) for p in candidates if p.suffix in MANIFEST_SUFFIXES and p.is_file())
        if not files:
            raise UsageError(f"{source}: no {', '.join(MANIFEST_SUFFIXES)} files in this directory")
        found.extend(files)
    if found.count(STDIN) > 1:
        raise UsageError("- (stdin) can be given to -f only once")
    return found


def read_manifests(
    sources: Sequence[str], *, namespace: str | None = None, recursive: bool = False
) -> list[Manifest]:
    """Every object in `sources`, in order. Refuses, naming the file and document, anything kubectl
    would refuse: a document that is no object, an object in another namespace than `-n` says."""
    manifests: list[Manifest] = []
    for source in manifest_files(sources, recursive=recursive):
        name = display_name(source)
        for number, document in enumerate(load_yaml_documents(source), start=1):
            for obj in _objects(document, f"{name}: document {number}"):
                manifests.append(Manifest(obj, name, _namespace_of(obj, namespace, name)))
    return manifests


def _objects(document: Any, where: str) -> Iterator[dict[str, Any]]:
    """The object a document holds, or the items of a List (`kind: List`, `PodList`, ...), expanded."""
    problem = _not_an_object(document)
    if problem:
        raise UsageError(f"{where}: not a Kubernetes object: {problem}")
    items = document.get("items")
    if str(document["kind"]).endswith("List") and isinstance(items, list):
        for index, item in enumerate(items):
            yield from _objects(item, f"{where}, items[{index}]")
    else:
        yield document


def _not_an_object(document: Any) -> str:
    if not isinstance(document, dict):
        return f"a {'list' if isinstance(document, list) else type(document).__name__}, not a mapping"
    missing = [key for key in ("apiVersion", "kind") if not isinstance(document.get(key), str)]
    return f"{' and '.join(missing)} not set" if missing else ""


def _namespace_of(obj: dict[str, Any], namespace: str | None, source: str) -> str:
    metadata = obj.get("metadata")
    own = metadata.get("namespace") if isinstance(metadata, dict) else None
    if isinstance(own, str) and own:
        if namespace is not None and namespace != own:
            raise UsageError(
                f"{source}: {title(obj)}: the namespace from the provided object {own!r} does not match"
                f" the namespace {namespace!r} given with -n: drop -n, or pass -n {own}"
            )
        return own
    return namespace or DEFAULT_NAMESPACE


# --- the policy -------------------------------------------------------------------------------------------


def add_policy_argument(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    parser.add_argument(
        "--policy",
        metavar="FILE",
        default=default,
        help="the policy: its YAML, or the ConfigMap holding it under data.policy.yaml"
        " (default: the embedded default policy)",
    )


def policy_text(source: str) -> tuple[str, str]:
    """The policy YAML in `source` and where it was: "" for a policy file, or the ConfigMap and key."""
    text = read_text(source)
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError:
        return text, ""  # parse_policy says what is wrong with it, and where
    if not isinstance(document, dict) or not isinstance(document.get("kind"), str):
        return text, ""
    kind, name = document["kind"], title(document).partition("/")[2]
    metadata = document.get("metadata")
    namespace = metadata.get("namespace") if isinstance(metadata, dict) else None
    qualified = f"{namespace}/{name}" if namespace else name
    if kind != "ConfigMap":
        raise UsageError(
            f"{display_name(source)}: a {kind} manifest, not a policy: give the policy YAML, or the"
            f" ConfigMap holding it under data.{CONFIGMAP_KEY}"
        )
    data = document.get("data")
    if not isinstance(data, dict) or not isinstance(data.get(CONFIGMAP_KEY), str):
        keys = ", ".join(sorted(map(str, data))) if isinstance(data, dict) else "none"
        raise UsageError(
            f"{display_name(source)}: ConfigMap {qualified} has no data.{CONFIGMAP_KEY}"
            f" (its data keys: {keys}); gpuguard reads the policy from that key"
        )
    return data[CONFIGMAP_KEY], f"ConfigMap {qualified}, key {CONFIGMAP_KEY}"


def load_policy(source: str | None) -> Policy:
    if source is None:
        return default_policy()
    text, origin = policy_text(source)
    try:
        return parse_policy(text)
    except PolicyError as exc:
        where = f"{display_name(source)} ({origin})" if origin else display_name(source)
        raise UsageError(f"{where}: {exc}") from None


# --- cluster facts ----------------------------------------------------------------------------------------

FACTS_COMMAND = "kubectl get priorityclasses,namespaces,nodes -o yaml"
Converter = Callable[[dict[str, Any]], tuple[Hashable, Any] | None]


def add_facts_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--facts",
        metavar="FILE",
        help=f"what the server would know about the cluster: the output of `{FACTS_COMMAND}`"
        " (ResourceClaims and ResourceClaimTemplates too); kinds the file does not hold stay unknown,"
        " as offline (default: nothing known)",
    )


def load_facts(source: str | None) -> ClusterFacts | None:
    """The ClusterFacts the server's watch caches would hold for these objects: read by the very
    converters its informers use, so an offline answer is the server's answer."""
    if source is None:
        return None
    from webhook.kube import fact_sources  # loads the Kubernetes client: only when facts are asked for

    converters: dict[str, tuple[str, Converter]] = {
        "PriorityClass": ("priority_classes", fact_sources.priority_class),
        "Namespace": ("namespace_labels", fact_sources.namespace_labels),
        "Node": ("nodes", fact_sources.node),
        "ResourceClaim": ("claims", fact_sources.resource_claim),
        "ResourceClaimTemplate": ("claim_templates", fact_sources.resource_claim_template),
    }
    known: dict[str, Any] = {}  # ClusterFacts field -> {key: fact}
    for manifest in read_manifests([source]):
        kind = manifest.obj["kind"]
        if kind not in converters:
            raise UsageError(
                f"{manifest.source}: {manifest.title}: not a cluster fact; --facts reads"
                f" {', '.join(converters)} (the output of `{FACTS_COMMAND}`)"
            )
        field, convert = converters[kind]
        converted = convert(manifest.obj)
        if converted is None:
            raise UsageError(f"{manifest.source}: {manifest.title}: incomplete (no name, or no value)")
        key, value = converted
        known.setdefault(field, {})[key] = value
    return ClusterFacts(**known)


# --- argument types ---------------------------------------------------------------------------------------


def namespaced_name(value: str) -> tuple[str, str]:
    namespace, _, name = value.partition("/")
    if not namespace or not name or "/" in name:
        raise argparse.ArgumentTypeError(f"expected NAMESPACE/NAME, got {value!r}")
    return namespace, name


def subject_name(value: str) -> str:
    """A --san: a DNS name or an IP address, refused before any certificate is made."""
    try:
        return certfiles.check_subject_name(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def seconds(value: str) -> float:
    """A duration option: seconds, 0 or more."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not number >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{value!r}: seconds are 0 or more")
    return number
