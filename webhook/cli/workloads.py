"""`gpuguard mutate` and `gpuguard validate`: the server's engine on manifests, offline.

Each object is mutated, then validated as the API server would validate it: validation sees the
mutated object, which is what the API server stores.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from webhook.admission import review
from webhook.cli import inputs, output
from webhook.policy import engine, patch
from webhook.policy.facts import ClusterFacts
from webhook.policy.model import Policy

Status = Literal["passed", "warned", "denied"]


@dataclass(frozen=True)
class Evaluation:
    manifest: inputs.Manifest
    mutated: engine.Result
    validated: engine.Result

    @property
    def decisions(self) -> tuple[engine.Decision, ...]:
        return (*self.mutated.decisions, *self.validated.decisions)

    @property
    def status(self) -> Status:
        """denied: the API server would refuse it; warned: kubectl would print a gpuguard warning."""
        if self.validated.denials:
            return "denied"
        return "warned" if review.warnings_for(self.decisions) else "passed"


def evaluate(
    manifests: Sequence[inputs.Manifest], policy: Policy, facts: ClusterFacts | None
) -> list[Evaluation]:
    evaluations = []
    for manifest in manifests:
        mutated = engine.mutate(manifest.obj, policy, namespace=manifest.namespace, facts=facts)
        validated = engine.validate(mutated.obj, policy, namespace=manifest.namespace, facts=facts)
        evaluations.append(Evaluation(manifest, mutated, validated))
    return evaluations


def _evaluate_arguments(args: argparse.Namespace) -> list[Evaluation]:
    policy = inputs.load_policy(args.policy)
    facts = inputs.load_facts(args.facts)
    manifests = inputs.read_manifests(args.files, namespace=args.namespace, recursive=args.recursive)
    return evaluate(manifests, policy, facts)


def _counts(evaluations: Sequence[Evaluation]) -> dict[Status, int]:
    counts: dict[Status, int] = {"passed": 0, "warned": 0, "denied": 0}
    for evaluation in evaluations:
        counts[evaluation.status] += 1
    return counts


def _report_line(evaluation: Evaluation, decision: engine.Decision) -> str:
    return f"{evaluation.manifest.title}: {decision.rule} ({decision.mode}) {decision.outcome}: {decision.message}"


def run_mutate(args: argparse.Namespace) -> int:
    evaluations = _evaluate_arguments(args)
    for evaluation in evaluations:
        for decision in evaluation.mutated.decisions:
            if decision.outcome != "applied":
                print(_report_line(evaluation, decision), file=sys.stderr)
    objects = [evaluation.mutated.obj for evaluation in evaluations]
    if args.patch:
        text = "".join(
            orjson.dumps(patch.diff(e.manifest.obj, e.mutated.obj)).decode() + "\n" for e in evaluations
        )
    elif args.diff:
        text = "".join(_diff(e) for e in evaluations)
    elif args.output == "json":
        text = output.dump_json(objects[0] if len(objects) == 1 else output.as_list(objects))
    else:
        text = "---\n".join(output.dump_yaml(obj) for obj in objects)
    sys.stdout.write(text)
    changed = sum(1 for e in evaluations if e.mutated.changed)
    counts = _counts(evaluations)
    outcomes = [("mutated", changed), ("unchanged", len(evaluations) - changed)]
    outcomes += [("warned", counts["warned"]), ("denied", counts["denied"])]
    print(output.summary(len(evaluations), "object", outcomes), file=sys.stderr)
    return output.EXIT_OK


def _diff(evaluation: Evaluation) -> str:
    name = evaluation.manifest.title
    before = output.dump_yaml(evaluation.manifest.obj).splitlines(keepends=True)
    after = output.dump_yaml(evaluation.mutated.obj).splitlines(keepends=True)
    return "".join(difflib.unified_diff(before, after, f"a/{name}", f"b/{name}"))


def report(evaluations: Sequence[Evaluation]) -> dict[str, Any]:
    """What `validate -o json|yaml` prints: every decision of every object, and the summary counts."""
    results = [
        {
            "object": e.manifest.title,
            "namespace": e.manifest.namespace,
            "source": e.manifest.source,
            "result": e.status,
            "decisions": [dataclasses.asdict(decision) for decision in e.decisions],
        }
        for e in evaluations
    ]
    return {"results": results, "summary": {"objects": len(evaluations), **_counts(evaluations)}}


def run_validate(args: argparse.Namespace) -> int:
    evaluations = _evaluate_arguments(args)
    counts = _counts(evaluations)
    if args.output != "table":
        sys.stdout.write(output.dump(report(evaluations), args.output))
    else:
        rows = [
            (e.manifest.namespace, e.manifest.title, d.rule, d.mode, d.outcome, d.message)
            for e in evaluations
            for d in e.decisions
            if d.outcome != "applied"
        ]
        if rows:
            headers = ("namespace", "object", "rule", "mode", "result", "message")
            sys.stdout.write(output.table(headers, rows))
        print(output.summary(len(evaluations), "object", counts.items()))
    return output.EXIT_FAILED if counts["denied"] else output.EXIT_OK


def _common_arguments(parser: argparse.ArgumentParser) -> None:
    inputs.add_manifest_arguments(parser)
    inputs.add_policy_argument(parser)
    inputs.add_facts_argument(parser)


def register(commands: output.Commands) -> None:
    mutate = output.add_parser(
        commands,
        "mutate",
        help="print the manifests as gpuguard would mutate them (decisions and a summary on stderr)",
    )
    _common_arguments(mutate)
    shape = mutate.add_mutually_exclusive_group()
    shape.add_argument("-o", "--output", choices=output.FORMATS, default="yaml", help="output format")
    shape.add_argument("--diff", action="store_true", help="print a unified diff of each object instead")
    shape.add_argument("--patch", action="store_true", help="print each object's JSON Patch, one per line")
    mutate.set_defaults(run=run_mutate)

    validate = output.add_parser(
        commands,
        "validate",
        help="say what gpuguard would deny or warn about, with a summary line; exit 1 if anything is denied",
    )
    _common_arguments(validate)
    validate.add_argument(
        "-o",
        "--output",
        choices=("table", *output.FORMATS),
        default="table",
        help="a table of findings, or every decision as yaml or json",
    )
    validate.set_defaults(run=run_validate)
