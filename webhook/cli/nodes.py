"""`gpuguard nodes`: the cluster's nodes as gpuguard sees them.

`nodes` (no subcommand) is the accelerator nodes' device health as the controllers decide it, `nodes
explain NODE` one node's signals, record, budget and next steps, `nodes reset-breaker` closes a latched
circuit breaker and `nodes ack NODE` acknowledges a node (an operator's decisions); they list the cluster. `nodes drivers` reads a node list
(`kubectl get nodes -o yaml`) or lists the nodes of a cluster. The Kubernetes client is imported only
to talk to a cluster.

The options of the device-health commands are the group's: given before or after the subcommand
(`nodes --kubeconfig K explain N`, `nodes explain N --kubeconfig K`), and a subcommand never resets
one given before it (its own copies default to "not given").
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from webhook.cli import inputs, output
from webhook.policy import drivers
from webhook.policy.facts import nodes_of
from webhook.policy.health import fences, ladder, observed, records
from webhook.policy.model import Policy, PolicyError

if TYPE_CHECKING:
    from webhook.controllers.breaker import BreakerState
    from webhook.controllers.status import Row
    from webhook.kube.client import ApiClient

NONE = "<none>"
DEFAULT_NAMESPACE = "gpuguard"
POLICY_CONFIGMAP = "gpuguard-policy"


def run_drivers(args: argparse.Namespace) -> int:
    if args.file:
        nodes = nodes_of(manifest.obj for manifest in inputs.read_manifests([args.file]))
    else:
        from webhook.kube.client import api_client  # the Kubernetes client only against a cluster
        from webhook.kube.fact_sources import list_nodes

        nodes = list_nodes(api_client(args.kubeconfig))
    labels = inputs.load_policy(args.policy).rules.driverCompatibility.nodeLabels
    pools = drivers.summarise(nodes, labels)
    sys.stdout.write(drivers_table(pools))
    return output.EXIT_FAILED if any(pool.mixed for pool in pools) else output.EXIT_OK


def drivers_table(pools: list[drivers.PoolDrivers]) -> str:
    """One line per pool and GPU product, MIXED where its nodes disagree, then the summary line."""
    if not pools:
        return "no node carries a GPU product or driver label\n"
    rows = [
        (
            pool.pool,
            pool.product,
            pool.nodes,
            drivers.versions_text(pool.drivers),
            drivers.versions_text(pool.cuda),
            "MIXED" if pool.mixed else "",
        )
        for pool in pools
    ]
    mixed = sum(pool.mixed for pool in pools)
    outcomes = [("mixed", mixed), ("on one driver and CUDA version", len(pools) - mixed)]
    return (
        output.table(("pool", "product", "nodes", "driver", "cuda", ""), rows)
        + output.summary(len(pools), "GPU pool", outcomes)
        + "\n"
    )


def run_health(args: argparse.Namespace) -> int:
    """`nodes`, `nodes explain NODE`, `nodes reset-breaker`, `nodes ack NODE`: the cluster as the controllers
    see it, and the operator's decisions."""
    from webhook.controllers import status  # the Kubernetes client only against a cluster
    from webhook.kube.client import ApiError, api_client

    now = datetime.datetime.now(datetime.UTC)
    try:
        api = api_client(args.kubeconfig)
        if args.nodes_command == "reset-breaker":
            closed = status.reset_breaker(api, args.namespace, now)
            print("circuit breaker closed" if closed else "circuit breaker is not open: nothing to do")
            return output.EXIT_OK
        if args.nodes_command == "ack":
            return _acknowledge(api, args.node, now)
        policy, source = _policy(args, lambda configmap: status.read_policy(api, configmap))
        cluster = status.read_cluster(api, args.namespace)
    except ApiError as exc:
        raise output.UsageError(f"the cluster answered {exc.status} {exc.reason}") from None
    rows = status.plans(cluster, policy, now)
    if args.nodes_command == "explain":
        row = next((r for r in rows if r.node.name == args.node), None)
        if row is None:
            output.error(f"node {args.node} is not an accelerator node the policy selects")
            return output.EXIT_FAILED
        sys.stdout.write(explain(row, policy, cluster.breaker, now))
        return output.EXIT_OK
    sys.stdout.write(health_table(rows, cluster.breaker, now))
    print(f"policy {policy.hash} from {source}", file=sys.stderr)
    return output.EXIT_OK


def _acknowledge(api: ApiClient, node: str, now: datetime.datetime) -> int:
    from webhook.controllers import status
    from webhook.kube.remediation import NodeWriter, NotFoundError

    try:
        moment = status.acknowledge(NodeWriter(api), node, now)
    except NotFoundError:
        output.error(f"node {node} not found")
        return output.EXIT_FAILED
    print(
        f"node {node} acknowledged at {moment}: gpuguard forgets its repeated failures and expected device"
        " counts from before now"
    )
    return output.EXIT_OK


