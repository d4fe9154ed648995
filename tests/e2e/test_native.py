"""`gpuguard policy compile` proven on the real API server: every example, every policy-test case's
manifests, every corpus manifest and the property tests' generated workloads are dry-run (server side)
once through the compiled native policies and once through the webhook (with cluster lookups, as
deploy/ runs it), each in its own namespace; the stored objects must be equal and the answers (allowed,
denied, a denial as a warning) the same. Each native result, submitted again, comes back unchanged:
the native policies converge as the webhook's rules do. A policy with rule and namespace modes checks
the bindings the same way.

Where the two cannot agree by design (cluster facts, warnings a MutatingAdmissionPolicy cannot give),
the last test shows it happen; `gpuguard policy compile` names the same gaps.
"""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings

from tests.e2e.test_corpus import CORPUS_PRIORITY_CLASSES, load
from tests.harness import REPO_ROOT, corpus
from tests.harness.admission import (
    OWNER_LABEL,
    LiveWebhook,
    cpu_pod,
    create_namespace,
    default_priority_classes,
    dry_run,
    dry_run_until,
    gpu_deployment,
    gpu_job,
    gpu_pod,
    gpu_statefulset,
    gpuguard_annotations,
    install_priority_classes,
    kubectl_warnings,
    pinned_to_gpu_nodes,
    submit,
)
from tests.harness.controlplane import ControlPlane
from tests.unit.policy.test_properties import workloads
from webhook.policy.model import Policy, default_policy, parse_policy
from webhook.policy.native import compile_policy

OWNER = "native"  # the native namespace's OWNER_LABEL: the session's webhook passes it by
WORKLOAD_KINDS = frozenset({"Pod", "Job", "CronJob", "Deployment", "StatefulSet", "ReplicaSet", "DaemonSet"})
NATIVE_KINDS = (
    "mutatingadmissionpolicies,mutatingadmissionpolicybindings,"
    "validatingadmissionpolicies,validatingadmissionpolicybindings"
)
# Fields the API server sets per object, whatever admitted it.
SERVER_SET = ("uid", "creationTimestamp", "namespace", "managedFields", "resourceVersion", "generation")
JOB_LABELS = (
    "controller-uid",
    "batch.kubernetes.io/controller-uid",
    "job-name",
    "batch.kubernetes.io/job-name",
)


def _manifest_files() -> list[Path]:
    examples = sorted((REPO_ROOT / "examples").glob("*.yaml"))
    cases = sorted(
        path
        for path in (REPO_ROOT / "examples" / "tests").glob("*/*.yaml")
        if path.name not in ("gpuguard-test.yaml", "policy.yaml", "facts.yaml")
    )
    # A file holding no workload (a ResourceClaimTemplate, a DeviceClass) has nothing to compare.
    return [path for path in examples + cases + corpus.FILES if _workloads(path)]


def _workloads(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in load(path) if doc.get("kind") in WORKLOAD_KINDS]


FILES = _manifest_files()


def apply_native(plane: ControlPlane, policy: Policy, owner: str) -> Callable[[], None]:
    """`policy` compiled and applied under names of `owner`'s own, every binding narrowed to the
    namespaces labelled OWNER_LABEL=<owner>; returns what deletes them again."""
    objects = copy.deepcopy(compile_policy(policy).objects)
    for obj in objects:
        obj["metadata"]["name"] = obj["metadata"]["name"].replace("gpuguard-", f"gpuguard-{owner}-", 1)
        obj["metadata"]["labels"][OWNER_LABEL] = owner
        if obj["kind"].endswith("Binding"):
            obj["spec"]["policyName"] = obj["spec"]["policyName"].replace(
                "gpuguard-", f"gpuguard-{owner}-", 1
            )
            selector = obj["spec"]["matchResources"]["namespaceSelector"]
            selector["matchExpressions"].append({"key": OWNER_LABEL, "operator": "In", "values": [owner]})
    submit(plane, "apply", {"apiVersion": "v1", "kind": "List", "items": objects})

    def remove() -> None:
        plane.kubectl("delete", NATIVE_KINDS, "-l", f"{OWNER_LABEL}={owner}", check=False)

    return remove


def wait_until_in_force(plane: ControlPlane, namespace: str) -> None:
    """Policies take effect once the API server's informers see them: until a GPU pod is mutated and
    a CPU pod pinned to GPU nodes denied in `namespace` (where the guard must enforce)."""
    dry_run_until(
        plane,
        gpu_pod("native-probe", namespace),
        lambda r: r.returncode == 0 and bool(gpuguard_annotations(json.loads(r.stdout))),
        what="the native policies mutating a GPU pod",
        timeout=30,
    )
    dry_run_until(
        plane,
        pinned_to_gpu_nodes("native-probe", namespace),
        lambda r: r.returncode != 0,
        what="the native policies denying a CPU pod pinned to GPU nodes",
        timeout=30,
    )


