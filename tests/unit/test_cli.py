"""`gpuguard` on the shipped examples, through webhook.cli.main with captured output."""

from __future__ import annotations

import io
import ipaddress
import json
import stat
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from webhook import cli
from webhook.policy import engine
from webhook.policy.model import default_policy

from .builders import EXAMPLES, admission_review, apply, assert_same_json, container, defaulted_gpu_pod, pod

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
    assert out.err == ""


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


def test_validate_denies_the_cpu_pod_on_a_gpu_node(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["validate", "-f", str(CPU_ON_GPU_NODE)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(
        "Pod/log-shipper: acceleratorNodeGuard (enforce) denied: priority 0 (no class) < 1000"
    )
    assert "nodeSelector cloud.google.com/gke-accelerator" in out


@pytest.mark.parametrize("name", GPU_EXAMPLES)
def test_validate_passes_the_gpu_examples(capsys: pytest.CaptureFixture[str], name: str) -> None:
    assert cli.main(["validate", "-f", example(name)]) == 0
    assert "denied" not in capsys.readouterr().out


def test_validate_respects_the_namespace(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["validate", "-f", str(CPU_ON_GPU_NODE), "-n", "kube-system"]) == 0
    assert capsys.readouterr().out == ""


def test_review_answers_a_mutate_review(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    request = tmp_path / "review.json"
    request.write_bytes(admission_review(defaulted_gpu_pod(), uid="cli-1"))
    assert cli.main(["review", str(request)]) == 0
    answer = json.loads(capsys.readouterr().out)
    response = answer["response"]
    assert (answer["kind"], response["uid"], response["allowed"]) == ("AdmissionReview", "cli-1", True)
    assert response["patchType"] == "JSONPatch"


def test_review_validate_denies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    request = tmp_path / "review.json"
    cpu_pod = pod(container(limits={"cpu": "1"}), nodeSelector={"nvidia.com/gpu.present": "true"})
    request.write_bytes(admission_review(cpu_pod, uid="cli-2"))
    assert cli.main(["review", "--validate", str(request)]) == 1
    response = json.loads(capsys.readouterr().out)["response"]
    assert (response["uid"], response["allowed"], response["status"]["code"]) == ("cli-2", False, 403)
    assert response["status"]["message"].startswith("gpuguard acceleratorNodeGuard: ")


def test_review_validate_allows_a_gpu_pod(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    request = tmp_path / "review.json"
    request.write_bytes(admission_review(defaulted_gpu_pod(priority=10000, priorityClassName="gpu-workload")))
    assert cli.main(["review", "--validate", str(request)]) == 0
    assert json.loads(capsys.readouterr().out)["response"]["allowed"] is True


def test_policy_check_good(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text("mode: warn\nrules:\n  priority:\n    className: ml-gpu\n")
    assert cli.main(["policy", "check", str(policy_file)]) == 0
    assert capsys.readouterr().out.startswith("policy ok: hash ")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("mode: enforce\nbogus: 1\n", "bogus: Extra inputs are not permitted", id="unknown-key"),
        pytest.param("mode: [\n", "not valid YAML", id="bad-yaml"),
        pytest.param("- a\n", "policy must be a mapping", id="not-a-mapping"),
    ],
)
def test_policy_check_bad(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(text)
    assert cli.main(["policy", "check", str(policy_file)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpuguard: ") and message in err


def test_policy_check_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["policy", "check", str(tmp_path / "absent.yaml")]) == 2
    assert "absent.yaml" in capsys.readouterr().err


def test_policy_default_round_trips_through_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["policy", "default"]) == 0
    policy_file = tmp_path / "default.yaml"
    policy_file.write_text(capsys.readouterr().out)
    assert cli.main(["policy", "check", str(policy_file)]) == 0
    assert capsys.readouterr().out == f"policy ok: hash {default_policy().hash}\n"


def test_certs_generate_for_a_service(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cert_dir = tmp_path / "certs"
    args = ["certs", "generate", "--service", "gpuguard", "--namespace", "gpuguard", "--dir", str(cert_dir)]
    assert cli.main(args) == 0
    assert str(cert_dir / "tls.crt") in capsys.readouterr().out

    cert = x509.load_pem_x509_certificate((cert_dir / "tls.crt").read_bytes())
    ca = x509.load_pem_x509_certificate((cert_dir / "ca.crt").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns_names = set(sans.get_values_for_type(x509.DNSName))
    assert {
        "gpuguard",
        "gpuguard.gpuguard",
        "gpuguard.gpuguard.svc",
        "gpuguard.gpuguard.svc.cluster.local",
    } <= dns_names
    assert ipaddress.ip_address("127.0.0.1") in sans.get_values_for_type(x509.IPAddress)
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in eku
    assert cert.issuer == ca.subject
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert stat.S_IMODE((cert_dir / "tls.key").stat().st_mode) == 0o600
