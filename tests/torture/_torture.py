"""Shared pieces of the Python torture suites: trial counts (small in CI,
full with ``ACP_TORTURE_FULL=1``), the figures each suite reports, the
trainer child processes, and real small file systems mounted for a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

FULL = os.environ.get("ACP_TORTURE_FULL") == "1"
TRAINER = Path(__file__).with_name("_trainer.py")


def trials(ci: int, full: int) -> int:
    """``ci`` trials, ``full`` with ``ACP_TORTURE_FULL=1``, or exactly
    ``ACP_TORTURE_TRIALS``."""
    forced = os.environ.get("ACP_TORTURE_TRIALS")
    if forced:
        return int(forced)
    return full if FULL else ci


def report(name: str, n: int, failures: list[str]) -> None:
    """Prints the suite's figures, appends them to ``$ACP_TORTURE_REPORT``,
    and fails when a trial failed."""
    print(f"TORTURE {name}: trials={n} failures={len(failures)}", file=sys.stderr)
    path = os.environ.get("ACP_TORTURE_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            rec = {"suite": name, "trials": n, "failures": len(failures)}
            f.write(json.dumps({**rec, "first_failures": failures[:5]}) + "\n")
    assert not failures, f"{name}: {len(failures)} of {n} trials failed:\n" + "\n".join(failures)


def weights(step: int, n: int = 50_000) -> np.ndarray:
    """Deterministic tensor contents of ``step``."""
    return (np.arange(n, dtype=np.int64) * 2654435761 + step * 97).astype(np.float32)


def state(step: int, n: int = 50_000) -> dict[str, object]:
    return {"w": weights(step, n), "b": weights(step + 1000, 17), "step": step}


def assert_state(st: object, step: int, n: int = 50_000) -> None:
    assert isinstance(st, dict), st
    assert st["step"] == step
    np.testing.assert_array_equal(st["w"], weights(step, n))
    np.testing.assert_array_equal(st["b"], weights(step + 1000, 17))


def job() -> str:
    return f"torture-{uuid.uuid4().hex[:12]}"


def run_trainer(
    mode: str, root: Path, shm: Path, job_id: str, *, timeout: float = 120, **env: str
) -> subprocess.Popen[str]:
    """Starts ``_trainer.py MODE ROOT SHM JOB`` (stdout and stderr piped)."""
    return subprocess.Popen(
        [sys.executable, str(TRAINER), mode, str(root), str(shm), job_id],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )


def wait_line(p: subprocess.Popen[str], want: str) -> None:
    """Reads the trainer's stdout until a line equal to ``want``."""
    assert p.stdout is not None
    for line in p.stdout:
        if line.strip() == want:
            return
    _, err = p.communicate(timeout=60)
    raise AssertionError(f"trainer ended before {want!r}: {err}")


@contextmanager
def small_fs(where: Path, size: str = "8m") -> Iterator[Path]:
    """A real tmpfs of ``size`` mounted at ``where`` for the test; skips
    (saying why) where mounting is impossible."""
    where.mkdir(parents=True, exist_ok=True)
    run = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if run.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root or CAP_SYS_ADMIN): {run.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def remount(where: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(where)], check=True)
