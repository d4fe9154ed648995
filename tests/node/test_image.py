"""gpuguard's image, built from the Dockerfile (scripts/build-image), run on the real nodes by the pod
templates of deploy/ as kustomize renders them: their security contexts, volumes and resources as they
are, under the namespaces' Pod Security levels as deploy/ labels them (the API server's own PodSecurity
admission enforces them), only the command replaced by a probe of what the container sees. The probe
reports through the container's termination message, which needs no pod network.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.harness.install import DEPLOY, find, render
from tests.harness.session import namespace_name
from tests.harness.workloads import GPU, HOSTNAME_LABEL, container_status, phase, wait_for_pod
from webhook import __version__

from .conftest import DEVICES_PER_NODE, NodeCluster

NODE = "node-a"
AGENT_NAMESPACE = "gpuguard-node"
# What the webhook's container sees: who it runs as, whether the root filesystem takes a write, whether
# the in-memory certificate folder does, the CPU limit from its cgroup and the worker count
# `--workers=auto` derives from it, what the image installed, and which modules every gpuguard process
# imports would be compiled from source at each start because their bytecode looks stale.
WEBHOOK_PROBE = """
import errno, importlib.util, json, os, shutil, subprocess, sys
from webhook.processes.serve_workers import auto_count, cpu_limit, usable_cpus
def write(path):
    try:
        with open(path, "w") as f:
            f.write("x")
        return "written"
    except OSError as e:
        return errno.errorcode[e.errno]
limit = cpu_limit()
imports = ("import webhook.processes.serve, webhook.processes.controllers, webhook.processes.node_agent;"
           " import kubernetes.client; kubernetes.client.CoreV1Api")
verbose = subprocess.run([sys.executable, "-v", "-c", imports], capture_output=True, text=True).stderr
stale = [line.split("'")[1] for line in verbose.splitlines() if line.startswith("# bytecode is stale for")]
report = {
    "uid": os.getuid(), "gid": os.getgid(),
    "version": subprocess.run(["gpuguard", "--version"], capture_output=True, text=True).stdout.strip(),
    "gpuguard": shutil.which("gpuguard"),
    "pip": importlib.util.find_spec("pip") is not None,
    "root_fs": write("/opt/gpuguard/probe"), "tmp": write("/tmp/probe"),
    "certs": write("/var/run/gpuguard/certs/probe"),
    "cpu_limit": limit, "workers": auto_count(limit, usable_cpus()),
    "stale_bytecode": {"count": len(stale), "first": stale[:5]},
}
open("/dev/termination-log", "w").write(json.dumps(report))
"""
# What the node agent's container sees: uid 0 without capabilities, and the kubelet's PodResources API
# through the hostPath.
AGENT_PROBE = """
import json
from pathlib import Path
from webhook.agent.podresources import PodResourcesClient
status = dict(line.split(":\\t", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":\\t" in line)
with PodResourcesClient(Path("/var/lib/kubelet/pod-resources/kubelet.sock")) as client:
    allocatable = {name: sorted(ids) for name, ids in client.allocatable().items()}
report = {"uid": int(status["Uid"].split()[0]), "effective_capabilities": int(status["CapEff"], 16),
          "allocatable": allocatable}
open("/dev/termination-log", "w").write(json.dumps(report))
"""


@pytest.fixture(scope="module")
def deploy_objects(cluster: NodeCluster) -> list[dict[str, Any]]:
    return render(cluster.plane, DEPLOY)


@pytest.fixture
def restricted_namespace(
    cluster: NodeCluster, deploy_objects: list[dict[str, Any]], request: pytest.FixtureRequest
) -> Iterator[str]:
    """A fresh namespace with the labels of deploy/'s gpuguard namespace (Pod Security `restricted`)."""
    name = namespace_name(request, "restricted")
    labels = find(deploy_objects, "Namespace", "gpuguard")["metadata"]["labels"]
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}
    cluster.plane.kubectl("apply", "-f", "-", input=json.dumps(namespace))
    yield name
    cluster.plane.kubectl("delete", "namespace", name, "--wait=false")


