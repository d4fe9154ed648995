"""`gpuguard certs`: a CA and serving certificate in files, and starting a rotation of the Secret's.

`cryptography` and the Kubernetes client are imported inside the commands: this module is loaded by
every `gpuguard` run, `serve` included, which must not pay for them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from webhook.certs import files as certfiles
from webhook.cli import inputs, output

DEFAULT_DIR = "certs"
DEFAULT_NAMESPACE = "gpuguard"


def run_generate(args: argparse.Namespace) -> int:
    cert_dir = Path(args.dir)
    existing = [cert_dir / name for name in (certfiles.CA_FILE, certfiles.CA_KEY_FILE)]
    if not args.force and any(path.exists() for path in existing):
        found = next(path for path in existing if path.exists())
        raise output.UsageError(
            f"{found} exists: a new CA would replace the one every caBundle and client trusts;"
            " pass --force to replace it, or --dir for another folder"
        )
    from webhook.certs import tls  # cryptography: only to make certificates

    names = list(args.san)
    if args.service:
        names = certfiles.dns_names_for_service(args.service, args.namespace) + names
    files = tls.generate_serving_files(cert_dir, names)
    validity = f"CA valid {tls.CA_VALIDITY.days} days, serving certificate {tls.LEAF_VALIDITY.days} days"
    print(f"wrote {files.ca}, {files.cert} and {files.key} ({validity})")
    return output.EXIT_OK


def run_rotate(args: argparse.Namespace) -> int:
    # The Kubernetes client and cryptography are only needed here, not to serve existing certificates.
    from webhook.certs import tls
    from webhook.certs.rotation import begin_rotation
    from webhook.kube.certificates import SecretStore
    from webhook.kube.client import ApiError, api_client

    namespace, name = args.secret
    try:
        store = SecretStore(api_client(args.kubeconfig), namespace, name)
        material = begin_rotation(store, schedule=tls.Schedule())
    except (tls.InvalidMaterialError, RuntimeError) as exc:
        output.error(str(exc))
        return output.EXIT_FAILED
    except ApiError as exc:
        output.error(f"Secret {namespace}/{name}: {exc.status} {exc.reason}")
        return output.EXIT_FAILED
    print(
        f"rotation started: {material.newest_ca.subject.rfc4514_string()} is now trusted next to the old CA."
        " The replicas add it to caBundle now, serve a certificate from it after --rotation-delay, and"
        " drop the old CA one delay later."
    )
    return output.EXIT_OK


def register(commands: output.Commands) -> None:
    group = output.add_parser(commands, "certs", help="certificates")
    certs = group.add_subparsers(dest="certs_command", required=True, metavar="COMMAND")

    generate = output.add_parser(
        certs,
        "generate",
        help="write a CA (5 years) and a serving certificate (1 year) for --service and every --san",
    )
    generate.add_argument("--dir", default=DEFAULT_DIR, help="where ca.crt, ca.key, tls.crt and tls.key go")
    generate.add_argument(
        "--service", help="a Service name: adds <svc>, <svc>.<ns>, <svc>.<ns>.svc[.cluster.local]"
    )
    generate.add_argument("--namespace", default=DEFAULT_NAMESPACE, help="the Service's namespace")
    generate.add_argument(
        "--san",
        action="append",
        default=[],
        type=inputs.subject_name,
        metavar="NAME",
        help="an extra DNS name or IP address; repeat for more (localhost and 127.0.0.1 are always in)",
    )
    generate.add_argument("--force", action="store_true", help="replace an existing CA in --dir")
    generate.set_defaults(run=run_generate)

    rotate = output.add_parser(
        certs, "rotate", help="start a CA rotation of a --tls-secret now; the running replicas complete it"
    )
    rotate.add_argument(
        "--secret", required=True, metavar="NAMESPACE/NAME", type=inputs.namespaced_name, help="the Secret"
    )
    rotate.add_argument("--kubeconfig", help="cluster credentials (default: in a pod, the service account)")
    rotate.set_defaults(run=run_rotate)
