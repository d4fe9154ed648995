"""What the API server stores after gpuguard's mutation: each rule, read back with `kubectl get -o json`."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.harness.admission import (
    API_SERVER_DEFAULT_SECONDS,
    BATCH_SECONDS,
    GRACE_SECONDS,
    PRE_STOP,
    READINESS_KEYS,
    RULES_ANNOTATION,
    SERVING_SECONDS,
    cpu_pod,
    gpu_cronjob,
    gpu_deployment,
    gpu_job,
    gpu_pod,
    gpu_statefulset,
    gpuguard_annotations,
    kubectl_warnings,
    pod_spec_of,
    read_back,
    readiness_tolerations,
    submit,
)
from tests.harness.controlplane import ControlPlane

PRIORITY_CLASS = "gpu-workload"
PRIORITY_VALUE = 10000  # the suite installs it (conftest: default_priority_classes)
DISRUPTION_RULE = {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
DEVICE_RULE = {"action": "Count", "onExitCodes": {"operator": "In", "values": [74, 75]}}

pytestmark = pytest.mark.usefixtures("gpuguard")


def create_and_read(plane: ControlPlane, obj: dict[str, Any], verb: str = "apply") -> Any:
    submit(plane, verb, obj)
    return read_back(plane, obj)


# --- rule 1: readiness tolerations ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("restart_policy", "seconds"),
    [("Always", SERVING_SECONDS), ("Never", BATCH_SECONDS), ("OnFailure", BATCH_SECONDS)],
    ids=["serving-Always", "batch-Never", "batch-OnFailure"],
)
def test_gpu_pod_readiness_tolerations_replace_the_defaulted_ones(
    control_plane: ControlPlane, namespace: str, restart_policy: str, seconds: int
) -> None:
    pod = create_and_read(control_plane, gpu_pod("gpu", namespace, restart_policy=restart_policy))

    # Exactly one entry per key, carrying the policy's seconds: DefaultTolerationSeconds' 300 s entry
    # was rewritten in place, not shadowing a second one (the taint manager honours the first match).
    assert readiness_tolerations(pod["spec"]) == {key: [seconds] for key in READINESS_KEYS}
    assert {
        "key": "node.kubernetes.io/not-ready",
        "operator": "Exists",
        "effect": "NoExecute",
        "tolerationSeconds": seconds,
    } in pod["spec"]["tolerations"]


def test_a_chosen_toleration_value_is_kept(control_plane: ControlPlane, namespace: str) -> None:
    manifest = gpu_pod("chosen", namespace, restart_policy="Never")
    chosen = {"key": READINESS_KEYS[0], "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 42}
    manifest["spec"]["tolerations"] = [chosen]

    pod = create_and_read(control_plane, manifest)

    assert readiness_tolerations(pod["spec"]) == {READINESS_KEYS[0]: [42], READINESS_KEYS[1]: [BATCH_SECONDS]}


# --- rule 2: podFailurePolicy ---------------------------------------------------------------------------


def test_never_job_gets_the_pod_failure_policy(control_plane: ControlPlane, namespace: str) -> None:
    job = create_and_read(control_plane, gpu_job("train", namespace, restart_policy="Never"))

    assert job["spec"]["podFailurePolicy"]["rules"] == [DISRUPTION_RULE, DEVICE_RULE]
    assert job["spec"]["podReplacementPolicy"] == "Failed"
    assert "podFailurePolicy" in gpuguard_annotations(job)[RULES_ANNOTATION].split(",")


def test_on_failure_job_is_accepted_without_pod_failure_policy_and_warned(
    control_plane: ControlPlane, namespace: str
) -> None:
    manifest = gpu_job("restarts", namespace, restart_policy="OnFailure")

    result = submit(control_plane, "apply", manifest)
    job = read_back(control_plane, manifest)

    assert "podFailurePolicy" not in job["spec"]
    # What the API server defaults when there is no podFailurePolicy: left alone.
    assert job["spec"]["podReplacementPolicy"] == "TerminatingOrFailed"
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"
    assert "podFailurePolicy" not in gpuguard_annotations(job)[RULES_ANNOTATION].split(",")
    assert any(w.startswith("gpuguard") and "podFailurePolicy" in w for w in kubectl_warnings(result)), (
        result.stderr
    )


def test_job_with_twenty_rules_keeps_exactly_its_rules(control_plane: ControlPlane, namespace: str) -> None:
    # 20 is the API server's maximum (batch validation maxPodFailurePolicyRules): one more is a 422.
    rules = [{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [100 + i]}} for i in range(20)]
    manifest = gpu_job("full", namespace)
    manifest["spec"]["podFailurePolicy"] = {"rules": rules}

    result = submit(control_plane, "apply", manifest)
    job = read_back(control_plane, manifest)

    assert job["spec"]["podFailurePolicy"]["rules"] == rules
    assert job["spec"]["podReplacementPolicy"] == "Failed"
    assert any("podFailurePolicy" in w for w in kubectl_warnings(result)), result.stderr


# --- templates: CronJob, Deployment, StatefulSet ----------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "seconds"),
    [
        (gpu_cronjob, BATCH_SECONDS),
        (gpu_deployment, SERVING_SECONDS),
        (gpu_statefulset, SERVING_SECONDS),
    ],
    ids=["CronJob", "Deployment", "StatefulSet"],
)
def test_workload_templates_get_every_mutation(
    control_plane: ControlPlane,
    namespace: str,
    build: Callable[[str, str], dict[str, Any]],
    seconds: int,
) -> None:
    stored = create_and_read(control_plane, build("workload", namespace))
    spec = pod_spec_of(stored)

    # Templates get no DefaultTolerationSeconds: gpuguard's entries are the only ones, and flow into pods.
    assert spec["tolerations"] == [
        {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": seconds}
        for key in READINESS_KEYS
    ]
    assert spec["containers"][0]["lifecycle"] == {"preStop": PRE_STOP}
    assert spec["terminationGracePeriodSeconds"] == GRACE_SECONDS
    assert spec["priorityClassName"] == PRIORITY_CLASS
    assert "priority" not in spec  # the Priority plugin resolves it on each pod, never on templates
    if stored["kind"] == "CronJob":
        job_spec = stored["spec"]["jobTemplate"]["spec"]
        assert job_spec["podFailurePolicy"]["rules"] == [DISRUPTION_RULE, DEVICE_RULE]
        assert job_spec["podReplacementPolicy"] == "Failed"
    assert gpuguard_annotations(stored)[RULES_ANNOTATION] == (
        "readinessTolerations,podFailurePolicy,gracefulTermination,priority"
        if stored["kind"] == "CronJob"
        else "readinessTolerations,gracefulTermination,priority"
    )


# --- rule 3: graceful termination -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("grace", "stored_grace"),
    [(None, GRACE_SECONDS), (5, GRACE_SECONDS), (300, 300)],
    ids=["defaulted-30-raised", "5-raised", "300-kept"],
)
def test_pre_stop_and_grace_period_are_stored_and_valid(
    control_plane: ControlPlane, namespace: str, grace: int | None, stored_grace: int
) -> None:
    manifest = gpu_pod("graceful", namespace)
    manifest["spec"]["containers"].append({"name": "cpu-sidecar", "image": "registry.k8s.io/pause:3.10"})
    if grace is not None:
        manifest["spec"]["terminationGracePeriodSeconds"] = grace

    # The API server's validation (sleep seconds <= terminationGracePeriodSeconds) ran after the patch.
    pod = create_and_read(control_plane, manifest)

    gpu, cpu = pod["spec"]["containers"]
    assert gpu["lifecycle"] == {"preStop": PRE_STOP}
    assert "lifecycle" not in cpu  # only accelerator containers hold devices to release
    assert pod["spec"]["terminationGracePeriodSeconds"] == stored_grace


def test_an_existing_pre_stop_is_kept(control_plane: ControlPlane, namespace: str) -> None:
    manifest = gpu_pod("own-hook", namespace)
    own = {"preStop": {"exec": {"command": ["/bin/drain", "--checkpoint"]}}}
    manifest["spec"]["containers"][0]["lifecycle"] = own

    pod = create_and_read(control_plane, manifest)

    assert pod["spec"]["containers"][0]["lifecycle"] == own
    assert pod["spec"]["terminationGracePeriodSeconds"] == GRACE_SECONDS


# --- rule 4: priority -----------------------------------------------------------------------------------


def test_gpu_pod_gets_the_class_and_its_resolved_priority(
    control_plane: ControlPlane, namespace: str
) -> None:
    pod = create_and_read(control_plane, gpu_pod("prio", namespace))

    assert pod["spec"]["priorityClassName"] == PRIORITY_CLASS
    # The Priority plugin had stamped 0 before the webhook ran; the stored integer matches the new class.
    assert pod["spec"]["priority"] == PRIORITY_VALUE
    assert pod["spec"]["preemptionPolicy"] == "PreemptLowerPriority"


def test_job_template_gets_the_class_name_only(control_plane: ControlPlane, namespace: str) -> None:
    job = create_and_read(control_plane, gpu_job("prio-job", namespace))

    spec = job["spec"]["template"]["spec"]
    assert spec["priorityClassName"] == PRIORITY_CLASS
    assert "priority" not in spec
    assert "preemptionPolicy" not in spec


def test_a_chosen_class_is_kept(control_plane: ControlPlane, namespace: str) -> None:
    manifest = gpu_pod("chosen-class", namespace)
    manifest["spec"]["priorityClassName"] = "system-cluster-critical"

    pod = create_and_read(control_plane, manifest)

    assert (pod["spec"]["priorityClassName"], pod["spec"]["priority"]) == (
        "system-cluster-critical",
        2000000000,
    )


# --- left alone -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["cpu-pod", "gpu-pod-in-kube-system"])
def test_untouched_pods(control_plane: ControlPlane, namespace: str, where: str) -> None:
    manifest = cpu_pod("cpu", namespace) if where == "cpu-pod" else gpu_pod(f"gpu-{namespace}", "kube-system")

    pod = create_and_read(control_plane, manifest, verb="create")

    assert not gpuguard_annotations(pod)
    assert readiness_tolerations(pod["spec"]) == {key: [API_SERVER_DEFAULT_SECONDS] for key in READINESS_KEYS}
    assert len(pod["spec"]["tolerations"]) == len(READINESS_KEYS)
    assert "lifecycle" not in pod["spec"]["containers"][0]
    assert pod["spec"]["terminationGracePeriodSeconds"] == 30
    assert "priorityClassName" not in pod["spec"]
    assert pod["spec"]["priority"] == 0


# --- server-side dry run ----------------------------------------------------------------------------------

SERVER_SET_METADATA = ("uid", "resourceVersion", "creationTimestamp", "managedFields", "generation")


def comparable(obj: dict[str, Any]) -> Any:
    """spec and gpuguard's annotations, with the object's own uid (Job selectors carry it) masked."""
    uid = obj["metadata"]["uid"]

    def mask(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: mask(v) for k, v in value.items()}
        if isinstance(value, list):
            return [mask(v) for v in value]
        return "<uid>" if value == uid else value

    metadata = {k: v for k, v in obj["metadata"].items() if k not in SERVER_SET_METADATA}
    return mask({"metadata": metadata, "spec": obj["spec"], "gpuguard": gpuguard_annotations(obj)})


@pytest.mark.parametrize(
    "build",
    [
        gpu_pod,
        gpu_job,
        gpu_cronjob,
        gpu_deployment,
        gpu_statefulset,
    ],
    ids=["Pod", "Job", "CronJob", "Deployment", "StatefulSet"],
)
def test_server_dry_run_shows_what_apply_stores(
    control_plane: ControlPlane, namespace: str, build: Callable[[str, str], dict[str, Any]]
) -> None:
    manifest = build("dry", namespace)

    preview = control_plane.kubectl_json("apply", "--dry-run=server", "-f", "-", input=json.dumps(manifest))
    stored = create_and_read(control_plane, manifest)

    assert gpuguard_annotations(preview)
    assert comparable(preview) == comparable(stored)
