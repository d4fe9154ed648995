"""charts/gpuguard installed with Helm on the tier's real nodes, as docs/install.md tells users (the release
in `default`, the chart creating gpuguard's namespace): `helm install --wait` brings every component up as
pods, `helm upgrade` to `failurePolicy: Fail` keeps gpuguard serving, `helm uninstall` leaves nothing.
The tests share one release and run in file order."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.harness.admission import (
    default_priority_classes,
    gpu_pod,
    gpuguard_annotations,
    install_priority_classes,
)
from tests.harness.chart import CHART, RELEASE, Helm
from tests.harness.controllers import eventually
from tests.harness.install import (
    CONFIGURATION,
    CONFIGURATION_KINDS,
    NAMESPACE,
    ca_bundles,
    read_secret,
    submit_dry_run,
)

from .conftest import PATIENCE, NodeCluster
from .test_install import (
    AGENT_NAMESPACE,
    AGENT_PODS,
    CONTROLLERS_PODS,
    WEBHOOK_PODS,
    leftovers,
    ready_pods,
    uninstall,
)

RELEASE_NAMESPACE = "default"
# Helm's own deadline for --wait, and the test's for Helm: pods start on a loaded machine.
WAIT = "--timeout=4m"
HELM_SECONDS = 300.0


@pytest.fixture(scope="module")
def released(cluster: NodeCluster, gpuguard_image: str, helm: Helm) -> Iterator[None]:
    """`helm install --wait` of the chart with its default values; uninstalled afterwards whatever
    happened, and the session's PriorityClasses back. The chart ships them too, and Helm adopts no object
    it did not create: the session's go first (the chart's have the same values), and so does what of
    deploy/ the session put there for gpuguard's processes (`accounts`)."""
    sessions = default_priority_classes()
    cluster.plane.kubectl("delete", "priorityclass", *sessions, "--ignore-not-found")
    uninstall(cluster.plane)
    try:
        helm(
            "install",
            RELEASE,
            str(CHART),
            "--namespace",
            RELEASE_NAMESPACE,
            "--wait",
            WAIT,
            timeout=HELM_SECONDS,
        )
        yield
    finally:
        helm("uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE, check=False, timeout=HELM_SECONDS)
        install_priority_classes(cluster.plane, sessions)


def mutated(cluster: NodeCluster, namespace: str) -> bool:
    result = submit_dry_run(cluster.plane, gpu_pod("trainer", namespace))
    return result.returncode == 0 and bool(gpuguard_annotations(json.loads(result.stdout)))


def test_helm_install_brings_gpuguard_up_as_pods_serving_through_its_service(
    cluster: NodeCluster, released: None, installed_namespace: str
) -> None:
    plane = cluster.plane

    # --wait returned: every Deployment and the DaemonSet are Ready.
    assert ready_pods(plane, NAMESPACE, WEBHOOK_PODS, 2)
    assert ready_pods(plane, NAMESPACE, CONTROLLERS_PODS, 2)
    assert ready_pods(plane, AGENT_NAMESPACE, AGENT_PODS, len(cluster.nodes))
    material = read_secret(plane)
    eventually(
        lambda: ca_bundles(plane) == {kind: material.cas for kind in CONFIGURATION_KINDS},
        what="caBundle of both configurations filled",
        timeout=PATIENCE,
    )
    assert mutated(cluster, installed_namespace)


def test_helm_upgrade_to_fail_closed_keeps_the_ca_bundle_and_serving(
    cluster: NodeCluster, released: None, helm: Helm, installed_namespace: str
) -> None:
    plane = cluster.plane
    bundles = ca_bundles(plane)

    helm(
        "upgrade",
        RELEASE,
        str(CHART),
        "--namespace",
        RELEASE_NAMESPACE,
        "--reuse-values",
        "--set",
        "failurePolicy=Fail",
        "--wait",
        WAIT,
        timeout=HELM_SECONDS,
    )

    for kind in CONFIGURATION_KINDS:
        assert plane.kubectl_json("get", kind, CONFIGURATION)["webhooks"][0]["failurePolicy"] == "Fail"
    assert ca_bundles(plane) == bundles  # no field of the chart's: Helm leaves what gpuguard wrote
    assert mutated(cluster, installed_namespace)


def test_helm_uninstall_leaves_nothing_of_gpuguard(cluster: NodeCluster, released: None, helm: Helm) -> None:
    plane = cluster.plane
    assert leftovers(plane)

    helm("uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE, "--wait", WAIT, timeout=HELM_SECONDS)

    eventually(lambda: not leftovers(plane), what="nothing of gpuguard left", timeout=PATIENCE)
    assert helm("list", "--all-namespaces", "--short").stdout.strip() == ""
