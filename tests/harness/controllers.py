"""`gpuguard controllers` against a control plane with a real kube-controller-manager, with the test in
the kubelet's place.

There are no kubelets: the test creates Nodes with the status a kubelet would report (capacity and
allocatable of `nvidia.com/gpu`, conditions), binds pods with `spec.nodeName` (or the binding
subresource, for a Job's pods), and writes pod status as the kubelet would (phase, container states,
`allocatedResourcesStatus`). The kube-controller-manager runs the Job, disruption, taint-eviction and
pod garbage collector controllers, and never the node lifecycle controller, which would taint these
heartbeat-less nodes unreachable. The controllers run as processes with the gpuguard-controllers
ServiceAccount of deploy/, so every call they make passes the RBAC that ships.
"""

from __future__ import annotations

import datetime
import json
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness import REPO_ROOT
from tests.harness.admission import metric_samples
from tests.harness.controlplane import (
    LOOPBACK,
    ControlPlane,
    Process,
    free_ports,
    http_get,
    log_tail,
    spawn,
    wait_until,
    without_proxies,
)
from webhook.policy.health import fences, observed, records

GPU = "nvidia.com/gpu"
# The DRA driver the tests play (an accelerators.draDrivers name: gpu.*).
DRA_DRIVER = "gpu.example.com"
NAMESPACE = "gpuguard"
SERVICE_ACCOUNT = "gpuguard-controllers"
KCM_CONTROLLERS = (
    "job-controller",
    "disruption-controller",
    "taint-eviction-controller",
    "pod-garbage-collector-controller",
    # What a NoExecute DeviceTaintRule hands the pods of a DRA device to.
    "device-taint-eviction-controller",
)
TEST_LABEL = "gpuguard-e2e/test"
POOL_LABEL = "karpenter.sh/nodepool"
PLUGIN_LABELS = {"app": "nvidia-device-plugin-daemonset"}
PLUGIN_NAMESPACE = "gpu-operator"
IMAGE = "registry.k8s.io/pause:3.10"


def device_plugin_pod(node: str, image: str) -> dict[str, Any]:
    """The device plugin's pod on `node`, in PLUGIN_NAMESPACE, as its DaemonSet's controller would create it
    (the owner is never looked up: no garbage collector runs to notice that it is absent)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"nvidia-device-plugin-{node}",
            "namespace": PLUGIN_NAMESPACE,
            "labels": PLUGIN_LABELS,
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "DaemonSet",
                    "name": "nvidia-device-plugin-daemonset",
                    "uid": "00000000-0000-0000-0000-000000000001",
                    "controller": True,
                }
            ],
        },
        "spec": {"nodeName": node, "containers": [{"name": "plugin", "image": image}]},
    }


# Short lease timings, so that a failover fits a test; the defaults are 15/10/2 s.
LEASE_ARGS = ("--lease-duration=4", "--renew-deadline=3", "--retry-period=1")
LEASE_SECONDS = 4.0

JSON = dict[str, Any]


def fast_policy(test: str, **health_overrides: Any) -> JSON:
    """Enforce everything, on this test's nodes only, with timings of seconds instead of minutes."""
    section: JSON = {
        "mode": "enforce",
        "nodeSelector": {"matchLabels": {TEST_LABEL: test}},
        "signals": {
            "deviceGap": {"forSeconds": 2},
            "devicePlugin": {
                "notReadyForSeconds": 2,
                "restartGraceSeconds": 1,
                "capacityVanishedForSeconds": 3,
            },
            "podDeviceHealth": {"unknownForSeconds": 2},
        },
        # Tests fail the same node again (the node tier's few real nodes): a second remediation must
        # not keep it marked until acknowledged. The escalation's own test turns it on.
        "recovery": {"afterSeconds": 3, "escalation": {"remediations": 0, "windowSeconds": 600}},
        "eviction": {"retrySeconds": 1, "maxRetrySeconds": 2, "timeoutSeconds": 6},
        "budget": {"maxUnhealthy": "100%"},
        "circuitBreaker": {"maxNodes": "100%", "windowSeconds": 600},
    }
    # The audit's reports only where a test asks for them (they need a CRD and the audit's rights).
    return {"health": _merged(section, health_overrides), "audit": {"reportIntervalSeconds": 0}}


