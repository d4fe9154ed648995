"""`gpuguard` as a whole, and `mutate` and `validate` on the shipped examples, in-process: through the
`gpuguard` fixture (argv, stdin and exit code as a user gives and sees them) or webhook.cli.main itself.
What needs the installed console script is in tests/integration/test_console_script.py.
"""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.harness.manifests import EXAMPLES, Gpuguard, apply, assert_same_json
from webhook import cli
from webhook.cli import output
from webhook.policy import engine
from webhook.policy.model import default_policy

GPU_EXAMPLES = ["gpu-training-job.yaml", "gpu-inference-deployment.yaml", "gpu-cronjob.yaml"]
CPU_ON_GPU_NODE = EXAMPLES / "cpu-pod-on-gpu-node.yaml"


def example(name: str) -> str:
    return str(EXAMPLES / name)


def load(name: str) -> dict[str, object]:
    document: dict[str, object] = yaml.safe_load((EXAMPLES / name).read_text())
    return document


def test_mutate_prints_the_mutated_manifest(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["mutate", "-f", example("gpu-training-job.yaml")]) == 0
    out = capsys.readouterr()
    (job,) = list(yaml.safe_load_all(out.out))
    spec = job["spec"]
    template = spec["template"]["spec"]
    assert spec["podReplacementPolicy"] == "Failed"
    assert [rule["action"] for rule in spec["podFailurePolicy"]["rules"]] == ["Ignore", "Count"]
    assert [t["tolerationSeconds"] for t in template["tolerations"]] == [1800, 1800]
    assert template["containers"][0]["lifecycle"] == {"preStop": {"sleep": {"seconds": 10}}}
    assert (template["terminationGracePeriodSeconds"], template["priorityClassName"]) == (60, "gpu-workload")
    assert out.err == "1 object: 1 mutated, 0 unchanged, 0 warned, 0 denied\n"


@pytest.mark.parametrize("name", GPU_EXAMPLES)
def test_mutate_output_equals_the_engine(capsys: pytest.CaptureFixture[str], name: str) -> None:
    assert cli.main(["mutate", "-f", example(name)]) == 0
    (printed,) = list(yaml.safe_load_all(capsys.readouterr().out))
    assert_same_json(printed, engine.mutate(load(name), default_policy(), namespace="default").obj)


def test_mutate_multi_document_from_stdin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text = "\n---\n".join((EXAMPLES / name).read_text() for name in [*GPU_EXAMPLES, CPU_ON_GPU_NODE.name])
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    assert cli.main(["mutate", "-f", "-"]) == 0
    documents = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in documents] == ["Job", "Deployment", "CronJob", "Pod"]
    assert documents[3] == load(CPU_ON_GPU_NODE.name)  # not an accelerator workload: unchanged


