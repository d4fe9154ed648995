"""Gangs and the other workload kinds on the real API server: JobSet's own CRD (its structural schema and
CEL rules, from the shared third_party folder) and minimal structural CRDs for LeaderWorkerSet,
PyTorchJob and RayCluster, reached through deploy/'s webhook configurations (their rules and
matchConditions as shipped) pointed at the session's gpuguard.

Every mutated object is stored as gpuguard made it (nothing pruned, nothing refused by the CRD's
validation), and running gpuguard again on what was stored changes nothing (re-invocation stable).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.harness import REPO_ROOT, third_party
from tests.harness.admission import (
    WebhookProcess,
    create_namespace,
    dry_run,
    gpuguard_annotations,
    kubectl_warnings,
    log_records,
    read_back,
    submit,
)
from tests.harness.controlplane import ControlPlane
from tests.harness.install import CRD_FOLDER, install_crds
from webhook.cli import main as cli_main
from webhook.policy import engine
from webhook.policy.model import default_policy

EXAMPLES = REPO_ROOT / "examples"
CONFIGURATION = "gpuguard-e2e-gangs"
SEES_GANGS = "gpuguard-e2e/gangs"  # the label of the namespaces deploy/'s webhooks are narrowed to
POLICY = default_policy()
GANG_EXAMPLES = (
    "gpu-jobset-trainer.yaml",
    "gpu-leaderworkerset-vllm.yaml",
    "gpu-pytorchjob.yaml",
    "gpu-raycluster.yaml",
)

Json = dict[str, Any]


@pytest.fixture(scope="module")
def workload_crds(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """JobSet's real CRD and the minimal ones, installed for this module and removed after it."""
    jobset = yaml.safe_load((third_party.jobset_source() / third_party.JOBSET_CRD).read_text())
    minimal = yaml.safe_load((CRD_FOLDER / "workload-kinds.yaml").read_text())
    crds = {"apiVersion": "v1", "kind": "List", "items": [jobset, *minimal["items"]]}
    path = tmp_path_factory.mktemp("gangs") / "crds.json"
    path.write_text(json.dumps(crds))
    install_crds(control_plane, path)
    try:
        yield
    finally:
        submit(control_plane, "delete", crds, "--ignore-not-found", "--wait=false")


@pytest.fixture(scope="module")
def shipped_webhooks(
    control_plane: ControlPlane, gpuguard: WebhookProcess, workload_crds: None
) -> Iterator[None]:
    """deploy/'s mutating and validating webhooks (rules, matchConditions) at the session's gpuguard,
    failurePolicy Fail, for namespaces labelled SEES_GANGS only."""
    shipped = [doc for doc in yaml.safe_load_all((REPO_ROOT / "deploy" / "install.yaml").read_text()) if doc]
    configurations = []
    for kind, name, path in (
        ("MutatingWebhookConfiguration", "mutate.gpuguard.io", "/mutate"),
        ("ValidatingWebhookConfiguration", "validate.gpuguard.io", "/validate"),
    ):
        (webhook,) = [
            w for doc in shipped if doc["kind"] == kind for w in doc["webhooks"] if w["name"] == name
        ]
        webhook |= {
            "clientConfig": {"url": f"{gpuguard.url}{path}", "caBundle": gpuguard.ca_bundle_b64},
            "failurePolicy": "Fail",
            "namespaceSelector": {"matchLabels": {SEES_GANGS: "true"}},
        }
        configurations.append(
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": kind,
                "metadata": {"name": CONFIGURATION},
                "webhooks": [webhook],
            }
        )
    submit(control_plane, "apply", {"apiVersion": "v1", "kind": "List", "items": configurations})
    try:
        yield
    finally:
        control_plane.kubectl(
            "delete",
            "mutatingwebhookconfiguration,validatingwebhookconfiguration",
            CONFIGURATION,
            "--ignore-not-found",
        )


@pytest.fixture
def gang_namespace(control_plane: ControlPlane, shipped_webhooks: None) -> Iterator[str]:
    name = create_namespace(control_plane, "gangs", {SEES_GANGS: "true"})
    yield name
    control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


def example(name: str, namespace: str) -> Json:
    obj: Json = yaml.safe_load((EXAMPLES / name).read_text())
    obj["metadata"]["namespace"] = namespace
    return obj


def missing(expected: Any, stored: Any, path: str = "") -> list[str]:
    """Where `stored` lacks what `expected` holds (the CRD's defaults, added beside it, are not a loss)."""
    if isinstance(expected, dict) and isinstance(stored, dict):
        return [
            m for key, value in expected.items() for m in missing(value, stored.get(key), f"{path}.{key}")
        ]
    if isinstance(expected, list) and isinstance(stored, list) and len(expected) == len(stored):
        return [
            m
            for i, (e, s) in enumerate(zip(expected, stored, strict=True))
            for m in missing(e, s, f"{path}[{i}]")
        ]
    return [] if expected == stored else [f"{path}: {expected!r} stored as {stored!r}"]


