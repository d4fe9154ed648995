"""`gpuguard policy check|default|effective` (status is in test_http.py, against a running server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.harness import REPO_ROOT
from tests.harness.manifests import Gpuguard
from webhook.policy.model import default_policy, parse_policy

README = REPO_ROOT / "docs" / "policy.md"


def test_policy_check_good(gpuguard: Gpuguard, tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text("mode: warn\nrules:\n  priority:\n    className: ml-gpu\n")
    run = gpuguard("policy", "check", "policy.yaml")
    assert run.code == 0
    assert run.out == f"policy ok: hash {parse_policy((tmp_path / 'policy.yaml').read_text()).hash}\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param(
            "mode: enforce\nrules:\n  priorty:\n    className: x\n",
            "invalid policy: rules.priorty: unknown key; did you mean 'priority'?",
            id="misspelt-key",
        ),
        pytest.param(
            "namespaces:\n- names: [a]\n- names: [b]\n  mode: enforced\n",
            "invalid policy: namespaces[1].mode: unknown value 'enforced', expected 'enforce', 'warn', 'audit'"
            " or 'off'; did you mean 'enforce'?",
            id="misspelt-value",
        ),
        pytest.param("mode: [\n", "policy is not valid YAML: line 2, column 1: ", id="bad-yaml"),
        pytest.param("- a\n", "policy must be a mapping", id="not-a-mapping"),
    ],
)
def test_policy_check_bad(gpuguard: Gpuguard, tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "policy.yaml").write_text(text)
    run = gpuguard("policy", "check", "policy.yaml")
    assert run.code == 2
    assert run.err.startswith(f"gpuguard: policy.yaml: {message}"), run.err
    assert "Extra inputs" not in run.err and "<unicode string>" not in run.err


def test_policy_check_missing_file(gpuguard: Gpuguard) -> None:
    run = gpuguard("policy", "check", "absent.yaml")
    assert (run.code, run.err) == (2, "gpuguard: absent.yaml: no such file\n")


def readme_configmap() -> str:
    """The README's complete ConfigMap example, as written there."""
    text = README.read_text()
    start = text.index("```yaml\napiVersion: v1\nkind: ConfigMap\n")
    return text[start + len("```yaml\n") : text.index("```", start + 3)]


def test_policy_check_accepts_the_readmes_configmap(gpuguard: Gpuguard) -> None:
    configmap = readme_configmap()
    run = gpuguard("policy", "check", "-", stdin=configmap)
    policy_yaml = yaml.safe_load(configmap)["data"]["policy.yaml"]
    assert (run.code, run.err) == (0, "")
    assert run.out == (
        f"policy ok: hash {parse_policy(policy_yaml).hash} (ConfigMap gpuguard/gpuguard-policy, key policy.yaml)\n"
    )


def test_policy_default_round_trips_through_check(gpuguard: Gpuguard) -> None:
    printed = gpuguard("policy", "default")
    assert printed.code == 0
    checked = gpuguard("policy", "check", "-", stdin=printed.out)
    assert checked.out == f"policy ok: hash {default_policy().hash}\n"


def test_policy_effective_is_the_merged_policy(gpuguard: Gpuguard, tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text(
        "rules:\n  readinessTolerations: {batchSeconds: 3600}\nnamespaces:\n- names: [research]\n  mode: audit\n"
    )
    run = gpuguard("policy", "effective", "policy.yaml")
    assert run.code == 0
    first, *_ = run.out.splitlines()
    given = parse_policy((tmp_path / "policy.yaml").read_text())
    assert (
        first == f"# policy {given.hash}: policy.yaml merged over the embedded default, as the server runs it"
    )
    effective = yaml.safe_load(run.out)
    assert effective["rules"]["readinessTolerations"] == {
        "batchSeconds": 3600,
        "servingSeconds": 600,
        "apiServerDefaultSeconds": 300,
    }
    # The default namespace exemptions stay, after the policy's own entry; unset fields are left out.
    assert effective["namespaces"][0] == {"names": ["research"], "mode": "audit"}
    assert "kube-system" in effective["namespaces"][1]["names"]
    # It is a policy file itself, and the same policy.
    assert parse_policy(run.out).model_dump() == given.model_dump()


def test_policy_effective_without_a_file_is_the_default(gpuguard: Gpuguard) -> None:
    run = gpuguard("policy", "effective", "-o", "json")
    assert run.code == 0
    assert json.loads(run.out) == default_policy().model_dump(mode="json", exclude_defaults=True)
    assert parse_policy(yaml.safe_dump(json.loads(run.out))).model_dump() == default_policy().model_dump()
