"""``_acp.pyi`` is true to the built module (mypy's stubtest)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# stubtest builds with mypy's cache off, so it analysed torch's, numpy's and
# MindSpore's sources on every run (about 40 s of the test suite's time on 2
# cores). The stub imports none of them; acp's own modules and the standard
# library, which it does import, are still analysed.
_CONFIG = """\
[mypy]
[mypy-torch.*,mindspore.*,numpy.*,safetensors.*]
follow_imports = skip
"""


def test_stubs_match_the_extension_module(tmp_path: Path) -> None:
    pytest.importorskip("mypy.stubtest", reason="mypy is not installed")
    config = tmp_path / "stubtest.ini"
    config.write_text(_CONFIG)
    run = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "acp._acp", "--mypy-config-file", str(config)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
