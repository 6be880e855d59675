"""The Python program of the repository's ``examples/`` folder: the README's
PyTorch quick start runs as users would run it, and README.md shows it exactly
as the example file has it. ``acp-core/tests/examples.rs`` does the same for
the Rust quick start."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "quickstart.py"


def readme_block(heading: str, lang: str) -> str:
    """The body of the first fenced ``lang`` block after ``heading`` in README.md."""
    text = (REPO / "README.md").read_text()
    start = text.index(f"\n{heading}\n")
    m = re.compile(rf"\n```{lang}\n(.*?\n)```\n", re.DOTALL).search(text, start)
    assert m is not None, f"README.md: no ```{lang} block after {heading!r}"
    return m.group(1)


def test_readme_shows_the_python_quick_start() -> None:
    assert readme_block("## Quick start: PyTorch", "python") == EXAMPLE.read_text(), (
        "README.md's PyTorch quick start differs from examples/quickstart.py: "
        "update one from the other"
    )


def test_python_quick_start_runs(tmp_path: Path) -> None:
    # The example keeps its checkpoints and its ring in a directory of
    # tempfile's, here under tmp_path, and removes it at the end: /dev/shm
    # is left alone.
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # One rank coalesces by default: the newest save is always committed,
    # older ones only when no persist was in flight.
    match = re.search(r"committed steps: \[([\d, ]*)\] newest: (\d+)", proc.stdout)
    assert match, proc.stdout
    committed = [int(s) for s in match.group(1).split(",")]
    assert int(match.group(2)) == 9, proc.stdout
    assert committed[-1] == 9, proc.stdout
    assert committed == sorted(set(committed))
    assert set(committed) <= set(range(1, 10))
    # Its directory is gone (torch may leave caches of its own in TMPDIR).
    assert list(tmp_path.glob("acp-readme-*")) == []
