"""Real third-party components the tests run beside gpuguard, from the shared third_party folder.

Like the corpus (corpus.py), the folder is not part of the repository: CI lays it out next to the
clone (`../shared/third_party`, found higher up from a worktree). Its archives are unpacked once into
the ignored cache (`.cache/third-party/<archive>/`), where a clean clone's test run puts them too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from tests.harness import REPO_ROOT

CACHE = REPO_ROOT / ".cache" / "third-party"
FOLDER = next(
    (
        path / "shared" / "third_party"
        for path in REPO_ROOT.parents
        if (path / "shared" / "third_party").is_dir()
    ),
    REPO_ROOT.parent / "shared" / "third_party",
)
JOBSET_CRD = Path("config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml")


class Missing(RuntimeError):
    pass


def jobset_source() -> Path:
    """JobSet's source tree (controller, CRDs), unpacked from the shared folder's archive."""
    archives = sorted(FOLDER.glob("jobset-*.tar.gz"))
    if not archives:
        raise Missing(f"no jobset-*.tar.gz in {FOLDER}: the JobSet tests need the shared third_party folder")
    archive = archives[-1]
    target = CACHE / archive.name.removesuffix(".tar.gz")
    if not (target / JOBSET_CRD).is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        # Unpacked beside its place and renamed into it: a run cut short, or another session unpacking at
        # the same time, never leaves a half tree where the next run looks.
        scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=CACHE))
        with tarfile.open(archive) as tar:
            tar.extractall(scratch, filter="data")
        try:
            os.rename(scratch, target)
        except OSError:
            shutil.rmtree(scratch, ignore_errors=True)
            if not (target / JOBSET_CRD).is_file():
                raise
    return target


def jobset_manager() -> Path:
    """JobSet's controller manager, built once from the unpacked source into the cache (a cold build takes
    about 2 minutes on 2 cores; its modules come from the Go module proxy)."""
    source = jobset_source()
    binary = source.with_name(f"{source.name}-bin") / "manager"
    if not binary.is_file():
        binary.parent.mkdir(parents=True, exist_ok=True)
        partial = binary.with_name("manager.partial")
        environment = os.environ | {"GOFLAGS": "-mod=mod", "CGO_ENABLED": "0", "GOTOOLCHAIN": "local"}
        subprocess.run(
            ["go", "build", "-trimpath", "-ldflags=-s -w", "-o", str(partial), "."],
            cwd=source,
            env=environment,
            check=True,
        )
        partial.rename(binary)
    return binary
