"""Every example and every real-world manifest of the shared corpus, applied through the real API server:
accepted, accelerator workloads mutated, everything else (DaemonSets above all) left as submitted. Then the
API server's own view of gpuguard's latency over a burst of every workload, as a figure in the summary
(a latency floor is the bench's to hold, not a test's). The corpus lives outside the repository
(tests/corpus.py): without it, its tests are skipped and the burst is the examples alone."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness import REPO_ROOT, corpus
from tests.harness.admission import (
    API_SERVER_DEFAULT_SECONDS,
    MUTATING_WEBHOOK,
    READINESS_KEYS,
    VALIDATING_WEBHOOK,
    admission_latency_buckets,
    gpuguard_annotations,
    install_priority_classes,
    pod_spec_of,
    read_back,
    readiness_tolerations,
    submit,
)
from tests.harness.controlplane import ControlPlane
from webhook.policy.kinds import BUILTIN

CORPUS = corpus.CORPUS
EXAMPLES = REPO_ROOT / "examples"
CORPUS_FILES = corpus.FILES


# The examples of custom resources (JobSet, LeaderWorkerSet, ...) need their CRDs and deploy/'s webhook
# rules: tests/e2e/test_gangs.py applies them.
def _core_kinds_only(path: Path) -> bool:
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    found = [BUILTIN.get(doc["apiVersion"].rpartition("/")[0], doc["kind"]) for doc in docs]
    return all(kind is None or kind.core for kind in found)


EXAMPLE_FILES = [path for path in sorted(EXAMPLES.glob("*.yaml")) if _core_kinds_only(path)]

# Placeholders upstream substitutes before applying (SOURCES.md), as their tools would fill them in.
# ServiceAccount admission is off in this control plane, but a serviceAccountName must still be a valid name.
# The GPU Operator creates its CUDA validation pod in its own namespace, `gpu-operator` in NVIDIA's install
# guide (`helm install -n gpu-operator --create-namespace nvidia/gpu-operator`), with its validator image.
OPERATOR_NAMESPACE = "gpu-operator"
VALIDATOR_IMAGE = "nvcr.io/nvidia/cloud-native/gpu-operator-validator:v25.3.0"
PLACEHOLDERS: dict[str, dict[str, str]] = {
    "gke-samples--tensorflow-gpu-statefulset.yaml": {"<GCSFUSE_KSA>": "default"},
    "gke-samples--triton-l4-deployment.yaml": {"$K8S_SA_NAME": "default"},
    "nvidia-gpu-operator--cuda-validator-pod-no-gpu-limit.yaml": {
        'namespace: "FILLED_BY_THE_VALIDATOR"': f"namespace: {OPERATOR_NAMESPACE}",
        'image: "FILLED_BY_THE_VALIDATOR"': f'image: "{VALIDATOR_IMAGE}"',
    },
}
# Namespaces a file names without creating them that exist in the clusters it is written for.
EXISTING_NAMESPACES = frozenset({"kube-system", OPERATOR_NAMESPACE})

# PriorityClasses the corpus names that a cluster does not have by itself. The Kueue fine-tune Job asks for
# `low-priority-preempting` on GPU nodes (gke-accelerator nodeSelector). acceleratorNodeGuard lets pods on
# accelerator nodes in at a priority >= minPriority (1000): 2000 admits the Job and every pod its controller
# would create, and keeps the class "low" next to gpuguard's gpu-workload (10000), as the sample intends.
CORPUS_PRIORITY_CLASSES = {"low-priority-preempting": 2000}

# The kinds gpuguard is registered for; DaemonSets are never sent to it and must stay as submitted.
WORKLOAD_KINDS = frozenset({"Pod", "Job", "CronJob", "Deployment", "StatefulSet", "ReplicaSet"})
CLUSTER_SCOPED_KINDS = frozenset({"Namespace", "DeviceClass"})
# Workloads of the corpus that are not accelerator workloads under the default policy, with the reason;
# every other workload must come back mutated.
NOT_ACCELERATOR_WORKLOADS: dict[str, dict[str, str]] = {
    "k8s-website--job-backoff-limit-per-index-failindex.yaml": {
        "Job/job-backoff-limit-per-index-failindex": "CPU only",
    },
    "k8s-website--job-pod-failure-policy-config-issue.yaml": {
        "Job/job-pod-failure-policy-config-issue": "CPU only",
    },
    "k8s-website--job-pod-failure-policy-example.yaml": {"Job/job-pod-failure-policy-example": "CPU only"},
    "k8s-website--job-pod-failure-policy-failjob-flow-style.yaml": {
        "Job/job-pod-failure-policy-failjob": "CPU only",
    },
    "k8s-website--job-pod-failure-policy-ignore.yaml": {"Job/job-pod-failure-policy-ignore": "CPU only"},
    "kueue--cpu-only-cronjob.yaml": {"CronJob/sample-cronjob": "CPU only (the corpus' negative control)"},
    "nvidia-gpu-operator--cuda-validator-pod-no-gpu-limit.yaml": {
        "Pod/nvidia-cuda-validator-": "no device request (GPUs through NVIDIA_VISIBLE_DEVICES), and the "
        "operator's namespace is off in the default policy",
    },
}
DENIED_EXAMPLES = {"cpu-pod-on-gpu-node.yaml": "acceleratorNodeGuard"}

pytestmark = pytest.mark.usefixtures("gpuguard")


@pytest.fixture(scope="module")
def corpus_cluster(control_plane: ControlPlane) -> None:
    """What the corpus expects a cluster to have: its PriorityClasses and the GPU Operator's namespace."""
    install_priority_classes(control_plane, CORPUS_PRIORITY_CLASSES)
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NAMESPACE}}
    submit(control_plane, "apply", namespace)


