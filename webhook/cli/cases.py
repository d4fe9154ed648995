"""`gpuguard test DIR...`: declarative policy tests for CI.

Every `gpuguard-test.yaml` under DIR holds cases: manifests, and what gpuguard must make of them under
a policy (and, optionally, cluster facts). Paths are relative to the test file:

    name: default policy            # optional; default: the test file's folder
    policy: policy.yaml             # optional: policy YAML or its ConfigMap; default: the embedded one
    facts: facts.yaml               # optional: `kubectl get priorityclasses,namespaces,nodes -o yaml`
    cases:
      - name: a training job gets every protection
        manifests: [job.yaml]       # files or directories, as for -f; `kind: List` expanded
        namespace: default          # optional, as -n
        policy: warn.yaml           # optional: this case's own policy (and `facts`)
        mutated: expected/job.yaml  # the mutated objects, in order
        results:                    # per object, per rule: a file, or inline as here
          Job/llm-finetune:
            readinessTolerations: applied
            acceleratorNodeGuard: pass

A rule's result is the strongest of its decisions (denied, would-deny, applied, would-apply, notice),
else `off` when its mode is off for the object's namespace, else `pass`. Only the objects and rules a
case lists are checked. `--update` writes the current output to every `mutated` file and every
`results` file (never to the test file itself, whose comments stay), for review before committing.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from webhook.cli import inputs, output, workloads
from webhook.cli.workloads import Evaluation
from webhook.policy.errors import describe_errors
from webhook.policy.facts import ClusterFacts
from webhook.policy.model import RULE_IDS, Policy, RuleId

TEST_FILE = "gpuguard-test.yaml"
Result = Literal["denied", "would-deny", "applied", "would-apply", "notice", "off", "pass"]
# The outcomes a rule's decisions can have, strongest first: the first one present is its result.
STRONGEST_FIRST: tuple[Result, ...] = ("denied", "would-deny", "applied", "would-apply", "notice")
Results: TypeAlias = dict[str, dict[RuleId, Result]]
RESULTS = TypeAdapter(Results)
CaseStatus = Literal["passed", "failed", "error", "updated"]
CASE_STATUSES: tuple[CaseStatus, ...] = ("passed", "failed", "error", "updated")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Case(_Model):
    name: str = Field(min_length=1)
    manifests: list[str] = Field(min_length=1)
    namespace: str | None = None
    policy: str | None = None
    facts: str | None = None
    mutated: str | None = None
    results: str | Results | None = None

    @model_validator(mode="after")
    def _expects_something(self) -> Case:
        if self.mutated is None and self.results is None:
            raise ValueError(f"case {self.name!r} expects nothing: give mutated, results or both")
        return self


class Suite(_Model):
    """A gpuguard-test.yaml."""

    name: str | None = None
    policy: str | None = None
    facts: str | None = None
    cases: list[Case] = Field(min_length=1)


@dataclass
class Outcome:
    suite: str
    case: str
    status: CaseStatus = "passed"
    details: list[str] = field(default_factory=list)

    def fail(self, detail: str) -> None:
        self.status = "failed"
        self.details.append(detail)


def rule_results(evaluation: Evaluation, policy: Policy, facts: ClusterFacts | None) -> dict[RuleId, Result]:
    outcomes: dict[str, set[str]] = {}
    for decision in evaluation.decisions:
        outcomes.setdefault(decision.rule, set()).add(decision.outcome)
    namespace = evaluation.manifest.namespace
    labels = facts.labels_of(namespace) if facts is not None else None
    results: dict[RuleId, Result] = {}
    for rule in RULE_IDS:
        found = outcomes.get(rule, set())
        strongest = next((result for result in STRONGEST_FIRST if result in found), None)
        off = policy.mode_for(rule, namespace, labels) == "off"
        results[rule] = strongest or ("off" if off else "pass")
    return results


def find_suites(paths: Sequence[str]) -> list[Path]:
    found: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            below = sorted(path.rglob(TEST_FILE))
            if not below:
                raise output.UsageError(f"{given}: no {TEST_FILE} in this directory or below it")
            found.extend(below)
        elif path.is_file():
            found.append(path)
        else:
            raise output.UsageError(f"{given}: no such file or directory")
    return found


def load_suite(path: Path) -> Suite:
    documents = inputs.load_yaml_documents(str(path))
    if len(documents) != 1:
        raise output.UsageError(f"{path}: a test file is one YAML document, found {len(documents)}")
    document = documents[0]
    try:
        return Suite.model_validate(document)
    except ValidationError as exc:
        raise output.UsageError(f"{path}: not a gpuguard test: {describe_errors(exc, Suite)}") from None


class _Runner:
    def __init__(self, update: bool) -> None:
        self.update = update
        # Policies and facts shared by many cases are read once.
        self._policies: dict[Path | None, Policy] = {}
        self._facts: dict[Path | None, ClusterFacts | None] = {}

    def policy(self, path: Path | None) -> Policy:
        if path not in self._policies:
            self._policies[path] = inputs.load_policy(str(path) if path else None)
        return self._policies[path]

    def facts(self, path: Path | None) -> ClusterFacts | None:
        if path not in self._facts:
            self._facts[path] = inputs.load_facts(str(path) if path else None)
        return self._facts[path]

    def run(self, suite: Suite, here: Path, case: Case, outcome: Outcome) -> None:
        def local(name: str | None) -> Path | None:
            return here / name if name else None

        policy = self.policy(local(case.policy or suite.policy))
        facts = self.facts(local(case.facts or suite.facts))
        sources = [here / m for m in case.manifests]
        manifests = inputs.read_manifests([str(source) for source in sources], namespace=case.namespace)
        evaluations = workloads.evaluate(manifests, policy, facts)
        if case.mutated is not None:
            # `mutated` may name the input itself ("left unchanged"): --update never rewrites an input.
            inputs_named = any((here / case.mutated).resolve() == source.resolve() for source in sources)
            self._check_mutated(
                here / case.mutated, [e.mutated.obj for e in evaluations], outcome, writable=not inputs_named
            )
        actual = {e.manifest.title: rule_results(e, policy, facts) for e in evaluations}
        if isinstance(case.results, str):
            self._check_results_file(here / case.results, actual, outcome)
        elif case.results is not None:
            for detail in _mismatches(case.results, actual):
                outcome.fail(detail)
            if outcome.status == "failed" and self.update:
                outcome.details.append("inline results are not updated: edit the test file, or use a file")

    def _record(self, path: Path, text: str, outcome: Outcome) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        outcome.status = "updated" if outcome.status == "passed" else outcome.status
        outcome.details.append(f"wrote {path}")

    def _check_mutated(self, path: Path, objects: list[Any], outcome: Outcome, *, writable: bool) -> None:
        text = "---\n".join(output.dump_yaml(obj) for obj in objects)
        expected = inputs.load_yaml_documents(str(path)) if path.is_file() else None
        if expected == objects:
            return
        if self.update and writable:
            self._record(path, text, outcome)
        elif expected is None:
            outcome.fail(f"{path}: missing (run with --update to record the current output)")
        else:
            recorded = "---\n".join(output.dump_yaml(obj) for obj in expected)
            diff = difflib.unified_diff(
                recorded.splitlines(keepends=True), text.splitlines(keepends=True), str(path), "mutated"
            )
            hint = "record them with --update" if writable else "it is an input: not updated"
            outcome.fail(f"mutated objects differ from {path} ({hint}):\n" + "".join(diff).rstrip())

    def _check_results_file(self, path: Path, actual: Results, outcome: Outcome) -> None:
        if self.update:
            text = output.dump_yaml(actual)
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                self._record(path, text, outcome)
            return
        if not path.is_file():
            outcome.fail(f"{path}: missing (run with --update to record the current output)")
            return
        documents = inputs.load_yaml_documents(str(path))
        try:
            expected = RESULTS.validate_python(documents[0] if len(documents) == 1 else documents)
        except ValidationError as exc:
            raise output.UsageError(f"{path}: not a results file: {describe_errors(exc, Case)}") from None
        for detail in _mismatches(expected, actual):
            outcome.fail(detail)


def _mismatches(expected: Results, actual: Results) -> list[str]:
    found = []
    for title, rules in expected.items():
        if title not in actual:
            found.append(f"{title}: no such object in the manifests (objects: {', '.join(actual) or 'none'})")
            continue
        for rule, result in rules.items():
            if actual[title][rule] != result:
                found.append(f"{title} {rule}: expected {result}, got {actual[title][rule]}")
    return found


def run_test(args: argparse.Namespace) -> int:
    runner = _Runner(update=args.update)
    plan: list[tuple[Suite, Path, Case]] = []
    for path in find_suites(args.paths):
        suite = load_suite(path)
        plan.extend((suite, path.parent, case) for case in suite.cases)
    outcomes: list[Outcome] = []
    with output.Progress(len(plan), "gpuguard test") as progress:
        for suite, here, case in plan:
            progress.step(f"{here}: {case.name}")
            outcome = Outcome(suite.name or str(here), case.name)
            try:
                runner.run(suite, here, case, outcome)
            except output.UsageError as exc:
                # A case whose input cannot be read is an error of that case; the others still run.
                outcome.status = "error"
                outcome.details.append(str(exc))
            outcomes.append(outcome)
    rows = [(o.suite, o.case, o.status, o.details[0].splitlines()[0] if o.details else "") for o in outcomes]
    sys.stdout.write(output.table(("suite", "case", "result", "detail"), rows))
    for o in outcomes:
        # The table shows each case's first line; a failure with more to say is printed in full after it.
        if o.status in ("failed", "error") and "\n".join(o.details) != o.details[0].splitlines()[0]:
            print(f"\n--- {o.suite}: {o.case}\n" + "\n".join(o.details))
    counts = {status: sum(1 for o in outcomes if o.status == status) for status in CASE_STATUSES}
    shown = [(status, n) for status, n in counts.items() if n or status in ("passed", "failed")]
    print(output.summary(len(outcomes), "case", shown))
    return output.EXIT_FAILED if counts["failed"] or counts["error"] else output.EXIT_OK


def register(commands: output.Commands) -> None:
    parser = output.add_parser(
        commands,
        "test",
        help=f"run the declarative policy tests ({TEST_FILE}) under each DIR; exit 1 on any mismatch",
    )
    parser.add_argument("paths", nargs="+", metavar="DIR", help=f"a folder holding {TEST_FILE} files, or one")
    parser.add_argument(
        "--update",
        action="store_true",
        help="record the current output in every `mutated` and `results` file (review the diff, then commit)",
    )
    parser.set_defaults(run=run_test)