def test_mutate_diff(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["mutate", "-f", example("gpu-training-job.yaml"), "--diff"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[:2] == ["--- a/Job/llm-finetune", "+++ b/Job/llm-finetune"]
    assert "+  podReplacementPolicy: Failed" in lines
    assert any(line.startswith("+") and "priorityClassName: gpu-workload" in line for line in lines)
    assert not any(line.startswith("-") and not line.startswith("---") for line in lines), (
        "nothing is removed"
    )


def test_mutate_diff_of_an_untouched_manifest_is_empty(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["mutate", "-f", str(CPU_ON_GPU_NODE), "--diff"]) == 0
    assert capsys.readouterr().out == ""


def test_mutate_patch_prints_one_json_line_per_document(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    names = [*GPU_EXAMPLES, CPU_ON_GPU_NODE.name]
    manifest = tmp_path / "all.yaml"
    manifest.write_text("\n---\n".join((EXAMPLES / name).read_text() for name in names))
    assert cli.main(["mutate", "-f", str(manifest), "--patch"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(names)
    for name, line in zip(names, lines, strict=True):
        operations = json.loads(line)
        original = load(name)
        assert_same_json(
            apply(original, operations), engine.mutate(original, default_policy(), namespace="default").obj
        )
    assert json.loads(lines[-1]) == []


def test_mutate_reports_notices_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "onfailure.yaml"
    manifest.write_text((EXAMPLES / "gpu-training-job.yaml").read_text().replace("Never", "OnFailure"))
    assert cli.main(["mutate", "-f", str(manifest)]) == 0
    err = capsys.readouterr().err
    assert "Job/llm-finetune: podFailurePolicy (enforce) notice: podFailurePolicy skipped" in err


def test_mutate_with_a_warn_policy_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text("mode: warn\n")
    assert (
        cli.main(["mutate", "-f", example("gpu-training-job.yaml"), "--policy", str(policy_file), "--patch"])
        == 0
    )
    out = capsys.readouterr()
    assert out.out == "[]\n"
    assert "(warn) would-apply: set priorityClassName gpu-workload" in out.err


def test_validate_says_so_when_everything_passes(gpuguard: Gpuguard) -> None:
    run = gpuguard("validate", *(arg for name in GPU_EXAMPLES for arg in ("-f", example(name))))
    assert (run.code, run.out, run.err) == (0, "3 objects: 3 passed, 0 warned, 0 denied\n", "")


def test_validate_counts_warnings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text("rules:\n  acceleratorNodeGuard: {mode: warn}\n")
    args = ["validate", "-f", str(CPU_ON_GPU_NODE), "-f", example("gpu-training-job.yaml")]
    assert cli.main([*args, "--policy", str(policy_file)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "2 objects: 1 passed, 1 warned, 0 denied"
    assert "would-deny" in lines[1].split()


def test_validate_respects_the_namespace(gpuguard: Gpuguard) -> None:
    run = gpuguard("validate", "-f", str(CPU_ON_GPU_NODE), "-n", "kube-system")
    assert (run.code, run.out) == (0, "1 object: 1 passed, 0 warned, 0 denied\n")


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_validate_output_formats_hold_every_decision(gpuguard: Gpuguard, fmt: str) -> None:
    run = gpuguard("validate", "-f", str(CPU_ON_GPU_NODE), "-f", example("gpu-training-job.yaml"), "-o", fmt)
    assert run.code == 1
    report = json.loads(run.out) if fmt == "json" else yaml.safe_load(run.out)
    assert report["summary"] == {"objects": 2, "passed": 1, "warned": 0, "denied": 1}
    denied, job = report["results"]
    assert (denied["object"], denied["namespace"], denied["result"]) == (
        "Pod/log-shipper",
        "default",
        "denied",
    )
    assert denied["source"] == str(CPU_ON_GPU_NODE)
    assert denied["decisions"][0]["rule"] == "acceleratorNodeGuard"
    assert denied["decisions"][0]["outcome"] == "denied"
    # Applied mutations are decisions too: the report is every decision, the table only the findings.
    assert {d["rule"] for d in job["decisions"] if d["outcome"] == "applied"} == {
        "readinessTolerations",
        "podFailurePolicy",
        "gracefulTermination",
        "priority",
    }


def test_mutate_json_output_is_the_object_or_a_list(gpuguard: Gpuguard) -> None:
    one = gpuguard("mutate", "-f", example("gpu-training-job.yaml"), "-o", "json")
    assert one.code == 0
    assert_same_json(
        json.loads(one.out),
        engine.mutate(load("gpu-training-job.yaml"), default_policy(), namespace="default").obj,
    )
    two = gpuguard("mutate", "-f", example("gpu-training-job.yaml"), "-f", str(CPU_ON_GPU_NODE), "-o", "json")
    listed = json.loads(two.out)
    assert (listed["apiVersion"], listed["kind"]) == ("v1", "List")
    assert [item["kind"] for item in listed["items"]] == ["Job", "Pod"]
    assert two.err.splitlines()[-1] == "2 objects: 1 mutated, 1 unchanged, 0 warned, 1 denied"


def test_mutate_output_conflicts_with_diff(gpuguard: Gpuguard) -> None:
    run = gpuguard("mutate", "-f", str(CPU_ON_GPU_NODE), "-o", "json", "--diff")
    assert run.code == 2 and "not allowed with argument" in run.err


# --- the command itself ---------------------------------------------------------------------------------


def _actions(
    parser: argparse.ArgumentParser, path: str = "gpuguard"
) -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _actions(sub, f"{path} {name}")
        else:
            yield path, action


def test_every_option_has_help_and_its_default_is_shown() -> None:
    root = cli.parser()
    seen = 0
    for path, action in _actions(root):
        if isinstance(action, argparse._HelpAction):
            continue
        seen += 1
        assert action.help, f"{path} {action.dest}: no help text"
        formatter = output.HelpFormatter(path)
        text = formatter._get_help_string(action) or ""
        unset = action.default in (None, False, []) or action.default == argparse.SUPPRESS
        if action.option_strings and not unset:
            assert "(default: %(default)s)" in text, f"{path} {action.option_strings[0]}: default not shown"
    assert seen > 50  # the walk reached the subcommands


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["serve"],
            ["--host HOST", "(default: 0.0.0.0)", "--port PORT", "(default: 8443)", "(default: certs)"],
        ),
        (["certs", "generate"], ["--dir DIR", "(default: certs)", "(default: gpuguard)"]),
        (["policy", "check"], ["FILE", "a ConfigMap holding it under data.policy.yaml"]),
        (["policy", "status"], ["(default: https://localhost:8443)", "(default: certs/ca.crt)"]),
        (["mutate"], ["-f FILE", "kind: List expanded", "(default: yaml)"]),
    ],
)
def test_help_says_the_defaults(gpuguard: Gpuguard, args: list[str], expected: list[str]) -> None:
    run = gpuguard(*args, "--help")
    assert run.code == 0
    text = " ".join(run.out.split())  # argparse wraps lines where it likes
    for words in expected:
        assert words in text, run.out