def key_of(obj: dict[str, Any]) -> str:
    """Kind/name, or Kind/generateName for objects named by the API server: the same for manifest and copy."""
    metadata = obj["metadata"]
    return f"{obj['kind']}/{metadata.get('generateName') or metadata['name']}"


def load(path: Path) -> list[dict[str, Any]]:
    """The file's documents, placeholders substituted, and a ResourceClaimTemplate v1beta1 converted."""
    text = path.read_text()
    for placeholder, value in PLACEHOLDERS.get(path.name, {}).items():
        assert placeholder in text, f"{path.name} no longer holds {placeholder!r}: update PLACEHOLDERS"
        text = text.replace(placeholder, value)
    return [to_served_version(doc) for doc in yaml.safe_load_all(text) if doc]


def to_served_version(doc: dict[str, Any]) -> dict[str, Any]:
    """resource.k8s.io/v1beta1 as v1: Kubernetes v1.37 no longer serves v1beta1 (`kubectl api-versions` lists
    only resource.k8s.io/v1), so the aws-neuron template would be refused with "no matches for kind". v1
    moved a request's device-selection fields under `exactly`; nothing else in it changes."""
    if doc.get("apiVersion") != "resource.k8s.io/v1beta1":
        return doc
    assert doc["kind"] == "ResourceClaimTemplate", doc["kind"]
    converted: dict[str, Any] = json.loads(json.dumps(doc))
    converted["apiVersion"] = "resource.k8s.io/v1"
    devices = converted["spec"]["spec"]["devices"]
    devices["requests"] = [
        {"name": request["name"], "exactly": {k: v for k, v in request.items() if k != "name"}}
        for request in devices["requests"]
    ]
    return converted


def place(docs: list[dict[str, Any]], namespace: str) -> None:
    """Namespaced objects go into `namespace` (what `kubectl apply -n` does), except into a namespace the
    file creates itself or one of EXISTING_NAMESPACES: those are applied as they are. `default` and the
    namespaces files name without creating them (example, aira) are replaced, so that each test has its own
    namespace (two corpus files both create Deployment default/qwen-vllm, for one)."""
    own = {doc["metadata"]["name"] for doc in docs if doc["kind"] == "Namespace"} | EXISTING_NAMESPACES
    for doc in docs:
        if doc["kind"] not in CLUSTER_SCOPED_KINDS and doc["metadata"].get("namespace") not in own:
            doc["metadata"]["namespace"] = namespace


def json_stream(text: str) -> Iterator[dict[str, Any]]:
    """The objects `kubectl -o json` printed: one object, a List, or several objects one after another."""
    decoder = json.JSONDecoder()
    rest = text.lstrip()
    while rest:
        obj, end = decoder.raw_decode(rest)
        yield from obj["items"] if obj.get("kind") == "List" else [obj]
        rest = rest[end:].lstrip()


