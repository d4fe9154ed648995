"""The controllers bench (`python -m bench.controllers`) at a tiny size, both fleets, so that it cannot
rot unnoticed: it starts its own control plane, creates the nodes, pods (and for DRA the slices and
allocated claims), starts gpuguard controllers, and prints its table. Its floors are the bench's
business: this asserts only that every step ran and every reaction was seen."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench import FLOOR_MISSED
from tests.harness import REPO_ROOT
from tests.harness.controlplane import ControlPlane, without_proxies


@pytest.mark.parametrize(
    ("extra", "fleet", "reaction"),
    [
        ((), "12 nodes and 36 pods", "allocatable dropped -> taint written"),
        (("--dra",), "12 DRA nodes and 36 pods, 24 claims", "driver taint -> DeviceTaintRule written"),
    ],
)
def test_controllers_bench_runs_every_step(
    control_plane: ControlPlane, extra: tuple[str, ...], fleet: str, reaction: str
) -> None:
    argv = [
        sys.executable, "-m", "bench.controllers", "--bin-dir", str(control_plane.bin_dir),
        "--nodes", "12", "--pods-per-node", "3", "--samples", "3", *extra,
    ]  # fmt: skip
    result = subprocess.run(
        argv, cwd=REPO_ROOT, env=without_proxies(), capture_output=True, text=True, timeout=300
    )

    # FLOOR_MISSED: a floor missed, on a busy machine; anything else is a failed run.
    assert result.returncode in (0, FLOOR_MISSED), result.stderr[-3000:]
    report = result.stdout
    assert f"gpuguard controllers, {fleet}, Kubernetes" in report, report
    assert f"| {reaction}, p50 / p99 / max of 3 |" in report, report
