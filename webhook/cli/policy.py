"""`gpuguard policy`: check a policy, print the default or the effective (merged) policy, compile it
into the API server's own admission policies, and ask a running server which policy it serves."""

from __future__ import annotations

import argparse
import datetime
import http.client
import ssl
import sys
import urllib.error
import urllib.request
from typing import Any

import orjson

from webhook.certs import files as certfiles
from webhook.cli import inputs, output
from webhook.policy import nativesync
from webhook.policy.model import Policy, PolicyError, default_policy_text, parse_policy
from webhook.policy.native import DEFAULT_NAMESPACE, compile_policy, fail_closed
from webhook.policy.nativenarrow import narrowing

DEFAULT_URL = "https://localhost:8443"
DEFAULT_CACERT = f"certs/{certfiles.CA_FILE}"
STATUS_TIMEOUT_SECONDS = 5


def run_check(args: argparse.Namespace) -> int:
    text, origin = inputs.policy_text(args.file)
    where = inputs.display_name(args.file) + (f" ({origin})" if origin else "")
    try:
        policy = parse_policy(text)
    except PolicyError as exc:
        raise output.UsageError(f"{where}: {exc}") from None
    print(f"policy ok: hash {policy.hash}" + (f" ({origin})" if origin else ""))
    return output.EXIT_OK


def run_default(_: argparse.Namespace) -> int:
    sys.stdout.write(default_policy_text())
    return output.EXIT_OK


def run_effective(args: argparse.Namespace) -> int:
    policy = inputs.load_policy(args.file)
    # Fields left unset (a rule's own mode, a namespace entry's unused half) are left out, so the output
    # reads like a policy file and checks as one.
    effective: dict[str, Any] = policy.model_dump(mode="json", exclude_defaults=True)
    if args.output == "json":
        sys.stdout.write(output.dump_json(effective))
    else:
        source = inputs.display_name(args.file) if args.file else "no policy file"
        print(f"# policy {policy.hash}: {source} merged over the embedded default, as the server runs it")
        sys.stdout.write(output.dump_yaml(effective))
    return output.EXIT_OK


def run_compile(args: argparse.Namespace) -> int:
    policy = inputs.load_policy(args.policy)
    compiled = compile_policy(policy, args.namespace)
    objects = fail_closed(compiled.objects, nativesync.FOLLOWS if args.failure_policy == "Fail" else ())
    # admission.mode native runs no webhook: what the native policies cannot decide is not decided.
    native = policy.admission.mode == "native"
    gaps = output.table(
        ["rule", "lost (admission.mode native)" if native else "left to the webhook"],
        ((gap.rule, gap.what) for gap in compiled.gaps),
    )
    if args.output == "json":
        sys.stdout.write(output.dump_json(output.as_list(objects)))
        sys.stderr.write(gaps)
        return output.EXIT_OK
    source = inputs.display_name(args.policy) if args.policy else "the embedded default policy"
    header = [
        f"policy {policy.hash} ({source}) as MutatingAdmissionPolicies and ValidatingAdmissionPolicies.",
        "What they cannot decide is lost: admission.mode is native, no webhook runs:"
        if native
        else "What they cannot decide stays the webhook's:",
        "",
        *gaps.splitlines(),
        *_webhooks_called(policy, args.namespace),
    ]
    sys.stdout.write("".join(f"# {line}".rstrip() + "\n" for line in header))
    sys.stdout.write("".join(f"---\n{output.dump_yaml(obj)}" for obj in objects))
    return output.EXIT_OK


def _webhooks_called(policy: Policy, namespace: str) -> list[str]:
    """What the controllers' leader lets reach gpuguard's webhooks in this mode (nativenarrow)."""
    if policy.admission.mode == "webhook":
        return []
    if policy.admission.mode == "native":
        return ["", "The controllers' leader narrows gpuguard's webhooks to match nothing."]
    lines = ["", "The controllers' leader narrows gpuguard's webhooks to:"]
    for kind, sent in narrowing(policy, namespace).sent.items():
        lines += [f"  {kind}:", *(f"    {what}" for what in sent)]
    return lines


