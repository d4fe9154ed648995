"""The kubelet's gRPC APIs for Python, compiled at test setup from the .proto files of the pinned
k8s.io/kubelet module (in the Go module cache, where the control-plane build put it) into an
ignored cache folder: nothing generated is committed, and the messages always match the kubelet
under test. The device plugin API (v1beta1), the PodResources API (v1), and what a DRA driver's
kubelet plugin speaks: plugin registration (v1), DRA (v1) and DRA device health (v1alpha1)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from tests.harness import REPO_ROOT

CONTROL_PLANE_MODULE = REPO_ROOT / "tests" / "controlplane"
DEVICE_PLUGIN_PROTO = "deviceplugin/v1beta1/api.proto"
POD_RESOURCES_PROTO = "podresources/v1/api.proto"
PLUGIN_REGISTRATION_PROTO = "pluginregistration/v1/api.proto"
DRA_PROTO = "dra/v1/api.proto"
DRA_HEALTH_PROTO = "dra-health/v1alpha1/api.proto"
# Service names as the .proto files declare them (package.Service), for the gRPC method paths.
DEVICE_PLUGIN_SERVICE = "v1beta1.DevicePlugin"
REGISTRATION_SERVICE = "v1beta1.Registration"
POD_RESOURCES_SERVICE = "v1.PodResourcesLister"
PLUGIN_REGISTRATION_SERVICE = "pluginregistration.Registration"
DRA_SERVICE = "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
DRA_HEALTH_SERVICE = "v1alpha1.DRAResourceHealth"
DEVICE_PLUGIN_VERSION = "v1beta1"  # what Register names, and the kubelet checks


@dataclass(frozen=True)
class KubeletApis:
    """The generated message modules (`Device`, `AllocateResponse`, `ListPodResourcesRequest`, ...)."""

    deviceplugin: ModuleType
    podresources: ModuleType
    pluginregistration: ModuleType
    dra: ModuleType
    dra_health: ModuleType
    kubelet_version: str


def kubelet_module() -> tuple[str, Path]:
    """(version, folder) of k8s.io/kubelet as tests/controlplane/go.mod pins it; downloads it into
    the module cache if it is not there yet."""
    result = subprocess.run(
        ["go", "mod", "download", "-json", "k8s.io/kubelet"],
        cwd=CONTROL_PLANE_MODULE,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local"},
    )
    info = json.loads(result.stdout)
    return str(info["Version"]), Path(info["Dir"])


def compile_apis(cache: Path) -> KubeletApis:
    """Compiles the .proto files (once per kubelet and grpcio-tools version) and loads them."""
    version, module_dir = kubelet_module()
    out = cache / f"kubelet-{version}" / f"grpcio-tools-{importlib.metadata.version('grpcio-tools')}"
    protos = (
        DEVICE_PLUGIN_PROTO,
        POD_RESOURCES_PROTO,
        PLUGIN_REGISTRATION_PROTO,
        DRA_PROTO,
        DRA_HEALTH_PROTO,
    )
    if not all((out / _generated(proto)).is_file() for proto in protos):
        partial = out.with_name(out.name + ".partial")
        partial.mkdir(parents=True, exist_ok=True)
        # -I at pkg/apis: each file keeps a distinct name in the protobuf registry (all are api.proto).
        subprocess.run(
            [
                sys.executable,
                "-m",
                "grpc_tools.protoc",
                f"-I{module_dir / 'pkg' / 'apis'}",
                f"--python_out={partial}",
                *protos,
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        shutil.rmtree(out, ignore_errors=True)
        partial.replace(out)
    return KubeletApis(
        deviceplugin=_load(out / _generated(DEVICE_PLUGIN_PROTO), "kubelet_deviceplugin_v1beta1"),
        podresources=_load(out / _generated(POD_RESOURCES_PROTO), "kubelet_podresources_v1"),
        pluginregistration=_load(
            out / _generated(PLUGIN_REGISTRATION_PROTO), "kubelet_pluginregistration_v1"
        ),
        dra=_load(out / _generated(DRA_PROTO), "kubelet_dra_v1"),
        dra_health=_load(out / _generated(DRA_HEALTH_PROTO), "kubelet_dra_health_v1alpha1"),
        kubelet_version=version,
    )


def _generated(proto: str) -> str:
    # protoc names Python modules after the file, a folder's hyphens made underscores (dra-health).
    return proto.removesuffix(".proto").replace("-", "_") + "_pb2.py"


def _load(path: Path, name: str) -> ModuleType:
    if name in sys.modules:  # the descriptors are registered once per process
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
