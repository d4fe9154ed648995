"""driverCompatibility on the real API server, with a real kube-scheduler binding pods to nodes that are
API objects (labelled like NVIDIA GPU Feature Discovery labels them): a workload stating a minimum driver
gets a required node affinity, the API server stores it, and its pods land only on new-enough nodes.

The session's gpuguard (default policy, no cluster access) shows the default behaviour; a second one with
cluster lookups and `multiNode.sameDriverVersion` shows the apply-time warning and one driver version
across the pods of an Indexed Job.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.harness.admission import (
    IMAGE,
    VALIDATING_WEBHOOK,
    LiveWebhook,
    dry_run_until,
    gpu_job,
    gpuguard_annotations,
    kubectl_warnings,
    pod_spec_of,
    read_back,
    submit,
)
from tests.harness.controlplane import ControlPlane, Process
from tests.harness.install import run_gpuguard
from tests.harness.scheduling import SCHEDULER_NAME, bound_node, create_nodes, node, start_scheduler

ANNOTATION = "gpuguard.io/min-driver-major"
MAJOR = "nvidia.com/cuda.driver-version.major"
FULL = "nvidia.com/cuda.driver-version.full"
PRODUCT = "nvidia.com/gpu.product"
POOL = "cloud.google.com/gke-nodepool"
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
# Each module run labels its nodes with its own value, and every pod here selects it: nothing else fits.
FLEET_LABEL = "gpuguard-e2e/fleet"
LIVE_NAME = "gpuguard-e2e-drivers"


@dataclass(frozen=True)
class Fleet:
    fleet: str
    old: tuple[str, ...]  # driver 535.183.01
    new: tuple[str, ...]  # driver 570.124.06
    new_other: tuple[str, ...]  # driver 570.86.15: the same major, another full version

    @property
    def all(self) -> tuple[str, ...]:
        return (*self.old, *self.new, *self.new_other)


@pytest.fixture(scope="module")
def fleet(control_plane: ControlPlane) -> Iterator[Fleet]:
    tag = secrets.token_hex(3)
    made = Fleet(
        tag,
        tuple(f"old-{tag}-{i}" for i in range(2)),
        tuple(f"new-{tag}-{i}" for i in range(2)),
        tuple(f"other-{tag}-{i}" for i in range(2)),
    )
    nodes = []
    for names, full, pool in (
        (made.old, "535.183.01", "a100"),
        (made.new, "570.124.06", "h100"),
        (made.new_other, "570.86.15", "h100"),
    ):
        for name in names:
            labels = {
                FLEET_LABEL: tag,
                MAJOR: full.split(".")[0],
                FULL: full,
                PRODUCT: "NVIDIA-H100-80GB-HBM3",
                POOL: pool,
            }
            nodes.append(node(name, labels))
    create_nodes(control_plane, nodes)
    try:
        yield made
    finally:
        if control_plane.running:
            control_plane.kubectl(
                "delete", "node", *made.all, "--ignore-not-found", "--wait=false", check=False
            )


@pytest.fixture(scope="module")
def scheduler(
    control_plane: ControlPlane, fleet: Fleet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Process]:
    running = start_scheduler(control_plane, tmp_path_factory.mktemp("scheduler"))
    try:
        yield running
    finally:
        running.stop()


def gpu_pod_needing(
    name: str, namespace: str, fleet: Fleet, minimum: int | None, **spec: Any
) -> dict[str, Any]:
    """A GPU pod for the module's scheduler and nodes, stating `minimum` (a driver major) if given."""
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if minimum is not None:
        metadata["annotations"] = {ANNOTATION: str(minimum)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            "schedulerName": SCHEDULER_NAME,
            "nodeSelector": {FLEET_LABEL: fleet.fleet},
            "containers": [
                {"name": "main", "image": IMAGE, "resources": {"limits": {"nvidia.com/gpu": "1"}}}
            ],
            **spec,
        },
    }


def required_terms(obj: dict[str, Any]) -> list[dict[str, Any]]:
    terms: list[dict[str, Any]] = pod_spec_of(obj)["affinity"]["nodeAffinity"][REQUIRED]["nodeSelectorTerms"]
    return terms


AT_LEAST_550 = {"key": MAJOR, "operator": "Gt", "values": ["549"]}


# --- the default policy: the session's gpuguard -------------------------------------------------------


@pytest.mark.usefixtures("gpuguard")
def test_pods_needing_a_newer_driver_land_only_on_nodes_that_have_it(
    control_plane: ControlPlane, namespace: str, fleet: Fleet, scheduler: Process
) -> None:
    pods = [gpu_pod_needing(f"train-{i}", namespace, fleet, 550) for i in range(4)]
    submit(control_plane, "create", {"apiVersion": "v1", "kind": "List", "items": pods})

    for pod in pods:
        stored = read_back(control_plane, pod)
        assert required_terms(stored) == [{"matchExpressions": [AT_LEAST_550]}]
        assert "driverCompatibility" in gpuguard_annotations(stored)["gpuguard.io/rules"]
    landed = {bound_node(control_plane, namespace, pod["metadata"]["name"]) for pod in pods}
    assert landed <= {*fleet.new, *fleet.new_other}, f"pods on {landed}; old-driver nodes are {fleet.old}"