def _policy(
    args: argparse.Namespace, from_configmap: Callable[[str], tuple[Policy, str]]
) -> tuple[Policy, str]:
    if args.policy is not None:
        return inputs.load_policy(args.policy), inputs.display_name(args.policy)
    configmap = args.policy_configmap or f"{args.namespace}/{POLICY_CONFIGMAP}"
    try:
        return from_configmap(configmap)
    except PolicyError as exc:
        raise output.UsageError(f"ConfigMap {configmap}: {exc}") from None


def _age(moment: datetime.datetime | None, now: datetime.datetime) -> str:
    """kubectl's way: 45s, 12m, 3h, 2d."""
    if moment is None:
        return NONE
    seconds = max(int((now - moment).total_seconds()), 0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _devices(plan: ladder.NodePlan) -> str:
    devices = plan.assessment.devices
    return ",".join(f"{name}={free}/{total}" for name, (free, total) in devices.items()) or NONE


def _signals(plan: ladder.NodePlan, now: datetime.datetime) -> str:
    kinds = [f"{s.kind}{'' if s.due(now) else '?'}" for s in plan.assessment.signals]
    kinds += [f"({s.kind} suppressed)" for s in plan.assessment.suppressed]
    return ",".join(dict.fromkeys(kinds)) or NONE


def _state(plan: ladder.NodePlan) -> str:
    state = plan.assessment.state
    if plan.hands_off:
        for word, why in (("labelled", "excluded"), ("paused", "paused")):
            if word in plan.hands_off:
                return f"{state},{why}"
        return f"{state},others"
    if plan.escalated:
        return f"{state},escalated"
    return f"{state},held" if plan.held and state == "unhealthy" else state


def _since(row: Row) -> datetime.datetime | None:
    record = row.node.record
    if record is not None and record.unhealthy_since is not None:
        return record.unhealthy_since
    return min((s.since for s in row.plan.assessment.signals), default=None)


def health_table(found: Sequence[Row], breaker: BreakerState, now: datetime.datetime) -> str:
    rows = []
    for row in found:
        plan, record = row.plan, row.node.record
        last = (
            f"{record.last_action} {_age(record.last_action_at, now)} ago"
            if record and record.last_action
            else NONE
        )
        rows.append(
            (
                plan.assessment.node,
                plan.assessment.pool or NONE,
                _devices(plan),
                _signals(plan, now),
                _state(plan),
                last,
                _age(_since(row), now),
            )
        )
    headers = ("node", "pool", "devices", "signals", "state", "last action", "since")
    return output.table(headers, rows) + "\n" + breaker_line(breaker, now) + "\n"


def breaker_line(breaker: BreakerState, now: datetime.datetime) -> str:
    if breaker.open:
        return f"circuit breaker: OPEN for {_age(breaker.opened_at, now)}: {breaker.reason} (gpuguard nodes reset-breaker)"
    closed = (
        f", closed {_age(breaker.closed_at, now)} ago by {breaker.closed_by}" if breaker.closed_at else ""
    )
    return f"circuit breaker: closed{closed}"


EFFECTS = {"do": "next", "would": "would (not enforced)", "hold": "held"}


def _dra_devices(node: observed.NodeFacts, plan: ladder.NodePlan) -> list[str]:
    """The DRA devices with something to say: a taint (of any effect), a claim's condition on them,
    gpuguard's DeviceTaintRule (as it is, and as the plan wants it)."""
    lines = []
    for device in node.dra.devices:
        said = [
            f"taint {t.key}{'=' + t.value if t.value else ''}:{t.effect} (ResourceSlice {device.slice})"
            for t in device.taints
        ]
        said += [
            f"claim condition {c.type}={c.status}{' ' + c.reason if c.reason else ''}{': ' + c.message if c.message else ''}"
            for c in device.conditions
        ]
        rule, wanted = node.dra.fenced.get(device.id), plan.fences.get(device.id)
        if rule is not None or wanted is not None:
            now_effect = f"{rule}" if rule is not None else "none"
            want_effect = wanted.effect if wanted is not None else "deleted"
            said.append(f"DeviceTaintRule {fences.rule_name(device.id)}: {now_effect}, wanted {want_effect}")
        if said:
            lines.append(f"  {device.id}: {'; '.join(said)}")
    return ["DRA devices:", *lines] if lines else []


def explain(row: Row, policy: Policy, breaker: BreakerState, now: datetime.datetime) -> str:
    plan = row.plan
    a = plan.assessment
    lines = [
        f"Node:        {a.node}",
        f"Pool:        {a.pool or NONE}",
        f"Accelerator: {'yes' if a.in_scope else 'no (not selected by the policy, or no accelerator resource or label)'}",
        f"Devices:     {_devices(plan)} (allocatable/capacity; a DRA driver's: not tainted/published)",
        f"State:       {_state(plan)}",
        "Signals:",
    ]
    for s in a.signals:
        due = "due" if s.due(now) else f"due in {_age(now, s.due_at)}"
        confirmed = f", confirmed: {s.confirmed_by}" if s.confirmed_by else ""
        lines.append(
            f"  {s.key}: {s.message} (first seen {_age(s.since, now)} ago, waits {s.for_seconds:g} s: {due}{confirmed})"
        )
    lines += [f"  {NONE}"] if not a.signals else []
    lines += _dra_devices(row.node, plan)
    if a.suppressed:
        lines.append("Not counted:")
        lines += [f"  {s.kind}: {s.message}" for s in a.suppressed]
    if a.correlated_failures:
        lines.append(f"Correlated:  {a.correlated_failures} device-failure exits or crash loops on the node")
    record = row.node.record
    if row.node.record_error:
        lines.append(f"Record:      {row.node.record_error}")
    if record is not None:
        lines.append(f"Record ({records.RECORD_ANNOTATION}):")
        for label, moment in (
            ("unhealthy since", record.unhealthy_since),
            ("in the budget since", record.admitted_at),
            ("draining since", record.draining_since),
            ("clear since", record.clear_since),
            ("cancelled by an operator", record.cancelled_at),
        ):
            if moment is not None:
                lines.append(f"  {label}: {records.format_time(moment)} ({_age(moment, now)} ago)")
        lines.append(f"  cordoned by gpuguard: {'yes' if record.cordoned else 'no'}")
        if record.last_action:
            lines.append(f"  last action: {record.last_action} {_age(record.last_action_at, now)} ago")
        if record.expected:
            expected = ",".join(f"{name}={count}" for name, count in sorted(record.expected.items()))
            lines.append(f"  expected devices: {expected}")
        if record.remediations:
            past = ", ".join(f"{_age(moment, now)} ago" for moment in record.remediations)
            lines.append(f"  remediated before: {past}")
        if record.acknowledged_at is not None:
            lines.append(f"  acknowledged: {_age(record.acknowledged_at, now)} ago")
    if plan.record_lost:
        lines.append(f"Record lost: {plan.record_lost}")
    modes = ", ".join(
        f"{action} {policy.health_mode(action)}" for action in ("condition", "taint", "drain", "evict")
    )
    lines.append(f"Modes:       {modes}")
    lines.append("Steps now:")
    lines += [f"  {step.action}: {EFFECTS[step.effect]}: {step.note}" for step in plan.steps] or [f"  {NONE}"]
    if plan.hands_off or plan.held:
        lines.append(f"Held:        {plan.hands_off or plan.held}")
    if plan.escalated:
        lines.append(f"Escalated:   {plan.escalated}")
    lines.append(breaker_line(breaker, now).capitalize())
    return "\n".join(lines) + "\n"


def _health_options(parser: argparse.ArgumentParser, *, inherited: bool) -> None:
    """The device-health commands' options; `inherited` on a subcommand, whose copies must not reset
    what was given before it (argparse copies a subcommand's defaults over the group's values)."""

    def default(value: str | None) -> str | None:
        return argparse.SUPPRESS if inherited else value

    parser.add_argument(
        "--kubeconfig",
        default=default(None),
        help="the cluster's credentials (default: in a pod, the service account)",
    )
    parser.add_argument(
        "--namespace",
        default=default(DEFAULT_NAMESPACE),
        help="the controllers' namespace, where the circuit breaker's ConfigMap is",
    )
    parser.add_argument(
        "--policy-configmap",
        metavar="NAMESPACE/NAME",
        default=default(None),
        help=f"the policy the controllers run (default: NAMESPACE/{POLICY_CONFIGMAP}, else the embedded one)",
    )
    inputs.add_policy_argument(parser, default=default(None))


def register(commands: output.Commands) -> None:
    group = output.add_parser(
        commands,
        "nodes",
        help="look at the cluster's nodes: without a subcommand, the accelerator nodes' device health",
    )
    _health_options(group, inherited=False)
    group.set_defaults(run=run_health)
    nodes = group.add_subparsers(dest="nodes_command", metavar="COMMAND")
    explain_node = output.add_parser(
        nodes, "explain", help="one node's signals, record, budget and next steps, as the controllers decide"
    )
    explain_node.add_argument("node", metavar="NODE", help="the Node's name")
    _health_options(explain_node, inherited=True)
    reset = output.add_parser(
        nodes, "reset-breaker", help="close a latched circuit breaker (an operator's decision)"
    )
    _health_options(reset, inherited=True)
    ack = output.add_parser(
        nodes,
        "ack",
        help="acknowledge a node: gpuguard forgets its repeated failures and expected device counts so far",
    )
    ack.add_argument("node", metavar="NODE", help="the Node's name")
    _health_options(ack, inherited=True)
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
        "--kubeconfig",
        default=argparse.SUPPRESS,
        help="without -f: the cluster's credentials (default: in a pod, the service account)",
    )
    inputs.add_policy_argument(node_drivers, default=argparse.SUPPRESS)
    node_drivers.set_defaults(run=run_drivers)
