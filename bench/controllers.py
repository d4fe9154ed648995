"""The controllers at fleet scale: `gpuguard controllers` against 20,000 Nodes and 200,000 Pods in a real
kube-apiserver (etcd + kube-apiserver from tests/controlplane, as the end-to-end tests run them).

    python -m bench.controllers [--nodes 20000] [--pods-per-node 10] [--samples 50] [--dra]

Measures the time from starting the process to its caches synced (/readyz) and to its first pass over
every node and pod done (work queues empty), its resident memory then, and the reaction time: from a
node's allocatable dropping (the status patch answered) to gpuguard's taint being on the node, with the
gap's persistence set to 0. Floors, by fleet size: up to 5,000 nodes synced <= 30 s and RSS <= 300 MB;
up to 20,000 nodes (the largest GPU clusters) synced <= 60 s and RSS <= 600 MB; reaction p99 <= 2 s at
any size.

With --dra the nodes are DRA nodes: no extended resource, a ResourceSlice of 8 GPUs each (driver
gpu.example.com), and every GPU worker holds a ResourceClaim allocated one of them and reserved for it.
The reaction is then from the answered update of a slice that taints one device (as NVIDIA's driver on
XID 79) to gpuguard's DeviceTaintRule for that device existing. Floors as above (5,000 DRA nodes and
50,000 claims: synced <= 30 s, RSS <= 300 MB, reaction p99 <= 2 s).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import http.client
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from bench import FLOOR_MISSED
from bench.common import rss_mb
from tests.harness import REPO_ROOT
from tests.harness.controllers import PLUGIN_NAMESPACE, device_plugin_pod
from tests.harness.controlplane import LOOPBACK, ControlPlane, free_ports, http_get, spawn, without_proxies
from webhook.policy.health import fences, observed, records

GPU = "nvidia.com/gpu"
DRA_DRIVER = "gpu.example.com"
DRA_DEVICES = 8
RESOURCE_API = "/apis/resource.k8s.io/v1"
NAMESPACE = "bench"
# (up to this many nodes, synced within seconds, RSS within MB), smallest fleet first.
FLOORS_BY_SIZE = ((5_000, 30.0, 300.0), (20_000, 60.0, 600.0))
FLOOR_REACTION_P99_S = 2.0
POSTERS = 8
TAINT_POLL_S = 0.01

JSON = dict[str, Any]
say: Callable[[str], None] = lambda text: print(f"bench: {text}", file=sys.stderr, flush=True)  # noqa: E731


def policy() -> JSON:
    """Enforce at once: a gap or a driver taint acts with no persistence, and no budget or breaker holds."""
    return {
        "health": {
            "mode": "enforce",
            "signals": {"deviceGap": {"forSeconds": 0}, "deviceTaints": {"keys": [], "forSeconds": 0}},
            "budget": {"maxUnhealthy": "100%"},
            "circuitBreaker": {"maxNodes": "100%"},
        }
    }


def nodes(count: int, *, dra: bool = False) -> Iterator[JSON]:
    """GPU nodes: 8 `nvidia.com/gpu` each, or with `dra` none (their slices say they have GPUs)."""
    gpus = {} if dra else {GPU: "8"}
    for index in range(count):
        pool = f"pool-{index % 20}"
        yield {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": f"gpu-{index:05d}",
                "labels": {
                    "karpenter.sh/nodepool": pool,
                    "nvidia.com/gpu.present": "true",
                    "kubernetes.io/hostname": f"gpu-{index:05d}",
                    "node.kubernetes.io/instance-type": "p5.48xlarge",
                    "topology.kubernetes.io/zone": f"zone-{index % 3}",
                },
            },
            "status": {
                "capacity": {"cpu": "192", "memory": "2Ti", "pods": "110", **gpus},
                "allocatable": {"cpu": "190", "memory": "1950Gi", "pods": "110", **gpus},
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
            },
        }


def pods(node_count: int, per_node: int, *, dra: bool = False) -> Iterator[tuple[str, JSON]]:
    """Per node: its device plugin (a DaemonSet's pod) and `per_node - 1` GPU workers, bound; with `dra`
    each worker holds its own ResourceClaim (named after it) instead of an extended resource."""
    gpu: JSON = {} if dra else {GPU: "1"}
    for index in range(node_count):
        node = f"gpu-{index:05d}"
        yield PLUGIN_NAMESPACE, device_plugin_pod(node, "nvcr.io/nvidia/k8s-device-plugin:v0.17.0")
        for worker in range(per_node - 1):
            name = f"train-{index:05d}-{worker}"
            claims: JSON = {"resourceClaims": [{"name": "gpu", "resourceClaimName": name}]} if dra else {}
            yield (
                NAMESPACE,
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": name, "labels": {"app": "train", "job-name": f"train-{index:05d}"}},
                    "spec": {
                        "nodeName": node,
                        "restartPolicy": "Never",
                        **claims,
                        "containers": [
                            {
                                "name": "main",
                                "image": "registry.example/train:1",
                                "resources": {
                                    "limits": {**gpu, "cpu": "16", "memory": "200Gi"},
                                    **({"claims": [{"name": "gpu"}]} if dra else {}),
                                },
                                "env": [{"name": "RANK", "value": str(worker)}],
                            }
                        ],
                    },
                },
            )


class Api:
    """Raw HTTPS to the API server with the admin's certificate, one connection per thread."""

    def __init__(self, plane: ControlPlane) -> None:
        self.port = plane.port
        self.context = plane.pki.admin_context()
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPSConnection:
        conn: http.client.HTTPSConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPSConnection(LOOPBACK, self.port, context=self.context, timeout=60)
            self._local.conn = conn
        return conn

    def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> JSON:
        conn = self._conn()
        payload = None if body is None else json.dumps(body)
        conn.request(method, path, body=payload, headers={"Content-Type": content_type})
        response = conn.getresponse()
        data = response.read()
        if response.status >= 300:
            raise RuntimeError(f"{method} {path}: {response.status} {data[:300]!r}")
        result: JSON = json.loads(data)
        return result


def create_all(api: Api, items: Iterator[tuple[str, JSON]]) -> list[JSON]:
    """POSTs every (collection path, object) with POSTERS threads; returns what the server answered."""
    with concurrent.futures.ThreadPoolExecutor(POSTERS) as pool:
        futures = [pool.submit(api.call, "POST", path, obj) for path, obj in items]
        return [future.result() for future in futures]


def resource_slice(node: str, generation: int = 1, tainted: int | None = None) -> JSON:
    """What a DRA driver's kubelet plugin publishes for the node; `tainted` names the device its health
    check failed (NVIDIA's driver: gpu.nvidia.com/xid NoSchedule on XID 79)."""
    xid = [{"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{DRA_DRIVER}"},
        "spec": {
            "driver": DRA_DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": [
                {"name": f"gpu-{i}", **({"taints": xid} if i == tainted else {})} for i in range(DRA_DEVICES)
            ],
        },
    }


