"""audit and warn modes: gpuguard restarted with a policy file changes and denies nothing.

The mode fixture is module-scoped and parametrized, so pytest runs every test under `audit`, then every
test under `warn`: three webhook restarts for the whole module (audit, warn, back to the default).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.harness.admission import (
    API_SERVER_DEFAULT_SECONDS,
    READINESS_KEYS,
    WebhookProcess,
    device_plugin_daemonset,
    gpu_job,
    gpu_pod,
    gpuguard_annotations,
    gpuguard_decisions,
    kubectl_warnings,
    pinned_to_gpu_nodes,
    read_back,
    readiness_tolerations,
    restore_default,
    submit,
    wait_until_answering,
)
from tests.harness.controlplane import ControlPlane


@pytest.fixture(scope="module")
def default_policy_afterwards(control_plane: ControlPlane, gpuguard: WebhookProcess) -> Iterator[None]:
    yield
    restore_default(control_plane, gpuguard)


@pytest.fixture(scope="module", params=["audit", "warn"])
def mode(
    request: pytest.FixtureRequest,
    control_plane: ControlPlane,
    gpuguard: WebhookProcess,
    default_policy_afterwards: None,
    tmp_path_factory: pytest.TempPathFactory,
) -> str:
    mode: str = request.param
    policy = tmp_path_factory.mktemp("policy") / f"{mode}.yaml"
    policy.write_text(f"mode: {mode}\n")  # a policy file names only what it changes (README)
    gpuguard.restart(policy)
    # The registration (failurePolicy Fail) is unchanged: an admitted probe was answered by this process.
    wait_until_answering(control_plane)
    return mode


def gpuguard_warnings(stderr_lines: list[str]) -> list[str]:
    return [line for line in stderr_lines if line.startswith("gpuguard")]


def test_gpu_pod_is_stored_as_submitted(
    control_plane: ControlPlane, gpuguard: WebhookProcess, namespace: str, mode: str
) -> None:
    manifest = gpu_pod("gpu", namespace)
    before = gpuguard_decisions(gpuguard, mode=mode, outcome="would-apply")

    result = submit(control_plane, "apply", manifest)
    pod = read_back(control_plane, manifest)

    assert not gpuguard_annotations(pod)
    assert readiness_tolerations(pod["spec"]) == {key: [API_SERVER_DEFAULT_SECONDS] for key in READINESS_KEYS}
    assert "lifecycle" not in pod["spec"]["containers"][0]
    assert pod["spec"]["terminationGracePeriodSeconds"] == 30
    assert "priorityClassName" not in pod["spec"]
    assert pod["spec"]["priority"] == 0
    # ...but recorded: one would-apply decision per rule that would have changed the pod.
    assert gpuguard_decisions(gpuguard, mode=mode, outcome="would-apply") > before
    warnings = gpuguard_warnings(kubectl_warnings(result))
    if mode == "warn":
        assert any(w.startswith("gpuguard (warn) would ") for w in warnings), result.stderr
        assert any("toleration" in w for w in warnings), warnings
    else:
        assert warnings == []


def test_gpu_job_is_stored_without_pod_failure_policy(
    control_plane: ControlPlane, namespace: str, mode: str
) -> None:
    manifest = gpu_job("train", namespace)

    result = submit(control_plane, "apply", manifest)
    job: dict[str, Any] = read_back(control_plane, manifest)

    assert not gpuguard_annotations(job)
    assert "podFailurePolicy" not in job["spec"]
    assert job["spec"]["podReplacementPolicy"] == "TerminatingOrFailed"
    assert "tolerations" not in job["spec"]["template"]["spec"]
    warnings = gpuguard_warnings(kubectl_warnings(result))
    assert any("podFailurePolicy" in w for w in warnings) if mode == "warn" else warnings == []


def test_pod_pinned_to_gpu_nodes_is_admitted(
    control_plane: ControlPlane, gpuguard: WebhookProcess, namespace: str, mode: str
) -> None:
    manifest = pinned_to_gpu_nodes("crowder", namespace)
    before = gpuguard_decisions(gpuguard, rule="acceleratorNodeGuard", mode=mode, outcome="would-deny")

    result = submit(control_plane, "apply", manifest)
    pod = read_back(control_plane, manifest)

    assert pod["spec"]["priority"] == 0
    assert (
        gpuguard_decisions(gpuguard, rule="acceleratorNodeGuard", mode=mode, outcome="would-deny")
        == before + 1
    )
    warnings = gpuguard_warnings(kubectl_warnings(result))
    if mode == "warn":
        assert any(
            w.startswith("gpuguard (warn) would deny") and "priorityClassName" in w for w in warnings
        ), result.stderr
    else:
        assert warnings == []


def test_untrusted_device_software_is_admitted_and_recorded(
    control_plane: ControlPlane, gpuguard: WebhookProcess, namespace: str, mode: str
) -> None:
    manifest = device_plugin_daemonset("plugin", namespace, "quay.io/example/device-plugin:v1")
    before = gpuguard_decisions(gpuguard, rule="trustedDeviceSoftware", mode=mode, outcome="would-deny")

    result = submit(control_plane, "apply", manifest)

    assert read_back(control_plane, manifest)["spec"]["template"]["spec"]["containers"][0][
        "image"
    ].startswith("quay.io/example/")
    after = gpuguard_decisions(gpuguard, rule="trustedDeviceSoftware", mode=mode, outcome="would-deny")
    assert after == before + 1
    warnings = gpuguard_warnings(kubectl_warnings(result))
    if mode == "warn":
        # The container and its image first: kubectl's warnings are cut at 120 characters.
        (warning,) = warnings
        assert warning.startswith(
            "gpuguard (warn) would deny: container plugin: image quay.io/example/device-plugin:v1 is not from"
        ), result.stderr
    else:
        assert warnings == []


def test_driver_requirement_is_recorded_not_applied(
    control_plane: ControlPlane, gpuguard: WebhookProcess, namespace: str, mode: str
) -> None:
    manifest = gpu_pod("needs-550", namespace)
    manifest["metadata"]["annotations"] = {"gpuguard.io/min-driver-major": "550"}
    before = gpuguard_decisions(gpuguard, rule="driverCompatibility", mode=mode, outcome="would-apply")

    result = submit(control_plane, "apply", manifest)

    assert "affinity" not in read_back(control_plane, manifest)["spec"]
    after = gpuguard_decisions(gpuguard, rule="driverCompatibility", mode=mode, outcome="would-apply")
    assert after == before + 1
    warnings = gpuguard_warnings(kubectl_warnings(result))
    if mode == "warn":
        assert any(
            "would require node label nvidia.com/cuda.driver-version.major >= 550" in w for w in warnings
        )
        # ...and the validating check says what that leaves open.
        assert any(w.startswith("gpuguard (warn) would deny: needs nvidia.com/cuda.driver") for w in warnings)
    else:
        assert warnings == []
