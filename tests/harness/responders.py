"""gpuguard's responders on the real nodes: `gpuguard controllers` and a node agent per node, run as
their deploy/ ServiceAccounts (processes of the test), or installed from deploy/ as pods (`PodResponder`
reads those); the device plugin's pods they read; and `GpuguardWrites`, which tells whether they wrote
anything to a node or its pods.

The fake device plugin is a process of the test (device_plugin.py), while gpuguard reads a device
plugin's health from its pods (`signals.devicePlugin`): a DaemonSet with the GPU operator's plugin
labels stands for it on every node, a container that only sleeps, so that what the cluster does to
those pods (the node-lifecycle controller marking them NotReady when their kubelet is gone) reaches
gpuguard as it would in a cluster.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tests.harness import REPO_ROOT
from tests.harness.admission import metric_samples
from tests.harness.controllers import PLUGIN_LABELS, PLUGIN_NAMESPACE
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
from tests.harness.images import BUSYBOX_IMAGE
from webhook.kube.remediation import FIELD_MANAGER
from webhook.policy.health import holdings, observed, records

AGENT_SERVICE_ACCOUNT = "gpuguard-node-agent"
AGENT_NAMESPACE = "gpuguard-node"  # deploy/node-agent: a namespace of its own
AGENT_INTERVAL_SECONDS = 1  # how often an agent asks the kubelet (10 s in deploy/)
AGENT_CONFIRM_SECONDS = 2  # how long a loss must last before the agent reports it (30 s in deploy/)
PLUGIN_DAEMONSET = "nvidia-device-plugin-daemonset"
# What every test here allows gpuguard, beyond the policy's waits, to act on what it saw: a poll of
# the agents, a reconcile, a write, on a loaded machine.
REACTION_SECONDS = 3.0
POLL_SECONDS = 0.25


class AgentProcess:
    """`python -m webhook node-agent` for one node, on that node's PodResources socket."""

    def __init__(self, workdir: Path, kubeconfig: Path, node: str, socket: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        (self.port,) = free_ports(1)
        self.node = node
        self.log_path = workdir / f"agent-{node}.log"
        self.argv = [
            sys.executable,
            "-m",
            "webhook",
            "node-agent",
            f"--node={node}",
            f"--socket={socket}",
            f"--interval={AGENT_INTERVAL_SECONDS}",
            f"--confirm-seconds={AGENT_CONFIRM_SECONDS}",
            f"--host={LOOPBACK}",
            f"--port={self.port}",
            f"--kubeconfig={kubeconfig}",
        ]
        self._process: Process | None = None

    def start(self) -> None:
        env = {
            k: v for k, v in without_proxies().items() if k not in ("KUBERNETES_SERVICE_HOST", "KUBECONFIG")
        }
        env["PYTHONPATH"] = str(REPO_ROOT)
        self._process = spawn(self.argv, self.log_path, env, cwd=REPO_ROOT)

    def ready(self) -> bool:
        return http_get(self.port, "/readyz")[0] == 200

    def metric(self, name: str, **labels: str) -> float:
        return metric_at(self.port, name, labels)

    def log(self) -> str:
        return log_tail(self.log_path, 60)

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()


def metric_at(port: int, name: str, labels: Mapping[str, str], host: str = LOOPBACK) -> float:
    """The sum of the samples of `name` carrying `labels` in what /metrics at host:port serves."""
    code, body = http_get(port, "/metrics", host=host)
    assert code == 200, f"/metrics at {host}:{port} answered {code}"
    return sum(v for found, v in metric_samples(body.decode(), name) if labels.items() <= found.items())


class Responder(Protocol):
    """The controllers or one node's agent, however they run: what the tests read of them."""

    def metric(self, name: str, **labels: str) -> float: ...

    def log(self) -> str: ...


class PodResponder:
    """One of gpuguard's components installed as pods (the controllers' replicas, or the node agent's pod
    on `node`): its counters read at each pod's address and summed (a standby controller counts nothing),
    its logs through `kubectl logs`. The pods are listed at every read, so a replaced one is read in its
    predecessor's place."""

    def __init__(
        self, plane: ControlPlane, namespace: str, selector: str, port: int, *, node: str | None = None
    ) -> None:
        self.plane = plane
        self.namespace = namespace
        self.selector = selector
        self.port = port
        self.node = node

    def pods(self) -> list[dict[str, Any]]:
        on_node = [f"--field-selector=spec.nodeName={self.node}"] if self.node else []
        listed: list[dict[str, Any]] = self.plane.kubectl_json(
            "get", "pods", "-n", self.namespace, "-l", self.selector, *on_node
        )["items"]
        return listed

    def metric(self, name: str, **labels: str) -> float:
        pods = self.pods()
        assert pods, f"no pod {self.selector} in {self.namespace} to read {name} from"
        return sum(metric_at(self.port, name, labels, host=pod["status"]["podIP"]) for pod in pods)

    def log(self) -> str:
        parts = []
        for pod in self.pods():
            name = pod["metadata"]["name"]
            logs = self.plane.kubectl("logs", "-n", self.namespace, name, "--tail=60", check=False)
            parts.append(
                f"--- pod {self.namespace}/{name} on {pod['spec'].get('nodeName')}\n{logs.stdout}{logs.stderr}"
            )
        return "\n".join(parts)


@dataclass
class Responders:
    controllers: Responder
    agents: Mapping[str, Responder]

    def writes(self) -> dict[str, float]:
        """What the responders' own counters say they wrote: the controllers' remediation steps done
        (conditions, taints, cordons, evictions, undoing them) and each agent's pod condition writes."""
        counts = {"controllers": self.controllers.metric("gpuguard_remediations_total", outcome="done")}
        for name, agent in self.agents.items():
            counts[f"agent {name}"] = agent.metric(
                "gpuguard_node_agent_condition_writes_total", outcome="written"
            )
        return counts

    def logs(self) -> str:
        parts = [f"--- controllers\n{self.controllers.log()}"]
        parts += [f"--- agent {name}\n{agent.log()}" for name, agent in self.agents.items()]
        return "\n".join(parts)


def plugin_daemonset(node_labels: Mapping[str, str]) -> dict[str, Any]:
    """The device plugin's pods as gpuguard sees them (the module docstring says why they only sleep):
    the GPU operator's name and labels, on the nodes with `node_labels`."""
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": PLUGIN_DAEMONSET, "namespace": PLUGIN_NAMESPACE, "labels": PLUGIN_LABELS},
        "spec": {
            "selector": {"matchLabels": PLUGIN_LABELS},
            "template": {
                "metadata": {"labels": PLUGIN_LABELS},
                "spec": {
                    "nodeSelector": dict(node_labels),
                    "terminationGracePeriodSeconds": 1,
                    "containers": [
                        {
                            "name": "plugin",
                            "image": BUSYBOX_IMAGE,
                            "imagePullPolicy": "Never",
                            "command": ["sh", "-c", "trap 'exit 0' TERM; while true; do sleep 1; done"],
                        }
                    ],
                },
            },
        },
    }


