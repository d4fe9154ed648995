"""`gpuguard`: the server, and the same engine offline on plain manifests.

One module per command group, each with a `register(commands)` that adds its subcommands:

    serve.py      gpuguard serve
    controllers.py  gpuguard controllers
    nodeagent.py  gpuguard node-agent
    workloads.py  gpuguard mutate, gpuguard validate
    review.py     gpuguard review
    policy.py     gpuguard policy check|default|effective|status
    certs.py      gpuguard certs generate|rotate
    nodes.py      gpuguard nodes [explain NODE | reset-breaker | drivers]
    cases.py      gpuguard test
    audit.py      gpuguard audit

shared by all of them:

    output.py     exit codes, UsageError, help that shows defaults, kubectl-style tables, -o json|yaml,
                  the summary line, a progress indicator (on a terminal only)
    inputs.py     -f manifests as kubectl reads them, --policy, --facts, argument types
    yaml_output.py  YAML that every reader reads back as written (-o yaml, `gpuguard mutate`)

and, for scripts/render-docs only (no command loads it):

    reference.py  the generated pages docs/reference/cli.md (from this parser) and docs/reference/policy.md

Adding a command group (say `gpuguard explain`) is one new module and one line in GROUPS below:

    # webhook/cli/explain.py
    def run_explain(args: argparse.Namespace) -> int:
        ...                                   # print; return output.EXIT_OK or output.EXIT_FAILED
    def register(commands: output.Commands) -> None:
        parser = output.add_parser(commands, "explain", help="...")   # help lines show defaults
        parser.add_argument(...)                                    # every option with help text
        parser.set_defaults(run=run_explain)

A subcommand of an existing group (another `gpuguard nodes ...`) goes into that group's module.
Raise `output.UsageError("FILE: what is wrong")` for anything the user must fix: it is printed as
`gpuguard: ...` with exit code 2. Import heavy libraries (kubernetes, cryptography, uvicorn) inside
the functions that use them, never at the top of the module: every module here is loaded by every
`gpuguard` run, `serve` included, and tests/unit/test_layering.py fails if that loads cryptography.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from webhook import __version__
from webhook.cli import (
    audit,
    cases,
    certs,
    controllers,
    nodeagent,
    nodes,
    output,
    policy,
    review,
    serve,
    workloads,
)

# The command groups, in the order `gpuguard --help` lists them.
GROUPS = (
    serve,
    controllers,
    nodeagent,
    workloads,
    review,
    policy,
    certs,
    nodes,
    cases,
    audit,
)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="gpuguard",
        description="GPU-aware Kubernetes admission webhook, and its engine offline on manifests.",
        epilog="Exit codes: 0 ok; 1 something was denied or a test failed; 2 the command could not run"
        " (bad arguments, unreadable input, an invalid policy, a server it could not reach).",
        formatter_class=output.HelpFormatter,
    )
    root.add_argument("--version", action="version", version=f"gpuguard {__version__}")
    commands = root.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in GROUPS:
        group.register(commands)
    return root


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except output.UsageError as exc:
        output.error(str(exc))
        return output.EXIT_USAGE
    except BrokenPipeError:
        # `gpuguard mutate ... | head`: the reader left; nothing more to say, and nobody to say it to.
        sys.stderr.close()
        return output.EXIT_FAILED
    return code


if __name__ == "__main__":
    sys.exit(main())
