"""What `gpuguard audit` costs on a cluster of a thousand workloads (the figure docs/performance.md states).

Starts the end-to-end control plane (etcd + kube-apiserver, tests/harness/controlplane.py) with the Policy
WG's PolicyReport CRDs, fills it as a cluster of ten teams would be, and times the command as a user
runs it (a fresh process, Kubernetes client start-up included): on the empty cluster first, which is
the fixed cost, then on the full one, printing a table and the run's conditions.

    python -m bench.audit [--workloads 1000] [--runs 3]

Per 10 workloads: 4 Deployments (a ReplicaSet and 2 pods each, as the Deployment controller would
make them), 3 Jobs (a pod each), 2 StatefulSets (a pod each), 1 CronJob; 6 of them unprotected GPU
workloads, 2 already mutated by gpuguard, 2 CPU workloads. About 2.7 objects per workload are read.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.harness import REPO_ROOT
from tests.harness.controlplane import ControlPlane, without_proxies
from webhook.policy import engine
from webhook.policy.model import default_policy

IMAGE = "registry.k8s.io/pause:3.10"
TEAMS = 10
CHUNK = 400  # objects per `kubectl create`
CRD_FILE = REPO_ROOT / "tests" / "e2e" / "crds" / "wgpolicyk8s.io-v1alpha2.yaml"
MIX = ("Deployment",) * 4 + ("Job",) * 3 + ("StatefulSet",) * 2 + ("CronJob",)


def _container(gpu: bool) -> dict[str, Any]:
    resources = {"limits": {"nvidia.com/gpu": "1"}} if gpu else {"requests": {"cpu": "10m"}}
    return {"name": "main", "image": IMAGE, "resources": resources}


def workload(kind: str, name: str, namespace: str, index: int) -> dict[str, Any]:
    """The `index`-th workload: unprotected GPU (6 in 10), GPU as gpuguard left it (2), CPU (2)."""
    gpu = index % 10 < 8
    restart = "Never" if kind in ("Job", "CronJob") else "Always"
    template = {
        "metadata": {"labels": {"app": name}},
        "spec": {"restartPolicy": restart, "containers": [_container(gpu)]},
    }
    spec: dict[str, Any]
    if kind == "Job":
        spec = {"template": template}
    elif kind == "CronJob":
        spec = {"schedule": "0 3 * * *", "jobTemplate": {"spec": {"template": template}}}
    else:
        spec = {"replicas": 2 if kind == "Deployment" else 1, "selector": {"matchLabels": {"app": name}}}
        spec["template"] = template
        if kind == "StatefulSet":
            spec["serviceName"] = name
    group = "batch/v1" if kind in ("Job", "CronJob") else "apps/v1"
    obj = {
        "apiVersion": group,
        "kind": kind,
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }
    if index % 10 in (6, 7):
        obj = engine.mutate(obj, default_policy(), namespace=namespace).obj
    return obj


def _owned(owner: dict[str, Any], kind: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
    metadata = owner["metadata"]
    reference = {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": metadata["name"],
        "uid": metadata["uid"],
        "controller": True,
    }
    version = "v1" if kind == "Pod" else "apps/v1"
    meta = {"name": name, "namespace": metadata["namespace"], "ownerReferences": [reference]}
    return {"apiVersion": version, "kind": kind, "metadata": meta, **body}


def _template_of(obj: dict[str, Any]) -> dict[str, Any]:
    template: dict[str, Any] = obj["spec"]["template"]
    return template


def _pod_of(owner: dict[str, Any], name: str) -> dict[str, Any]:
    """A pod of `owner`'s template, owned by it, as its controller would create it (unscheduled)."""
    template = _template_of(owner)
    pod = _owned(owner, "Pod", name, {"spec": template["spec"]})
    pod["metadata"]["labels"] = template["metadata"]["labels"]
    return pod


def _documents(text: str) -> list[dict[str, Any]]:
    """What `kubectl create -o json` prints for several objects: one JSON document after another."""
    decoder, position = json.JSONDecoder(), 0
    documents: list[dict[str, Any]] = []
    while position < len(text.rstrip()):
        document, position = decoder.raw_decode(text, position)
        documents += document["items"] if document.get("kind") == "List" else [document]
        while position < len(text) and text[position].isspace():
            position += 1
    return documents