def allocate(api: Api, pod: JSON) -> None:
    """The worker's claim, as the scheduler and the resource claim controller leave it: allocated one
    of its node's devices, reserved for the pod."""
    name, node, uid = pod["metadata"]["name"], pod["spec"]["nodeName"], pod["metadata"]["uid"]
    claims = f"{RESOURCE_API}/namespaces/{NAMESPACE}/resourceclaims"
    request = {"name": "gpu", "exactly": {"deviceClassName": DRA_DRIVER}}
    api.call("POST", claims, {"metadata": {"name": name}, "spec": {"devices": {"requests": [request]}}})
    device = f"gpu-{int(name.rsplit('-', 1)[1]) % DRA_DEVICES}"
    status = {
        "allocation": {
            "devices": {
                "results": [{"request": "gpu", "driver": DRA_DRIVER, "pool": node, "device": device}]
            },
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                ]
            },
        },
        "reservedFor": [{"resource": "pods", "name": name, "uid": uid}],
    }
    api.call("PATCH", f"{claims}/{name}/status", {"status": status}, "application/merge-patch+json")


def populate(plane: ControlPlane, api: Api, node_count: int, per_node: int, *, dra: bool) -> None:
    for namespace in (NAMESPACE, PLUGIN_NAMESPACE):
        plane.kubectl("create", "namespace", namespace)
    start = time.monotonic()
    created = create_all(api, (("/api/v1/nodes", node) for node in nodes(node_count, dra=dra)))
    say(f"{len(created)} nodes in {time.monotonic() - start:.0f} s")
    start = time.monotonic()
    created = create_all(
        api, ((f"/api/v1/namespaces/{ns}/pods", pod) for ns, pod in pods(node_count, per_node, dra=dra))
    )
    say(f"{len(created)} pods in {time.monotonic() - start:.0f} s")
    if dra:
        start = time.monotonic()
        slices = create_all(
            api,
            ((f"{RESOURCE_API}/resourceslices", resource_slice(f"gpu-{i:05d}")) for i in range(node_count)),
        )
        workers = [pod for pod in created if pod["metadata"]["namespace"] == NAMESPACE]
        with concurrent.futures.ThreadPoolExecutor(POSTERS) as pool:
            for future in [pool.submit(allocate, api, pod) for pod in workers]:
                future.result()
        say(
            f"{len(slices)} ResourceSlices and {len(workers)} allocated claims in {time.monotonic() - start:.0f} s"
        )
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(POSTERS) as pool:
        for step in (node_ready, plugin_running):
            for future in [pool.submit(step, api, index) for index in range(node_count)]:
                future.result()
    say(f"{node_count} nodes and their device plugin pods Ready in {time.monotonic() - start:.0f} s")


