"""A two-worker JobSet on the two real nodes, one worker per node, each holding a fake GPU: one worker's
device fails (its container exits with the device-failure code) and JobSet's controller, built from the
shared third_party source, restarts every worker by the failurePolicy rule gpuguard added, without
spending maxRestarts. The figure printed is the time from the failure to every worker running again:
the Job controller's verdict, the old workers' graceful termination (gpuguard's preStop included) and
the new workers' scheduling and start, on real kubelets.

The JobSet is what gpuguard makes of the manifest with the tier's policy (engine.mutate; the admission
path for JobSets is tests/e2e/test_gangs.py's), plus what JobSet's own webhook would default."""

from __future__ import annotations

import copy
import datetime
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.admission import gpu_container, submit
from tests.harness.controlplane import Process, wait_until
from tests.harness.jobset import (
    JOBSET_DEFAULTS,
    attempt_pods,
    install_jobset_crd,
    jobset_status,
    start_jobset_manager,
)
from tests.harness.workloads import container_status, on_node, running
from webhook.policy import engine
from webhook.policy.model import parse_policy

from .conftest import DEVICE_FAILURE_EXIT_CODE, NODE_NAMES, PATIENCE, POLICY, NodeCluster

JOBSET = "gang"


@pytest.fixture(scope="module")
def jobset_controller(cluster: NodeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    workdir = tmp_path_factory.mktemp("jobset")
    install_jobset_crd(cluster.plane, workdir)
    process = start_jobset_manager(cluster.plane, workdir)
    try:
        yield process
    finally:
        process.stop()


def worker(node: str, script: str) -> dict[str, Any]:
    """A replicated Job of one worker pinned to `node`, running `script` with one fake GPU."""
    pod_template = {"spec": {"restartPolicy": "Never", "containers": [gpu_container()]}}
    job = on_node({"kind": "Job", "spec": {"template": pod_template}}, node, script)
    job["spec"] |= {"parallelism": 1, "completions": 1, "backoffLimit": 0}
    return {"name": f"worker-{node[-1]}", "replicas": 1, "template": {"spec": job["spec"]}}


def gang(namespace: str, marker: Path) -> dict[str, Any]:
    # The worker on the second node fails on its first attempt only (the marker is on the machine's disk,
    # reached through a hostPath), as a worker whose GPU fell off the bus; the other trains on.
    fails_once = (
        f"if [ -e /attempts/failed ]; then exec sleep 3600; fi; touch /attempts/failed; sleep 2; "
        f"exit {DEVICE_FAILURE_EXIT_CODE}"
    )
    second = worker(NODE_NAMES[1], fails_once)
    pod = second["template"]["spec"]["template"]["spec"]
    pod["volumes"] = [{"name": "attempts", "hostPath": {"path": str(marker), "type": "Directory"}}]
    pod["containers"][0]["volumeMounts"] = [{"name": "attempts", "mountPath": "/attempts"}]
    manifest = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": JOBSET, "namespace": namespace},
        "spec": {
            "failurePolicy": {"maxRestarts": 0},
            **JOBSET_DEFAULTS,
            "replicatedJobs": [worker(NODE_NAMES[0], "exec sleep 3600"), second],
        },
    }
    mutated: dict[str, Any] = engine.mutate(
        copy.deepcopy(manifest), parse_policy(POLICY), namespace=namespace
    ).obj
    return mutated


def started_at(pod: dict[str, Any]) -> datetime.datetime:
    return datetime.datetime.fromisoformat(container_status(pod, "main")["state"]["running"]["startedAt"])


def test_a_device_failure_restarts_both_workers_on_real_nodes(
    cluster: NodeCluster,
    jobset_controller: Process,
    namespace: str,
    tmp_path: Path,
    summary: Callable[[str, str], None],
) -> None:
    plane = cluster.plane
    submit(plane, "create", gang(namespace, tmp_path))

    def all_running(attempt: int) -> bool:
        pods = attempt_pods(plane, JOBSET, namespace, attempt)
        return len(pods) == 2 and all(running(pod) for pod in pods)

    def failed_worker() -> dict[str, Any] | None:
        for pod in plane.kubectl_json("get", "pods", "-n", namespace)["items"]:
            state = (pod.get("status", {}).get("containerStatuses") or [{}])[0].get("state", {})
            if state.get("terminated", {}).get("exitCode") == DEVICE_FAILURE_EXIT_CODE:
                found: dict[str, Any] = pod
                return found
        return None

    wait_until(lambda: failed_worker() is not None, timeout=PATIENCE, what="the worker's device failure")
    failed = failed_worker()
    assert failed is not None
    failed_at = datetime.datetime.fromisoformat(
        container_status(failed, "main")["state"]["terminated"]["finishedAt"]
    )
    wait_until(lambda: all_running(1), timeout=PATIENCE, what="both workers of attempt 1 running")

    restarted = attempt_pods(plane, JOBSET, namespace, 1)
    assert {pod["spec"]["nodeName"] for pod in restarted} == set(NODE_NAMES)
    status = jobset_status(plane, JOBSET, namespace)
    assert status.get("restarts") == 1
    # maxRestarts 0: a counted restart would have failed the JobSet instead.
    assert status.get("restartsCountTowardsMax", 0) == 0
    seconds = (max(started_at(pod) for pod in restarted) - failed_at).total_seconds()
    summary(
        "gang_restart",
        f"two-worker JobSet on real nodes: every worker running again {seconds:.0f} s after one worker's "
        f"device failure (the old workers' preStop and grace period included)",
    )