class Cluster:
    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane

    def create(self, objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Creates `objects` in chunks; returns them as stored (uids and all)."""
        stored: list[dict[str, Any]] = []
        for start in range(0, len(objects), CHUNK):
            chunk = {"apiVersion": "v1", "kind": "List", "items": objects[start : start + CHUNK]}
            result = self.plane.kubectl(
                "create", "-f", "-", "-o", "json", input=json.dumps(chunk), timeout=600
            )
            stored += _documents(result.stdout)
        return stored

    def fill(self, count: int) -> int:
        """`count` workloads and what their controllers would have made; the number of objects."""
        namespaces = [f"team-{i}" for i in range(TEAMS)]
        classes = [
            {
                "apiVersion": "scheduling.k8s.io/v1",
                "kind": "PriorityClass",
                "metadata": {"name": n},
                "value": v,
            }
            for n, v in default_policy().priorityClasses.items()
        ]
        self.create(
            [
                *classes,
                *({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}} for n in namespaces),
            ]
        )
        workloads = [workload(MIX[i % len(MIX)], f"w{i}", namespaces[i % TEAMS], i) for i in range(count)]
        stored = self.create(workloads)
        owned: list[dict[str, Any]] = []
        replica_sets: list[dict[str, Any]] = []
        for obj in stored:
            name, kind = obj["metadata"]["name"], obj["kind"]
            if kind == "Deployment":
                template = json.loads(json.dumps(_template_of(obj)))
                template["metadata"]["labels"]["pod-template-hash"] = "h"
                selector = {"matchLabels": template["metadata"]["labels"]}
                body = {"spec": {"replicas": 2, "selector": selector, "template": template}}
                replica_sets.append(_owned(obj, "ReplicaSet", f"{name}-h", body))
            elif kind in ("Job", "StatefulSet"):
                owned.append(_pod_of(obj, f"{name}-0"))
        for replica_set in self.create(replica_sets):
            owned += [_pod_of(replica_set, f"{replica_set['metadata']['name']}-{i}") for i in range(2)]
        self.create(owned)
        return len(classes) + len(namespaces) + len(stored) + len(replica_sets) + len(owned)


@dataclass(frozen=True)
class Timing:
    wall: float
    cpu: float  # the audit process's own user + system time: what a busy machine does not inflate
    result: subprocess.CompletedProcess[str]


def timed_audit(plane: ControlPlane, *args: str) -> Timing:
    env = without_proxies()
    env["PYTHONPATH"] = str(REPO_ROOT)
    argv = [sys.executable, "-m", "webhook", "audit", "--kubeconfig", str(plane.kubeconfig), *args]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=900)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise RuntimeError(f"gpuguard audit {' '.join(args)} exited {result.returncode}: {result.stderr}")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return Timing(wall, cpu, result)


def median(timings: list[Timing]) -> Timing:
    ordered = sorted(timings, key=lambda t: t.wall)
    return ordered[len(ordered) // 2]


def _bin_dir() -> Path:
    script = REPO_ROOT / "tests" / "controlplane" / "build.sh"
    built = subprocess.run(
        ["bash", str(script)], stdout=subprocess.PIPE, text=True, check=True, cwd=REPO_ROOT
    )
    return Path(built.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.audit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each measurement (median)")
    args = parser.parse_args(argv)
    with (
        tempfile.TemporaryDirectory(prefix="gpuguard-bench-audit-") as workdir,
        ControlPlane.start(_bin_dir(), Path(workdir)) as plane,
    ):
        plane.kubectl("apply", "-f", "-", input=json.dumps(yaml.safe_load(CRD_FILE.read_text())))
        plane.kubectl(
            "wait",
            "--for=condition=Established",
            "crd/policyreports.wgpolicyk8s.io",
            "crd/clusterpolicyreports.wgpolicyk8s.io",
        )
        empty = median([timed_audit(plane, "-o", "json") for _ in range(args.runs)])
        started = time.monotonic()
        objects = Cluster(plane).fill(args.workloads)
        filled = time.monotonic() - started
        full = median([timed_audit(plane, "-o", "json") for _ in range(args.runs)])
        first = timed_audit(plane, "--report")
        again = timed_audit(plane, "--report")
    findings = len(json.loads(full.result.stdout)["findings"])
    rows = [
        ("empty cluster (client start-up, fact lists)", empty, ""),
        (f"{args.workloads:,} workloads, {objects:,} objects, `-o json`", full, f"{findings:,} findings"),
        ("`--report`, first run", first, _written(first)),
        ("`--report`, same findings again", again, _written(again)),
    ]
    print(
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.node()}: {os.cpu_count()} cores,"
        f" Python {platform.python_version()}, Kubernetes {plane.version}; load average at the end"
        f" {os.getloadavg()[0]:.1f}; filling the cluster took {filled:.0f} s. `gpuguard audit -A` as a"
        f" fresh process; the first two rows are the median of {args.runs} runs.\n"
    )
    print("| audit | wall time | CPU time of the audit | |\n|---|---:|---:|---|")
    for what, timing, note in rows:
        print(f"| {what} | {timing.wall:.1f} s | {timing.cpu:.1f} s | {note} |")
    return 0


def _written(timing: Timing) -> str:
    return timing.result.stderr.strip().splitlines()[-1].split("reports: ")[-1]


if __name__ == "__main__":
    sys.exit(main())
