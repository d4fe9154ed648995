"""The harness itself: the control plane behaves like Kubernetes, and gpuguard's registration takes effect."""

from __future__ import annotations

import json
from pathlib import Path

from tests.harness.admission import (
    CONFIG_NAME,
    MUTATING_WEBHOOK,
    VALIDATING_WEBHOOK,
    WebhookProcess,
    cpu_pod,
    gpu_pod,
    gpuguard_annotations,
)
from tests.harness.controlplane import SHOWN_LINES, ControlPlane, wait_until


def test_control_plane_stores_and_defaults_pods(control_plane: ControlPlane, namespace: str) -> None:
    control_plane.kubectl("create", "-f", "-", input=json.dumps(cpu_pod("cpu", namespace)))

    pod = control_plane.kubectl_json("get", "pod", "cpu", "-n", namespace)

    assert pod["metadata"]["namespace"] == namespace
    assert pod["status"]["phase"] == "Pending"  # no scheduler, no nodes
    # The in-tree DefaultTolerationSeconds admission plugin ran: this is the baseline gpuguard raises.
    assert {
        "key": "node.kubernetes.io/not-ready",
        "operator": "Exists",
        "effect": "NoExecute",
        "tolerationSeconds": 300,
    } in pod["spec"]["tolerations"]


def test_registered_webhook_is_called(
    control_plane: ControlPlane, gpuguard: WebhookProcess, namespace: str
) -> None:
    for kind, name, path in [
        ("mutatingwebhookconfiguration", MUTATING_WEBHOOK, "/mutate"),
        ("validatingwebhookconfiguration", VALIDATING_WEBHOOK, "/validate"),
    ]:
        (webhook,) = control_plane.kubectl_json("get", kind, CONFIG_NAME)["webhooks"]
        assert (webhook["name"], webhook["failurePolicy"]) == (name, "Fail")
        assert webhook["clientConfig"]["url"] == f"{gpuguard.url}{path}"

    created = control_plane.kubectl_json("create", "-f", "-", input=json.dumps(gpu_pod("gpu", namespace)))
    stored = control_plane.kubectl_json("get", "pod", "gpu", "-n", namespace)
    assert gpuguard_annotations(created)
    assert gpuguard_annotations(stored) == gpuguard_annotations(created)

    # kube-system is excluded by the namespaceSelector, so a dead gpuguard can't wedge the cluster.
    excluded = control_plane.kubectl_json(
        "create", "--dry-run=server", "-f", "-", input=json.dumps(gpu_pod("gpu", "kube-system"))
    )
    assert not gpuguard_annotations(excluded)


def test_kubectl_caches_inside_the_control_planes_folder(control_plane: ControlPlane) -> None:
    # Without KUBECACHEDIR kubectl writes discovery answers to ~/.kube/cache, outside the test's folders.
    control_plane.kubectl("api-resources", "-o", "name")

    assert control_plane.kube_cache.is_relative_to(control_plane.workdir)
    assert control_plane.kubectl_env()["KUBECACHEDIR"] == str(control_plane.kube_cache)
    assert any(path.is_file() for path in control_plane.kube_cache.rglob("*")), "nothing cached there"


def test_a_failing_test_prints_the_webhook_lines_of_the_metrics_not_all_of_them(
    control_plane: ControlPlane,
) -> None:
    control_plane.kubectl("get", "--raw", "/metrics")
    call = control_plane.history[-1]
    printed = str(call).splitlines()

    assert len(call.stdout.splitlines()) > 1000  # what used to be printed, per failure
    assert len(printed) <= SHOWN_LINES + 3
    assert all("admission_webhook" in line for line in printed[2:] if not line.startswith("[..."))
    assert "lines shown: the ones about admission webhooks" in printed[1]


def test_controller_manager_and_scheduler_are_opt_in_additions(k8s_bin: Path, tmp_path: Path) -> None:
    # A control plane of its own: the session's stays without controllers, as the other tests expect.
    with ControlPlane.start(k8s_bin, tmp_path) as plane:
        plane.start_controller_manager(node_monitor_grace_period=10)
        plane.start_scheduler()
        # The serviceaccount controller gives every namespace its `default` ServiceAccount.
        wait_until(
            lambda: plane.kubectl("get", "serviceaccount", "default", check=False).returncode == 0,
            timeout=30,
            what="default ServiceAccount",
        )
        # The scheduler tries the pod, finds no node, and says so on the pod.
        plane.kubectl("create", "-f", "-", input=json.dumps(cpu_pod("unschedulable", "default")))
        wait_until(
            lambda: _condition(plane, "unschedulable", "PodScheduled") == ("False", "Unschedulable"),
            timeout=30,
            what="PodScheduled=False",
        )
        # The namespace controller finishes deleting a namespace (without it, it stays Terminating).
        plane.kubectl("create", "namespace", "short-lived")
        plane.kubectl("delete", "namespace", "short-lived", "--timeout=30s")
        assert plane.running


def _condition(plane: ControlPlane, pod: str, kind: str) -> tuple[str, str] | None:
    conditions = plane.kubectl_json("get", "pod", pod).get("status", {}).get("conditions") or []
    return next(((c["status"], c.get("reason", "")) for c in conditions if c["type"] == kind), None)
