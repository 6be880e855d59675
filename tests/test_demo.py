"""The demo end to end, reduced: train, SIGKILL mid-run, resume from RAM,
check the losses bit for bit; and proof that the check can fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_demo(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "acp.demo", "--quick", "--steps", "12", "--warm"]
    cmd += ["--workdir", str(tmp_path), "--json", str(tmp_path / "figures.json"), *extra]
    env = {**os.environ, "PYTHONWARNINGS": ""}
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=240, env=env)


def test_demo_resumes_from_ram_bit_exact(tmp_path: Path) -> None:
    proc = run_demo(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "SIGKILLed right after the save of step" in out
    assert "source=ram" in out
    assert "bit-exact: all 12 losses" in out
    assert "torch.save + fsync" in out
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert figures["mismatches"] == []
    assert figures["restored"]["source"] == "ram"
    killed, restored = figures["killed_after"], figures["restored"]["step"]
    assert 6 <= killed < 12
    assert restored >= killed  # nothing saved before the kill was lost
    assert len(figures["ref"]) == 12
    assert figures["restore"]["ram_source"] == "ram"
    assert figures["restore"]["storage_source"] == "storage"
    # The work directory is removed at the end.
    assert [p.name for p in tmp_path.iterdir()] == ["figures.json"]


def test_demo_check_fails_on_a_perturbed_resume(tmp_path: Path) -> None:
    proc = run_demo(tmp_path, "--perturb")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "MISMATCH" in proc.stdout
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert figures["mismatches"]
    assert min(figures["mismatches"]) > figures["restored"]["step"]  # only after the nudge
    # A run that did not resume exactly times no restores.
    assert figures["restore"] == {}
    assert "median" not in proc.stdout
