"""A session killed before its teardown leaves its containers and shims running (the kubelet and
containerd die with it): the next session reclaims them by their cgroup tree, and leaves alone the
trees of sessions still running (another worktree's node tier, for one)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from tests.harness.controlplane import wait_until
from tests.harness.node import (
    CGROUP_PREFIX,
    CgroupTree,
    node_tier_unavailable,
    reclaim_leftovers,
    session_cgroup_prefix,
)


@pytest.fixture
def trees() -> Iterator[tuple[CgroupTree, CgroupTree]]:
    """A tree as a killed session leaves it (named after a process that is gone), and one of this
    live session."""
    if (unavailable := node_tier_unavailable()) is not None:
        pytest.skip(f"node tier not run: {unavailable}")
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead, live = (
        CgroupTree(f"{CGROUP_PREFIX}{gone.pid}-node-x"),
        CgroupTree(f"{session_cgroup_prefix()}node-y"),
    )
    for tree in (dead, live):
        tree.create()
    yield dead, live
    for tree in (dead, live):
        if tree.exists():
            tree.kill_all()
            tree.remove()


def test_a_killed_sessions_processes_and_cgroups_are_reclaimed(trees: tuple[CgroupTree, CgroupTree]) -> None:
    dead, live = trees
    # Like a shim: in the tree, and not a child that dies with anyone.
    shim = subprocess.Popen(["sh", "-c", 'echo $$ > "$1" && exec sleep 600', "sh", str(dead.system_procs)])
    wait_until(lambda: shim.pid in dead.processes(), timeout=10, what="stand-in shim in its cgroup")

    reclaimed = reclaim_leftovers()

    assert f"{dead.name} (1 processes)" in reclaimed
    assert shim.wait(timeout=10) == -9
    assert not dead.exists()
    assert live.exists()