@pytest.mark.usefixtures("gpuguard")
def test_pods_stating_nothing_are_left_alone(
    control_plane: ControlPlane, namespace: str, fleet: Fleet, scheduler: Process
) -> None:
    pod = gpu_pod_needing("anywhere", namespace, fleet, None)
    submit(control_plane, "create", pod)
    stored = read_back(control_plane, pod)
    assert "affinity" not in stored["spec"]
    assert bound_node(control_plane, namespace, "anywhere") in fleet.all


@pytest.mark.usefixtures("gpuguard")
def test_existing_terms_each_get_the_requirement_and_the_api_server_accepts_them(
    control_plane: ControlPlane, namespace: str, fleet: Fleet, scheduler: Process
) -> None:
    by_product = {"key": PRODUCT, "operator": "In", "values": ["NVIDIA-H100-80GB-HBM3"]}
    by_pool = {"key": POOL, "operator": "In", "values": ["a100", "h100"]}
    affinity = {
        "nodeAffinity": {
            REQUIRED: {
                "nodeSelectorTerms": [{"matchExpressions": [by_product]}, {"matchExpressions": [by_pool]}]
            }
        }
    }
    pod = gpu_pod_needing("merged", namespace, fleet, 550, affinity=affinity)
    submit(control_plane, "create", pod)

    stored = read_back(control_plane, pod)
    assert required_terms(stored) == [
        {"matchExpressions": [by_product, AT_LEAST_550]},
        {"matchExpressions": [by_pool, AT_LEAST_550]},
    ]
    assert bound_node(control_plane, namespace, "merged") in {*fleet.new, *fleet.new_other}


@pytest.mark.usefixtures("gpuguard")
@pytest.mark.parametrize("kind", ["Deployment", "Job", "CronJob"])
def test_workload_templates_are_stored_with_the_affinity(
    control_plane: ControlPlane, namespace: str, kind: str
) -> None:
    job = gpu_job("train", namespace)
    template = job["spec"]["template"]
    template["metadata"] = {"annotations": {ANNOTATION: "550"}}
    if kind == "Job":
        manifest = job
    elif kind == "CronJob":
        manifest = {
            **job,
            "kind": "CronJob",
            "spec": {"schedule": "0 2 * * *", "jobTemplate": {"spec": job["spec"]}},
        }
    else:
        template["spec"]["restartPolicy"] = "Always"
        template["metadata"]["labels"] = {"app": "train"}
        spec = {"replicas": 1, "selector": {"matchLabels": {"app": "train"}}, "template": template}
        manifest = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": job["metadata"], "spec": spec}
    submit(control_plane, "apply", manifest)
    assert required_terms(read_back(control_plane, manifest)) == [{"matchExpressions": [AT_LEAST_550]}]


@pytest.mark.usefixtures("gpuguard")
def test_a_pod_whose_own_selector_rules_out_every_new_enough_driver_is_refused(
    control_plane: ControlPlane, namespace: str, fleet: Fleet
) -> None:
    pod = gpu_pod_needing("stuck", namespace, fleet, 550)
    pod["spec"]["nodeSelector"][MAJOR] = "535"
    result = submit(control_plane, "create", pod, check=False)
    assert result.returncode != 0
    assert f'admission webhook "{VALIDATING_WEBHOOK}" denied the request' in result.stderr
    assert f"gpuguard driverCompatibility: needs {MAJOR} >= 550 (annotation {ANNOTATION})" in result.stderr
    assert f"nodeSelector {MAJOR}=535 rules out every such node" in result.stderr


@pytest.mark.usefixtures("gpuguard")
def test_a_malformed_requirement_is_refused_rather_than_ignored(
    control_plane: ControlPlane, namespace: str, fleet: Fleet
) -> None:
    pod = gpu_pod_needing("typo", namespace, fleet, None)
    pod["metadata"]["annotations"] = {ANNOTATION: "550.54"}
    result = submit(control_plane, "create", pod, check=False)
    assert result.returncode != 0
    assert f"annotation {ANNOTATION}: '550.54' is not a driver major version" in result.stderr


# --- cluster lookups and one driver version per Job: a gpuguard of the module's own ------------------


def live_policy() -> str:
    return "rules:\n  driverCompatibility:\n    multiNode: {sameDriverVersion: true}\n"


@pytest.fixture(scope="module")
def live(
    control_plane: ControlPlane, fleet: Fleet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveWebhook]:
    webhook = LiveWebhook(control_plane, tmp_path_factory.mktemp("live-drivers"), LIVE_NAME)
    try:
        webhook.start(live_policy())
        yield webhook
    finally:
        webhook.stop()


