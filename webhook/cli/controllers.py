"""`gpuguard controllers`: the node health controller and the pod device-health watcher.

The Kubernetes client and uvicorn are imported when the controllers start, never when the module
loads (every `gpuguard` run loads every command module).
"""

from __future__ import annotations

import argparse
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from webhook.cli import inputs, output
from webhook.policy.model import Policy, PolicyError, parse_policy
from webhook.runtime import logs

if TYPE_CHECKING:
    from webhook.kube.client import ApiClient

DEFAULT_HOST = "0.0.0.0"
DEFAULT_PORT = 8081


def run_controllers(args: argparse.Namespace) -> int:
    from webhook.processes import controllers  # the Kubernetes client and uvicorn only to run them

    logs.configure()
    if args.policy:
        # Refused before anything starts, naming the file; the controllers read it as policy YAML.
        try:
            parse_policy(inputs.read_text(args.policy))
        except PolicyError as exc:
            raise output.UsageError(f"{args.policy}: {exc}") from None
    options = controllers.Options(
        namespace=args.namespace,
        host=args.host,
        port=args.port,
        kubeconfig=args.kubeconfig,
        policy_file=Path(args.policy) if args.policy else None,
        policy_configmap=args.policy_configmap,
        identity=args.identity or "",
        webhook_config=args.webhook_config,
        # Unset: the Lease's defaults (15 s, 10 s, 2 s), as controller-runtime's.
        **{
            name: value
            for name, value in (
                ("lease_seconds", args.lease_duration),
                ("renew_deadline", args.renew_deadline),
                ("retry_seconds", args.retry_period),
            )
            if value is not None
        },
    )
    from webhook.audit.background import ReportLoop  # the audit's report loop, on the leader

    def reports(api: ApiClient, policy: Callable[[], Policy], stop: threading.Event) -> ReportLoop:
        # The audit's PolicyReports kept current (docs/audit.md), every audit.reportIntervalSeconds.
        return ReportLoop.for_cluster(api, policy, stop=stop)

    return controllers.run(options, [reports])


def register(commands: output.Commands) -> None:
    parser = output.add_parser(
        commands, "controllers", help="run the node health controller and the pod device-health watcher"
    )
    parser.add_argument("--host", default=DEFAULT_HOST, help="address the probes listen on")
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="plain HTTP: /healthz, /readyz, /metrics, /policy"
    )
    parser.add_argument(
        "--policy",
        metavar="FILE",
        help="the policy YAML, re-read when it changes (default: the embedded default policy)",
    )
    parser.add_argument(
        "--policy-configmap",
        metavar="NAMESPACE/NAME",
        help="watch this ConfigMap's policy.yaml key and apply changes live",
    )
    parser.add_argument("--kubeconfig", help="cluster credentials (default: in a pod, the service account)")
    parser.add_argument(
        "--namespace",
        default=os.environ.get("POD_NAMESPACE", "gpuguard"),
        help="where the Lease and the circuit breaker's ConfigMap live ($POD_NAMESPACE when set)",
    )
    parser.add_argument("--identity", help="this replica's name in the Lease (default: hostname_random)")
    parser.add_argument(
        "--webhook-config",
        metavar="NAME",
        default="gpuguard",
        help="in admission.mode hybrid or native, narrow the webhooks of this Mutating- and"
        " ValidatingWebhookConfiguration to what the native policies cannot decide (default: gpuguard)",
    )
    for flag, meaning in (
        ("--lease-duration", "how long a standby waits on a silent leader (default: 15)"),
        ("--renew-deadline", "how long the leader may fail to renew before it stops (default: 10)"),
        ("--retry-period", "how often the Lease is renewed or tried (default: 2)"),
    ):
        parser.add_argument(flag, type=float, metavar="SECONDS", help=meaning)
    parser.set_defaults(run=run_controllers)
