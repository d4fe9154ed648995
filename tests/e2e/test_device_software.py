"""trustedDeviceSoftware through `kubectl` on the real API server: device plugins and driver DaemonSets
from the vendors' registries are admitted as submitted, the same software from anywhere else is refused
at create, at `kubectl set image` and at `kubectl debug`, with a message naming container, image, mount
and the trusted prefixes; in kube-system (through deploy/'s own webhook for it) and the GPU operator's
namespaces, exempt from every other rule, it is the one still checked. (warn and audit:
tests/e2e/test_modes.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness import corpus
from tests.harness.admission import (
    DEVICE_PLUGINS,
    IMAGE,
    OWNER_LABEL,
    VALIDATING_WEBHOOK,
    WebhookProcess,
    device_plugin_daemonset,
    gpu_pod,
    gpuguard_annotations,
    pinned_to_gpu_nodes,
    read_back,
    submit,
)
from tests.harness.controlplane import ControlPlane, wait_until
from tests.harness.install import DEPLOY
from webhook.policy.model import default_policy
from webhook.policy.rules import device_software
from webhook.policy.workload import locate

pytestmark = pytest.mark.usefixtures("gpuguard")

UNTRUSTED = "quay.io/example/device-plugin:v1"
# deploy/'s webhook for kube-system, which the session's configuration leaves out.
KUBE_SYSTEM_WEBHOOK = "device-software.gpuguard.io"
TRUSTED = default_policy().rules.trustedDeviceSoftware
# Every DaemonSet of the corpus: NVIDIA's device plugin, GPU feature discovery and DCGM exporter, AMD's
# device plugin, GKE's NCCL/RDMA installer; all from their vendors' own registries.
CORPUS_DAEMONSETS = [
    path
    for path in corpus.FILES
    if any(d and d["kind"] == "DaemonSet" for d in yaml.safe_load_all(path.read_text()))
]


def corpus_daemonset(path: Path, namespace: str) -> dict[str, Any]:
    daemonset: dict[str, Any]
    (daemonset,) = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    daemonset["metadata"]["namespace"] = namespace
    return daemonset


def device_software_containers(daemonset: dict[str, Any]) -> list[str]:
    """The containers the default policy calls device software (by its hostPath patterns)."""
    workload = locate(daemonset, daemonsets=True)
    assert workload is not None
    return [container["name"] for _, container, _ in device_software(workload, TRUSTED)]


def images_of(daemonset: dict[str, Any]) -> list[str]:
    spec = daemonset["spec"]["template"]["spec"]
    return [c["image"] for c in [*spec.get("initContainers", []), *spec["containers"]]]


def assert_refused_naming(stderr: str, *parts: str) -> None:
    assert f'admission webhook "{VALIDATING_WEBHOOK}" denied the request' in stderr, stderr
    assert "gpuguard trustedDeviceSoftware" in stderr, stderr
    for part in parts:
        assert part in stderr, f"{part!r} not in: {stderr}"


def test_untrusted_device_plugin_daemonset_is_refused_with_an_explanation(
    control_plane: ControlPlane, namespace: str
) -> None:
    result = submit(
        control_plane, "apply", device_plugin_daemonset("plugin", namespace, UNTRUSTED), check=False
    )

    assert result.returncode != 0
    assert_refused_naming(
        result.stderr,
        "container plugin",
        f"image {UNTRUSTED}",
        f"hostPath {DEVICE_PLUGINS}",
        "trusted images: nvcr.io/nvidia/, docker.io/rocm/",
        "registry.k8s.io/",
    )
    assert control_plane.kubectl("get", "daemonset", "plugin", "-n", namespace, check=False).returncode != 0


def test_vendor_device_plugin_daemonset_is_admitted_as_submitted(
    control_plane: ControlPlane, namespace: str
) -> None:
    manifest = device_plugin_daemonset("plugin", namespace, "nvcr.io/nvidia/k8s-device-plugin:v0.17.0")
    submit(control_plane, "apply", manifest)
    stored = read_back(control_plane, manifest)
    assert not gpuguard_annotations(stored)
    assert images_of(stored) == images_of(manifest)


@pytest.mark.corpus
def test_the_corpus_has_daemonsets() -> None:
    # The parametrization below would otherwise be skipped as an empty set.
    assert CORPUS_DAEMONSETS, f"no DaemonSet in {corpus.CORPUS}"


@pytest.mark.corpus
@pytest.mark.parametrize("path", CORPUS_DAEMONSETS, ids=[p.stem for p in CORPUS_DAEMONSETS])
def test_corpus_daemonsets_pass_and_the_same_from_elsewhere_is_refused(
    control_plane: ControlPlane, namespace: str, path: Path
) -> None:
    # As published (their own kube-system placement aside): admitted and stored unchanged.
    manifest = corpus_daemonset(path, namespace)
    submit(control_plane, "apply", manifest)
    stored = read_back(control_plane, manifest)
    assert not gpuguard_annotations(stored)
    assert images_of(stored) == images_of(manifest)
    assert device_software_containers(manifest), f"{path.name}: no device software found in it"
    # Its device software pulled from another registry: refused, naming the container.
    for name in device_software_containers(manifest):
        tampered = json.loads(json.dumps(manifest))
        tampered["metadata"]["name"] += "-elsewhere"
        spec = tampered["spec"]["template"]["spec"]
        for container in [*spec.get("containers", []), *spec.get("initContainers", [])]:
            if container["name"] == name:
                container["image"] = UNTRUSTED
        result = submit(control_plane, "apply", tampered, check=False)
        assert result.returncode != 0, f"{path.name}: {name} from {UNTRUSTED} was admitted"
        assert_refused_naming(result.stderr, f" {name}: image {UNTRUSTED}")


def test_set_image_to_an_untrusted_registry_is_refused(control_plane: ControlPlane, namespace: str) -> None:
    manifest = device_plugin_daemonset("plugin", namespace, "nvcr.io/nvidia/k8s-device-plugin:v0.17.0")
    submit(control_plane, "apply", manifest)

    changed = control_plane.kubectl(
        "set", "image", "daemonset/plugin", f"plugin={UNTRUSTED}", "-n", namespace, check=False
    )
    assert changed.returncode != 0
    assert_refused_naming(changed.stderr, f"image {UNTRUSTED}")
    # A trusted upgrade, and a change that leaves the device software alone, go through.
    control_plane.kubectl(
        "set", "image", "daemonset/plugin", "plugin=nvcr.io/nvidia/k8s-device-plugin:v0.18.0", "-n", namespace
    )
    control_plane.kubectl("label", "daemonset/plugin", "team=gpu", "-n", namespace)
    stored = read_back(control_plane, manifest)
    assert stored["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":v0.18.0")


def _gpuguard_sees(plane: ControlPlane, namespace: str, seen: bool) -> None:
    """Until a dry run of an untrusted device plugin in `namespace` is refused (seen) or admitted (not):
    the API server reads namespace labels from its cache, so a label change takes a moment to count."""
    probe = device_plugin_daemonset("probe", namespace, UNTRUSTED)
    wait_until(
        lambda: (submit(plane, "apply", probe, "--dry-run=server", check=False).returncode != 0) == seen,
        timeout=30,
        what=f"gpuguard {'seeing' if seen else 'leaving alone'} namespace {namespace}",
    )


def test_an_update_is_not_refused_for_what_the_object_already_ran(
    control_plane: ControlPlane, namespace: str
) -> None:
    # Installed before gpuguard (here: while the namespace was out of its view), it stays manageable:
    # refused only for what an update changes.
    manifest = device_plugin_daemonset("legacy", namespace, UNTRUSTED)
    control_plane.kubectl("label", "namespace", namespace, f"{OWNER_LABEL}=none")
    _gpuguard_sees(control_plane, namespace, False)
    submit(control_plane, "apply", manifest)
    control_plane.kubectl("label", "namespace", namespace, f"{OWNER_LABEL}-")
    _gpuguard_sees(control_plane, namespace, True)

    control_plane.kubectl("label", "daemonset/legacy", "team=gpu", "-n", namespace)  # admitted
    plugin = manifest["spec"]["template"]["spec"]["containers"][0]
    exporter = {
        "name": "exporter",
        "image": "quay.io/example/exporter:1",
        "volumeMounts": [{"name": "device-plugins", "mountPath": "/dp"}],
    }
    added = control_plane.kubectl(
        "patch",
        "daemonset/legacy",
        "-n",
        namespace,
        "-p",
        json.dumps({"spec": {"template": {"spec": {"containers": [plugin, exporter]}}}}),
        check=False,
    )
    assert added.returncode != 0
    assert_refused_naming(added.stderr, "container exporter", "image quay.io/example/exporter:1")
    assert "container plugin" not in added.stderr  # what it already ran is not held against it


def test_kubectl_debug_with_an_untrusted_image_holding_the_devices_is_refused(
    control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "plugin", "namespace": namespace},
        "spec": device_plugin_daemonset("plugin", namespace, IMAGE)["spec"]["template"]["spec"],
    }
    submit(control_plane, "apply", pod)
    custom = tmp_path / "debug.json"
    custom.write_text(json.dumps({"volumeMounts": [{"name": "device-plugins", "mountPath": "/dp"}]}))

    debug = control_plane.kubectl(
        "debug",
        "plugin",
        "-n",
        namespace,
        f"--image={UNTRUSTED}",
        "--container=debugger",
        f"--custom={custom}",
        "--profile=general",
        check=False,
    )
    assert debug.returncode != 0, debug.stdout
    assert_refused_naming(debug.stderr, "ephemeral container debugger", f"image {UNTRUSTED}")
    # The same with an image of a trusted registry is added.
    control_plane.kubectl(
        "debug",
        "plugin",
        "-n",
        namespace,
        f"--image={IMAGE}",
        "--container=trusted-debugger",
        f"--custom={custom}",
        "--profile=general",
    )
    stored = read_back(control_plane, pod)
    assert [c["name"] for c in stored["spec"].get("ephemeralContainers", [])] == ["trusted-debugger"]


def test_a_gpu_pod_is_not_device_software(control_plane: ControlPlane, namespace: str) -> None:
    # Privileged and asking for a GPU, from any registry, but holding none of the device software paths.
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "train", "namespace": namespace},
        "spec": {
            "priorityClassName": "gpu-workload",
            "containers": [
                {
                    "name": "train",
                    "image": "quay.io/example/trainer:1",
                    "securityContext": {"privileged": True},
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                    "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
                }
            ],
            "volumes": [{"name": "shm", "hostPath": {"path": "/dev/shm"}}],
        },
    }
    submit(control_plane, "apply", pod)
    assert gpuguard_annotations(read_back(control_plane, pod))  # mutated as any GPU pod, not refused


# --- the infrastructure namespaces: exempt from every rule but this one ------------------------------------

KUBE_SYSTEM_CONFIGURATION = "gpuguard-e2e-kube-system"


@pytest.fixture
def kube_system_webhook(control_plane: ControlPlane, gpuguard: WebhookProcess) -> Iterator[None]:
    """deploy/'s own kube-system webhook (device-software.gpuguard.io: its namespaceSelector, rules and
    matchConditions as shipped in deploy/install.yaml) pointed at the session's gpuguard, failurePolicy
    Fail so that an admission proves gpuguard said yes."""
    shipped = [
        doc
        for doc in yaml.safe_load_all((DEPLOY / "install.yaml").read_text())
        if doc and doc["kind"] == "ValidatingWebhookConfiguration"
    ]
    (webhook,) = [w for doc in shipped for w in doc["webhooks"] if w["name"] == KUBE_SYSTEM_WEBHOOK]
    webhook |= {
        "clientConfig": {"url": f"{gpuguard.url}/validate", "caBundle": gpuguard.ca_bundle_b64},
        "failurePolicy": "Fail",
    }
    configuration = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": KUBE_SYSTEM_CONFIGURATION},
        "webhooks": [webhook],
    }
    submit(control_plane, "apply", configuration)
    try:
        _gpuguard_sees(control_plane, "kube-system", True)
        yield
    finally:
        control_plane.kubectl(
            "delete", "validatingwebhookconfiguration", KUBE_SYSTEM_CONFIGURATION, "--ignore-not-found"
        )


@pytest.mark.corpus
@pytest.mark.usefixtures("kube_system_webhook")
@pytest.mark.parametrize("path", CORPUS_DAEMONSETS, ids=[p.stem for p in CORPUS_DAEMONSETS])
def test_in_kube_system_corpus_daemonsets_pass_and_the_same_from_elsewhere_is_refused(
    control_plane: ControlPlane, path: Path
) -> None:
    # Where most of them are published to run, through the webhook deploy/ ships for it (dry runs:
    # nothing is left in kube-system).
    manifest = corpus_daemonset(path, "kube-system")
    admitted = submit(control_plane, "apply", manifest, "--dry-run=server", "-o", "json")
    stored = json.loads(admitted.stdout)
    assert not gpuguard_annotations(stored)
    assert images_of(stored) == images_of(manifest)
    for name in device_software_containers(manifest):
        tampered = json.loads(json.dumps(manifest))
        spec = tampered["spec"]["template"]["spec"]
        for container in [*spec.get("containers", []), *spec.get("initContainers", [])]:
            if container["name"] == name:
                container["image"] = UNTRUSTED
        result = submit(control_plane, "apply", tampered, "--dry-run=server", check=False)
        assert result.returncode != 0, f"{path.name}: {name} from {UNTRUSTED} was admitted in kube-system"
        assert f'admission webhook "{KUBE_SYSTEM_WEBHOOK}" denied the request' in result.stderr, result.stderr
        assert f" {name}: image {UNTRUSTED}" in result.stderr, result.stderr


def test_in_a_gpu_operator_namespace_only_device_software_is_checked(
    control_plane: ControlPlane, namespace: str
) -> None:
    # One of the default policy's infrastructure namespaces that the session's webhooks see (kube-system
    # is kept from them). Created once and left: without kube-controller-manager a deleted namespace
    # stays Terminating, and nothing else in the suite uses this one.
    operator_namespace = "nvidia-gpu-operator"
    submit(
        control_plane,
        "apply",
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": operator_namespace}},
    )

    # Refused anywhere else by acceleratorNodeGuard; here admitted. A GPU pod is stored as submitted.
    elsewhere = submit(
        control_plane, "apply", pinned_to_gpu_nodes("validator", namespace), "--dry-run=server", check=False
    )
    assert elsewhere.returncode != 0 and "gpuguard acceleratorNodeGuard" in elsewhere.stderr, elsewhere.stderr
    submit(control_plane, "apply", pinned_to_gpu_nodes("validator", operator_namespace), "--dry-run=server")
    gpu = json.loads(
        submit(
            control_plane, "apply", gpu_pod("cuda", operator_namespace), "--dry-run=server", "-o", "json"
        ).stdout
    )
    assert not gpuguard_annotations(gpu)
    assert "priorityClassName" not in gpu["spec"]
    # Device software from an untrusted registry is refused there as everywhere.
    result = submit(
        control_plane,
        "apply",
        device_plugin_daemonset("plugin", operator_namespace, UNTRUSTED),
        "--dry-run=server",
        check=False,
    )
    assert result.returncode != 0
    assert_refused_naming(result.stderr, "container plugin", f"image {UNTRUSTED}")
    submit(
        control_plane,
        "apply",
        device_plugin_daemonset("plugin", operator_namespace, "nvcr.io/nvidia/k8s-device-plugin:v0.17.0"),
        "--dry-run=server",
    )