def plugin_pod(plane: ControlPlane, node: str) -> dict[str, Any] | None:
    """The device plugin's pod on `node`, if there is one."""
    listed = plane.kubectl_json(
        "get",
        "pods",
        "-n",
        PLUGIN_NAMESPACE,
        "-l",
        f"app={PLUGIN_LABELS['app']}",
        f"--field-selector=spec.nodeName={node}",
    )["items"]
    return listed[0] if listed else None


def pod_ready(pod: Mapping[str, Any] | None) -> bool:
    conditions = (pod or {}).get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


# --- did gpuguard write? ---------------------------------------------------------------------------------


def gpuguard_marks(obj: Mapping[str, Any]) -> set[str]:
    """What a version of a Node or a Pod shows of gpuguard's writes: a field its field manager wrote
    (with when), its node condition, taint, record and cordon, the agent's pod condition, an eviction
    (the Eviction API's DisruptionTarget: nobody but gpuguard evicts here)."""
    metadata, spec, status = (obj.get(key) or {} for key in ("metadata", "spec", "status"))
    marks = {
        f"{FIELD_MANAGER} wrote {entry.get('subresource') or 'the object'} at {entry.get('time')}"
        for entry in metadata.get("managedFields") or []
        if entry.get("manager") == FIELD_MANAGER
    }
    for condition in status.get("conditions") or []:
        kind = condition["type"]
        if kind in (observed.CONDITION_TYPE, holdings.CONDITION_TYPE) or (
            kind == "DisruptionTarget" and condition.get("reason") == "EvictionByEvictionAPI"
        ):
            marks.add(
                f"condition {kind}={condition['status']} ({condition.get('reason')}: {condition.get('message')})"
            )
    marks.update(
        f"taint {t['key']}:{t['effect']}" for t in spec.get("taints") or [] if t["key"] == observed.TAINT_KEY
    )
    if record := (metadata.get("annotations") or {}).get(records.RECORD_ANNOTATION):
        marks.add(f"record {record}")
    if spec.get("unschedulable"):
        marks.add("cordoned")
    return marks


