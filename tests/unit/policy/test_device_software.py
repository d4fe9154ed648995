"""trustedDeviceSoftware: what makes a container device software, whose image is trusted, and which
objects and operations are checked."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.harness.manifests import JSON, make_policy, pod, templated, validate_review
from webhook.policy import engine, hostpaths, images
from webhook.policy.model import RULE_IDS, Policy, PolicyError
from webhook.policy.rules import device_mount

UNTRUSTED = "quay.io/example/device-plugin:v1"
NVIDIA = "nvcr.io/nvidia/k8s-device-plugin:v0.17.0"
DIGEST = "sha256:" + "a" * 64
DEVICE_PLUGINS = "/var/lib/kubelet/device-plugins"


def plugin_container(
    image: str = UNTRUSTED, *, name: str = "plugin", mount: str = "host", sub_path: str | None = None
) -> JSON:
    volume_mount: JSON = {"name": mount, "mountPath": "/host"}
    if sub_path is not None:
        volume_mount["subPath"] = sub_path
    return {"name": name, "image": image, "volumeMounts": [volume_mount]}


def host_volume(path: str = DEVICE_PLUGINS, name: str = "host") -> JSON:
    return {"name": name, "hostPath": {"path": path}}


def device_pod(*containers: JSON, path: str = DEVICE_PLUGINS, **kwargs: Any) -> JSON:
    return pod(*(containers or (plugin_container(),)), volumes=[host_volume(path)], **kwargs)


def denials(obj: Any, policy: Policy, **kwargs: Any) -> list[str]:
    return [
        d.message
        for d in engine.validate(obj, policy, **kwargs).decisions
        if d.rule == "trustedDeviceSoftware"
    ]


# --- which mounts make a container device software ----------------------------------------------------


@pytest.mark.parametrize(
    ("host_path", "sub_path", "pattern"),
    [
        pytest.param(DEVICE_PLUGINS, None, DEVICE_PLUGINS, id="the-directory"),
        pytest.param(f"{DEVICE_PLUGINS}/kubelet.sock", None, DEVICE_PLUGINS, id="inside-it"),
        pytest.param("/var/lib/kubelet", None, DEVICE_PLUGINS, id="the-kubelet-root-above-it"),
        pytest.param("/", None, DEVICE_PLUGINS, id="the-host-root"),
        pytest.param("/var/lib", "kubelet/device-plugins", DEVICE_PLUGINS, id="reached-through-subpath"),
        pytest.param("/var/lib", "log", None, id="subpath-elsewhere"),
        pytest.param(
            "/var/lib/kubelet/pod-resources", None, "/var/lib/kubelet/pod-resources", id="pod-resources"
        ),
        pytest.param(
            "/var/lib/kubelet/plugins/gpu.nvidia.com", None, "/var/lib/kubelet/plugins", id="dra-plugin"
        ),
        pytest.param("/dev", None, "/dev/nvidia*", id="all-of-dev"),
        pytest.param("/dev/nvidia0", None, "/dev/nvidia*", id="a-device-node"),
        pytest.param("/dev/nvidia-caps/nvidia-cap1", None, "/dev/nvidia*", id="below-a-glob-match"),
        pytest.param("/dev/shm", None, None, id="shared-memory-is-no-device"),
        pytest.param("/dev/dri/renderD128", None, "/dev/dri", id="intel-amd-render-node"),
        pytest.param("/dev/accel/accel0", None, "/dev/accel*", id="gaudi-tpu"),
        pytest.param("/var/run/nvidia/driver", None, "/run/nvidia", id="var-run-is-run"),
        pytest.param("//var//lib/kubelet/./device-plugins/", None, DEVICE_PLUGINS, id="unnormalised"),
        pytest.param(
            "/home/kubernetes/bin/nvidia/lib64", None, "/home/kubernetes/bin/nvidia", id="gke-driver"
        ),
        pytest.param("/etc/cdi", None, "/etc/cdi", id="cdi-specs"),
        pytest.param("/sys", None, None, id="sysfs"),
        pytest.param("/var/log", None, None, id="logs"),
        pytest.param("/var/lib/kubelet-other", None, None, id="a-sibling-with-the-same-prefix"),
    ],
)
def test_device_software_paths(
    policy: Policy, host_path: str, sub_path: str | None, pattern: str | None
) -> None:
    mount = device_mount(
        plugin_container(sub_path=sub_path), {"host": host_path}, policy.rules.trustedDeviceSoftware
    )
    assert (mount.pattern if mount else None) == pattern


PATH_PARTS = st.lists(
    st.sampled_from(["var", "lib", "kubelet", "device-plugins", "dev", "nvidia0", "x"]), max_size=6
)


@given(PATH_PARTS)
def test_a_directory_above_device_software_is_device_software(parts: list[str]) -> None:
    # Whoever holds a parent directory holds everything below it: no mount dodges the rule by going up.
    rule = make_policy().rules.trustedDeviceSoftware
    path = hostpaths.render(tuple(parts))
    if device_mount(plugin_container(), {"host": path}, rule) is not None:
        for cut in range(len(parts)):
            parent = hostpaths.render(tuple(parts[:cut]))
            assert device_mount(plugin_container(), {"host": parent}, rule) is not None, parent


def test_mounts_of_other_volumes_and_unmounted_host_paths_do_not_count(policy: Policy) -> None:
    spec_pod = pod(
        {"name": "app", "image": UNTRUSTED, "volumeMounts": [{"name": "scratch", "mountPath": "/x"}]},
        volumes=[{"name": "scratch", "emptyDir": {}}, host_volume()],  # the hostPath one is never mounted
    )
    assert denials(spec_pod, policy) == []


def test_a_gpu_pod_is_not_device_software(policy: Policy) -> None:
    privileged = {
        "name": "train",
        "image": UNTRUSTED,
        "securityContext": {"privileged": True},
        "resources": {"limits": {"nvidia.com/gpu": 8}},
    }
    assert denials(pod(privileged, priorityClassName="gpu-workload"), policy) == []


# --- whose image is trusted --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("image", "normalised"),
    [
        ("busybox", "docker.io/library/busybox:latest"),
        ("rocm/k8s-device-plugin", "docker.io/rocm/k8s-device-plugin:latest"),
        ("index.docker.io/rocm/k8s-device-plugin:1.31", "docker.io/rocm/k8s-device-plugin:1.31"),
        ("NVCR.IO/nvidia/k8s-device-plugin:v0.17.0", "nvcr.io/nvidia/k8s-device-plugin:v0.17.0"),
        ("localhost:5000/dp@" + DIGEST, "localhost:5000/dp@" + DIGEST),
        ("registry.k8s.io/nfd/node-feature-discovery:v0.17.0@" + DIGEST, None),
    ],
)
def test_images_are_read_as_the_runtime_reads_them(image: str, normalised: str | None) -> None:
    ref = images.parse(image)
    assert ref is not None
    if normalised is not None:
        assert str(ref) == normalised


@pytest.mark.parametrize("image", ["", " busybox", "library/Upper", "x:bad tag", "x@sha256:nothex", 7, None])
def test_what_is_no_image_reference(image: object) -> None:
    assert images.parse(image) is None


@pytest.mark.parametrize(
    ("image", "trusted"),
    [
        (NVIDIA, True),
        ("nvcr.io/nvidia/cloud-native/gpu-operator-validator:v25.3.0", True),
        ("nvcr.io/nvidia-evil/dp:1", False),  # a prefix ends at a path component
        ("nvcr.io/other/dp:1", False),
        ("rocm/k8s-device-plugin", True),  # Docker Hub, written short
        ("registry.k8s.io/dra-example-driver/dra-example-driver:v0.1.0", True),
        ("registry.k8s.io.evil.example/dp:1", False),
        ("quay.io/example/device-plugin:v1", False),
        ("busybox", False),
    ],
)
def test_trusted_prefixes(policy: Policy, image: str, trusted: bool) -> None:
    assert bool(denials(device_pod(plugin_container(image)), policy)) is not trusted


# Each vendor's device software as it ships: its image and the device node or directory it mounts.
VENDORS = [
    pytest.param(NVIDIA, "/dev/nvidia0", "/dev/nvidia*", id="nvidia"),
    pytest.param(
        "nvcr.io/nvidia/driver:570.124.06-ubuntu22.04", "/run/nvidia", "/run/nvidia", id="nvidia-driver"
    ),
    pytest.param("docker.io/rocm/k8s-device-plugin:1.31.0.6", "/dev/kfd", "/dev/kfd", id="amd"),
    pytest.param("rocm/k8s-device-plugin:labeller-1.31.0.6", "/dev/dri", "/dev/dri", id="amd-labeller"),
    pytest.param("intel/intel-gpu-plugin:0.32.0", "/dev/dri", "/dev/dri", id="intel-gpu"),
    pytest.param("docker.io/intel/intel-npu-plugin:0.32.0", "/dev/accel", "/dev/accel*", id="intel-npu"),
    pytest.param(
        "vault.habana.ai/docker-k8s-device-plugin/docker-k8s-device-plugin:1.19.1",
        "/dev/hl0",
        "/dev/hl*",
        id="habana",
    ),
    pytest.param(
        "public.ecr.aws/neuron/neuron-device-plugin:2.22.4.0", "/dev/neuron0", "/dev/neuron*", id="neuron"
    ),
    pytest.param("gke.gcr.io/tpu-device-plugin:v1.0.0", "/dev/accel0", "/dev/accel*", id="tpu"),
    pytest.param("gke.gcr.io/tpu-device-plugin:v1.0.0", "/dev/vfio", "/dev/vfio", id="tpu-vfio"),
]


@pytest.mark.parametrize(("image", "device_path", "pattern"), VENDORS)
def test_every_vendors_software_is_recognised_and_trusted_by_default(
    policy: Policy, image: str, device_path: str, pattern: str
) -> None:
    # The default patterns see it as device software even without the kubelet's directories...
    mount = device_mount(plugin_container(image), {"host": device_path}, policy.rules.trustedDeviceSoftware)
    assert mount is not None and mount.pattern == pattern
    # ...the default prefixes trust it from its vendor, and the same software from elsewhere is refused.
    assert denials(device_pod(plugin_container(image), path=device_path), policy) == []
    (message,) = denials(device_pod(plugin_container(UNTRUSTED), path=device_path), policy)
    assert f"mounts hostPath {device_path}" in message


def test_one_repository_without_a_trailing_slash() -> None:
    policy = make_policy(
        {"rules": {"trustedDeviceSoftware": {"trustedImages": ["quay.io/example/device-plugin"]}}}
    )
    assert denials(device_pod(plugin_container(UNTRUSTED)), policy) == []
    assert denials(device_pod(plugin_container("quay.io/example/device-plugin-2:v1")), policy)


def test_require_digest() -> None:
    policy = make_policy({"rules": {"trustedDeviceSoftware": {"requireDigest": True}}})
    (message,) = denials(device_pod(plugin_container(NVIDIA)), policy)
    assert "is not pinned by digest (requireDigest)" in message
    assert denials(device_pod(plugin_container(f"{NVIDIA}@{DIGEST}")), policy) == []


@pytest.mark.parametrize(
    ("prefix", "error"),
    [
        ("rocm/", "names no registry: write it in full, e.g. docker.io/rocm/"),
        ("nvcr.io/nvidia:v1", "not a tag"),
        ("nvcr.io/nvidia@" + DIGEST, "not a digest"),
        ("nvcr.io/Nvidia/", "is not a repository path"),
    ],
)
def test_bad_prefixes_are_refused_naming_the_field(prefix: str, error: str) -> None:
    with pytest.raises(PolicyError) as raised:
        make_policy({"rules": {"trustedDeviceSoftware": {"trustedImages": ["nvcr.io/nvidia/", prefix]}}})
    assert "rules.trustedDeviceSoftware.trustedImages[1]" in str(raised.value)
    assert error in str(raised.value)


def test_prefixes_are_normalised() -> None:
    policy = make_policy(
        {"rules": {"trustedDeviceSoftware": {"trustedImages": ["index.docker.io/rocm/", "Quay.io"]}}}
    )
    assert policy.rules.trustedDeviceSoftware.trustedImages == ["docker.io/rocm/", "quay.io/"]


@pytest.mark.parametrize("path", ["dev/nvidia*", "/var/lib/../kubelet"])
def test_bad_host_paths_are_refused_naming_the_field(path: str) -> None:
    with pytest.raises(PolicyError, match=r"rules\.trustedDeviceSoftware\.hostPaths\[0\]"):
        make_policy({"rules": {"trustedDeviceSoftware": {"hostPaths": [path]}}})


# --- the message ----------------------------------------------------------------------------------


def test_the_denial_names_container_image_mount_and_trusted_prefixes(policy: Policy) -> None:
    response = validate_review(templated("DaemonSet", plugin_container(), volumes=[host_volume()]), policy)
    assert response["allowed"] is False
    assert response["status"]["code"] == 403
    message = response["status"]["message"]
    assert message.startswith(
        f"gpuguard trustedDeviceSoftware: container plugin: image {UNTRUSTED} is not from a trusted source, "
        f"and it mounts hostPath {DEVICE_PLUGINS}, which makes it device software; trusted images: nvcr.io/nvidia/, "
    )
    assert message.endswith("registry.k8s.io/")


def test_the_denial_says_which_pattern_a_parent_directory_reached(policy: Policy) -> None:
    (message,) = denials(device_pod(path="/var/lib/kubelet"), policy)
    assert f"mounts hostPath /var/lib/kubelet (matches {DEVICE_PLUGINS})" in message


# --- which objects and containers are checked --------------------------------------------------------


@pytest.mark.parametrize("kind", ["DaemonSet", "Deployment", "StatefulSet", "ReplicaSet"])
def test_every_pod_template_is_checked(policy: Policy, kind: str) -> None:
    assert denials(templated(kind, plugin_container(), volumes=[host_volume()]), policy)


def test_jobs_cronjobs_and_their_init_containers(policy: Policy) -> None:
    from tests.harness.manifests import cronjob, job

    for obj in (
        job(
            plugin_container(NVIDIA),
            template={"volumes": [host_volume()], "initContainers": [plugin_container(name="setup")]},
        ),
        cronjob(
            plugin_container(NVIDIA),
            template={"volumes": [host_volume()], "initContainers": [plugin_container(name="setup")]},
        ),
    ):
        (message,) = denials(obj, policy)
        assert message.startswith("init container setup: ")


def test_ephemeral_containers_count(policy: Policy) -> None:
    trusted = device_pod(plugin_container(NVIDIA), owner="DaemonSet")
    debugged = device_pod(plugin_container(NVIDIA), owner="DaemonSet")
    debugged["spec"]["ephemeralContainers"] = [plugin_container(name="debugger")]
    (message,) = denials(debugged, policy, operation="UPDATE", old=trusted)
    assert message.startswith(f"ephemeral container debugger: image {UNTRUSTED}")


def test_a_controllers_new_pod_is_checked_through_its_template(policy: Policy) -> None:
    # A DaemonSet admitted before gpuguard (or while it was down) keeps running on new nodes.
    assert denials(device_pod(owner="DaemonSet"), policy) == []
    assert denials(device_pod(owner="ReplicaSet"), policy) == []
    # ...but a bare pod is its own template.
    assert denials(device_pod(), policy)


def test_mirror_pods_are_never_refused(policy: Policy) -> None:
    assert denials(device_pod(annotations={"kubernetes.io/config.mirror": "x"}), policy) == []


@pytest.mark.parametrize(
    ("old_image", "new_image", "denied"),
    [
        pytest.param(UNTRUSTED, UNTRUSTED, False, id="what-it-already-ran"),
        pytest.param(NVIDIA, UNTRUSTED, True, id="set-image-to-untrusted"),
        pytest.param(UNTRUSTED, "quay.io/example/device-plugin:v2", True, id="another-untrusted-image"),
        pytest.param(UNTRUSTED, NVIDIA, False, id="to-trusted"),
    ],
)
def test_update_refuses_only_what_it_introduces(
    policy: Policy, old_image: str, new_image: str, denied: bool
) -> None:
    old = templated("DaemonSet", plugin_container(old_image), volumes=[host_volume()])
    new = templated("DaemonSet", plugin_container(new_image), volumes=[host_volume()])
    assert bool(denials(new, policy, operation="UPDATE", old=old)) is denied


def test_a_pod_whose_image_is_changed_in_place_is_refused(policy: Policy) -> None:
    old = device_pod(plugin_container(NVIDIA), owner="DaemonSet")
    new = device_pod(plugin_container(UNTRUSTED), owner="DaemonSet")
    assert denials(new, policy, operation="UPDATE", old=old)


# --- modes, namespaces and the engine's other rules ----------------------------------------------------


INFRASTRUCTURE_NAMESPACES = [
    "kube-system",
    "kube-node-lease",
    "gpu-operator",
    "gpu-operator-resources",
    "nvidia-gpu-operator",
]


@pytest.mark.parametrize("namespace", INFRASTRUCTURE_NAMESPACES)
def test_infrastructure_namespaces_are_checked_by_default(policy: Policy, namespace: str) -> None:
    # Device software lives in kube-system and the GPU operator's namespaces: every other rule is off
    # there (a rule added later included), this one follows the global mode.
    assert {rule: policy.mode_for(rule, namespace) for rule in RULE_IDS} == {
        rule: "enforce" if rule == "trustedDeviceSoftware" else "off" for rule in RULE_IDS
    }
    assert denials(device_pod(), policy, namespace=namespace)
    assert denials(device_pod(plugin_container(NVIDIA)), policy, namespace=namespace) == []


@pytest.mark.parametrize("mode", ["warn", "audit"])
def test_warn_and_audit_refuse_nothing(mode: str) -> None:
    policy = make_policy({"rules": {"trustedDeviceSoftware": {"mode": mode}}})
    result = engine.validate(device_pod(), policy)
    assert result.denials == []
    assert [(d.rule, d.mode, d.outcome) for d in result.decisions] == [
        ("trustedDeviceSoftware", mode, "would-deny")
    ]


def test_a_namespace_can_turn_it_off() -> None:
    policy = make_policy({"namespaces": [{"names": ["lab"], "rules": {"trustedDeviceSoftware": "off"}}]})
    assert denials(device_pod(), policy, namespace="lab") == []
    assert denials(device_pod(), policy, namespace="default")


def test_daemonsets_are_never_mutated(policy: Policy) -> None:
    daemonset = templated("DaemonSet", plugin_container(), volumes=[host_volume()])
    assert engine.mutate(daemonset, policy).skipped == "kind not handled"