def submit_file(
    plane: ControlPlane, path: Path, namespace: str
) -> tuple[list[dict[str, Any]], subprocess.CompletedProcess[str]]:
    """The file's documents, placed, and kubectl's answer to applying them (`create` when the file uses
    generateName, which apply refuses)."""
    docs = load(path)
    place(docs, namespace)
    verb = "create" if any("generateName" in doc["metadata"] for doc in docs) else "apply"
    result = submit(
        plane, verb, {"apiVersion": "v1", "kind": "List", "items": docs}, "-o", "json", check=False
    )
    return docs, result


@dataclass(frozen=True)
class Applied:
    manifests: dict[str, dict[str, Any]]  # by key_of
    stored: list[dict[str, Any]]  # read back, in the order kubectl applied them


def apply_file(plane: ControlPlane, path: Path, namespace: str) -> Applied:
    docs, result = submit_file(plane, path, namespace)
    if result.returncode != 0:
        pytest.fail(f"{path.name} was refused:\n{result.stderr}", pytrace=False)
    stored = [read_back(plane, obj) for obj in json_stream(result.stdout)]
    return Applied({key_of(doc): doc for doc in docs}, stored)


# --- what "mutated" and "untouched" mean on a stored object ---------------------------------------------


def assert_mutated(stored: dict[str, Any]) -> None:
    assert gpuguard_annotations(stored), f"{key_of(stored)} was not mutated"
    seconds = readiness_tolerations(pod_spec_of(stored))
    assert all(len(values) <= 1 for values in seconds.values()), f"{key_of(stored)}: duplicated {seconds}"


def assert_untouched(
    manifest: dict[str, Any], stored: dict[str, Any], *, default_seconds: int = API_SERVER_DEFAULT_SECONDS
) -> None:
    """No annotation, toleration, hook, grace period or class of gpuguard's: what the API server alone makes
    of the manifest (a bare pod gets DefaultTolerationSeconds' entries of `default_seconds`, the API
    server's --default-*-toleration-seconds, nothing else)."""
    name = key_of(stored)
    assert not gpuguard_annotations(stored), f"{name} carries gpuguard annotations"
    if stored["kind"] not in WORKLOAD_KINDS | {"DaemonSet"}:
        return
    want, got = pod_spec_of(manifest), pod_spec_of(stored)
    wanted_tolerations, got_tolerations = want.get("tolerations") or [], got.get("tolerations") or []
    assert all(t in got_tolerations for t in wanted_tolerations), name
    added = [t for t in got_tolerations if t not in wanted_tolerations]
    defaulted = [
        {
            "key": key,
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": default_seconds,
        }
        for key in READINESS_KEYS
    ]
    assert all(t in defaulted for t in added) if stored["kind"] == "Pod" else added == [], f"{name}: {added}"
    for before, after in zip(want["containers"], got["containers"], strict=True):
        assert ("preStop" in (before.get("lifecycle") or {})) == ("preStop" in (after.get("lifecycle") or {}))
    assert got["terminationGracePeriodSeconds"] == want.get("terminationGracePeriodSeconds", 30), name
    assert got.get("priorityClassName") == want.get("priorityClassName"), name
    if stored["kind"] in ("Job", "CronJob"):
        job = stored["spec"] if stored["kind"] == "Job" else stored["spec"]["jobTemplate"]["spec"]
        job_manifest = (
            manifest["spec"] if stored["kind"] == "Job" else manifest["spec"]["jobTemplate"]["spec"]
        )
        rules = (job.get("podFailurePolicy") or {}).get("rules", [])
        assert len(rules) == len((job_manifest.get("podFailurePolicy") or {}).get("rules", [])), name


# --- the tests --------------------------------------------------------------------------------------------


@pytest.mark.corpus
def test_corpus_is_complete() -> None:
    # Every manifest SOURCES.md lists is there (and nothing unlisted): the parametrization below is complete.
    listed = set(re.findall(r"^\| `([^`]+\.yaml)`", (CORPUS / "SOURCES.md").read_text(), re.MULTILINE))
    assert {path.name for path in CORPUS_FILES} == listed
    assert set(NOT_ACCELERATOR_WORKLOADS) | set(PLACEHOLDERS) <= listed