def _merged(base: JSON, override: Mapping[str, Any]) -> JSON:
    merged = dict(base)
    for key, value in override.items():
        merged[key] = (
            _merged(merged[key], value)
            if isinstance(value, dict) and isinstance(merged.get(key), dict)
            else value
        )
    return merged


def now_text(seconds_ago: float = 0) -> str:
    moment = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=seconds_ago)
    return records.format_time(moment)


# --- the cluster ---------------------------------------------------------------------------------------


def install_rbac(plane: ControlPlane) -> None:
    """The namespace and the controllers' ServiceAccount, roles and bindings exactly as deploy/ ships them."""
    install_service_account(plane, SERVICE_ACCOUNT)
    plane.kubectl("create", "namespace", PLUGIN_NAMESPACE)


def install_service_account(plane: ControlPlane, service_account: str) -> None:
    """The namespace and one ServiceAccount of deploy/ with its roles and bindings, as shipped."""
    rendered = [
        doc for doc in yaml.safe_load_all(plane.kubectl("kustomize", str(REPO_ROOT / "deploy")).stdout) if doc
    ]
    wanted = [
        doc
        for doc in rendered
        if doc["kind"] == "Namespace"
        or (
            doc["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
            and doc["metadata"]["name"] == service_account
        )
    ]
    plane.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": wanted}))


def service_account_kubeconfig(
    plane: ControlPlane, path: Path, service_account: str = SERVICE_ACCOUNT, namespace: str = NAMESPACE
) -> Path:
    token = plane.kubectl("create", "token", service_account, "-n", namespace, "--duration=4h").stdout.strip()
    config = json.loads(plane.kubeconfig.read_text())
    config["users"] = [{"name": service_account, "user": {"token": token}}]
    config["contexts"] = [{"name": "sa", "context": {"cluster": "e2e", "user": service_account}}]
    config["current-context"] = "sa"
    path.write_text(json.dumps(config))
    return path


class Kubelet:
    """What the tests write in the kubelet's place, through the API server."""

    def __init__(self, plane: ControlPlane, test: str) -> None:
        self.plane = plane
        self.test = test
        self.nodes: list[str] = []

    def node(
        self,
        name: str,
        *,
        capacity: int | None = 8,
        allocatable: int | None = None,
        pool: str | None = None,
        labels: Mapping[str, str] | None = None,
        plugin: bool = True,
    ) -> str:
        """A GPU node reporting `capacity` devices, `allocatable` of them healthy, with a Ready device
        plugin pod that has run for an hour (unless `plugin` is False). `capacity` None: no GPU resource
        at all (a DRA or passthrough node)."""
        all_labels = {TEST_LABEL: self.test, "kubernetes.io/hostname": name, **(labels or {})}
        if pool is not None:
            all_labels[POOL_LABEL] = pool
        devices = {} if capacity is None else {GPU: str(capacity)}
        healthy = {} if capacity is None else {GPU: str(capacity if allocatable is None else allocatable)}
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": all_labels},
            "status": {
                "capacity": {"cpu": "32", "memory": "256Gi", "pods": "110", **devices},
                "allocatable": {"cpu": "31", "memory": "250Gi", "pods": "110", **healthy},
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "lastHeartbeatTime": now_text(),
                        "lastTransitionTime": now_text(3600),
                    }
                ],
            },
        }
        self.plane.kubectl("create", "-f", "-", input=json.dumps(node))
        # What the node lifecycle controller (not running here) does once a node is Ready: the not-ready
        # taint the API server put on it at its creation (TaintNodesByCondition) goes.
        self.plane.kubectl("taint", "node", name, "node.kubernetes.io/not-ready:NoSchedule-")
        self.nodes.append(name)
        if plugin:
            self.device_plugin(name)
        return name

    def devices(self, node: str, *, capacity: int, allocatable: int) -> None:
        """What the device manager reports: `capacity` = healthy + unhealthy, `allocatable` = healthy."""
        patch = {"status": {"capacity": {GPU: str(capacity)}, "allocatable": {GPU: str(allocatable)}}}
        self.plane.kubectl(
            "patch", "node", node, "--subresource=status", "--type=strategic", "-p", json.dumps(patch)
        )

    def node_condition(self, node: str, condition_type: str, status: str) -> None:
        condition = {
            "type": condition_type,
            "status": status,
            "reason": "Agent",
            "lastTransitionTime": now_text(),
        }
        patch = {"status": {"conditions": [condition]}}
        self.plane.kubectl(
            "patch", "node", node, "--subresource=status", "--type=strategic", "-p", json.dumps(patch)
        )

    def device_plugin(self, node: str, *, ready: bool = True, started_seconds_ago: float = 3600) -> str:
        pod = device_plugin_pod(node, IMAGE)
        name: str = pod["metadata"]["name"]
        self.plane.kubectl("apply", "-f", "-", input=json.dumps(pod))
        self.running(PLUGIN_NAMESPACE, name, ready=ready, started_seconds_ago=started_seconds_ago)
        return name

    def gpu_pod(
        self, name: str, namespace: str, node: str, *, gpus: int = 1, labels: Mapping[str, str] | None = None
    ) -> str:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {})},
            "spec": {
                "nodeName": node,
                "restartPolicy": "Always",
                "terminationGracePeriodSeconds": 30,
                "containers": [{"name": "main", "image": IMAGE, "resources": {"limits": {GPU: str(gpus)}}}],
            },
        }
        self.plane.kubectl("create", "-f", "-", input=json.dumps(pod))
        return name

    def claim_pod(self, name: str, namespace: str, node: str) -> str:
        """A pod holding the DRA claim `gpu` (the ResourceClaim object itself is never read)."""
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "nodeName": node,
                "resourceClaims": [{"name": "gpu", "resourceClaimName": f"{name}-gpu"}],
                "containers": [{"name": "main", "image": IMAGE, "resources": {"claims": [{"name": "gpu"}]}}],
            },
        }
        self.plane.kubectl("create", "-f", "-", input=json.dumps(pod))
        return name

    def allocated_claim(self, namespace: str, pod: str, node: str, device: str) -> str:
        """What the scheduler and the resource claim controller leave for a claim pod's `gpu` claim
        (`claim_pod`): the ResourceClaim, allocated `device` of the node's pool, reserved for the pod."""
        name = f"{pod}-gpu"
        claim = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRA_DRIVER}}]}},
        }
        self.plane.kubectl("create", "-f", "-", input=json.dumps(claim))
        uid = self.plane.kubectl_json("get", "pod", pod, "-n", namespace)["metadata"]["uid"]
        on_node = {"key": "metadata.name", "operator": "In", "values": [node]}
        status = {
            "allocation": {
                "devices": {
                    "results": [{"request": "gpu", "driver": DRA_DRIVER, "pool": node, "device": device}]
                },
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [on_node]}]},
            },
            "reservedFor": [{"resource": "pods", "name": pod, "uid": uid}],
        }
        self.plane.kubectl(
            "patch",
            "resourceclaim",
            name,
            "-n",
            namespace,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": status}),
        )
        return name

    def bind(self, namespace: str, pod: str, node: str) -> None:
        """What the scheduler does: the binding subresource (a Job's pods come unscheduled)."""
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": pod, "namespace": namespace},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        path = f"/api/v1/namespaces/{namespace}/pods/{pod}/binding"
        self.plane.kubectl("create", "--raw", path, "-f", "-", input=json.dumps(binding))

    def running(
        self,
        namespace: str,
        pod: str,
        *,
        ready: bool = True,
        devices: Mapping[str, str] | None = None,
        resource: str = GPU,
        started_seconds_ago: float = 60,
    ) -> None:
        """The pod's containers run; `devices` maps device IDs of `resource` (a device plugin's resource,
        or claim:<claim> for DRA) to their health (allocatedResourcesStatus)."""
        current = self.plane.kubectl_json("get", "pod", pod, "-n", namespace)
        statuses = []
        for container in current["spec"]["containers"]:
            status: JSON = {
                "name": container["name"],
                "image": container["image"],
                "imageID": "",
                "ready": ready,
                "started": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": now_text(started_seconds_ago)}},
            }
            if devices is not None:
                status["allocatedResourcesStatus"] = [
                    {
                        "name": resource,
                        "resources": [
                            {"resourceID": device, "health": state} for device, state in devices.items()
                        ],
                    }
                ]
            statuses.append(status)
        conditions = [
            {
                "type": kind,
                "status": "True" if ready or kind == "PodScheduled" else "False",
                "lastTransitionTime": now_text(),
            }
            for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
        ]
        self._status(
            namespace, pod, {"phase": "Running", "conditions": conditions, "containerStatuses": statuses}
        )

    def device_health(
        self, namespace: str, pod: str, devices: Mapping[str, str], *, resource: str = GPU
    ) -> None:
        self.running(namespace, pod, devices=devices, resource=resource)

    def terminate(self, namespace: str, pod: str, *, exit_code: int) -> None:
        """The container died and the pod failed, as the kubelet reports it: one status patch (conditions
        the API server added, DisruptionTarget among them, stay: strategic merge by type)."""
        current = self.plane.kubectl_json("get", "pod", pod, "-n", namespace)
        statuses = [
            {
                "name": container["name"],
                "image": container["image"],
                "imageID": "",
                "ready": False,
                "started": False,
                "restartCount": 0,
                "state": {
                    "terminated": {
                        "exitCode": exit_code,
                        "reason": "Error",
                        "finishedAt": now_text(),
                        "startedAt": now_text(60),
                    }
                },
            }
            for container in current["spec"]["containers"]
        ]
        conditions = [{"type": "Ready", "status": "False", "lastTransitionTime": now_text()}]
        self._status(
            namespace, pod, {"phase": "Failed", "conditions": conditions, "containerStatuses": statuses}
        )

    def finish_deletion(self, namespace: str, pod: str) -> None:
        """What the kubelet does last for a pod being deleted: the delete with grace period 0."""
        self.plane.kubectl(
            "delete", "pod", pod, "-n", namespace, "--grace-period=0", "--force", "--wait=false", check=False
        )

    def _status(self, namespace: str, pod: str, status: JSON) -> None:
        self.plane.kubectl(
            "patch",
            "pod",
            pod,
            "-n",
            namespace,
            "--subresource=status",
            "--type=strategic",
            "-p",
            json.dumps({"status": status}),
        )

    def resource_slice(
        self,
        node: str,
        *,
        devices: int = 8,
        generation: int = 1,
        taints: Mapping[int, list[JSON]] | None = None,
    ) -> str:
        """What a DRA driver's kubelet plugin publishes: one ResourceSlice of `devices` GPUs for the
        node's pool (named after the node, as node-local drivers do), `taints` by device index."""
        name = f"{node}-{DRA_DRIVER}"
        piece = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": name, "labels": {TEST_LABEL: self.test}},
            "spec": {
                "driver": DRA_DRIVER,
                "nodeName": node,
                "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
                "devices": [
                    {"name": f"gpu-{i}", **({"taints": (taints or {})[i]} if i in (taints or {}) else {})}
                    for i in range(devices)
                ],
            },
        }
        self.plane.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(piece))
        return name

    def cleanup(self) -> None:
        self.plane.kubectl(
            "delete", "resourceslices", "-l", f"{TEST_LABEL}={self.test}", "--ignore-not-found", check=False
        )
        # gpuguard's rules are owned by their Node, and no garbage collector runs here.
        own = f"{fences.MANAGED_BY_LABEL}={fences.MANAGED_BY}"
        self.plane.kubectl("delete", "devicetaintrules", "-l", own, "--ignore-not-found", check=False)
        for node in self.nodes:
            self.plane.kubectl(
                "delete",
                "pod",
                f"nvidia-device-plugin-{node}",
                "-n",
                PLUGIN_NAMESPACE,
                "--ignore-not-found",
                "--grace-period=0",
                "--force",
                check=False,
            )
            self.plane.kubectl("delete", "node", node, "--ignore-not-found", "--wait=false", check=False)