def _fetch_status(url: str, cacert: str) -> dict[str, Any]:
    try:
        context = ssl.create_default_context(cafile=cacert)
    except FileNotFoundError:
        raise output.UsageError(
            f"--cacert {cacert}: no such file (the CA that signed the server's certificate;"
            " `gpuguard serve` says where it wrote it)"
        ) from None
    except ssl.SSLError as exc:
        raise output.UsageError(f"--cacert {cacert}: not a PEM CA certificate ({exc.reason})") from None
    except OSError as exc:
        raise output.UsageError(f"--cacert {cacert}: {exc.strerror or exc}") from None
    endpoint = f"{url.rstrip('/')}/policy"
    try:
        with urllib.request.urlopen(endpoint, context=context, timeout=STATUS_TIMEOUT_SECONDS) as response:
            status: dict[str, Any] = orjson.loads(response.read())
            return status
    except urllib.error.HTTPError as exc:
        raise output.UsageError(f"{endpoint}: HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, ssl.SSLCertVerificationError):
            raise output.UsageError(
                f"{endpoint}: certificate not trusted by --cacert {cacert} ({reason.verify_message})"
            ) from None
        detail = reason.strerror if isinstance(reason, OSError) and reason.strerror else reason
        raise output.UsageError(f"cannot reach {endpoint}: {detail}") from None
    except (TimeoutError, http.client.HTTPException, ssl.SSLError, ConnectionError) as exc:
        raise output.UsageError(f"cannot reach {endpoint}: {exc or type(exc).__name__}") from None
    except orjson.JSONDecodeError:
        raise output.UsageError(f"{endpoint}: the answer is not JSON: is this a gpuguard server?") from None
    except ValueError as exc:  # urllib's "unknown url type"
        raise output.UsageError(f"--url {url}: {exc}") from None


def run_status(args: argparse.Namespace) -> int:
    status = _fetch_status(args.url, args.cacert)
    loaded = datetime.datetime.fromtimestamp(status["loadedAt"], datetime.UTC).isoformat(timespec="seconds")
    print(f"policy {status['hash']} from {status['source']}, loaded {loaded}")
    if not status["enabled"]:
        print("kill switch: enabled is false, every rule passes through")
    if status["lastError"]:
        print(f"last refused policy: {status['lastError']}")
    if status["unavailableLookups"]:
        print(f"cluster lookups unavailable: {', '.join(status['unavailableLookups'])}")
    return output.EXIT_OK


def register(commands: output.Commands) -> None:
    group = output.add_parser(commands, "policy", help="check, print or inspect a policy")
    policy = group.add_subparsers(dest="policy_command", required=True, metavar="COMMAND")

    check = output.add_parser(policy, "check", help="validate a policy file; exit 2 naming what is wrong")
    check.add_argument(
        "file",
        metavar="FILE",
        help="the policy YAML, or a ConfigMap holding it under data.policy.yaml; - for stdin",
    )
    check.set_defaults(run=run_check)

    output.add_parser(policy, "default", help="print the embedded default policy").set_defaults(
        run=run_default
    )

    effective = output.add_parser(
        policy,
        "effective",
        help="print the policy the server would run: FILE merged over the embedded default",
    )
    effective.add_argument(
        "file",
        nargs="?",
        metavar="FILE",
        help="the policy YAML or its ConfigMap; - for stdin (default: none, the embedded default alone)",
    )
    output.add_output_option(effective)
    effective.set_defaults(run=run_effective)

    compile_ = output.add_parser(
        policy,
        "compile",
        help="print the MutatingAdmissionPolicies, ValidatingAdmissionPolicies and bindings that decide what"
        " CEL can of the policy, and what is left to the webhook",
    )
    inputs.add_policy_argument(compile_)
    compile_.add_argument(
        "--failure-policy",
        choices=("Ignore", "Fail"),
        default="Ignore",
        help="what the API server does with a request a policy cannot evaluate: admit it (Ignore, as deploy/'s"
        " webhooks) or refuse it (Fail, as deploy/fail-closed/'s); in hybrid and native mode the controllers'"
        " leader follows the installed webhooks instead",
    )
    compile_.add_argument(
        "--namespace",
        default=DEFAULT_NAMESPACE,
        help="the namespace gpuguard is installed in (deploy/'s, or the chart's `namespace`), which no native"
        " policy binds, as no webhook of gpuguard's calls there",
    )
    output.add_output_option(compile_)
    compile_.set_defaults(run=run_compile)

    status = output.add_parser(policy, "status", help="show the policy a running server serves (GET /policy)")
    status.add_argument("--url", default=DEFAULT_URL, help="the server's base URL")
    status.add_argument(
        "--cacert", default=DEFAULT_CACERT, metavar="FILE", help="the CA that signed its certificate"
    )
    status.set_defaults(run=run_status)
