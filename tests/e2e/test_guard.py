"""acceleratorNodeGuard through the real API server: kubectl's exit code and message, and who is let in."""

from __future__ import annotations

import pytest

from tests.harness.admission import (
    gpuguard_annotations,
    install_priority_classes,
    pinned_to_gpu_nodes,
    read_back,
    submit,
)
from tests.harness.controlplane import ControlPlane

HIGH_PRIORITY_CLASS = "gpuguard-e2e-high"
HIGH_PRIORITY_VALUE = 100000  # well above the default policy's minPriority 1000

pytestmark = pytest.mark.usefixtures("gpuguard")


@pytest.fixture(scope="module")
def high_priority_class(control_plane: ControlPlane) -> str:
    install_priority_classes(control_plane, {HIGH_PRIORITY_CLASS: HIGH_PRIORITY_VALUE})
    return HIGH_PRIORITY_CLASS


def test_default_priority_pod_on_gpu_nodes_is_denied(control_plane: ControlPlane, namespace: str) -> None:
    manifest = pinned_to_gpu_nodes("crowder", namespace)

    result = submit(control_plane, "apply", manifest, check=False)

    assert result.returncode != 0
    assert 'admission webhook "validate.gpuguard.io" denied the request' in result.stderr
    assert "acceleratorNodeGuard" in result.stderr
    assert "priorityClassName" in result.stderr  # says how to fix it
    assert "nodeSelector cloud.google.com/gke-accelerator" in result.stderr  # and why it applies
    assert control_plane.kubectl("get", "pod", "crowder", "-n", namespace, check=False).returncode != 0


def test_high_priority_pod_on_gpu_nodes_is_admitted(
    control_plane: ControlPlane, namespace: str, high_priority_class: str
) -> None:
    manifest = pinned_to_gpu_nodes("important", namespace)
    manifest["spec"]["priorityClassName"] = high_priority_class

    submit(control_plane, "apply", manifest)
    pod = read_back(control_plane, manifest)

    assert pod["spec"]["priority"] == HIGH_PRIORITY_VALUE
    assert not gpuguard_annotations(pod)  # no GPU request: nothing to mutate


def test_daemonset_pod_on_gpu_nodes_is_admitted(control_plane: ControlPlane, namespace: str) -> None:
    manifest = pinned_to_gpu_nodes("node-agent", namespace)
    manifest["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "name": "node-agent",
            "uid": "6f1f2d0e-8f8a-4d3c-9a57-0d9a1e3b7c21",  # made up: no garbage collector runs here
            "controller": True,
        }
    ]

    submit(control_plane, "apply", manifest)
    pod = read_back(control_plane, manifest)

    assert pod["spec"]["priority"] == 0
    assert pod["metadata"]["ownerReferences"][0]["kind"] == "DaemonSet"