# --- reading back --------------------------------------------------------------------------------------


def node(plane: ControlPlane, name: str) -> JSON:
    result: JSON = plane.kubectl_json("get", "node", name)
    return result


def taints(plane: ControlPlane, name: str) -> list[str]:
    return [f"{t['key']}:{t['effect']}" for t in node(plane, name)["spec"].get("taints") or []]


def own_condition(plane: ControlPlane, name: str) -> JSON | None:
    conditions = node(plane, name)["status"].get("conditions") or []
    return next((c for c in conditions if c["type"] == observed.CONDITION_TYPE), None)


def record(plane: ControlPlane, name: str) -> JSON | None:
    text = (node(plane, name)["metadata"].get("annotations") or {}).get(records.RECORD_ANNOTATION)
    result: JSON | None = json.loads(text) if text else None
    return result


def events(plane: ControlPlane, *, kind: str, name: str, namespace: str = "default") -> list[JSON]:
    """gpuguard's Events about one object (events.k8s.io/v1)."""
    listed = plane.kubectl_json("get", "events.events.k8s.io", "-n", namespace)
    return [
        event
        for event in listed["items"]
        if event.get("reportingController") == "gpuguard.io/gpuguard"
        and event["regarding"]["kind"] == kind
        and event["regarding"]["name"] == name
    ]


