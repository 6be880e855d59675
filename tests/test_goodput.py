"""The goodput benchmark's smoke run: every mode is SIGKILLed, resumes from a checkpoint
whose checksum matches the trained state, and the results files are written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "acp-bench" / "peers" / "goodput.py"


def test_goodput_quick(tmp_path: Path) -> None:
    out = tmp_path / "out"
    work = tmp_path / "work" / "missing"  # --workdir is created when it does not exist
    cmd = [sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--workdir", str(work)]
    env = {**os.environ, "PYTHONWARNINGS": ""}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("goodput.json", "goodput.md", "goodput.png"):
        assert (out / name).stat().st_size > 0, name
    doc = json.loads((out / "goodput.json").read_text())
    [rnd] = doc["rounds"]
    assert rnd["kills"]
    assert rnd["bare_rate"] > 0
    assert [s["mode"] for s in doc["summary"]] == ["acp", "torch-5", "dcp-5"]
    for s, run in zip(doc["summary"], doc["runs"]):
        assert s["checks"] == "ok", s["failures"]
        assert s["faults"] >= 1, s["mode"]
        assert len(run["spawns"]) == len(rnd["kills"]) + 1
        assert s["resumed"] >= 1, s["mode"]  # a restart restored a step > 0
        restored = [e for e in run["events"] if e["ev"] == "restored"]
        assert restored, s["mode"]
        assert s["useful_steps"] > 0, s["mode"]
        assert run["probe"]["ev"] == "restored"
        assert run["probe"]["step"] == s["useful_steps"]
    acp = doc["summary"][0]
    assert acp["ram_restores"] >= 1  # the restart found the killed worker's slot in RAM
    md = (out / "goodput.md").read_text()
    assert "| acp, save every step |" in md
    # Checkpoint directories and the worker logs are removed at the end.
    assert list(work.iterdir()) == []