def mutate(obj: Json, namespace: str) -> engine.Result:
    group, _, _ = obj["apiVersion"].rpartition("/")
    return engine.mutate(obj, POLICY, namespace=namespace, group=group, kind=obj["kind"])


@pytest.mark.parametrize("name", GANG_EXAMPLES)
def test_every_kind_is_stored_as_gpuguard_made_it_and_stays_so(
    control_plane: ControlPlane, gang_namespace: str, name: str
) -> None:
    manifest = example(name, gang_namespace)
    expected = mutate(copy.deepcopy(manifest), gang_namespace)
    assert expected.changed

    submit(control_plane, "apply", manifest)
    stored = read_back(control_plane, manifest)

    # Nothing gpuguard wrote was pruned or refused by the CRD's schema (JobSet's CEL rules included).
    assert not missing(expected.obj["spec"], stored["spec"])
    assert gpuguard_annotations(stored) == gpuguard_annotations(expected.obj)
    again = mutate(stored, gang_namespace)
    assert not again.changed, [d.message for d in again.decisions if d.outcome == "applied"]


def test_a_jobset_with_the_users_own_rules_keeps_them_first(
    control_plane: ControlPlane, gang_namespace: str
) -> None:
    manifest = example("gpu-jobset-trainer.yaml", gang_namespace)
    mine = {"name": "failOnBadInput", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}
    manifest["spec"]["failurePolicy"]["rules"] = [mine]
    node = manifest["spec"]["replicatedJobs"][1]["template"]["spec"]
    user_rule = {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [3]}}
    node["podFailurePolicy"] = {"rules": [user_rule]}

    result = submit(control_plane, "apply", manifest)
    stored = read_back(control_plane, manifest)

    rules = stored["spec"]["failurePolicy"]["rules"]
    assert rules[0] == mine
    assert rules[1]["name"] == "gpuguardDeviceFailure"
    assert rules[1]["onJobFailureMessagePatterns"] == [
        "matching FailJob rule at index 1$",
        "matching FailJob rule at index 2$",
    ]
    stored_node = stored["spec"]["replicatedJobs"][1]["template"]["spec"]
    assert stored_node["podFailurePolicy"]["rules"][0] == user_rule
    # The user's catch-all comes first: kubectl says so.
    assert any("failOnBadInput comes first" in w for w in kubectl_warnings(result)), result.stderr


def test_a_cpu_jobset_never_reaches_gpuguard(
    control_plane: ControlPlane, gpuguard: WebhookProcess, gang_namespace: str
) -> None:
    manifest = example("gpu-jobset-trainer.yaml", gang_namespace)
    manifest["metadata"]["name"] = "cpu-only"
    del manifest["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"]["containers"][0][
        "resources"
    ]
    # The validating webhook sees no reason either (no class, no accelerator binding): the proof that
    # matchConditions kept the object away is that gpuguard logged no review of it.
    submit(control_plane, "apply", manifest)
    stored = read_back(control_plane, manifest)
    assert not gpuguard_annotations(stored)
    assert not [
        r for r in log_records(gpuguard.log_path) if r.get("kind") == "JobSet" and r.get("name") == "cpu-only"
    ]


def test_a_jobset_with_a_low_priority_job_bound_for_gpu_nodes_is_refused_at_apply(
    control_plane: ControlPlane, gang_namespace: str
) -> None:
    # The CPU initializer pinned to GPU nodes gets no class from gpuguard (it asks for no GPU): the guard
    # refuses the JobSet at kubectl apply, not pod by pod inside JobSet's controller.
    manifest = example("gpu-jobset-trainer.yaml", gang_namespace)
    initializer = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    initializer["nodeSelector"] = {"nvidia.com/gpu.present": "true"}

    result = dry_run(control_plane, manifest)

    assert result.returncode != 0
    assert 'admission webhook "validate.gpuguard.io" denied the request' in result.stderr
    assert "replicatedJobs[dataset-initializer]: priority 0 (no class) < 1000" in result.stderr, result.stderr


def test_the_audit_judges_the_kinds_whose_crds_exist(
    control_plane: ControlPlane, gang_namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in GANG_EXAMPLES:
        submit(control_plane, "apply", example(name, gang_namespace))
    capsys.readouterr()
    policy = str(REPO_ROOT / "webhook" / "default-policy.yaml")
    args = [
        "--kubeconfig",
        str(control_plane.kubeconfig),
        "--policy",
        policy,
        "-n",
        gang_namespace,
        "-o",
        "json",
    ]
    code = cli_main(["audit", *args])
    document = json.loads(capsys.readouterr().out)
    assert code == 0
    kinds = {(f["kind"], f["name"]) for f in document["findings"]}
    assert {
        ("JobSet", "llm-finetune"),
        ("LeaderWorkerSet", "vllm"),
        ("PyTorchJob", "resnet-ddp"),
        ("RayCluster", "raycluster-gpu"),
    } <= kinds
