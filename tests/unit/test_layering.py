"""The pure core imports no framework, client or crypto library (style.md, item 13)."""

from __future__ import annotations

import json
import subprocess
import sys

CORE = ["engine", "review", "policy", "rules", "patch", "workload", "facts"]
SHELL_ONLY = ["fastapi", "kubernetes", "cryptography", "uvicorn", "starlette"]


def test_pure_core_imports_no_shell_library() -> None:
    code = (
        f"import {', '.join(f'webhook.{module}' for module in CORE)}, sys; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {set(SHELL_ONLY)!r}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]", result.stdout


def test_the_check_itself_sees_shell_imports() -> None:
    # The probe must be able to fail: importing the HTTP shell does pull FastAPI in.
    code = (
        "import webhook.app, sys; "
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & {set(SHELL_ONLY)!r})))"
    )
    result = subprocess.run(
        [sys.executable, "-c", f"import json; {code}"], capture_output=True, text=True, timeout=60, check=True
    )
    assert {"fastapi", "starlette"} <= set(json.loads(result.stdout))


def test_serving_existing_certificates_never_imports_cryptography() -> None:
    # cryptography costs every replica about 10 MB of resident memory (the 64 MB floor of issue 6):
    # only generating or rotating certificates may load it.
    code = (
        "import webhook.cli, webhook.server, webhook.app, webhook.certfiles, sys; "
        "print('cryptography' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "False", result.stdout
