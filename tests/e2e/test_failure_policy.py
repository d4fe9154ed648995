"""failurePolicy Ignore: with gpuguard down, GPU pods are still admitted (fail open), unmutated."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.harness.admission import (
    API_SERVER_DEFAULT_SECONDS,
    READINESS_KEYS,
    WebhookProcess,
    gpu_pod,
    gpuguard_annotations,
    probe_until,
    read_back,
    readiness_tolerations,
    register,
    restore_default,
    submit,
)
from tests.harness.controlplane import ControlPlane


@pytest.fixture
def gpuguard_down_fail_open(control_plane: ControlPlane, gpuguard: WebhookProcess) -> Iterator[None]:
    """gpuguard stopped and registered with failurePolicy Ignore; afterwards started again, registered
    with the suite's failurePolicy and proven to be called."""
    try:
        gpuguard.stop()
        register(control_plane, gpuguard, failure_policy="Ignore")
        # Until the apiserver's informer has the new policy, the dead webhook still rejects (Fail).
        probe_until(
            control_plane,
            lambda r: r.returncode == 0 and not gpuguard_annotations(json.loads(r.stdout)),
            what="GPU pods admitted with gpuguard down",
        )
        yield
    finally:
        restore_default(control_plane, gpuguard)


def test_gpu_pod_is_admitted_unmutated_while_gpuguard_is_down(
    control_plane: ControlPlane, gpuguard: WebhookProcess, namespace: str, gpuguard_down_fail_open: None
) -> None:
    assert not gpuguard.running
    manifest = gpu_pod("gpu", namespace)

    submit(control_plane, "apply", manifest)
    pod = read_back(control_plane, manifest)

    assert not gpuguard_annotations(pod)
    assert readiness_tolerations(pod["spec"]) == {key: [API_SERVER_DEFAULT_SECONDS] for key in READINESS_KEYS}
    assert "priorityClassName" not in pod["spec"]
