"""``_acp.pyi`` is true to the built module (mypy's stubtest)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_stubs_match_the_extension_module() -> None:
    pytest.importorskip("mypy.stubtest", reason="mypy is not installed")
    run = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "acp._acp"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
