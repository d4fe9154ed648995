"""What gpuguard's JobSet mutation does on real controllers: JobSet's own controller (built from the
shared third_party source) and kube-controller-manager's Job and garbage collector controllers, on a
control plane of its own, with the test in the kubelet's place (it writes the pods' terminal status).

A device failure (exit code 74) in one worker fails its Job by PodFailurePolicy, and the JobSet
restarts every worker: `status.restarts` counts it, `restartsCountTowardsMax` does not. A failure of
the user's own (exit code 1) still counts toward maxRestarts. The JobSet created is the one gpuguard's
webhook makes of the manifest (tests/e2e/test_gangs.py proves the webhook path and the CRD's
acceptance), with what JobSet's own defaulting webhook adds (not run here) written out.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.harness.controllers import Kubelet
from tests.harness.controlplane import ControlPlane, Process, wait_until
from tests.harness.jobset import (
    JOBSET_DEFAULTS,
    attempt_pods,
    install_jobset_crd,
    jobset_status,
    start_jobset_manager,
)
from webhook.policy import engine
from webhook.policy.model import default_policy

NAMESPACE = "default"
JOBSET = "gang"
WAIT_SECONDS = 90.0

Json = dict[str, Any]


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    workdir = tmp_path_factory.mktemp("jobset-plane")
    plane = ControlPlane.start(control_plane.bin_dir, workdir)
    try:
        plane.start_controller_manager(controllers=("job-controller", "garbage-collector-controller"))
        install_jobset_crd(plane, workdir)
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="module")
def jobset_controller(cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    process = start_jobset_manager(cluster, tmp_path_factory.mktemp("jobset-manager"))
    try:
        yield process
    finally:
        process.stop()


def gang_jobset() -> Json:
    """Two workers in one Job, as a torchrun world; maxRestarts 1. What JobSet's webhook defaults
    (successPolicy, startupPolicy, network) is written out, since that webhook does not run here."""
    container = {
        "name": "worker",
        "image": "registry.k8s.io/pause:3.10",
        "resources": {"limits": {"nvidia.com/gpu": 1}},
    }
    job_spec = {
        "parallelism": 2,
        "completions": 2,
        "completionMode": "Indexed",
        "backoffLimit": 0,
        "template": {"spec": {"restartPolicy": "Never", "containers": [container]}},
    }
    manifest = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": JOBSET, "namespace": NAMESPACE},
        "spec": {
            "failurePolicy": {"maxRestarts": 1},
            **JOBSET_DEFAULTS,
            "replicatedJobs": [{"name": "workers", "replicas": 1, "template": {"spec": job_spec}}],
        },
    }
    result = engine.mutate(copy.deepcopy(manifest), default_policy(), namespace=NAMESPACE)
    mutated: Json = result.obj
    # The priority class gpuguard names exists in a cluster with gpuguard; not in this one.
    del mutated["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["priorityClassName"]
    return mutated


def status(plane: ControlPlane) -> Json:
    return jobset_status(plane, JOBSET, NAMESPACE)


def workers(plane: ControlPlane, attempt: int) -> list[Json]:
    return attempt_pods(plane, JOBSET, NAMESPACE, attempt)


def wait(what: str, ready: Callable[[], bool], process: Process) -> float:
    return wait_until(ready, timeout=WAIT_SECONDS, what=what, process=process)


def test_a_device_failure_restarts_every_worker_without_spending_max_restarts(
    cluster: ControlPlane, jobset_controller: Process, summary: Callable[[str, str], None]
) -> None:
    kubelet = Kubelet(cluster, "jobset")
    cluster.kubectl("apply", "-f", "-", input=json.dumps(gang_jobset()))
    wait("two workers of attempt 0", lambda: len(workers(cluster, 0)) == 2, jobset_controller)
    first = {pod["metadata"]["uid"] for pod in workers(cluster, 0)}

    # One worker's device fails: its container exits with a device-failure code.
    failed_at = time.monotonic()
    kubelet.terminate(NAMESPACE, workers(cluster, 0)[0]["metadata"]["name"], exit_code=74)
    wait("two workers of attempt 1", lambda: len(workers(cluster, 1)) == 2, jobset_controller)
    recreated = time.monotonic() - failed_at
    # Every worker is new, the healthy one too: the whole world restarts from its checkpoint.
    assert not first & {pod["metadata"]["uid"] for pod in workers(cluster, 1)}
    after_device = status(cluster)
    assert after_device.get("restarts") == 1
    assert after_device.get("restartsCountTowardsMax", 0) == 0
    summary(
        "jobset_restart",
        f"JobSet restart on a device failure (control plane, no kubelet): every worker recreated "
        f"{recreated:.1f} s after the failure",
    )

    # The user's own failure (exit code 1) is the JobSet's ordinary restart, counted against maxRestarts.
    kubelet.terminate(NAMESPACE, workers(cluster, 1)[0]["metadata"]["name"], exit_code=1)
    wait("two workers of attempt 2", lambda: len(workers(cluster, 2)) == 2, jobset_controller)
    after_own = status(cluster)
    assert after_own.get("restarts") == 2
    assert after_own.get("restartsCountTowardsMax") == 1

    # A device failure again: maxRestarts (1) is spent, but this restart does not need it.
    kubelet.terminate(NAMESPACE, workers(cluster, 2)[0]["metadata"]["name"], exit_code=74)
    wait("two workers of attempt 3", lambda: len(workers(cluster, 3)) == 2, jobset_controller)
    assert status(cluster).get("restartsCountTowardsMax") == 1
