"""The composition root of `gpuguard node-agent`: the informers of this node's pods and ResourceSlices,
the kubelet's PodResources client, the Event recorder and the probe server, wired around the poll loop
(webhook.agent.nodeagent) and started in this order.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any

from webhook.agent.nodeagent import NodeAgent, Options
from webhook.agent.podresources import PodResourcesClient
from webhook.kube import remediation
from webhook.kube.client import api_client
from webhook.kube.events import EventRecorder, api_sender
from webhook.kube.informer import Informer
from webhook.policy.health import holdings, observed
from webhook.policy.health.holdings import PodView
from webhook.runtime import probes
from webhook.runtime.metrics import Registry


def _pod(raw: dict[str, Any]) -> tuple[Hashable, PodView] | None:
    pod = holdings.pod_view(raw)
    return (pod.key, pod) if pod is not None else None


def _slice(raw: dict[str, Any]) -> tuple[Hashable, observed.SliceFacts] | None:
    piece = observed.slice_facts(raw)
    return (piece.name, piece) if piece is not None else None


def run(options: Options) -> int:
    stop = threading.Event()
    api = api_client(options.kubeconfig)
    registry = Registry()
    events = EventRecorder(api_sender(api), stop=stop, instance=options.node)
    pods: Informer[PodView] = Informer("pods", remediation.pods_on_node(api, options.node), _pod, stop=stop)
    # A cluster that serves no resource.k8s.io/v1 leaves them unserved: no DRA device is held there.
    slices: Informer[observed.SliceFacts] = Informer(
        "resourceslices", remediation.slices_on_node(api, options.node), _slice, stop=stop
    )
    client = PodResourcesClient(options.socket)
    agent = NodeAgent(
        options,
        resources=client,
        pods=pods,
        slices=slices,
        writer=remediation.PodStatusWriter(api),
        events=events,
        registry=registry,
        stop=stop,
    )
    checks = probes.Probes(
        detail=lambda: f"node={options.node}",
        metrics=registry.render,
        status=lambda: {
            "node": options.node,
            "socket": str(options.socket),
            "lastPollOk": agent.observation.ok,
            # Which pod holds which DRA device here: a failed device's pods on this node.
            "draDevices": {
                device: {
                    "pods": list(holders.pods),
                    "claims": list(holders.claims),
                    **({"failed": why} if (why := agent.observation.dra_failed.get(device)) else {}),
                }
                for device, holders in agent.observation.dra.items()
            },
        },
    )
    checks.add_readiness_check("pods", pods.has_synced)
    checks.add_readiness_check("podresources", lambda: agent.observation.ok)
    server = probes.ProbeServer(checks, options.host, options.port, stop)
    server.start()
    events.start()
    pods.start()
    slices.start()
    polling = threading.Thread(target=agent.run, name="poll", daemon=True)
    polling.start()
    stop.wait()
    polling.join(timeout=options.interval + 5)
    client.close()
    server.shutdown()
    return 0
