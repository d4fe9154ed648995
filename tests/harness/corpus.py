"""Where the shared corpus of real-world manifests is, and whether this run has it.

The corpus is not part of the repository: CI lays it out next to the clone (`../shared/corpus`; a git
worktree one level further down finds the same folder higher up), and GPUGUARD_CORPUS names another. A clone without it runs every test of its own and skips the tests
marked `corpus`, and the test command's header and summary say which happened. Naming a folder in
GPUGUARD_CORPUS makes the corpus required: a missing one is then an error, not a skip.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.harness import REPO_ROOT

ENV = "GPUGUARD_CORPUS"
REQUIRED = bool(os.environ.get(ENV))
CORPUS = (
    Path(os.environ[ENV]).resolve()
    if REQUIRED
    else next(
        (path / "shared" / "corpus" for path in REPO_ROOT.parents if (path / "shared" / "corpus").is_dir()),
        REPO_ROOT.parent / "shared" / "corpus",
    )
)
PRESENT = CORPUS.is_dir()
FILES = sorted(CORPUS.glob("*.yaml")) if PRESENT else []
