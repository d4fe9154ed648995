"""A policy number past what the API field takes, on the real API server with failurePolicy Ignore.

Ignore does not cover a patch the API server cannot decode: a `tolerationSeconds` of 2**63 once made
every GPU pod create fail with `InternalError ... cannot unmarshal number ... into tolerationSeconds of
type int64`, cluster-wide, from one policy edit. The policy now refuses such a number; the largest it
accepts goes through the API server into a stored pod.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness.admission import (
    OWNER_LABEL,
    READINESS_KEYS,
    LiveWebhook,
    gpu_pod,
    gpuguard_annotations,
    policy_hash,
    read_back,
    readiness_tolerations,
    register,
    submit,
)
from tests.harness.controlplane import ControlPlane
from webhook.policy.model_types import MAX_SECONDS

BASELINE = "rules:\n  readinessTolerations:\n    servingSeconds: 700\n"


def serving(seconds: int) -> str:
    return BASELINE.replace("700", str(seconds))


@pytest.fixture(scope="module")
def ignoring(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveWebhook]:
    """A gpuguard with its policy in a ConfigMap, registered with failurePolicy Ignore as deploy/ is."""
    webhook = LiveWebhook(control_plane, tmp_path_factory.mktemp("bounds"), "gpuguard-e2e-bounds")
    try:
        webhook.start(BASELINE)
        selector = {"matchLabels": {OWNER_LABEL: webhook.name}}
        register(control_plane, webhook.process, "Ignore", name=webhook.name, namespace_selector=selector)
        yield webhook
    finally:
        webhook.stop()


def create_gpu_pod(plane: ControlPlane, namespace: str, name: str) -> dict[str, list[int | None]]:
    """A real create (not a dry run): the pod as stored, by its readiness tolerations' seconds."""
    pod = gpu_pod(name, namespace)
    submit(plane, "create", pod)
    stored = read_back(plane, pod)
    assert gpuguard_annotations(stored), "not mutated"
    return readiness_tolerations(stored["spec"])


def test_seconds_past_int64_are_refused_and_gpu_pods_are_still_created(
    control_plane: ControlPlane, ignoring: LiveWebhook
) -> None:
    namespace = ignoring.namespace("past-int64")
    errors_before = ignoring.status()["errors"]

    ignoring.edit_policy(serving(2**63))
    ignoring.process.wait(lambda: ignoring.status()["errors"] > errors_before, what="the edit refused")

    status = ignoring.status()
    assert status["hash"] == policy_hash(BASELINE)
    assert "servingSeconds" in status["lastError"]
    assert create_gpu_pod(control_plane, namespace, "after-refusal") == {key: [700] for key in READINESS_KEYS}


def test_the_largest_seconds_accepted_are_stored_by_the_api_server(
    control_plane: ControlPlane, ignoring: LiveWebhook
) -> None:
    namespace = ignoring.namespace("largest-seconds")

    ignoring.set_policy(serving(MAX_SECONDS))

    assert create_gpu_pod(control_plane, namespace, "largest") == {
        key: [MAX_SECONDS] for key in READINESS_KEYS
    }
    ignoring.set_policy(BASELINE)