def reasons(plane: ControlPlane, *, kind: str, name: str, namespace: str = "default") -> list[str]:
    return [event["reason"] for event in events(plane, kind=kind, name=name, namespace=namespace)]


# --- the controllers as a process ----------------------------------------------------------------------


class ControllersProcess:
    """`python -m webhook controllers` with a policy file (or, given `policy_configmap`, the policy of
    that ConfigMap, NAMESPACE/NAME), as the controllers' ServiceAccount."""

    def __init__(
        self,
        workdir: Path,
        kubeconfig: Path,
        policy: JSON,
        *,
        identity: str,
        policy_configmap: str | None = None,
        lease_args: tuple[str, ...] = LEASE_ARGS,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.identity = identity
        (self.port,) = free_ports(1)
        self.policy_path = workdir / "policy.yaml"
        self.write_policy(policy)
        source = (
            f"--policy-configmap={policy_configmap}" if policy_configmap else f"--policy={self.policy_path}"
        )
        self.log_path = workdir / f"{identity}.log"
        self.argv = [
            sys.executable,
            "-m",
            "webhook",
            "controllers",
            f"--host={LOOPBACK}",
            f"--port={self.port}",
            f"--kubeconfig={kubeconfig}",
            f"--namespace={NAMESPACE}",
            source,
            f"--identity={identity}",
            *lease_args,
        ]
        self._process: Process | None = None

    def write_policy(self, policy: JSON) -> None:
        """A new policy: the running process picks it up (its file watcher), last good kept."""
        self.policy_path.write_text(yaml.safe_dump(policy))

    def start(self) -> None:
        env = {
            k: v for k, v in without_proxies().items() if k not in ("KUBERNETES_SERVICE_HOST", "KUBECONFIG")
        }
        env["PYTHONPATH"] = str(REPO_ROOT)
        with self.log_path.open("a") as log:
            log.write(f"# e2e: {' '.join(self.argv)}\n")
        self._process = spawn(self.argv, self.log_path, env, cwd=REPO_ROOT)

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.running()

    def get(self, path: str) -> tuple[int, bytes]:
        return http_get(self.port, path)

    def status(self) -> JSON:
        code, body = self.get("/policy")
        if code != 200:
            return {}
        result: JSON = json.loads(body)
        return result

    def ready(self) -> bool:
        return self.get("/readyz")[0] == 200

    def leading(self) -> bool:
        return self.status().get("role") == "leader"

    def wait_ready(self, timeout: float = 60.0) -> float:
        return wait_until(
            self.ready, timeout=timeout, what=f"controllers {self.identity} /readyz", process=self._process
        )

    def wait_leading(self, timeout: float = 60.0) -> float:
        return wait_until(
            self.leading, timeout=timeout, what=f"controllers {self.identity} leading", process=self._process
        )

    def metric(self, name: str, **labels: str) -> float:
        code, body = self.get("/metrics")
        assert code == 200, f"/metrics answered {code}"
        return sum(
            value for found, value in metric_samples(body.decode(), name) if labels.items() <= found.items()
        )

    def log(self, lines: int = 60) -> str:
        return log_tail(self.log_path, lines)

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()

    def kill(self) -> None:
        """SIGKILL: no release of the Lease, no goodbye."""
        assert self._process is not None
        self._process.popen.send_signal(signal.SIGKILL)
        self._process.popen.wait(10)
        self._process.log.close()

    def exit_code(self) -> int | None:
        return None if self._process is None else self._process.popen.poll()


Start = Callable[..., ControllersProcess]


def start_fixture(cleanup: Callable[[ControlPlane], None], **process_options: Any) -> Any:
    """A `start` fixture for a test module whose tests start controllers (`start = start_fixture(...)`),
    over its `cluster` and `kubeconfig` fixtures. `start(policy, identity, lead=True)` starts a process
    with `process_options`, waits until it serves and, with `lead`, until it holds the Lease. After the
    test every process started is stopped, and `cleanup` removes what they leave in the cluster for
    the next test (state that outlives a process by design: a Lease, the breaker's ConfigMap, ...)."""

    @pytest.fixture
    def start(cluster: ControlPlane, kubeconfig: Path, tmp_path: Path) -> Iterator[Start]:
        started: list[ControllersProcess] = []

        def start_one(
            policy: JSON | None = None, identity: str = "a", *, lead: bool = True
        ) -> ControllersProcess:
            process = ControllersProcess(
                tmp_path / identity, kubeconfig, policy or {}, identity=identity, **process_options
            )
            started.append(process)
            process.start()
            process.wait_ready()
            if lead:
                process.wait_leading()
            return process

        try:
            yield start_one
        finally:
            for process in started:
                process.stop()
            cleanup(cluster)

    return start


def eventually(
    check: Callable[[], bool],
    *,
    what: str,
    timeout: float = 45.0,
    processes: Iterable[ControllersProcess] = (),
    logs: Callable[[], str] | None = None,
) -> float:
    """Polls until `check` holds; on a timeout, the controllers' logs go with the error (those of
    `processes`, and whatever `logs()` reads: gpuguard's pods, say)."""
    start = time.monotonic()
    try:
        return wait_until(check, timeout=timeout, what=what)
    except TimeoutError as exc:
        parts = [f"--- {p.log_path}\n{p.log()}" for p in processes]
        if logs is not None:
            parts.append(logs())
        raise TimeoutError(f"{exc} (after {time.monotonic() - start:.1f} s)\n" + "\n".join(parts)) from None
