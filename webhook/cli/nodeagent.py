"""`gpuguard node-agent`: reports pods holding devices their node no longer allocates, or DRA devices
its ResourceSlices fail (a DaemonSet).

The Kubernetes client, gRPC and uvicorn are imported when the agent starts, never when the module
loads (every `gpuguard` run loads every command module).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from webhook.cli import inputs, output
from webhook.runtime import logs

DEFAULT_HOST = "0.0.0.0"
DEFAULT_PORT = 8082
DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0")
    return value


def run_node_agent(args: argparse.Namespace) -> int:
    # The Kubernetes client, gRPC and uvicorn only to run it.
    from webhook.agent.nodeagent import Options
    from webhook.processes import node_agent

    if not args.node:
        raise output.UsageError("--node is required (in the DaemonSet: $NODE_NAME from spec.nodeName)")
    logs.configure()
    return node_agent.run(
        Options(
            node=args.node,
            socket=Path(args.socket),
            interval=args.interval,
            confirm_seconds=args.confirm_seconds,
            host=args.host,
            port=args.port,
            kubeconfig=args.kubeconfig,
        )
    )


def register(commands: output.Commands) -> None:
    parser = output.add_parser(
        commands,
        "node-agent",
        help="report pods holding devices their node no longer allocates, or failed DRA devices (the kubelet's"
        " PodResources API, the node's ResourceSlices)",
    )
    parser.add_argument(
        "--node", default=os.environ.get("NODE_NAME", ""), help="this node's name ($NODE_NAME when set)"
    )
    parser.add_argument("--socket", default=DEFAULT_SOCKET, help="the kubelet's PodResources socket")
    parser.add_argument(
        "--interval", type=_positive, default=10.0, metavar="SECONDS", help="how often the kubelet is asked"
    )
    parser.add_argument(
        "--confirm-seconds",
        type=inputs.seconds,
        default=30.0,
        metavar="SECONDS",
        help="how long a device must stay held but not allocatable before it is reported",
    )
    parser.add_argument("--host", default=DEFAULT_HOST, help="address the probes listen on")
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="plain HTTP: /healthz, /readyz, /metrics"
    )
    parser.add_argument("--kubeconfig", help="cluster credentials (default: in a pod, the service account)")
    parser.set_defaults(run=run_node_agent)