@pytest.mark.corpus
@pytest.mark.usefixtures("corpus_cluster")
@pytest.mark.parametrize("path", CORPUS_FILES, ids=[path.stem for path in CORPUS_FILES])
def test_corpus_manifest_is_accepted_and_mutated_when_it_uses_accelerators(
    control_plane: ControlPlane, namespace: str, path: Path
) -> None:
    applied = apply_file(control_plane, path, namespace)
    expected_untouched = NOT_ACCELERATOR_WORKLOADS.get(path.name, {})

    assert applied.stored, f"{path.name}: nothing was applied, so nothing below would be checked"
    assert {key_of(obj) for obj in applied.stored} == set(applied.manifests)
    for stored in applied.stored:
        key = key_of(stored)
        if stored["kind"] in WORKLOAD_KINDS and key not in expected_untouched:
            assert_mutated(stored)
        else:
            assert_untouched(applied.manifests[key], stored)


def test_examples_are_there() -> None:
    # The parametrization below would otherwise pass on nothing.
    assert len(EXAMPLE_FILES) >= 4, EXAMPLE_FILES


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=[path.stem for path in EXAMPLE_FILES])
def test_example_manifest(control_plane: ControlPlane, namespace: str, path: Path) -> None:
    if path.name in DENIED_EXAMPLES:
        _, result = submit_file(control_plane, path, namespace)
        assert result.returncode != 0
        assert 'admission webhook "validate.gpuguard.io" denied the request' in result.stderr
        assert DENIED_EXAMPLES[path.name] in result.stderr
        return
    applied = apply_file(control_plane, path, namespace)
    assert [obj["kind"] for obj in applied.stored] == [doc["kind"] for doc in applied.manifests.values()]
    for stored in applied.stored:
        assert_mutated(stored)


# --- latency as the API server observes it ---------------------------------------------------------------

FIVE_MS = "0.005"


def burst_of_every_workload(namespace: str) -> dict[str, Any]:
    """Every workload of the examples and (when this run has it) the corpus, in one List for `kubectl
    create`, renamed through generateName so that nothing collides, all into `namespace` (namespaces and
    DRA objects are not sent to gpuguard)."""
    items = []
    for path in [*EXAMPLE_FILES, *CORPUS_FILES]:
        for doc in load(path):
            if doc["kind"] in WORKLOAD_KINDS:
                metadata = doc["metadata"]
                base = (metadata.pop("name", None) or metadata["generateName"])[:40].rstrip("-")
                metadata.update(generateName=f"{base}-", namespace=namespace)
                items.append(doc)
    return {"apiVersion": "v1", "kind": "List", "items": items}


def share_within(buckets: dict[str, float], baseline: dict[str, float], le: str) -> tuple[float, float]:
    calls = buckets.get("+Inf", 0.0) - baseline.get("+Inf", 0.0)
    return buckets.get(le, 0.0) - baseline.get(le, 0.0), calls


@pytest.mark.usefixtures("corpus_cluster")
def test_api_server_calls_gpuguard_for_every_workload_of_a_burst(
    control_plane: ControlPlane, namespace: str, summary: Callable[[str, str], None]
) -> None:
    webhooks = (MUTATING_WEBHOOK, VALIDATING_WEBHOOK)
    burst = burst_of_every_workload(namespace)
    assert burst["items"], "no workload to send"
    baseline = admission_latency_buckets(control_plane, webhooks)

    # Some workloads are refused (a denial is an answer too, and timed the same): no check here.
    submit(control_plane, "create", burst, check=False)
    buckets = admission_latency_buckets(control_plane, webhooks)

    fast, calls = share_within(buckets, baseline, FIVE_MS)
    session_fast, session_calls = share_within(buckets, {}, FIVE_MS)
    # Each workload is sent to /mutate and to /validate at least once (bare pods are reinvoked: more).
    assert calls >= 2 * len(burst["items"]), f"only {calls:.0f} calls for {len(burst['items'])} workloads"
    # How fast is a figure, not an assertion: on a busy machine it says more about the machine.
    source = "examples and corpus" if CORPUS_FILES else "examples (no corpus)"
    summary(
        "apiserver_webhook_5ms_share",
        f"API server saw {fast / calls:.1%} of {calls:.0f} gpuguard calls within 5 ms over a burst of "
        f"{len(burst['items'])} workloads of the {source} ({session_fast / session_calls:.1%} of "
        f"{session_calls:.0f} this session)",
    )