def probe_pod(workload: dict[str, Any], name: str, namespace: str, image: str, probe: str) -> dict[str, Any]:
    """A one-shot pod of `workload`'s template (deploy/'s Deployment or DaemonSet) on NODE, its first
    container running `probe` in gpuguard's Python instead of its command. The security contexts, volumes
    and resources stay as deploy/ has them; what needs the API server (probes, the ServiceAccount's token)
    goes."""
    spec = copy.deepcopy(workload["spec"]["template"]["spec"])
    for key in ("affinity", "topologySpreadConstraints", "serviceAccountName", "priorityClassName"):
        spec.pop(key, None)
    spec.update(
        nodeSelector={HOSTNAME_LABEL: NODE}, restartPolicy="Never", automountServiceAccountToken=False
    )
    container = spec["containers"][0]
    for key in ("readinessProbe", "livenessProbe", "lifecycle", "args"):
        container.pop(key, None)
    container.update(image=image, imagePullPolicy="Never", command=["python", "-c", probe])
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def reported(cluster: NodeCluster, pod: dict[str, Any]) -> dict[str, Any]:
    """The probe's report, once its pod has Succeeded."""
    cluster.plane.kubectl("create", "-f", "-", input=json.dumps(pod))
    metadata = pod["metadata"]
    done = wait_for_pod(
        cluster.plane,
        metadata["namespace"],
        metadata["name"],
        lambda p: phase(p) in ("Succeeded", "Failed"),
        what="the probe finished",
        timeout=120,
    )
    assert done is not None and phase(done) == "Succeeded", done and done["status"]
    terminated = container_status(done, pod["spec"]["containers"][0]["name"])["state"]["terminated"]
    result: dict[str, Any] = json.loads(terminated["message"])
    return result


def test_the_webhook_pod_runs_as_deploy_says_under_pod_security_restricted(
    cluster: NodeCluster, gpuguard_image: str, deploy_objects: list[dict[str, Any]], restricted_namespace: str
) -> None:
    webhook = find(deploy_objects, "Deployment", "gpuguard")

    report = reported(
        cluster, probe_pod(webhook, "webhook-probe", restricted_namespace, gpuguard_image, WEBHOOK_PROBE)
    )

    assert report["uid"] == report["gid"] == 65532
    assert report["version"].endswith(__version__), report["version"]
    assert report["gpuguard"] == "/opt/gpuguard/bin/gpuguard"
    assert report["pip"] is False  # nothing to install with in the run image
    assert report["root_fs"] == report["tmp"] == "EROFS"  # readOnlyRootFilesystem holds
    assert report["certs"] == "written"  # the in-memory emptyDir the serving files go to
    # limits.cpu "1" in deploy/, read from the container's real cgroup: one worker.
    assert report["cpu_limit"] == 1.0
    assert report["workers"] == 1
    # Bytecode checked by hash: an image layer that rounds file times made every module of the venv look
    # stale, and the node agent compiling the Kubernetes client at start crossed its 128Mi limit.
    assert report["stale_bytecode"] == {"count": 0, "first": []}


def test_pod_security_restricted_refuses_what_deploy_does_not_do(
    cluster: NodeCluster, gpuguard_image: str, deploy_objects: list[dict[str, Any]], restricted_namespace: str
) -> None:
    pod = probe_pod(
        find(deploy_objects, "Deployment", "gpuguard"), "root-probe", restricted_namespace, gpuguard_image, ""
    )
    del pod["spec"]["securityContext"]["runAsNonRoot"]
    pod["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True

    refused = cluster.plane.kubectl("create", "-f", "-", input=json.dumps(pod), check=False)

    assert refused.returncode != 0
    assert 'violates PodSecurity "restricted:latest"' in refused.stderr, refused.stderr
    assert "allowPrivilegeEscalation" in refused.stderr and "runAsNonRoot" in refused.stderr


@pytest.fixture
def agent_namespace(cluster: NodeCluster, deploy_objects: list[dict[str, Any]]) -> Iterator[str]:
    """deploy/'s node-agent namespace, with its labels (Pod Security `privileged`); the session's
    gpuguard leaves it out, as deploy/'s webhooks do."""
    namespace = find(deploy_objects, "Namespace", AGENT_NAMESPACE)
    cluster.plane.kubectl("apply", "-f", "-", input=json.dumps(namespace))
    yield AGENT_NAMESPACE
    cluster.plane.kubectl("delete", "pod", "agent-probe", "-n", AGENT_NAMESPACE, "--ignore-not-found")


def test_the_node_agent_pod_reads_the_kubelets_pod_resources_as_uid_0_without_capabilities(
    cluster: NodeCluster, gpuguard_image: str, deploy_objects: list[dict[str, Any]], agent_namespace: str
) -> None:
    agent = find(deploy_objects, "DaemonSet", "gpuguard-node-agent")

    report = reported(cluster, probe_pod(agent, "agent-probe", agent_namespace, gpuguard_image, AGENT_PROBE))

    assert report["uid"] == 0
    assert report["effective_capabilities"] == 0  # capabilities: drop [ALL]
    devices = cluster.plugins[NODE].device_ids
    assert len(devices) == DEVICES_PER_NODE
    assert report["allocatable"][GPU] == sorted(devices)