def node_ready(api: Api, index: int) -> None:
    """What the node lifecycle controller does once a node is Ready: the not-ready taint the API server
    put on it at its creation (TaintNodesByCondition) goes. gpuguard leaves a node carrying it alone."""
    body = {"spec": {"taints": None}}
    api.call("PATCH", f"/api/v1/nodes/gpu-{index:05d}", body, "application/merge-patch+json")


def plugin_running(api: Api, index: int) -> None:
    """What the kubelet reports for a device plugin that has run for an hour: Running and Ready."""
    started = records.format_time(datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=1))
    status = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True"}],
        "containerStatuses": [
            {
                "name": "plugin",
                "image": "nvcr.io/nvidia/k8s-device-plugin:v0.17.0",
                "imageID": "",
                "ready": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": started}},
            }
        ],
    }
    path = f"/api/v1/namespaces/{PLUGIN_NAMESPACE}/pods/nvidia-device-plugin-gpu-{index:05d}/status"
    api.call("PATCH", path, {"status": status}, "application/strategic-merge-patch+json")


class Controllers:
    def __init__(self, plane: ControlPlane, workdir: Path) -> None:
        (self.port,) = free_ports(1)
        policy_path = workdir / "policy.yaml"
        policy_path.write_text(yaml.safe_dump(policy()))
        self.log_path = workdir / "controllers.log"
        argv = [
            sys.executable,
            "-m",
            "webhook",
            "controllers",
            f"--host={LOOPBACK}",
            f"--port={self.port}",
            f"--kubeconfig={plane.kubeconfig}",
            "--namespace=default",
            f"--policy={policy_path}",
            "--identity=bench",
        ]
        env = {
            k: v for k, v in without_proxies().items() if k not in ("KUBERNETES_SERVICE_HOST", "KUBECONFIG")
        }
        env["PYTHONPATH"] = str(REPO_ROOT)
        self.started = time.monotonic()
        self.process = spawn(argv, self.log_path, env, cwd=REPO_ROOT)

    def get(self, path: str) -> tuple[int, bytes]:
        return http_get(self.port, path)

    def wait(self, ready: Callable[[], bool], what: str, timeout: float = 600) -> float:
        while not ready():
            if not self.process.running():
                # The log lives in the bench's temporary folder, gone once the bench ends: say its end.
                tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])
                raise RuntimeError(
                    f"controllers exited while waiting for {what}; the end of their log:\n{tail}"
                )
            if time.monotonic() - self.started > timeout:
                raise TimeoutError(what)
            time.sleep(0.05)
        return time.monotonic() - self.started

    def idle(self) -> bool:
        code, body = self.get("/metrics")
        if code != 200:
            return False
        depths = [line for line in body.decode().splitlines() if line.startswith("gpuguard_workqueue_depth{")]
        leading = b"gpuguard_leader_election_master_status 1" in body
        return leading and bool(depths) and all(line.endswith(" 0") for line in depths)


def reaction(api: Api, node: str) -> float:
    """Seconds from the answered status patch lowering allocatable to gpuguard's taint seen on the node."""
    patch = {"status": {"allocatable": {GPU: "7"}}}
    api.call("PATCH", f"/api/v1/nodes/{node}/status", patch, "application/strategic-merge-patch+json")
    dropped = time.monotonic()
    while True:
        spec = api.call("GET", f"/api/v1/nodes/{node}")["spec"]
        if any(t["key"] == observed.TAINT_KEY for t in spec.get("taints") or []):
            return time.monotonic() - dropped
        if time.monotonic() - dropped > 30:
            raise TimeoutError(f"no taint on {node} within 30 s")
        time.sleep(TAINT_POLL_S)


