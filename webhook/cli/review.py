"""`gpuguard review`: answer an AdmissionReview as the server's /mutate or /validate would, or build one
from a manifest (`--from-manifest`) to send to a server with curl or to answer here."""

from __future__ import annotations

import argparse
import base64
import sys
import uuid
from typing import Any

import orjson
import yaml

from webhook.admission import review
from webhook.cli import inputs, output


def admission_review(manifest: inputs.Manifest, operation: str) -> dict[str, Any]:
    """The AdmissionReview the API server would send for `manifest` (without its defaulting: the API
    server fills in defaults, such as the 300 s tolerations, before calling webhooks). The uid is derived
    from the content, so the same manifest always gives the same review."""
    obj = manifest.obj
    group, _, version = str(obj["apiVersion"]).rpartition("/")
    kind = str(obj["kind"])
    metadata = obj.get("metadata")
    name = metadata.get("name") if isinstance(metadata, dict) else None
    content = orjson.dumps([obj, manifest.namespace, operation], option=orjson.OPT_SORT_KEYS)
    request: dict[str, Any] = {
        "uid": str(uuid.uuid5(uuid.NAMESPACE_URL, content.decode())),
        "kind": {"group": group, "version": version, "kind": kind},
        # The plural of every kind the rules handle (pods, jobs, cronjobs, deployments, ...); gpuguard
        # itself goes by `kind`.
        "resource": {"group": group, "version": version, "resource": f"{kind.lower()}s"},
        "namespace": manifest.namespace,
        "operation": operation,
        "userInfo": {"username": "gpuguard-cli"},
        "object": obj,
        "dryRun": False,
    }
    if name:
        request["name"] = name
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


def _from_manifest(args: argparse.Namespace) -> int:
    manifests = inputs.read_manifests([args.from_manifest], namespace=args.namespace)
    if len(manifests) != 1:
        raise output.UsageError(
            f"{inputs.display_name(args.from_manifest)}: holds {output.plural(len(manifests), 'object')};"
            " an AdmissionReview carries exactly one"
        )
    sys.stdout.write(output.dump_json(admission_review(manifests[0], args.operation)))
    return output.EXIT_OK


def _not_a_review(source: str, body: bytes, reason: str) -> output.UsageError:
    """Says why `body` is no AdmissionReview; a plain manifest gets told how to make one of it."""
    try:
        first = next(iter(yaml.safe_load_all(body.decode("utf-8"))), None)
    except (UnicodeDecodeError, yaml.YAMLError):
        first = None
    name = inputs.display_name(source)
    kind = first.get("kind") if isinstance(first, dict) else None
    if isinstance(kind, str) and kind != "AdmissionReview":
        file = "FILE" if source == inputs.STDIN else source
        return output.UsageError(
            f"{name}: a {kind} manifest, not the AdmissionReview `gpuguard review` expects:"
            f" `gpuguard review --from-manifest {file}` wraps it in one,"
            f" `gpuguard mutate -f {file}` mutates it directly"
        )
    return output.UsageError(f"{name}: not an AdmissionReview: {reason}")


def run_review(args: argparse.Namespace) -> int:
    if args.from_manifest:
        if args.file:
            raise output.UsageError("give either FILE (an AdmissionReview) or --from-manifest, not both")
        return _from_manifest(args)
    if not args.file:
        raise output.UsageError("give FILE (an AdmissionReview, - for stdin) or --from-manifest FILE")
    body = inputs.read_bytes(args.file)
    endpoint: review.Endpoint = "validate" if args.validate else "mutate"
    answer = review.review(
        body,
        endpoint=endpoint,
        policy=inputs.load_policy(args.policy),
        facts=inputs.load_facts(args.facts),
    )
    reply = orjson.loads(answer.body)
    response = reply["response"]
    status = response.get("status", {})
    if not answer.allowed and status.get("code") == 400:
        raise _not_a_review(args.file, body, status.get("message", ""))
    if args.decode and "patch" in response:
        response["patch"] = orjson.loads(base64.b64decode(response["patch"]))
    sys.stdout.write(output.dump_json(reply))
    return output.EXIT_OK if answer.allowed else output.EXIT_FAILED


def register(commands: output.Commands) -> None:
    parser = output.add_parser(
        commands,
        "review",
        help="answer an AdmissionReview as /mutate (or /validate) would; exit 1 if it is denied",
    )
    parser.add_argument("file", nargs="?", metavar="FILE", help="the AdmissionReview JSON; - for stdin")
    parser.add_argument("--validate", action="store_true", help="answer as /validate instead of /mutate")
    parser.add_argument(
        "--decode", action="store_true", help="show the answer's patch as JSON instead of base64"
    )
    parser.add_argument(
        "--from-manifest",
        metavar="MANIFEST",
        help="print the AdmissionReview the API server would send for this one-object manifest instead",
    )
    parser.add_argument(
        "-n",
        "--namespace",
        help="with --from-manifest: the namespace, when the object names none (default: default)",
    )
    parser.add_argument(
        "--operation",
        choices=("CREATE", "UPDATE"),
        default="CREATE",
        help="with --from-manifest: the request's operation",
    )
    inputs.add_policy_argument(parser)
    inputs.add_facts_argument(parser)
    parser.set_defaults(run=run_review)
