"""`gpuguard audit`: what is already running without gpuguard's protections, judged by the same engine
as admission with the live policy, printed for people or programs and, with `--report`, written as
PolicyReports. Only the report goes to stdout; progress and notes go to stderr.

gpuguard audit [--kubeconfig FILE] [-n NAMESPACE | -A] [-o table|json|yaml] [--rule RULE ...]
               [--fail-on deny|change] [--report] [--policy FILE | --policy-configmap NS/NAME]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import orjson
import yaml

from webhook.audit import findings, output
from webhook.policy.model import RULE_IDS, Policy, PolicyError, default_policy, parse_policy

if TYPE_CHECKING:
    from webhook.kube.client import ApiClient

EXIT_FINDINGS = 1  # --fail-on found what it names
EXIT_USAGE = 2  # bad arguments, an invalid policy, no usable kubeconfig
EXIT_CLUSTER = 3  # the API server cannot be reached, or refuses a read (or a report write) the audit needs
EXIT_NO_REPORT_API = 4  # --report, and no PolicyReport CRD is installed
DEFAULT_POLICY_CONFIGMAP = "gpuguard/gpuguard-policy"
POLICY_KEY = "policy.yaml"
FAIL_ON: dict[str, frozenset[findings.Verdict]] = {
    "deny": frozenset({"deny"}),
    "change": frozenset({"deny", "change"}),  # a denial is a change the API server will not even make
}


class Progress:
    """One line on stderr, rewritten in place, once reading takes more than a moment; only on a terminal."""

    def __init__(self, stream: TextIO, *, after: float = 0.5) -> None:
        self.stream = stream
        self.enabled = stream.isatty()
        self.after = after
        self.started = time.monotonic()
        self.shown = False

    def update(self, resource: str, count: int) -> None:
        if not self.enabled or time.monotonic() - self.started < self.after:
            return
        self.stream.write(f"\r\033[Kgpuguard audit: reading {resource}: {count}")
        self.stream.flush()
        self.shown = True

    def done(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *_: object) -> None:
        self.done()


def _note(message: str) -> None:
    print(f"gpuguard audit: {message}", file=sys.stderr)


def _policy(args: argparse.Namespace, api: ApiClient) -> Policy:
    """The policy file given, else the policy in the ConfigMap the webhook watches (default if absent)."""
    from webhook.kube.policy_source import read_policy_text

    if args.policy:
        return parse_policy(Path(args.policy).read_text(encoding="utf-8"))
    namespace, _, name = args.policy_configmap.partition("/")
    text = read_policy_text(api, namespace, name, key=POLICY_KEY)
    if text is None:
        _note(f"no {POLICY_KEY} in ConfigMap {namespace}/{name}: auditing with the embedded default policy")
        return default_policy()
    try:
        return parse_policy(text)
    except PolicyError as exc:
        raise PolicyError(f"ConfigMap {namespace}/{name}: {exc}") from exc


def _render(audit: findings.Audit, form: str) -> str:
    if form == "json":
        return orjson.dumps(output.document(audit), option=orjson.OPT_INDENT_2).decode() + "\n"
    if form == "yaml":
        return yaml.safe_dump(output.document(audit), sort_keys=False)
    return output.table(audit)


def cmd_audit(args: argparse.Namespace) -> int:
    # The Kubernetes client only for this command: the offline commands never load it.
    from webhook.audit import scan
    from webhook.kube import client as kube
    from webhook.kube import listing
    from webhook.kube import reports as kube_reports

    namespace, _, name = args.policy_configmap.partition("/")
    if not namespace or not name:
        _note(f"--policy-configmap: expected NAMESPACE/NAME, got {args.policy_configmap!r}")
        return EXIT_USAGE
    try:
        api = kube.api_client(args.kubeconfig)
    except kube.ConfigError as exc:
        _note(str(exc))
        return EXIT_USAGE
    report_api = None
    written = None
    try:
        with Progress(sys.stderr) as progress:
            policy = _policy(args, api)
            if args.report:
                report_api = kube_reports.served_report_api(api)
                if report_api is None:
                    _note(kube_reports.MISSING_REPORT_API)
                    return EXIT_NO_REPORT_API
            audit = scan.scan(
                listing.ClusterReader(api, on_page=progress.update), policy, namespace=args.namespace
            )
            if report_api is not None:
                writer = kube_reports.ReportWriter(api, report_api)
                written = scan.write_reports(writer, audit, now=int(time.time()), namespace=args.namespace)
    except kube.NETWORK_ERRORS as exc:
        _note(f"the API server at {api.configuration.host} did not answer: {exc}")
        return EXIT_CLUSTER
    except kube.AccessError as exc:
        _note(f"{exc}; see deploy/audit/ for the rights the audit needs")
        return EXIT_CLUSTER
    except kube.ApiError as exc:
        what = f"writing {report_api.describe()} reports" if report_api else "reading the cluster"
        _note(f"{what}: {exc.status} {exc.reason}")
        return EXIT_CLUSTER
    except RuntimeError as exc:  # a list that expired while read, a report that kept changing
        _note(str(exc))
        return EXIT_CLUSTER
    shown = audit.only(args.rule) if args.rule else audit
    sys.stdout.write(_render(shown, args.output))
    if report_api is not None and written is not None:
        counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(written.items()))
        _note(f"{report_api.describe()} reports: {counts or 'none to write'}")
    if args.fail_on and any(f.worst() in FAIL_ON[args.fail_on] for f in shown.findings):
        return EXIT_FINDINGS
    return 0


def add_parser(commands: Any) -> None:
    """Adds `audit` to the `gpuguard` subcommands (`commands`: argparse's subparsers action)."""
    audit = commands.add_parser(
        "audit",
        help="judge what already runs in a cluster; optionally write PolicyReports",
        description="Reads Pods, Jobs, CronJobs, Deployments, StatefulSets, ReplicaSets and DaemonSets and"
        " runs each through the engine as admission would, with the live policy and cluster facts; pods"
        " are reported through the workload that owns them. Also checks accelerator nodes for a taint"
        " and for low-priority pods running on them.",
        epilog=f"exit codes: 0 done; {EXIT_FINDINGS} --fail-on matched; {EXIT_USAGE} bad arguments, policy"
        f" or kubeconfig; {EXIT_CLUSTER} the API server unreachable or refusing a read or report write;"
        f" {EXIT_NO_REPORT_API} --report without a PolicyReport CRD installed",
    )
    audit.add_argument("--kubeconfig", help="cluster credentials; in a pod the service account is used")
    scope = audit.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", help="audit this namespace only (no node checks)")
    scope.add_argument(
        "-A", "--all-namespaces", action="store_true", help="audit every namespace and node (the default)"
    )
    audit.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table")
    audit.add_argument(
        "--rule",
        action="append",
        choices=RULE_IDS,
        metavar="RULE",
        help=f"print (and --fail-on) only these rules, repeatable: {', '.join(RULE_IDS)};"
        " reports always hold every rule",
    )
    audit.add_argument(
        "--fail-on",
        choices=tuple(FAIL_ON),
        help=f"exit {EXIT_FINDINGS} when a workload would be denied (deny), or changed or denied (change)",
    )
    audit.add_argument(
        "--report",
        action="store_true",
        help="write PolicyReports: one per namespace and a cluster-scoped one for nodes"
        " (openreports.io/v1alpha1 when installed, else wgpolicyk8s.io/v1alpha2)",
    )
    policy = audit.add_mutually_exclusive_group()
    policy.add_argument("--policy", metavar="FILE", help="judge with this policy file instead")
    policy.add_argument(
        "--policy-configmap",
        metavar="NAMESPACE/NAME",
        default=DEFAULT_POLICY_CONFIGMAP,
        help=f"the ConfigMap the webhook reads its policy from (default: {DEFAULT_POLICY_CONFIGMAP})",
    )
    audit.set_defaults(run=cmd_audit)
