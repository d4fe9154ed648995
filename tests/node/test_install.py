"""gpuguard installed as the README installs it, running as pods on the tier's real nodes: `kubectl apply -k
deploy/` with the image built from the Dockerfile, then admission through the webhook Service, the
controllers' leader election and the node agent in pods, and `kubectl delete -k deploy/` leaving nothing.

The tests share one install and run in file order (the last one uninstalls). The workloads go to a
namespace the session's own gpuguard leaves alone (conftest.installed_namespace), so whatever mutates or
denies them there is the installed gpuguard, called by the API server at the Service's endpoints (the pods'
addresses on the tier's bridge, node.TierNetwork).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from cryptography import x509

from tests.harness.admission import (
    default_priority_classes,
    gpu_job,
    gpu_pod,
    gpuguard_annotations,
    install_priority_classes,
    metric_samples,
    pinned_to_gpu_nodes,
)
from tests.harness.controllers import eventually
from tests.harness.controlplane import ControlPlane, http_get, wait_until
from tests.harness.install import (
    CONFIGURATION,
    CONFIGURATION_KINDS,
    DEPLOY,
    NAMESPACE,
    Stream,
    ca_bundles,
    insecure_context,
    read_secret,
    submit_dry_run,
)
from tests.harness.node import condition
from webhook import __version__
from webhook.certs import files, tls
from webhook.processes.controllers import LEASE_NAME

from .conftest import PATIENCE, NodeCluster

AGENT_NAMESPACE = "gpuguard-node"
WEBHOOK_PORT = 8443  # deploy/'s containerPort `https`
PART_OF = "app.kubernetes.io/part-of=gpuguard"  # the label deploy/'s kustomizations put on every object
# The name containerd knows gpuguard's image by (deploy/'s `image: gpuguard:<version>`), and a second tag.
IMAGE_REPOSITORY = "docker.io/library/gpuguard"
NEXT_TAG = f"{__version__}-next"
WEBHOOK_PODS = "app.kubernetes.io/name=gpuguard"
CONTROLLERS_PODS = "app.kubernetes.io/name=gpuguard-controllers"
AGENT_PODS = "app.kubernetes.io/name=gpuguard-node-agent"
CLUSTER_KINDS = (
    "mutatingwebhookconfigurations,validatingwebhookconfigurations,clusterroles,clusterrolebindings,"
    "priorityclasses,validatingadmissionpolicies,validatingadmissionpolicybindings,namespaces"
)


T = TypeVar("T")


def awaited(find: Callable[[], T | None], *, what: str) -> T:
    """What `find` returns once it returns something: the install's pods start on a loaded machine."""
    found: list[T] = []

    def check() -> bool:
        value = find()
        if value is not None:
            found[:] = [value]
        return value is not None

    eventually(check, what=what, timeout=PATIENCE)
    return found[0]


def pods(plane: ControlPlane, namespace: str, selector: str) -> list[dict[str, Any]]:
    listed: list[dict[str, Any]] = plane.kubectl_json("get", "pods", "-n", namespace, "-l", selector)["items"]
    return listed


def ready(pod: dict[str, Any]) -> bool:
    state = condition(pod, "Ready")
    return (
        pod["metadata"].get("deletionTimestamp") is None and state is not None and state["status"] == "True"
    )


def ready_pods(plane: ControlPlane, namespace: str, selector: str, count: int) -> list[dict[str, Any]] | None:
    """The `count` Ready pods matching `selector`, when there are exactly that many and no others."""
    found = pods(plane, namespace, selector)
    return found if len(found) == count and all(ready(p) for p in found) else None


def served_certificate(pod: dict[str, Any]) -> x509.Certificate:
    """What a TLS handshake with the pod's own address gets."""
    with (
        socket.create_connection((pod["status"]["podIP"], WEBHOOK_PORT), timeout=5) as raw,
        insecure_context().wrap_socket(raw) as conn,
    ):
        der = conn.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


def admissions(pod: dict[str, Any]) -> float:
    """gpuguard_admission_requests_total of one webhook pod, read at its address."""
    status, body = http_get(WEBHOOK_PORT, "/metrics", insecure_context(), pod["status"]["podIP"])
    assert status == 200, f"/metrics of {pod['metadata']['name']} answered {status}"
    return sum(value for _, value in metric_samples(body.decode(), "gpuguard_admission_requests_total"))


