"""Device-failure exit codes on a real terminated container: the Job controller applies the
podFailurePolicy gpuguard injected, as the policy says (conftest.POLICY: the device-failure code is
ignored, the non-retriable code fails the Job at once)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.harness.admission import gpu_job, read_back, submit
from tests.harness.controlplane import ControlPlane, wait_until
from tests.harness.node import condition
from tests.harness.workloads import container_status, on_node

from .conftest import DEVICE_FAILURE_EXIT_CODE, NON_RETRIABLE_EXIT_CODE, NodeCluster

NODE = "node-b"


def job_pods(plane: ControlPlane, namespace: str, job: str) -> list[dict[str, Any]]:
    pods: list[dict[str, Any]] = plane.kubectl_json("get", "pods", "-n", namespace, "-l", f"job-name={job}")[
        "items"
    ]
    return sorted(pods, key=lambda p: p["metadata"]["creationTimestamp"])


def finished(plane: ControlPlane, manifest: dict[str, Any]) -> dict[str, Any]:
    """The Job once it has a Complete or Failed condition."""
    seen: list[dict[str, Any]] = []

    def done() -> bool:
        seen[:] = [read_back(plane, manifest)]
        return any(
            (c := condition(seen[0], kind)) is not None and c["status"] == "True"
            for kind in ("Complete", "Failed")
        )

    wait_until(done, timeout=120, what=f"Job {manifest['metadata']['name']} finished")
    return seen[0]


def exit_codes(pods: list[dict[str, Any]]) -> list[int]:
    return [container_status(p)["state"]["terminated"]["exitCode"] for p in pods]


def test_device_failure_exit_code_is_not_counted_against_backoff_limit(
    cluster: NodeCluster, namespace: str, tmp_path: Path
) -> None:
    plane = cluster.plane
    # The first pod fails the way a lost GPU makes a CUDA program fail; its replacement succeeds.
    # The marker file is on the machine's disk, which the node's pods reach through a hostPath.
    script = (
        f"if [ -e /attempts/first ]; then exit 0; fi; touch /attempts/first; exit {DEVICE_FAILURE_EXIT_CODE}"
    )
    manifest = on_node(gpu_job("device-failure", namespace), NODE, script)
    manifest["spec"]["backoffLimit"] = 0  # counted, the first failure would fail the Job
    template = manifest["spec"]["template"]["spec"]
    template["volumes"] = [{"name": "attempts", "hostPath": {"path": str(tmp_path), "type": "Directory"}}]
    template["containers"][0]["volumeMounts"] = [{"name": "attempts", "mountPath": "/attempts"}]
    submit(plane, "create", manifest)

    job = finished(plane, manifest)

    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert {
        "action": "Ignore",
        "onExitCodes": {"operator": "In", "values": [DEVICE_FAILURE_EXIT_CODE, 75]},
    } in rules
    assert condition(job, "Complete") is not None, job["status"]
    assert job["status"].get("failed", 0) == 0  # the device failure did not count
    pods = job_pods(plane, namespace, "device-failure")
    assert [p["status"]["phase"] for p in pods] == ["Failed", "Succeeded"]
    assert exit_codes(pods) == [DEVICE_FAILURE_EXIT_CODE, 0]


def test_non_retriable_exit_code_fails_the_job_at_once(cluster: NodeCluster, namespace: str) -> None:
    plane = cluster.plane
    manifest = on_node(gpu_job("non-retriable", namespace), NODE, f"exit {NON_RETRIABLE_EXIT_CODE}")
    manifest["spec"]["backoffLimit"] = 6  # counted, it would be retried six times
    submit(plane, "create", manifest)

    job = finished(plane, manifest)

    failed = condition(job, "Failed")
    assert failed is not None and failed["reason"] == "PodFailurePolicy", job["status"]
    assert str(NON_RETRIABLE_EXIT_CODE) in failed["message"]
    assert exit_codes(job_pods(plane, namespace, "non-retriable")) == [NON_RETRIABLE_EXIT_CODE]