def holds_for(violation: Callable[[], str], seconds: float, *, logs: Callable[[], str]) -> None:
    """Asserts that nothing is wrong for `seconds` from now (`violation()` says what is, or ""),
    failing at the first violation with it and `logs()`."""
    start = time.monotonic()
    while not (problem := violation()):
        if time.monotonic() - start >= seconds:
            return
        time.sleep(POLL_SECONDS)
    raise AssertionError(f"{problem} ({time.monotonic() - start:.1f} s into {seconds:.0f} s)\n{logs()}")


class ObjectWatch:
    """`kubectl get ... --watch`: every version of the objects the API server sends from the start on
    (their listing first), read from its output as it comes."""

    def __init__(self, plane: ControlPlane, log_path: Path, *what: str) -> None:
        self.what = " ".join(what)
        self.log_path = log_path
        argv: list[str | Path] = [plane.bin_dir / "kubectl", f"--kubeconfig={plane.kubeconfig}", "get", *what]
        self._process = spawn(
            [*argv, "--watch", "--output-watch-events", "-o", "json"], log_path, plane.kubectl_env()
        )
        self._offset = 0
        self.versions: list[dict[str, Any]] = []

    def read(self) -> list[dict[str, Any]]:
        """Every version received so far (kubectl writes each watch event as a line of JSON)."""
        with self.log_path.open("rb") as output:
            output.seek(self._offset)
            text = output.read()
        complete = text[: text.rfind(b"\n") + 1]
        self._offset += len(complete)
        self.versions += [json.loads(line)["object"] for line in complete.splitlines() if line.strip()]
        if not self._process.running():
            raise RuntimeError(f"the watch of {self.what} ended: {log_tail(self.log_path)}")
        return self.versions

    def stop(self) -> None:
        self._process.stop()


class GpuguardWrites:
    """Whether gpuguard writes to a node or to the pods of a namespace from now on: what they carry of
    gpuguard's now is read once, then every later version the API server sends of them (a watch each)
    is read for gpuguard's marks, and a mark an object did not carry at the start is a write; so is any
    step the responders' own counters add.

    Absence is asserted over a deadline derived from the policy's waits: `quiet_for(seconds)` fails at
    the first write seen."""

    def __init__(
        self, plane: ControlPlane, responders: Responders, workdir: Path, node: str, namespace: str
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.responders = responders
        self.counts = responders.writes()
        objects = [
            plane.kubectl_json("get", "node", node),
            *plane.kubectl_json("get", "pods", "-n", namespace)["items"],
        ]
        self.start = {obj["metadata"]["uid"]: gpuguard_marks(obj) for obj in objects}
        self.watches = [
            ObjectWatch(plane, workdir / f"watch-node-{node}.json", "node", node),
            ObjectWatch(plane, workdir / f"watch-pods-{namespace}.json", "pods", "-n", namespace),
        ]
        wait_until(
            lambda: sum(len(watch.read()) for watch in self.watches) >= len(objects),
            timeout=30,
            what=f"the watches of node {node} and the pods of {namespace} listing them",
        )

    def found(self) -> list[str]:
        """gpuguard's writes seen so far, one line each: a mark with the first version that carried it."""
        first: dict[tuple[str, str], str] = {}
        for watch in self.watches:
            for version in watch.read():
                metadata = version["metadata"]
                name = "/".join(filter(None, (metadata.get("namespace"), metadata["name"])))
                for mark in sorted(gpuguard_marks(version) - self.start.get(metadata["uid"], set())):
                    first.setdefault((f"{version['kind']} {name}", mark), metadata["resourceVersion"])
        writes = [f"{who} (from resourceVersion {version}): {mark}" for (who, mark), version in first.items()]
        counts = self.responders.writes()
        writes += [
            f"{who} counted {counts[who] - before:.0f} more"
            for who, before in self.counts.items()
            if counts[who] != before
        ]
        return writes

    def quiet_for(self, seconds: float, *, what: str) -> int:
        """Fails at the first write seen within `seconds` from now; returns how many versions of the
        objects it read."""

        def violation() -> str:
            writes = self.found()
            return f"gpuguard wrote after {what}:\n  " + "\n  ".join(writes) if writes else ""

        holds_for(violation, seconds, logs=self.responders.logs)
        return sum(len(watch.versions) for watch in self.watches)

    def stop(self) -> None:
        for watch in self.watches:
            watch.stop()