@pytest.fixture(scope="module")
def native(control_plane: ControlPlane) -> Iterator[str]:
    """The default policy compiled and applied, bound to one namespace the webhook passes by; yields it."""
    install_priority_classes(control_plane, {**default_priority_classes(), **CORPUS_PRIORITY_CLASSES})
    namespace = create_namespace(control_plane, "native", {OWNER_LABEL: OWNER})
    remove = apply_native(control_plane, default_policy(), OWNER)
    try:
        wait_until_in_force(control_plane, namespace)
        yield namespace
    finally:
        remove()
        control_plane.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def _key(obj: dict[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata'].get('name') or obj['metadata'].get('generateName')}"


def _in(obj: dict[str, Any], namespace: str) -> dict[str, Any]:
    placed = copy.deepcopy(obj)
    placed["metadata"]["namespace"] = namespace
    return placed


def stored_object(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The object a dry run would have stored, without what the API server makes per object: its uid
    (in a Job's selector and pod labels too) and a generated name."""
    obj: dict[str, Any] = json.loads(result.stdout)
    metadata = obj["metadata"]
    text = json.dumps(obj).replace(metadata["uid"], "<uid>")
    if "generateName" in metadata:
        text = text.replace(metadata["name"], "<name>")
    obj = json.loads(text)
    for field in SERVER_SET:
        obj["metadata"].pop(field, None)
    return obj


def _resubmittable(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` as a user could submit it again: without what the API server set on it, and a Job without the
    selector and labels its defaulting derived from the first uid."""
    again = copy.deepcopy(obj)
    for field in SERVER_SET:
        again["metadata"].pop(field, None)
    if again["kind"] == "Job":
        again["spec"].pop("selector", None)
        # A Job without labels of its own also gets its pods' labels.
        for metadata in (again["metadata"], again["spec"]["template"]["metadata"]):
            for key in JOB_LABELS:
                metadata.get("labels", {}).pop(key, None)
    return again


def _verdict(result: subprocess.CompletedProcess[str]) -> str:
    return "allowed" if result.returncode == 0 else "denied"


def test_there_is_something_to_compare() -> None:
    assert len(FILES) >= 8, FILES


def assert_same_outcome(
    plane: ControlPlane, obj: dict[str, Any], native: str, webhook: str, where: str
) -> None:
    """`obj` dry-run through the native policies and through the webhook: the same answer, the same
    stored object, and the native result unchanged when submitted again."""
    by_native = dry_run(plane, _in(obj, native))
    by_webhook = dry_run(plane, _in(obj, webhook))
    assert _verdict(by_native) == _verdict(by_webhook), (
        f"{where}: native {by_native.stderr.strip()!r}, webhook {by_webhook.stderr.strip()!r}"
    )
    # A denial in warn mode is a warning from either (a mutation in warn mode only from the webhook).
    native_warned = any("ValidatingAdmissionPolicy" in w for w in kubectl_warnings(by_native))
    webhook_warned = any("would deny" in w for w in kubectl_warnings(by_webhook))
    assert native_warned == webhook_warned, f"{where}: {by_native.stderr!r} vs {by_webhook.stderr!r}"
    if by_native.returncode != 0:
        return
    native_stored, webhook_stored = stored_object(by_native), stored_object(by_webhook)
    assert native_stored == webhook_stored, (
        f"{where}:\n--- native\n{yaml.safe_dump(native_stored)}\n--- webhook\n{yaml.safe_dump(webhook_stored)}"
    )
    again = dry_run(plane, _in(_resubmittable(json.loads(by_native.stdout)), native))
    assert again.returncode == 0, again.stderr
    assert stored_object(again) == native_stored, f"{where} changed on a second pass"


@pytest.mark.parametrize("path", FILES, ids=[path.stem for path in FILES])
def test_native_policies_store_what_the_webhook_stores(
    control_plane: ControlPlane, native: str, webhook_namespace: str, path: Path
) -> None:
    for obj in _workloads(path):
        assert_same_outcome(control_plane, obj, native, webhook_namespace, f"{path.name} {_key(obj)}")


@pytest.mark.parametrize("owner", ["JobSet", "LeaderWorkerSet"])
def test_what_a_group_made_from_its_template_is_left_as_it_is(
    control_plane: ControlPlane, native: str, webhook_namespace: str, owner: str
) -> None:
    """A JobSet's Jobs and a LeaderWorkerSet's StatefulSets were mutated with their owner's template:
    neither the webhook nor the native policies touch them again."""
    made = gpu_job("made", "") if owner == "JobSet" else gpu_statefulset("made", "")
    # Its class set, as its owner's mutated template gave it: admitted, so that what it stores shows.
    made["spec"]["template"]["spec"]["priorityClassName"] = default_policy().rules.priority.className
    # Labels of its own: a Job without any gets its template's, and with them the uid the server generated.
    made["metadata"]["labels"] = {"group": "made"}
    made["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "example.com/v1",
            "kind": owner,
            "name": "group",
            "uid": "0f1e2d3c",
            "controller": True,
        }
    ]
    assert_same_outcome(control_plane, made, native, webhook_namespace, f"a {made['kind']} of a {owner}")
    stored = stored_object(dry_run(control_plane, _in(made, native)))
    assert "annotations" not in stored["metadata"], stored


@pytest.fixture(scope="module")
def webhook(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveWebhook]:
    """gpuguard with the default policy and cluster lookups, as deploy/ runs it, for namespaces of its own."""
    live = LiveWebhook(control_plane, tmp_path_factory.mktemp("native-webhook"), "gpuguard-e2e-native")
    try:
        live.start("")
        yield live
    finally:
        live.stop()


@pytest.fixture(scope="module")
def webhook_namespace(webhook: LiveWebhook) -> str:
    """One namespace the webhook decides in, for every comparison of the module (a dry run stores nothing)."""
    return webhook.namespace("native-webhook-side")


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(obj=workloads())
def test_generated_workloads_are_stored_the_same(
    control_plane: ControlPlane, native: str, webhook_namespace: str, obj: dict[str, Any]
) -> None:
    assert_same_outcome(control_plane, obj, native, webhook_namespace, f"generated {obj['kind']}")


# Modes as bindings: a rule in warn, and namespaces by selector in audit and with the guard warning.
MODES_POLICY = """
rules:
  gracefulTermination: {mode: warn}
namespaces:
  - selector: {matchLabels: {gpuguard-e2e/tier: audited}}
    mode: audit
  - selector: {matchLabels: {gpuguard-e2e/tier: warned}}
    rules: {acceleratorNodeGuard: warn}
"""
MODES_OWNER = "native-modes"
TIER_LABEL = "gpuguard-e2e/tier"
TIERS = ("plain", "audited", "warned")


@pytest.fixture(scope="module")
def modes(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[str, str]]]:
    """MODES_POLICY served by a gpuguard of its own and compiled natively; per tier label, a namespace
    for each: {tier: (native namespace, webhook namespace)}."""
    live = LiveWebhook(control_plane, tmp_path_factory.mktemp("native-modes"), "gpuguard-e2e-native-modes")
    remove = apply_native(control_plane, parse_policy(MODES_POLICY), MODES_OWNER)
    native_namespaces: list[str] = []
    try:
        live.start(MODES_POLICY)
        pairs = {}
        for tier in TIERS:
            labels = {OWNER_LABEL: MODES_OWNER, TIER_LABEL: tier}
            native_namespaces.append(create_namespace(control_plane, f"native-{tier}", labels))
            pairs[tier] = (native_namespaces[-1], live.namespace(f"webhook-{tier}", {TIER_LABEL: tier}))
        wait_until_in_force(control_plane, pairs["plain"][0])
        yield pairs
    finally:
        remove()
        live.stop()
        if native_namespaces:
            control_plane.kubectl("delete", "namespace", *native_namespaces, "--wait=false", check=False)


EXAMPLE_FILES = [path for path in FILES if path.parent == REPO_ROOT / "examples"]


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=[path.stem for path in EXAMPLE_FILES])
def test_namespace_and_rule_modes_bind_as_the_webhook_decides(
    control_plane: ControlPlane, modes: dict[str, tuple[str, str]], tier: str, path: Path
) -> None:
    native_ns, webhook_ns = modes[tier]
    for obj in _workloads(path):
        assert_same_outcome(control_plane, obj, native_ns, webhook_ns, f"{tier}: {path.name} {_key(obj)}")


LOW_CLASS = "native-e2e-low"  # in the cluster, not in the policy's priorityClasses


def test_by_design_only_the_webhook_decides_with_cluster_facts(
    control_plane: ControlPlane, native: str, webhook_namespace: str
) -> None:
    """A pod naming an accelerator node, and a template naming a low class the policy does not value: the
    webhook looks both up and denies; the native guard sees neither (the table's acceleratorNodeGuard row)."""
    node = "native-e2e-gpu-node"
    labels = {"nvidia.com/gpu.present": "true"}
    submit(
        control_plane,
        "apply",
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": labels}},
    )
    install_priority_classes(control_plane, {LOW_CLASS: 10})
    named_node = cpu_pod("named-node", native)
    named_node["spec"]["nodeName"] = node
    low_class = gpu_deployment("low-class", native)
    low_class["spec"]["template"]["spec"]["priorityClassName"] = LOW_CLASS
    try:
        for obj in (named_node, low_class):
            # The webhook's facts come from informers: wait until it has seen the node and the class.
            dry_run_until(
                control_plane,
                _in(obj, webhook_namespace),
                lambda r: r.returncode != 0,
                what=f"the webhook denying {_key(obj)} from cluster facts",
            )
            assert dry_run(control_plane, _in(obj, native)).returncode == 0, _key(obj)
    finally:
        control_plane.kubectl("delete", f"node/{node}", f"priorityclass/{LOW_CLASS}", check=False)
