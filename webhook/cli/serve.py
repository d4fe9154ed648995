"""`gpuguard serve`: the admission webhook over TLS.

uvicorn, FastAPI and the Kubernetes client are imported when serving starts, and `cryptography` only
when certificates must be made or rotated: a replica serving existing certificates never loads it
(about 10 MB of memory each; tests/unit/test_layering.py checks).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from webhook.certs import files as certfiles
from webhook.cli import inputs, output
from webhook.policy.model import PolicyError, parse_policy
from webhook.runtime import logs

DEFAULT_HOST = "0.0.0.0"
DEFAULT_PORT = 8443
DEFAULT_CERT_DIR = "certs"
# Each worker holds its own caches: more than a machine's cores only costs memory.
MAX_WORKERS = 64


def _serving_files(cert_dir: Path, sans: Sequence[str]) -> certfiles.ServingFiles:
    """The certificate files in `cert_dir`, generated first when missing."""
    existing = certfiles.existing_serving_files(cert_dir)
    if existing is not None:
        return existing
    from webhook.certs import tls  # cryptography costs every replica about 10 MB: imported only to generate

    return tls.generate_serving_files(cert_dir, sans)


def run_serve(args: argparse.Namespace) -> int:
    from webhook.processes import serve  # uvicorn and FastAPI are only needed to serve

    logs.configure()
    settings = None
    if args.tls_secret:
        # cryptography only with certificates from a Secret: they are created or rotated here.
        from webhook.certs import rotation as certificates
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
    elif args.tls_cert or args.tls_key:
        raise output.UsageError("--tls-cert and --tls-key go together")
    else:
        files = _serving_files(Path(args.cert_dir), args.san)
        cert_file, key_file = files.cert, files.key
        action = "generated" if files.created else "using"
        print(
            f"gpuguard: {action} certificate {files.cert}; the CA for caBundle is {files.ca}", file=sys.stderr
        )
    if args.policy:
        # Refused before listening, naming the file; the server reads it as policy YAML (no ConfigMap).
        try:
            parse_policy(inputs.read_text(args.policy))
        except PolicyError as exc:
            raise output.UsageError(f"{args.policy}: {exc}") from None
    in_cluster = "KUBERNETES_SERVICE_HOST" in os.environ
    lookups = args.cluster_lookups == "on" or (
        args.cluster_lookups == "auto"
        and bool(in_cluster or args.kubeconfig or args.policy_configmap or args.tls_secret)
    )
    count = _worker_count(args.workers)
    plural = "s" if count > 1 else ""
    print(f"gpuguard: serving https://{args.host}:{args.port} ({count} worker{plural})", file=sys.stderr)
    options = serve.Options(
        host=args.host,
        port=args.port,
        cert_file=cert_file,
        key_file=key_file,
        policy_file=Path(args.policy) if args.policy else None,
        policy_configmap=args.policy_configmap,
        cluster=lookups,
        kubeconfig=args.kubeconfig,
        certificates=settings,
        workers=count,
    )
    return serve.serve(options)


def _worker_count(value: str) -> int:
    if value != "auto":
        return int(value)
    from webhook.processes import serve_workers

    return serve_workers.auto_count(serve_workers.cpu_limit(), serve_workers.usable_cpus())


def _workers_argument(value: str) -> str:
    if value == "auto" or (value.isdigit() and 1 <= int(value) <= MAX_WORKERS):
        return value
    raise argparse.ArgumentTypeError(f"expected auto or a number from 1 to {MAX_WORKERS}, got {value!r}")


def register(commands: output.Commands) -> None:
    serve = output.add_parser(commands, "serve", help="run the admission webhook over TLS")
    serve.add_argument(
        "--host", default=DEFAULT_HOST, help="address to listen on; ./scripts/serve passes 127.0.0.1"
    )
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")
    serve.add_argument(
        "--policy",
        metavar="FILE",
        help="the policy YAML, re-read when it changes (default: the embedded default policy)",
    )
    serve.add_argument(
        "--cert-dir", default=DEFAULT_CERT_DIR, help="where tls.crt and tls.key are read, or generated"
    )
    serve.add_argument(
        "--san",
        action="append",
        default=[],
        type=inputs.subject_name,
        metavar="NAME",
        help="an extra DNS name or IP address for a generated certificate; repeat for more",
    )
    serve.add_argument(
        "--tls-cert", metavar="FILE", help="serving certificate (PEM); with --tls-key, --cert-dir is unused"
    )
    serve.add_argument("--tls-key", metavar="FILE", help="serving key (PEM)")
    serve.add_argument(
        "--policy-configmap",
        metavar="NAMESPACE/NAME",
        help="watch this ConfigMap's policy.yaml key and apply changes live",
    )
    serve.add_argument("--kubeconfig", help="cluster credentials (default: in a pod, the service account)")
    serve.add_argument(
        "--tls-secret",
        metavar="NAMESPACE/NAME",
        type=inputs.namespaced_name,
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
        help="with --tls-secret: time between the steps of a CA rotation",
    )
    serve.add_argument(
        "--cluster-lookups",
        choices=("auto", "on", "off"),
        default="auto",
        help="cache PriorityClasses, namespaces, nodes and DRA claims (auto: when cluster access is configured)",
    )
    serve.add_argument(
        "--workers",
        default="1",
        type=_workers_argument,
        metavar="N|auto",
        help="processes answering on the one port, seen as one server (metrics summed, ready when all"
        " are); auto: one per CPU of the container's CPU limit (deploy/ passes auto)",
    )
    serve.set_defaults(run=run_serve)