@pytest.fixture(scope="module")
def installed(cluster: NodeCluster, gpuguard_image: str) -> Iterator[list[dict[str, Any]]]:
    """`kubectl apply -k deploy/` (the README's command) with the image on both nodes; yields the two
    webhook pods once both are Ready. Afterwards whatever is left of it goes (waited for), and the
    session's PriorityClasses (which deploy/ ships too, and its uninstall removes) are back."""
    plane = cluster.plane
    try:
        plane.kubectl("apply", "-k", str(DEPLOY))
        yield awaited(
            lambda: ready_pods(plane, NAMESPACE, WEBHOOK_PODS, 2), what="both webhook replicas Ready"
        )
    finally:
        uninstall(plane)  # before the next module, which may install gpuguard again (test_helm)
        install_priority_classes(plane, default_priority_classes())


def test_both_webhook_replicas_serve_the_one_certificate_they_bootstrapped(
    cluster: NodeCluster, installed: list[dict[str, Any]]
) -> None:
    material = read_secret(cluster.plane)

    assert {pod["spec"]["nodeName"] for pod in installed} == set(cluster.nodes)  # one per node
    assert material.phase == "steady"
    assert len(material.cas) == 1
    logs = "".join(
        cluster.plane.kubectl("logs", "-n", NAMESPACE, pod["metadata"]["name"]).stdout for pod in installed
    )
    assert logs.count("certificates: create") == 1  # one replica created the Secret, the other adopted it
    assert tls.covers(material.leaf, files.dns_names_for_service("gpuguard", NAMESPACE))
    for pod in installed:
        assert served_certificate(pod) == material.leaf, pod["metadata"]["name"]
    eventually(
        lambda: ca_bundles(cluster.plane) == {kind: material.cas for kind in CONFIGURATION_KINDS},
        what="caBundle of both configurations filled with the Secret's CA",
        timeout=PATIENCE,
    )


def test_pod_security_enforces_restricted_and_admits_gpuguards_pods(
    cluster: NodeCluster, installed: list[dict[str, Any]]
) -> None:
    plane = cluster.plane
    labels = plane.kubectl_json("get", "namespace", NAMESPACE)["metadata"]["labels"]
    privileged = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "privileged", "namespace": NAMESPACE},
        "spec": {"containers": [{"name": "c", "image": "gpuguard", "securityContext": {"privileged": True}}]},
    }

    refused = plane.kubectl(
        "create", "--dry-run=server", "-f", "-", input=json.dumps(privileged), check=False
    )

    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    assert 'violates PodSecurity "restricted:latest"' in refused.stderr, refused.stderr
    # Admitted and running there under it: the webhook replicas, and the controllers.
    assert all(ready(pod) for pod in installed)
    awaited(lambda: ready_pods(plane, NAMESPACE, CONTROLLERS_PODS, 2), what="both controllers replicas Ready")


def test_a_gpu_job_is_mutated_through_the_service(
    cluster: NodeCluster, installed: list[dict[str, Any]], installed_namespace: str
) -> None:
    plane = cluster.plane
    job = gpu_job("train", installed_namespace)
    job["spec"]["suspend"] = True  # admission is the point: no pod
    calls_before = sum(admissions(pod) for pod in installed)

    dry_run = submit_dry_run(plane, job)
    plane.kubectl("apply", "-f", "-", input=json.dumps(job))
    stored = plane.kubectl_json("get", "job", "train", "-n", installed_namespace)

    assert dry_run.returncode == 0, dry_run.stderr
    for mutated in (json.loads(dry_run.stdout), stored):
        assert gpuguard_annotations(mutated)
        spec = mutated["spec"]
        assert {
            "action": "Ignore",
            "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
        } in spec["podFailurePolicy"]["rules"]
        template = spec["template"]["spec"]
        assert template["priorityClassName"] == "gpu-workload"
        readiness = {t["key"]: t["tolerationSeconds"] for t in template["tolerations"]}
        assert readiness == {"node.kubernetes.io/not-ready": 1800, "node.kubernetes.io/unreachable": 1800}
    # Both requests (dry run and apply) went to the replicas, each called once per webhook at least.
    assert sum(admissions(pod) for pod in installed) >= calls_before + 4