def test_no_node_new_enough_is_a_warning_at_apply_time(
    control_plane: ControlPlane, live: LiveWebhook, fleet: Fleet
) -> None:
    namespace = live.namespace("drivers-warning")
    pod = gpu_pod_needing("too-new", namespace, fleet, 600)
    expected = f"gpuguard: no node has {MAJOR} >= 600 and fits this workload: its pods would stay Pending"

    # Bounded poll: gpuguard's node cache sees the module's nodes within moments of their creation.
    _, answers = dry_run_until(
        control_plane, pod, lambda r: expected in kubectl_warnings(r), what="the no-node warning"
    )
    assert answers[-1].returncode == 0  # a warning, not a refusal
    fits = gpu_pod_needing("fits", namespace, fleet, 570)
    result = submit(control_plane, "create", fits)
    assert not [w for w in kubectl_warnings(result) if "no node has" in w]


def test_an_indexed_jobs_pods_all_land_on_one_driver_version(
    control_plane: ControlPlane, live: LiveWebhook, fleet: Fleet, scheduler: Process
) -> None:
    namespace = live.namespace("drivers-multinode")
    job = gpu_job("allreduce", namespace)
    job["spec"].update(parallelism=4, completions=4, completionMode="Indexed")
    template = job["spec"]["template"]
    template["metadata"] = {"annotations": {ANNOTATION: "570"}}
    template["spec"].update(schedulerName=SCHEDULER_NAME, nodeSelector={FLEET_LABEL: fleet.fleet})
    submit(control_plane, "apply", job)
    stored = read_back(control_plane, job)
    spec = pod_spec_of(stored)
    assert required_terms(stored) == [
        {"matchExpressions": [{"key": MAJOR, "operator": "Gt", "values": ["569"]}]}
    ]
    assert spec["affinity"]["podAffinity"][REQUIRED] == [
        {
            "labelSelector": {
                "matchExpressions": [{"key": "batch.kubernetes.io/job-name", "operator": "Exists"}]
            },
            "matchLabelKeys": ["batch.kubernetes.io/controller-uid"],
            "topologyKey": FULL,
        }
    ]

    # What the Job controller does (there is none here): one pod per index from the stored template,
    # labelled with the Job's uid and name, owned by the Job.
    uid = stored["metadata"]["uid"]
    labels = stored["spec"]["template"]["metadata"]["labels"]
    owner = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "name": "allreduce",
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }
    pods = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"allreduce-{index}",
                "namespace": namespace,
                "labels": {**labels, "batch.kubernetes.io/job-completion-index": str(index)},
                "annotations": stored["spec"]["template"]["metadata"].get("annotations", {}),
                "ownerReferences": [owner],
            },
            "spec": stored["spec"]["template"]["spec"],
        }
        for index in range(4)
    ]
    submit(control_plane, "create", {"apiVersion": "v1", "kind": "List", "items": pods})
    created = read_back(control_plane, pods[0])
    # The API server resolved matchLabelKeys into the pod's own selector: scoped to this Job.
    (term,) = created["spec"]["affinity"]["podAffinity"][REQUIRED]
    assert {"key": "batch.kubernetes.io/controller-uid", "operator": "In", "values": [uid]} in term[
        "labelSelector"
    ]["matchExpressions"]

    landed = [bound_node(control_plane, namespace, pod["metadata"]["name"]) for pod in pods]
    versions = {
        control_plane.kubectl_json("get", "node", name)["metadata"]["labels"][FULL] for name in landed
    }
    assert len(versions) == 1, f"pods of one Job on drivers {versions} (nodes {landed})"
    assert set(landed) <= {*fleet.new, *fleet.new_other}


def test_nodes_drivers_flags_the_mixed_pool(
    control_plane: ControlPlane, fleet: Fleet, live: LiveWebhook
) -> None:
    result = run_gpuguard("nodes", "drivers", "--kubeconfig", str(control_plane.kubeconfig))
    assert result.returncode == 1, result.stdout + result.stderr  # mixed somewhere: our h100 pool
    h100 = [line for line in result.stdout.splitlines() if line.startswith("h100 ")]
    assert h100 and "570.124.06 (2), 570.86.15 (2)" in h100[0] and h100[0].endswith("MIXED"), result.stdout
    # The serve process exports the same from its node cache.
    metrics = live.process.metrics()
    assert 'gpuguard_driver_versions{pool="h100",product="NVIDIA-H100-80GB-HBM3"} 2' in metrics
    assert 'gpuguard_driver_versions{pool="a100",product="NVIDIA-H100-80GB-HBM3"} 1' in metrics
    # ...and counts the mixed pools the command counted (`N GPU pools: M mixed, ...`).
    mixed = int(result.stdout.splitlines()[-1].split(": ", 1)[1].split(" mixed")[0])
    assert mixed >= 1 and f"\ngpuguard_driver_mixed_pools {mixed}\n" in metrics, result.stdout
