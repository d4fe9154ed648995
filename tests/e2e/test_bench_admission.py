"""The pod-create bench (`bench/run admission`) at a tiny size, so that it cannot rot unnoticed: it starts
its own control plane, installs deploy/ with a gpuguard replica, bench/map/'s policy, the compiled
native policies, hybrid (those compiled for it and the replica's webhooks narrowed) and the no-op webhooks, creates pods in every scenario and writes its report. Its timing floors are the bench's
business, not the suite's: this asserts what must hold on any machine, that no create failed and that
both extensions mutated every pod."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench import FLOOR_MISSED
from tests.harness import REPO_ROOT
from tests.harness.controlplane import ControlPlane, without_proxies


def _floors(report: str) -> dict[str, str]:
    """The floors table of a report: floor -> 'met' or '**missed**'."""
    section = report.split("\nFloors:\n", 1)[1]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    return {cells[0].removeprefix("| "): cells[-1].removesuffix(" |") for cells in rows[1:]}


def test_admission_bench_runs_every_scenario(control_plane: ControlPlane, tmp_path: Path) -> None:
    out = tmp_path / "admission-results.md"
    argv = [
        sys.executable, "-m", "bench.admission", "--k8s-bin", str(control_plane.bin_dir),
        "--rates", "20", "--duration", "1", "--rounds", "1", "--warmup", "0.2", "--saturation", "0.5",
        "--attempts", "1", "--wait-quiet", "0", "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(
        argv, cwd=REPO_ROOT, env=without_proxies(), capture_output=True, text=True, timeout=300
    )

    # FLOOR_MISSED: a timing floor missed, on a busy machine; anything else is a failed run.
    assert result.returncode in (0, FLOOR_MISSED), result.stderr[-3000:]
    report = out.read_text()
    scenarios = (
        "(a) no admission extension",
        "(b) gpuguard webhooks",
        "(c) MutatingAdmissionPolicy",
        "(n) gpuguard policy compile (native)",
        "(h) gpuguard hybrid (native + narrowed webhooks)",
    )
    for scenario in (*scenarios, "(e) no-op webhooks"):
        assert f"| {scenario} | 20/s |" in report
    floors = _floors(report)
    assert floors["No create fails (every scenario, rate and saturation run)"] == "met", report
    assert floors["(b) gpuguard webhooks mutates the created pods"] == "met", report
    assert floors["(c) MutatingAdmissionPolicy mutates the created pods"] == "met", report
    assert floors["(n) gpuguard policy compile (native) mutates the created pods"] == "met", report
    assert floors["(h) gpuguard hybrid (native + narrowed webhooks) mutates the created pods"] == "met", (
        report
    )
    assert "`apiserver_admission_webhook_admission_duration_seconds` mutate.gpuguard.io" in report
    assert "`apiserver_mutating_admission_policy_check_duration_seconds`" in report
    # The no-op webhooks were called (they answered the API server: no create failed, none failed open).
    assert (
        "`apiserver_admission_webhook_admission_duration_seconds` validate.no-op.bench.gpuguard.io" in report
    )
    assert "two webhooks that do nothing, configured as deploy/'s, add" in report