def test_a_default_priority_pod_bound_for_gpu_nodes_is_denied_through_the_service(
    cluster: NodeCluster, installed: list[dict[str, Any]], installed_namespace: str
) -> None:
    plane = cluster.plane
    crowder = pinned_to_gpu_nodes("crowder", installed_namespace)

    dry_run = submit_dry_run(plane, crowder)
    applied = plane.kubectl("apply", "-f", "-", input=json.dumps(crowder), check=False)

    for refused in (dry_run, applied):
        assert refused.returncode != 0
        assert 'admission webhook "validate.gpuguard.io" denied the request' in refused.stderr, refused.stderr
        assert "acceleratorNodeGuard" in refused.stderr
    assert plane.kubectl("get", "pod", "crowder", "-n", installed_namespace, check=False).returncode != 0
    # A GPU pod in the same namespace is admitted and mutated.
    admitted = submit_dry_run(plane, gpu_pod("trainer", installed_namespace))
    assert admitted.returncode == 0 and gpuguard_annotations(json.loads(admitted.stdout)), admitted.stderr


def test_the_controllers_elect_a_leader_among_their_pods(
    cluster: NodeCluster, installed: list[dict[str, Any]]
) -> None:
    plane = cluster.plane
    controllers = awaited(
        lambda: ready_pods(plane, NAMESPACE, CONTROLLERS_PODS, 2), what="both controllers replicas Ready"
    )

    def holder() -> str | None:
        lease = plane.kubectl("get", "lease", LEASE_NAME, "-n", NAMESPACE, "-o", "json", check=False)
        return json.loads(lease.stdout)["spec"].get("holderIdentity") if lease.returncode == 0 else None

    leader = awaited(holder, what="the controllers' Lease held")

    assert leader in {pod["metadata"]["name"] for pod in controllers}


def test_the_node_agent_runs_on_each_gpu_node(cluster: NodeCluster, installed: list[dict[str, Any]]) -> None:
    plane = cluster.plane

    agents = awaited(
        lambda: ready_pods(plane, AGENT_NAMESPACE, AGENT_PODS, len(cluster.nodes)),
        what="a Ready node agent pod on each node",
    )

    assert sorted(pod["spec"]["nodeName"] for pod in agents) == sorted(cluster.nodes)
    labels = plane.kubectl_json("get", "namespace", AGENT_NAMESPACE)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"


# --- operations under a steady stream of GPU pods, with failurePolicy Fail ---------------------------------


def expect_no_loss(stream: Stream) -> None:
    """Every GPU pod of the stream came back admitted and mutated by gpuguard."""
    outcomes = stream.outcomes
    failures = [o.detail for o in outcomes if not o.ok]
    assert not failures, f"{len(failures)} of {len(outcomes)} requests failed, first: {failures[0]}"


def more_requests(stream: Stream, count: int = 10) -> None:
    """Waits until `count` requests more went through, so that the stream ran on after what happened."""
    moment = time.monotonic()
    wait_until(lambda: stream.count_after(moment) >= count, timeout=PATIENCE, what=f"{count} requests more")
    assert stream.thread.is_alive(), "the stream stopped early"


@pytest.fixture(scope="module")
def fail_closed(cluster: NodeCluster, installed: list[dict[str, Any]]) -> None:
    """deploy/fail-closed/ applied over the install: a webhook that cannot answer refuses the pod."""
    cluster.plane.kubectl("apply", "-k", str(DEPLOY / "fail-closed"))
    for kind in CONFIGURATION_KINDS:
        webhook = cluster.plane.kubectl_json("get", kind, CONFIGURATION)["webhooks"][0]
        assert webhook["failurePolicy"] == "Fail"


def test_a_rolling_update_to_another_tag_under_a_stream_of_gpu_pods_loses_none(
    cluster: NodeCluster, installed: list[dict[str, Any]], fail_closed: None, installed_namespace: str
) -> None:
    plane = cluster.plane
    for node in cluster.nodes.values():  # the same image under a second tag: a new template all the same
        node.ctr("images", "tag", f"{IMAGE_REPOSITORY}:{__version__}", f"{IMAGE_REPOSITORY}:{NEXT_TAG}")
    before = {pod["metadata"]["name"] for pod in pods(plane, NAMESPACE, WEBHOOK_PODS)}

    with Stream(plane, installed_namespace) as stream:
        wait_until(lambda: stream.count_after(0) >= 5, timeout=PATIENCE, what="the stream under way")
        plane.kubectl("set", "image", "deployment/gpuguard", f"gpuguard=gpuguard:{NEXT_TAG}", "-n", NAMESPACE)
        plane.kubectl(
            "rollout",
            "status",
            "deployment/gpuguard",
            "-n",
            NAMESPACE,
            f"--timeout={PATIENCE:.0f}s",
            timeout=PATIENCE + 30,
        )
        more_requests(stream)

    expect_no_loss(stream)
    after = awaited(lambda: ready_pods(plane, NAMESPACE, WEBHOOK_PODS, 2), what="the new replicas alone")
    assert not before & {pod["metadata"]["name"] for pod in after}
    assert {pod["spec"]["containers"][0]["image"] for pod in after} == {f"gpuguard:{NEXT_TAG}"}