def dra_reaction(api: Api, node: str) -> float:
    """Seconds from the answered update of the node's slice that taints gpu-0 (a new pool generation,
    as a driver publishes it) to gpuguard's DeviceTaintRule for that device existing."""
    rule = fences.rule_name(f"{DRA_DRIVER}/{node}/gpu-0")
    path = f"{RESOURCE_API}/resourceslices/{node}-{DRA_DRIVER}"
    current = api.call("GET", path)
    updated = resource_slice(node, generation=2, tainted=0)
    updated["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
    api.call("PUT", path, updated)
    tainted = time.monotonic()
    while True:
        try:
            api.call("GET", f"{RESOURCE_API}/devicetaintrules/{rule}")
            return time.monotonic() - tainted
        except RuntimeError as exc:
            if ": 404 " not in str(exc):
                raise
        if time.monotonic() - tainted > 30:
            raise TimeoutError(f"no DeviceTaintRule for {node}/gpu-0 within 30 s")
        time.sleep(TAINT_POLL_S)


def floors(node_count: int) -> tuple[float, float]:
    """Synced within (s) and RSS within (MB) for a fleet of this size: the floor of the smallest size
    class that holds it (a fleet past the largest is judged by the largest's)."""
    for most, sync_s, memory_mb in FLOORS_BY_SIZE:
        if node_count <= most:
            return sync_s, memory_mb
    return FLOORS_BY_SIZE[-1][1:]


def percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(len(ordered) * share), len(ordered) - 1)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench.controllers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=20_000)
    parser.add_argument("--pods-per-node", type=int, default=10, help="a device plugin pod and GPU workers")
    parser.add_argument(
        "--samples", type=int, default=50, help="nodes whose allocatable drops, one at a time"
    )
    parser.add_argument(
        "--bin-dir", type=Path, default=None, help="the Go-built control plane (default: build.sh's)"
    )
    parser.add_argument(
        "--dra",
        action="store_true",
        help="DRA nodes: ResourceSlices and a claim per worker, no extended resource",
    )
    args = parser.parse_args(argv)
    if args.bin_dir is None:
        build = REPO_ROOT / "tests" / "controlplane" / "build.sh"
        built = subprocess.run(["bash", str(build)], check=True, capture_output=True, text=True)
        args.bin_dir = Path(built.stdout.strip().splitlines()[-1])
    bin_dir: Path = args.bin_dir
    with (
        tempfile.TemporaryDirectory(prefix="gpuguard-bench-") as work,
        ControlPlane.start(bin_dir, Path(work)) as plane,
    ):
        api = Api(plane)
        populate(plane, api, args.nodes, args.pods_per_node, dra=args.dra)
        controllers = Controllers(plane, Path(work))
        try:
            synced = controllers.wait(lambda: controllers.get("/readyz")[0] == 200, "caches synced")
            synced_rss = rss_mb(controllers.process.popen.pid)
            settled = controllers.wait(controllers.idle, "first pass over every node and pod")
            settled_rss = rss_mb(controllers.process.popen.pid)
            say(
                f"synced in {synced:.1f} s ({synced_rss:.0f} MB), first pass done at {settled:.1f} s ({settled_rss:.0f} MB)"
            )
            react = dra_reaction if args.dra else reaction
            times = [
                react(api, f"gpu-{index * (args.nodes // args.samples):05d}") for index in range(args.samples)
            ]
            peak_rss = rss_mb(controllers.process.popen.pid)
        finally:
            controllers.process.stop()
    p50, p99 = statistics.median(times), percentile(times, 0.99)
    floor_sync_s, floor_rss_mb = floors(args.nodes)
    rows = [
        (
            "caches synced (/readyz) after start",
            f"{synced:.1f} s",
            f"<= {floor_sync_s:g} s",
            synced <= floor_sync_s,
        ),
        ("first pass over every node and pod done", f"{settled:.1f} s", "", True),
        (
            "RSS once synced / after the first pass / at the end",
            f"{synced_rss:.0f} / {settled_rss:.0f} / {peak_rss:.0f} MB",
            f"<= {floor_rss_mb:g} MB",
            max(synced_rss, settled_rss, peak_rss) <= floor_rss_mb,
        ),
        (
            f"{'driver taint -> DeviceTaintRule' if args.dra else 'allocatable dropped -> taint'} written, "
            f"p50 / p99 / max of {len(times)}",
            f"{p50 * 1000:.0f} / {p99 * 1000:.0f} / {max(times) * 1000:.0f} ms",
            f"p99 <= {FLOOR_REACTION_P99_S:g} s",
            p99 <= FLOOR_REACTION_P99_S,
        ),
    ]
    claims = f", {args.nodes * (args.pods_per_node - 1)} claims" if args.dra else ""
    print(
        f"gpuguard controllers, {args.nodes} {'DRA ' if args.dra else ''}nodes and "
        f"{args.nodes * args.pods_per_node} pods{claims}, Kubernetes {plane.version}\n"
    )
    print("| measurement | figure | floor | |\n|---|---|---|---|")
    for name, figure, floor, met in rows:
        print(f"| {name} | {figure} | {floor} | {'met' if met else '**missed**'} |")
    return 0 if all(met for *_, met in rows) else FLOOR_MISSED


if __name__ == "__main__":
    sys.exit(main())
