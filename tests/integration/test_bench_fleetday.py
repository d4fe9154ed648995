"""The fleet-day bench (`python -m bench.fleetday`) at a tiny size, so that it cannot rot unnoticed: the
real controllers replayed over a scripted day. Its floors are the bench's business (today's controllers
act on ordinary events, which is what it reveals): this asserts that every run reaches its report, that
the fake API applies what gpuguard writes (a failed node ends up tainted), that a replay is
deterministic and that every write it counts is gpuguard's."""

from __future__ import annotations

import subprocess
import sys

import yaml

from bench import FLOOR_MISSED, fleetday
from tests.harness import REPO_ROOT
from webhook.policy.health import observed
from webhook.policy.model import parse_policy


def test_the_bench_runs_every_scenario_to_its_report() -> None:
    argv = [sys.executable, "-m", "bench.fleetday", "--nodes", "10"]
    result = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)

    # FLOOR_MISSED: a floor missed (the controllers' business); anything else is a failed run.
    assert result.returncode in (0, FLOOR_MISSED), result.stderr[-3000:]
    report = result.stdout
    for row in ("| ordinary day |", "| ordinary day + 1 device failures |", "| rolling bad-driver wave"):
        assert row in report, report
    assert "| scenario | ledger | breaker |" in report, report


def test_a_device_gap_is_tainted_through_the_fake_api_and_a_replay_is_deterministic() -> None:
    def replayed() -> tuple[fleetday.Day, list[fleetday.Write]]:
        day = fleetday.Day(10, 7, fleetday.enforcing())
        gap = next(f for f in fleetday.FAILURES if f.name.startswith("device gap"))
        day.fail(gap, day.cluster.nodes["gpu-00001"], 60)
        day.run(1800)
        return day, day.cluster.writes

    day, writes = replayed()
    assert writes == replayed()[1]
    # The taint gpuguard sent is on the scripted node: the writes reach the objects and their watch.
    assert any(t["key"] == observed.TAINT_KEY for t in day.cluster.nodes["gpu-00001"].taints)
    assert day.replay.nodes.get("gpu-00001").tainted  # type: ignore[union-attr]
    times, missed = day.times_to_act()
    assert missed == [] and len(times) == 1
    assert not [w for w in writes if w.false and w.node == "gpu-00001"]


def test_in_audit_mode_the_ordinary_day_writes_only_what_the_node_agent_reports() -> None:
    # Nothing but gpuguard writes in the replay: audit mode leaves the controllers nothing to send, so
    # every write left is the node agent's (which has no mode), and each is attributed to its event.
    day = fleetday.Day(10, 7, parse_policy(yaml.safe_dump({"health": {"mode": "audit"}})))
    for episode in fleetday.ORDINARY_DAY:
        day.plan(episode)
    day.run()
    assert {w.kind for w in day.cluster.writes} <= {"pod condition"}
    assert {w.cause for w in day.cluster.writes} <= {e.name for e in fleetday.ORDINARY_DAY}
