"""`gpuguard`: the server, and the same engine offline on plain manifests.

gpuguard serve [--port 8443] [--cert-dir certs] [--san NAME] [--policy FILE]
gpuguard mutate -f FILE|- [--diff | --patch]      prints the mutated manifests
gpuguard validate -f FILE|-                       prints violations; exit 1 if anything is denied
gpuguard review [--validate] FILE|-               prints the AdmissionReview answer
gpuguard policy check FILE | policy default | policy status [--url URL --cacert FILE]
gpuguard certs generate [--dir certs] [--service NAME --namespace NS] [--san NAME]
gpuguard certs rotate --secret NS/NAME            starts a CA rotation the running replicas complete
gpuguard nodes drivers [-f FILE|- | --kubeconfig FILE]   driver/CUDA versions by pool; exit 1 if any mixed
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import os
import ssl
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import orjson
import yaml

from webhook import logs
from webhook.admission import review
from webhook.certs import files as certfiles
from webhook.policy import engine, patch
from webhook.policy.model import Policy, PolicyError, default_policy, default_policy_text, parse_policy

EXIT_DENIED = 1
EXIT_USAGE = 2


def _read(source: str) -> str:
    return sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")


def _load_policy(path: str | None) -> Policy:
    return default_policy() if path is None else parse_policy(_read(path))


def _documents(source: str) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(_read(source)) if doc is not None]


def _namespace(obj: Any, default: str) -> str:
    metadata = obj.get("metadata") if isinstance(obj, dict) else None
    namespace = metadata.get("namespace") if isinstance(metadata, dict) else None
    return namespace if isinstance(namespace, str) and namespace else default


def _title(obj: Any) -> str:
    if not isinstance(obj, dict):
        return "document"
    metadata = obj.get("metadata")
    metadata = metadata if isinstance(metadata, dict) else {}
    name = metadata.get("name") or metadata.get("generateName") or ""
    return f"{obj.get('kind', '?')}/{name}"


def _dump(obj: Any) -> str:
    return yaml.safe_dump(obj, sort_keys=False, default_flow_style=False)


def _results(args: argparse.Namespace) -> Iterator[tuple[Any, engine.Result, engine.Result]]:
    """Each document mutated, then validated as the API server would: validation sees the mutated object."""
    policy = _load_policy(args.policy)
    for doc in _documents(args.file):
        namespace = _namespace(doc, args.namespace)
        mutated = engine.mutate(doc, policy, namespace=namespace)
        validated = engine.validate(mutated.obj, policy, namespace=namespace)
        yield doc, mutated, validated


def _report(decisions: Sequence[engine.Decision], title: str, out: TextIO) -> None:
    for decision in decisions:
        if decision.outcome != "applied":
            print(
                f"{title}: {decision.rule} ({decision.mode}) {decision.outcome}: {decision.message}", file=out
            )


def cmd_mutate(args: argparse.Namespace) -> int:
    outputs: list[str] = []
    for doc, mutated, _ in _results(args):
        _report(mutated.decisions, _title(doc), sys.stderr)
        if args.patch:
            outputs.append(orjson.dumps(patch.diff(doc, mutated.obj)).decode() + "\n")
        elif args.diff:
            before, after = _dump(doc).splitlines(keepends=True), _dump(mutated.obj).splitlines(keepends=True)
            title = _title(doc)
            outputs.append("".join(difflib.unified_diff(before, after, f"a/{title}", f"b/{title}")))
        else:
            outputs.append(_dump(mutated.obj))
    separator = "" if args.patch or args.diff else "---\n"
    sys.stdout.write(separator.join(outputs))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    denied = False
    for doc, mutated, validated in _results(args):
        _report([*mutated.decisions, *validated.decisions], _title(doc), sys.stdout)
        denied = denied or bool(validated.denials)
    return EXIT_DENIED if denied else 0


def cmd_review(args: argparse.Namespace) -> int:
    endpoint: review.Endpoint = "validate" if args.validate else "mutate"
    answer = review.review(_read(args.file).encode(), endpoint=endpoint, policy=_load_policy(args.policy))
    sys.stdout.write(orjson.dumps(orjson.loads(answer.body), option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0 if answer.allowed else EXIT_DENIED


def cmd_policy_check(args: argparse.Namespace) -> int:
    policy = parse_policy(_read(args.file))
    print(f"policy ok: hash {policy.hash}")
    return 0


def cmd_policy_default(_: argparse.Namespace) -> int:
    sys.stdout.write(default_policy_text())
    return 0


def _namespaced_name(value: str) -> tuple[str, str]:
    namespace, _, name = value.partition("/")
    if not namespace or not name or "/" in name:
        raise argparse.ArgumentTypeError(f"expected NAMESPACE/NAME, got {value!r}")
    return namespace, name


def cmd_certs_rotate(args: argparse.Namespace) -> int:
    # The Kubernetes client and cryptography are only needed here, not to serve existing certificates.
    from webhook.certs import tls
    from webhook.certs.controller import begin_rotation
    from webhook.kube.certificates import SecretStore
    from webhook.kube.client import ApiError, api_client

    namespace, name = args.secret
    try:
        store = SecretStore(api_client(args.kubeconfig), namespace, name)
        material = begin_rotation(store, schedule=tls.Schedule())
    except (tls.InvalidMaterialError, RuntimeError) as exc:
        print(f"gpuguard: {exc}", file=sys.stderr)
        return EXIT_DENIED
    except ApiError as exc:
        print(f"gpuguard: Secret {namespace}/{name}: {exc.status} {exc.reason}", file=sys.stderr)
        return EXIT_DENIED
    print(
        f"rotation started: {material.newest_ca.subject.rfc4514_string()} is now trusted next to the old CA."
        " The replicas add it to caBundle now, serve a certificate from it after --rotation-delay, and"
        " drop the old CA one delay later."
    )
    return 0


def cmd_certs_generate(args: argparse.Namespace) -> int:
    from webhook.certs import tls

    names = list(args.san)
    if args.service:
        names = certfiles.dns_names_for_service(args.service, args.namespace) + names
    files = tls.generate_serving_files(Path(args.dir), names)
    print(f"wrote {files.ca}, {files.cert} and {files.key}")
    return 0


def _serving_files(cert_dir: Path, sans: Sequence[str]) -> certfiles.ServingFiles:
    """The certificate files in `cert_dir`, generated first when missing."""
    existing = certfiles.existing_serving_files(cert_dir)
    if existing is not None:
        return existing
    from webhook.certs import tls  # cryptography costs every replica about 10 MB: imported only to generate

    return tls.generate_serving_files(cert_dir, sans)


def cmd_serve(args: argparse.Namespace) -> int:
    from webhook import manager  # uvicorn and FastAPI are only needed to serve

    logs.configure()
    settings = None
    if args.tls_secret:
        # cryptography only with certificates from a Secret: they are created or rotated here.
        from webhook.certs import controller as certificates
        from webhook.certs import tls

        namespace, name = args.tls_secret
        service = certfiles.dns_names_for_service(args.service, namespace) if args.service else []
        cert_dir = Path(args.cert_dir)
        settings = certificates.Settings(
            namespace=namespace,
            secret=name,
            names=tuple(certfiles.serving_names([*service, *args.san])),
            webhook_config=args.webhook_config,
            cert_dir=cert_dir,
            schedule=tls.Schedule(rotation_delay=datetime.timedelta(seconds=args.rotation_delay)),
        )
        cert_file, key_file = cert_dir / certfiles.CERT_FILE, cert_dir / certfiles.KEY_FILE
    elif args.tls_cert and args.tls_key:
        cert_file, key_file = Path(args.tls_cert), Path(args.tls_key)
    else:
        files = _serving_files(Path(args.cert_dir), args.san)
        cert_file, key_file = files.cert, files.key
        action = "generated" if files.created else "using"
        print(
            f"gpuguard: {action} certificate {files.cert}; the CA for caBundle is {files.ca}", file=sys.stderr
        )
    in_cluster = "KUBERNETES_SERVICE_HOST" in os.environ
    lookups = args.cluster_lookups == "on" or (
        args.cluster_lookups == "auto"
        and bool(in_cluster or args.kubeconfig or args.policy_configmap or args.tls_secret)
    )
    options = manager.Options(
        host=args.host,
        port=args.port,
        cert_file=cert_file,
        key_file=key_file,
        policy_file=Path(args.policy) if args.policy else None,
        policy_configmap=args.policy_configmap,
        cluster=lookups,
        kubeconfig=args.kubeconfig,
        certificates=settings,
    )
    manager.serve(options)
    return 0


def cmd_nodes_drivers(args: argparse.Namespace) -> int:
    from webhook.policy import drivers
    from webhook.policy.facts import nodes_of

    if args.file:
        nodes = nodes_of(_documents(args.file))
    else:
        from webhook.kube.client import api_client  # the Kubernetes client only against a cluster
        from webhook.kube.facts import list_nodes

        nodes = list_nodes(api_client(args.kubeconfig))
    pools = drivers.summarise(nodes, _load_policy(args.policy).rules.driverCompatibility.nodeLabels)
    sys.stdout.write(drivers.table(pools))
    return EXIT_DENIED if any(pool.mixed for pool in pools) else 0


def cmd_policy_status(args: argparse.Namespace) -> int:
    context = ssl.create_default_context(cafile=args.cacert)
    with urllib.request.urlopen(f"{args.url.rstrip('/')}/policy", context=context, timeout=5) as response:
        status = orjson.loads(response.read())
    loaded = datetime.datetime.fromtimestamp(status["loadedAt"], datetime.UTC).isoformat(timespec="seconds")
    print(f"policy {status['hash']} from {status['source']}, loaded {loaded}")
    if not status["enabled"]:
        print("kill switch: enabled is false, every rule passes through")
    if status["lastError"]:
        print(f"last refused policy: {status['lastError']}")
    if status["unavailableLookups"]:
        print(f"cluster lookups unavailable: {', '.join(status['unavailableLookups'])}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuguard", description="GPU-aware Kubernetes admission webhook")
    commands = parser.add_subparsers(dest="command", required=True)

    def with_policy(sub: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sub.add_argument(
            "--policy", metavar="FILE", help="policy YAML (the ConfigMap's content); default: embedded"
        )
        return sub

    serve = with_policy(commands.add_parser("serve", help="run the admission webhook over TLS"))
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=int, default=8443)
    serve.add_argument("--cert-dir", default="certs", help="where tls.crt/tls.key are read, or generated")
    serve.add_argument("--san", action="append", default=[], help="extra name for a generated certificate")
    serve.add_argument("--tls-cert", help="serving certificate (PEM); with --tls-key, --cert-dir is unused")
    serve.add_argument("--tls-key", help="serving key (PEM)")
    serve.add_argument(
        "--policy-configmap",
        metavar="NAMESPACE/NAME",
        help="watch this ConfigMap's policy.yaml key and apply changes live",
    )
    serve.add_argument("--kubeconfig", help="cluster credentials; in a pod the service account is used")
    serve.add_argument(
        "--tls-secret",
        metavar="NAMESPACE/NAME",
        type=_namespaced_name,
        help="keep the CA and serving certificate in this Secret, shared by all replicas: created when"
        " missing, rotated before expiry, reloaded without restart (--cert-dir: where files are written)",
    )
    serve.add_argument("--service", help="with --tls-secret: the Service's DNS names go into the certificate")
    serve.add_argument(
        "--webhook-config",
        metavar="NAME",
        help="with --tls-secret: keep the caBundle of this Mutating- and ValidatingWebhookConfiguration",
    )
    serve.add_argument(
        "--rotation-delay",
        type=float,
        default=certfiles.DEFAULT_ROTATION_DELAY.total_seconds(),
        metavar="SECONDS",
        help="with --tls-secret: time between the steps of a CA rotation (default: %(default).0f)",
    )
    serve.add_argument(
        "--cluster-lookups",
        choices=("auto", "on", "off"),
        default="auto",
        help="cache PriorityClasses, namespaces, nodes and DRA claims (auto: when cluster access is configured)",
    )
    serve.set_defaults(run=cmd_serve)

    for name, run, help_text in (
        ("mutate", cmd_mutate, "print the manifests as gpuguard would mutate them"),
        ("validate", cmd_validate, "print what gpuguard would deny; exit 1 if anything"),
    ):
        sub = with_policy(commands.add_parser(name, help=help_text))
        sub.add_argument(
            "-f", "--file", required=True, help="manifest file, multi-document YAML; - for stdin"
        )
        sub.add_argument("-n", "--namespace", default="default", help="namespace for objects that name none")
        sub.set_defaults(run=run)
        if name == "mutate":
            output = sub.add_mutually_exclusive_group()
            output.add_argument("--diff", action="store_true", help="print a unified diff instead")
            output.add_argument(
                "--patch", action="store_true", help="print the JSON Patch, one line per document"
            )

    review_cmd = with_policy(commands.add_parser("review", help="answer an AdmissionReview JSON file"))
    review_cmd.add_argument("file", help="AdmissionReview JSON; - for stdin")
    review_cmd.add_argument("--validate", action="store_true", help="answer as /validate instead of /mutate")
    review_cmd.set_defaults(run=cmd_review)

    policy = commands.add_parser("policy", help="check or print a policy").add_subparsers(
        dest="policy_command", required=True
    )
    check = policy.add_parser("check", help="validate a policy file")
    check.add_argument("file")
    check.set_defaults(run=cmd_policy_check)
    policy.add_parser("default", help="print the embedded default policy").set_defaults(
        run=cmd_policy_default
    )
    status = policy.add_parser("status", help="show the running server's active policy")
    status.add_argument("--url", default="https://localhost:8443", help="the server's base URL")
    status.add_argument("--cacert", default="certs/ca.crt", help="the CA that signed its certificate")
    status.set_defaults(run=cmd_policy_status)

    certs = commands.add_parser("certs", help="certificates").add_subparsers(
        dest="certs_command", required=True
    )
    generate = certs.add_parser("generate", help="write a CA and a serving certificate")
    generate.add_argument("--dir", default="certs")
    generate.add_argument(
        "--service", help="Service name: adds <svc>, <svc>.<ns>, <svc>.<ns>.svc[.cluster.local]"
    )
    generate.add_argument("--namespace", default="gpuguard")
    generate.add_argument("--san", action="append", default=[], help="extra DNS name or IP")
    generate.set_defaults(run=cmd_certs_generate)
    rotate = certs.add_parser(
        "rotate", help="start a CA rotation of a --tls-secret now; the running replicas complete it"
    )
    rotate.add_argument("--secret", required=True, metavar="NAMESPACE/NAME", type=_namespaced_name)
    rotate.add_argument("--kubeconfig", help="cluster credentials; in a pod the service account is used")
    rotate.set_defaults(run=cmd_certs_rotate)

    nodes = commands.add_parser("nodes", help="look at the cluster's nodes").add_subparsers(
        dest="nodes_command", required=True
    )
    node_drivers = with_policy(
        nodes.add_parser("drivers", help="driver and CUDA versions by node pool and GPU product")
    )
    node_drivers.add_argument("-f", "--file", help="a node list (kubectl get nodes -o yaml); - for stdin")
    node_drivers.add_argument("--kubeconfig", help="without -f: list the nodes of this cluster")
    node_drivers.set_defaults(run=cmd_nodes_drivers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except PolicyError as exc:
        print(f"gpuguard: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (OSError, yaml.YAMLError, urllib.error.URLError) as exc:
        print(f"gpuguard: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return code


if __name__ == "__main__":
    sys.exit(main())
