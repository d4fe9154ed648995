"""`gpuguard audit`: what already runs without gpuguard's protections, judged by the same engine as
admission with the live policy and cluster facts, printed for people (a table grouped by namespace) or
programs (`-o json|yaml`) and, with `--report`, written as PolicyReports. Only the report goes to
stdout; notes, and on a terminal a progress line, go to stderr.

The Kubernetes client is imported inside `run_audit` only: every other command stays without it.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from webhook.audit import findings
from webhook.audit import output as audit_output
from webhook.cli import inputs, output
from webhook.policy.model import CONFIGMAP_KEY, RULE_IDS, Policy, PolicyError, default_policy, parse_policy

if TYPE_CHECKING:
    from webhook.kube.client import ApiClient

# --report, and neither PolicyReport API is served: install a CRD (the message says which) and run again.
EXIT_NO_REPORT_API = 3
DEFAULT_POLICY_CONFIGMAP = "gpuguard/gpuguard-policy"
FAIL_ON: dict[str, frozenset[findings.Verdict]] = {
    "deny": frozenset({"deny"}),
    "change": frozenset({"deny", "change"}),  # a denial is a change the API server will not even make
}
# Reading a small cluster takes well under this: no progress line flickers on for it.
PROGRESS_AFTER_SECONDS = 0.5


def _note(message: str) -> None:
    print(f"gpuguard audit: {message}", file=sys.stderr)


def _configmap(value: str) -> tuple[str, str]:
    namespace, _, name = value.partition("/")
    if not namespace or not name or "/" in name:
        raise output.UsageError(f"--policy-configmap: expected NAMESPACE/NAME, got {value!r}")
    return namespace, name


def _live_policy(api: ApiClient, namespace: str, name: str) -> Policy:
    """The policy in the ConfigMap the webhook watches; the embedded default when there is none."""
    from webhook.kube.policy_source import read_policy_text

    text = read_policy_text(api, namespace, name, key=CONFIGMAP_KEY)
    if text is None:
        _note(
            f"no {CONFIGMAP_KEY} in ConfigMap {namespace}/{name}: auditing with the embedded default policy"
        )
        return default_policy()
    try:
        return parse_policy(text)
    except PolicyError as exc:
        # The webhook keeps its last good policy, which cannot be read from here: judge with none.
        raise output.UsageError(f"ConfigMap {namespace}/{name}, key {CONFIGMAP_KEY}: {exc}") from None


def render(audit: findings.Audit, form: str) -> str:
    if form in output.FORMATS:
        return output.dump(audit_output.document(audit), "json" if form == "json" else "yaml")
    read = audit_output.read(audit)
    if not audit.findings:
        return f"no accelerator workloads found ({read})\n"
    summary = output.summary(len(audit.findings), "finding", audit_output.counts(audit.findings))
    return output.table(audit_output.HEADERS, audit_output.rows(audit)) + f"\n{summary}; {read}\n"


def run_audit(args: argparse.Namespace) -> int:
    # The Kubernetes client only for this command: the offline commands never load it.
    from webhook.audit import scan
    from webhook.kube import client as kube
    from webhook.kube import listing
    from webhook.kube import reports as kube_reports

    configmap = _configmap(args.policy_configmap)
    try:
        api = kube.api_client(args.kubeconfig)
    except kube.ConfigError as exc:
        raise output.UsageError(str(exc)) from None
    report_api = None
    written = None
    try:
        with output.Progress(0, "gpuguard audit: reading", after=PROGRESS_AFTER_SECONDS) as progress:
            policy = inputs.load_policy(args.policy) if args.policy else _live_policy(api, *configmap)
            if args.report:
                report_api = kube_reports.served_report_api(api)
                if report_api is None:
                    _note(kube_reports.MISSING_REPORT_API)
                    return EXIT_NO_REPORT_API
            reader = listing.ClusterReader(
                api, on_page=lambda resource, count: progress.show(f"{resource}: {count}")
            )
            audit = scan.scan(reader, policy, namespace=args.namespace)
            if report_api is not None:
                writer = kube_reports.ReportWriter(api, report_api)
                written = scan.write_reports(writer, audit, now=int(time.time()), namespace=args.namespace)
    except kube.NETWORK_ERRORS as exc:
        raise output.UsageError(f"the API server at {api.configuration.host} did not answer: {exc}") from None
    except kube.AccessError as exc:
        raise output.UsageError(f"{exc}; deploy/audit/ grants the rights the audit needs") from None
    except kube.ApiError as exc:
        what = f"writing {report_api.describe()} reports" if report_api else "reading the cluster"
        raise output.UsageError(f"{what}: {exc.status} {exc.reason}") from None
    except RuntimeError as exc:  # a list that expired while read, a report that kept changing
        raise output.UsageError(str(exc)) from None
    shown = audit.only(args.rule) if args.rule else audit
    sys.stdout.write(render(shown, args.output))
    if report_api is not None and written is not None:
        counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(written.items()))
        _note(f"{report_api.describe()} reports: {counts or 'none to write'}")
    if args.fail_on and any(f.worst() in FAIL_ON[args.fail_on] for f in shown.findings):
        return output.EXIT_FAILED
    return output.EXIT_OK


def register(commands: output.Commands) -> None:
    parser = output.add_parser(
        commands,
        "audit",
        help="judge what already runs in a cluster, as admission would; optionally write PolicyReports",
        description="Lists Pods, Jobs, CronJobs, Deployments, StatefulSets, ReplicaSets and DaemonSets (and"
        " JobSets, LeaderWorkerSets, Kubeflow, Ray and Volcano jobs where their CRDs are installed) and"
        " runs each through the engine as admission would (mutate, then validate the result), with the"
        " live policy and cluster facts; pods are reported through the workload that owns them. A"
        " cluster-wide audit also checks accelerator nodes for a taint and for low-priority pods on them.",
        epilog=f"exit codes: {output.EXIT_OK} done; {output.EXIT_FAILED} --fail-on matched; {output.EXIT_USAGE}"
        " the audit could not run (bad arguments, an invalid policy, no usable kubeconfig, the API server"
        " unreachable or refusing a read or a report write: the message names which);"
        f" {EXIT_NO_REPORT_API} --report, and no PolicyReport CRD is installed",
    )
    parser.add_argument(
        "--kubeconfig",
        help="the cluster's credentials (default: in a pod, the service account; else $KUBECONFIG)",
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", help="audit this namespace only (no node checks)")
    scope.add_argument(
        "-A",
        "--all-namespaces",
        action="store_true",
        help="audit every namespace and node (what happens without -n)",
    )
    parser.add_argument(
        "-o", "--output", choices=("table", *output.FORMATS), default="table", help="output format"
    )
    parser.add_argument(
        "--rule",
        action="append",
        choices=RULE_IDS,
        metavar="RULE",
        help=f"print (and --fail-on) only these rules, repeatable: {', '.join(RULE_IDS)};"
        " reports always hold every rule",
    )
    parser.add_argument(
        "--fail-on",
        choices=tuple(FAIL_ON),
        help=f"exit {output.EXIT_FAILED} when a workload would be denied (deny), or changed or denied (change)",
    )
    parser.add_argument(
        "--report",
        action="store_true",
        help="write PolicyReports: one per namespace and a cluster-scoped one for nodes"
        " (openreports.io/v1alpha1 when served, else wgpolicyk8s.io/v1alpha2)",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--policy",
        metavar="FILE",
        help="judge with this policy instead: its YAML, or the ConfigMap holding it under data.policy.yaml",
    )
    source.add_argument(
        "--policy-configmap",
        metavar="NAMESPACE/NAME",
        default=DEFAULT_POLICY_CONFIGMAP,
        help="the ConfigMap the webhook reads its policy from (key policy.yaml)",
    )
    parser.set_defaults(run=run_audit)
