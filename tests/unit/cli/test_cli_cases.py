"""`gpuguard test`: the shipped policy tests pass, a mismatch fails, --update records, bad suites say why."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from tests.harness.manifests import EXAMPLES, Gpuguard
from webhook.policy.model import RULE_IDS

SHIPPED = EXAMPLES / "tests"


def test_the_shipped_policy_tests_pass(gpuguard: Gpuguard) -> None:
    run = gpuguard("test", str(SHIPPED))
    assert run.code == 0, run.out + run.err
    header, *rows, summary = run.out.splitlines()
    assert header.split() == ["SUITE", "CASE", "RESULT", "DETAIL"]
    suites = {row.split()[0] for row in rows}
    assert suites == {"default-policy", "warn-mode", "cluster-facts"}
    assert all(" passed" in row for row in rows)
    assert summary == f"{len(rows)} cases: {len(rows)} passed, 0 failed"
    assert len(rows) >= 10


def suite(tmp_path: Path, text: str, **files: str) -> Path:
    folder = tmp_path / "suite"
    folder.mkdir(exist_ok=True)
    shutil.copy(EXAMPLES / "gpu-training-job.yaml", folder / "job.yaml")
    shutil.copy(EXAMPLES / "cpu-pod-on-gpu-node.yaml", folder / "pod.yaml")
    (folder / "gpuguard-test.yaml").write_text(text)
    for name, content in files.items():
        (folder / name.replace("__", ".")).write_text(content)
    return folder


def test_a_wrong_expectation_fails_and_says_how(gpuguard: Gpuguard, tmp_path: Path) -> None:
    folder = suite(
        tmp_path,
        "cases:\n"
        "  - name: the pod passes\n    manifests: [pod.yaml]\n"
        "    results: {Pod/log-shipper: {acceleratorNodeGuard: pass}}\n"
        "  - name: the job is judged\n    manifests: [job.yaml]\n"
        "    results: {Job/llm-finetune: {priority: applied}}\n",
    )
    run = gpuguard("test", str(folder))
    assert run.code == 1
    lines = run.out.splitlines()
    assert lines[1].split()[4:] == [
        "failed",
        "Pod/log-shipper",
        "acceleratorNodeGuard:",
        "expected",
        "pass,",
        "got",
        "denied",
    ]
    assert lines[2].endswith(" passed")
    assert lines[-1] == "2 cases: 1 passed, 1 failed"


def test_update_records_and_then_the_suite_passes(gpuguard: Gpuguard, tmp_path: Path) -> None:
    folder = suite(
        tmp_path,
        "cases:\n  - name: job\n    manifests: [job.yaml]\n    mutated: expected/job.yaml\n"
        "    results: expected/job.results.yaml\n",
    )
    missing = gpuguard("test", str(folder))
    assert missing.code == 1
    assert "expected/job.yaml: missing (run with --update to record the current output)" in missing.out
    updated = gpuguard("test", "--update", str(folder))
    assert updated.code == 0
    assert updated.out.splitlines()[-1] == "1 case: 0 passed, 0 failed, 1 updated"
    (recorded,) = yaml.safe_load((folder / "expected" / "job.results.yaml").read_text()).values()
    assert list(recorded) == list(RULE_IDS)  # every rule, in the policy's order
    protections = ("readinessTolerations", "podFailurePolicy", "gracefulTermination", "priority")
    assert {rule: recorded[rule] for rule in protections} == dict.fromkeys(protections, "applied")
    assert recorded["acceleratorNodeGuard"] == "pass"
    (mutated,) = yaml.safe_load_all((folder / "expected" / "job.yaml").read_text())
    assert mutated["spec"]["podReplacementPolicy"] == "Failed"
    assert gpuguard("test", str(folder)).out.splitlines()[-1] == "1 case: 1 passed, 0 failed"
    # A changed input is now a mismatch, shown as a diff of the mutated objects.
    (folder / "job.yaml").write_text(
        (folder / "job.yaml").read_text().replace("backoffLimit: 4", "backoffLimit: 5")
    )
    changed = gpuguard("test", str(folder))
    assert changed.code == 1
    assert "-  backoffLimit: 4\n+  backoffLimit: 5" in changed.out
    # The test file itself is never rewritten: its comments stay.
    assert (folder / "gpuguard-test.yaml").read_text().startswith("cases:\n  - name: job\n")


def test_inline_results_are_not_updated(gpuguard: Gpuguard, tmp_path: Path) -> None:
    text = "cases:\n  - name: pod\n    manifests: [pod.yaml]\n    results: {Pod/log-shipper: {acceleratorNodeGuard: pass}}\n"
    folder = suite(tmp_path, text)
    run = gpuguard("test", "--update", str(folder))
    assert run.code == 1
    assert "inline results are not updated: edit the test file, or use a file" in run.out
    assert (folder / "gpuguard-test.yaml").read_text() == text


def test_a_case_per_policy_and_facts(gpuguard: Gpuguard, tmp_path: Path) -> None:
    folder = suite(
        tmp_path,
        "policy: warn.yaml\ncases:\n"
        "  - name: warned\n    manifests: [pod.yaml]\n    results: {Pod/log-shipper: {acceleratorNodeGuard: would-deny}}\n"
        "  - name: enforced\n    manifests: [pod.yaml]\n    policy: enforce.yaml\n"
        "    results: {Pod/log-shipper: {acceleratorNodeGuard: denied}}\n",
        warn__yaml="mode: warn\n",
        enforce__yaml="mode: enforce\n",
    )
    assert gpuguard("test", str(folder)).code == 0


def test_the_facts_suite_needs_its_facts(gpuguard: Gpuguard, tmp_path: Path) -> None:
    """Without `facts:` the cluster-facts suite fails: the facts are what decides its cases."""
    copy = tmp_path / "cluster-facts"
    shutil.copytree(SHIPPED / "cluster-facts", copy)
    shutil.copy(EXAMPLES / "gpu-training-job.yaml", tmp_path / "job.yaml")
    text = (copy / "gpuguard-test.yaml").read_text().replace("facts: facts.yaml\n", "")
    (copy / "gpuguard-test.yaml").write_text(text.replace("../../gpu-training-job.yaml", "../job.yaml"))
    run = gpuguard("test", str(copy))
    assert run.code == 1
    assert run.out.splitlines()[-1] == "3 cases: 0 passed, 3 failed"


def test_a_case_that_cannot_be_read_is_an_error_and_the_rest_run(gpuguard: Gpuguard, tmp_path: Path) -> None:
    folder = suite(
        tmp_path,
        "cases:\n  - name: gone\n    manifests: [absent.yaml]\n    results: {}\n"
        "  - name: pod\n    manifests: [pod.yaml]\n    results: {Pod/log-shipper: {acceleratorNodeGuard: denied}}\n",
    )
    run = gpuguard("test", str(folder))
    assert run.code == 1
    assert "absent.yaml: no such file" in run.out.splitlines()[1]
    assert run.out.splitlines()[-1] == "2 cases: 1 passed, 0 failed, 1 error"


def test_bad_suites_are_usage_errors(gpuguard: Gpuguard, tmp_path: Path) -> None:
    folder = suite(
        tmp_path,
        "cases:\n  - name: pod\n    manifests: [pod.yaml]\n"
        "    results: {Pod/log-shipper: {acceleratorNodeGuad: denied}}\n",
    )
    typo = gpuguard("test", str(folder))
    assert typo.code == 2
    assert (
        "not a gpuguard test: cases[0].results" in typo.err
        and "did you mean 'acceleratorNodeGuard'?" in typo.err
    )
    (folder / "gpuguard-test.yaml").write_text("cases:\n  - name: nothing\n    manifests: [pod.yaml]\n")
    vacuous = gpuguard("test", str(folder))
    assert vacuous.code == 2
    assert "case 'nothing' expects nothing: give mutated, results or both" in vacuous.err
    empty = tmp_path / "empty"
    empty.mkdir()
    none = gpuguard("test", str(empty))
    assert (none.code, none.err) == (
        2,
        f"gpuguard: {empty}: no gpuguard-test.yaml in this directory or below it\n",
    )


def test_update_never_rewrites_an_input(gpuguard: Gpuguard, tmp_path: Path) -> None:
    # `mutated: job.yaml` says "left unchanged"; the job is mutated, and --update must not rewrite it.
    folder = suite(tmp_path, "cases:\n  - name: job\n    manifests: [job.yaml]\n    mutated: job.yaml\n")
    before = (folder / "job.yaml").read_text()
    run = gpuguard("test", "--update", str(folder))
    assert run.code == 1
    assert "job.yaml (it is an input: not updated)" in run.out
    assert (folder / "job.yaml").read_text() == before
