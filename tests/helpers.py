"""Comparison helpers for the tests, and a child interpreter to run in."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (so nan == nan and -0.0 != 0.0)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_same(a: Any, b: Any, key: str = "") -> None:
    """``b`` equals ``a`` with identical types all the way down; tensors
    bit for bit, with the same dtype, shape, device and parameter-ness."""
    assert type(a) is type(b), f"{key}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{key}: {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{key}: {a.shape} != {b.shape}"
        assert a.device == b.device, f"{key}: {a.device} != {b.device}"
        assert a.requires_grad == b.requires_grad, key
        assert torch.equal(bits(a), bits(b)), f"{key}: values differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{key}: keys {list(a)} != {list(b)}"
        for (k1, v1), k2 in zip(a.items(), b):
            assert type(k1) is type(k2), f"{key}.{k1}: key type"
            assert_same(v1, b[k2], f"{key}.{k1}")
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), key
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{key}: length"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{key}.{i}")
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{key}: {a!r} != {b!r}"
    elif type(a).__module__ == "numpy":
        import numpy as np

        np.testing.assert_array_equal(a, b, err_msg=key)
        assert a.dtype == b.dtype, key
    else:
        assert a == b, f"{key}: {a!r} != {b!r}"


def run_child(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Runs ``script`` (Python source) in a child interpreter in ``cwd``
    (where a core dump would go), its output captured: for a test whose
    regression would kill or hang the process it runs in."""
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=cwd,
    )


def start_staged_ranks(
    tmp_path: Path, script: Path, world: int, args: list[str]
) -> tuple[Path, Path, list[subprocess.Popen[bytes]]]:
    """Starts ``world`` ranks of ``script`` (``python script RANK ROOT OUT
    SHM PORT *args``, their stderr in ``tmp_path/stderr-RANK``); returns
    the root, the report directory and the processes once every rank has
    touched ``OUT/staged-RANK``."""
    from tests.test_replicas import free_port

    root, out, shm = tmp_path / "ckpt", tmp_path / "out", tmp_path / "shm"
    out.mkdir()
    shm.mkdir()
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    procs = []
    for r in range(world):
        argv = [str(r), str(root), str(out), str(shm), str(port), *args]
        with (tmp_path / f"stderr-{r}").open("wb") as err:
            procs.append(
                subprocess.Popen([sys.executable, str(script), *argv], env=env, stderr=err)
            )
    deadline = time.monotonic() + 180
    while not all((out / f"staged-{r}").exists() for r in range(world)):
        for r, p in enumerate(procs):
            if p.poll() is not None:
                for q in procs:
                    q.kill()
                raise AssertionError((tmp_path / f"stderr-{r}").read_text()[-3000:])
        if time.monotonic() >= deadline:
            for q in procs:
                q.kill()
            raise AssertionError("the ranks did not stage")
        time.sleep(0.05)
    return root, out, procs