def test_deleting_a_webhook_pod_under_a_stream_of_gpu_pods_loses_none(
    cluster: NodeCluster, installed: list[dict[str, Any]], fail_closed: None, installed_namespace: str
) -> None:
    plane = cluster.plane
    victim = pods(plane, NAMESPACE, WEBHOOK_PODS)[0]["metadata"]["name"]

    with Stream(plane, installed_namespace) as stream:
        wait_until(lambda: stream.count_after(0) >= 5, timeout=PATIENCE, what="the stream under way")
        plane.kubectl("delete", "pod", victim, "-n", NAMESPACE, "--wait=false")
        replaced = awaited(
            lambda: ready_pods(plane, NAMESPACE, WEBHOOK_PODS, 2),
            what="the deleted replica replaced and gone",
        )
        more_requests(stream)

    expect_no_loss(stream)
    assert victim not in {pod["metadata"]["name"] for pod in replaced}


def test_the_disruption_budget_blocks_a_drain_that_would_take_both_replicas(
    cluster: NodeCluster, installed: list[dict[str, Any]], fail_closed: None, installed_namespace: str
) -> None:
    plane = cluster.plane
    nodes = sorted(cluster.nodes)
    plane.kubectl("cordon", *nodes)  # so an evicted replica's replacement has nowhere to go
    try:
        drain = plane.kubectl(
            "drain",
            *nodes,
            f"--pod-selector={WEBHOOK_PODS}",
            "--delete-emptydir-data",  # the replicas' in-memory certificate folder, as any drain of them needs
            "--timeout=30s",
            check=False,
            timeout=120,
        )
        standing = [pod for pod in pods(plane, NAMESPACE, WEBHOOK_PODS) if ready(pod)]
        admitted = submit_dry_run(plane, gpu_pod("during-drain", installed_namespace))
    finally:
        plane.kubectl("uncordon", *nodes)

    assert drain.returncode != 0
    assert "Cannot evict pod as it would violate the pod's disruption budget" in drain.stderr, drain.stderr
    assert len(standing) == 1  # one evicted, the other kept by the budget, still serving
    assert admitted.returncode == 0 and gpuguard_annotations(json.loads(admitted.stdout)), admitted.stderr
    awaited(lambda: ready_pods(plane, NAMESPACE, WEBHOOK_PODS, 2), what="both replicas back once uncordoned")


def leftovers(plane: ControlPlane) -> list[str]:
    """gpuguard's objects still in the cluster: anything labelled part of it, the webhook configurations
    and the node agent's admission policy by name, its namespaces."""
    labelled = plane.kubectl("get", CLUSTER_KINDS, "-l", PART_OF, "-o", "name").stdout.split()
    named = plane.kubectl(
        "get",
        ",".join(CONFIGURATION_KINDS),
        CONFIGURATION,
        "--ignore-not-found",
        "-o",
        "name",
    ).stdout.split()
    spaces = plane.kubectl(
        "get", "namespace", NAMESPACE, AGENT_NAMESPACE, "--ignore-not-found", "-o", "name"
    ).stdout.split()
    return sorted({*labelled, *named, *spaces})


def uninstall(plane: ControlPlane) -> None:
    """Whatever deploy/ has in the cluster deleted, and gone: namespaces included."""
    plane.kubectl("delete", "-k", str(DEPLOY), "--ignore-not-found", "--wait=false")
    eventually(lambda: not leftovers(plane), what="nothing of gpuguard left", timeout=PATIENCE)


def test_deleting_deploy_leaves_nothing_of_gpuguard(
    cluster: NodeCluster, installed: list[dict[str, Any]]
) -> None:
    plane = cluster.plane
    assert leftovers(plane)  # installed, to begin with

    plane.kubectl("delete", "-k", str(DEPLOY), "--wait=false")

    eventually(lambda: not leftovers(plane), what="nothing of gpuguard left", timeout=PATIENCE)
    assert not plane.kubectl("get", "pods", "-A", "-l", PART_OF, "-o", "name").stdout.split()
