"""`gpuguard nodes`: the cluster's nodes as gpuguard sees them.

`nodes drivers` reads a node list (`kubectl get nodes -o yaml`) or lists the nodes of a cluster; the
Kubernetes client is imported only for the latter.
"""

from __future__ import annotations

import argparse
import sys

from webhook.cli import inputs, output
from webhook.policy import drivers
from webhook.policy.facts import nodes_of


def run_drivers(args: argparse.Namespace) -> int:
    if args.file:
        nodes = nodes_of(manifest.obj for manifest in inputs.read_manifests([args.file]))
    else:
        from webhook.kube.client import api_client  # the Kubernetes client only against a cluster
        from webhook.kube.facts import list_nodes

        nodes = list_nodes(api_client(args.kubeconfig))
    labels = inputs.load_policy(args.policy).rules.driverCompatibility.nodeLabels
    pools = drivers.summarise(nodes, labels)
    sys.stdout.write(drivers.table(pools))
    return output.EXIT_FAILED if any(pool.mixed for pool in pools) else output.EXIT_OK


def register(commands: output.Commands) -> None:
    group = output.add_parser(commands, "nodes", help="look at the cluster's nodes")
    nodes = group.add_subparsers(dest="nodes_command", required=True, metavar="COMMAND")
    node_drivers = output.add_parser(
        nodes,
        "drivers",
        help="driver and CUDA versions by node pool and GPU product; exit 1 if a pool mixes them",
    )
    node_drivers.add_argument(
        "-f",
        "--filename",
        "--file",
        dest="file",
        metavar="FILE",
        help="a node list (kubectl get nodes -o yaml); - for stdin (default: list the cluster's nodes)",
    )
    node_drivers.add_argument(
        "--kubeconfig", help="without -f: the cluster's credentials (default: in a pod, the service account)"
    )
    inputs.add_policy_argument(node_drivers)
    node_drivers.set_defaults(run=run_drivers)
