"""Writable views of a staging slot (the private ``_acp`` API): a view made
from the one ``Staging.buffer()`` returns (a slice, a cast, a NumPy array, a
torch tensor) holds the slot as firmly as the view itself. ``finish()``
refuses, naming the tensor, while any of them lives; once they are all gone
it seals the slot, and nothing can write into the resident copy afterwards
(a write through a surviving view used to change the committed image and,
once the slot was remapped, crash the interpreter)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from acp import _acp

VALUES = json.dumps({"acp.codec": 1, "state": None})
SPECS: list[tuple[str, str, tuple[int, ...]]] = [("a", "U8", (16,)), ("b", "U8", (8,))]

DERIVE: dict[str, Callable[[memoryview], Any]] = {
    "slice": lambda mv: mv[0:4],
    "cast": lambda mv: mv.cast("B"),
    "memoryview": memoryview,
    "numpy": lambda mv: np.frombuffer(mv, dtype=np.uint8),
    "torch": lambda mv: torch.frombuffer(mv, dtype=torch.uint8),
    "slice of slice": lambda mv: mv[2:][1:3],
    "obj": lambda mv: mv.obj,
}


@pytest.fixture
def engine(tmp_path: Path, shm_dir: Path) -> Iterator[_acp.Engine]:
    e = _acp.Engine(tmp_path / "root", job="views", ring_bytes=16 << 20, shm_dir=shm_dir)
    yield e
    e.close()


def begin(engine: _acp.Engine, step: int = 1) -> _acp.Staging:
    staging = engine.begin_save(step, SPECS, VALUES)
    assert staging is not None
    return staging


@pytest.mark.parametrize("how", list(DERIVE))
def test_finish_refuses_while_a_derived_view_lives(engine: _acp.Engine, how: str) -> None:
    staging = begin(engine)
    view = staging.buffer(0)
    view[:] = bytes(range(16))
    derived = DERIVE[how](view)
    del view
    gc.collect()
    with pytest.raises(BufferError, match="tensor `a`"):
        staging.finish()
    del derived
    gc.collect()
    staging.finish().wait()
    loaded = engine.load(1)
    names = [e[0] for e in loaded.entries()]
    assert bytes(loaded.buffer(names.index("a"))) == bytes(range(16))


def test_a_released_view_does_not_hold_the_slot(engine: _acp.Engine) -> None:
    staging = begin(engine)
    view = staging.buffer(1)
    view[:] = b"12345678"
    view.release()  # no slice: the release ends the export
    staging.finish().wait()


def test_abort_keeps_the_slot_while_a_derived_view_lives(tmp_path: Path, shm_dir: Path) -> None:
    e = _acp.Engine(
        tmp_path,
        job="views-abort",
        ring_bytes=4 << 20,
        ring_slots=1,
        on_full="skip",
        shm_dir=shm_dir,
    )
    try:
        staging = begin(e)
        view = staging.buffer(0)
        part = view[4:8]
        del view
        staging.abort()
        del staging
        gc.collect()
        assert e.begin_save(2, SPECS, VALUES) is None  # the slice still holds the slot
        part[:] = b"abcd"  # harmless: the slot is not reused while it lives
        del part
        gc.collect()
        again = e.begin_save(2, SPECS, VALUES)
        assert again is not None
        again.abort()
    finally:
        e.close()


# Misuses a slice that outlives its view. Without the fix, finish() accepted
# the save, the write after commit changed the resident copy, and the write
# after the slot was remapped for a larger image was a SIGSEGV: run in a
# child so that a crash fails the test instead of killing pytest.
MISUSE = textwrap.dedent(
    """
    import gc, json, sys
    from acp import _acp

    root, shm = sys.argv[1], sys.argv[2]
    values = json.dumps({"acp.codec": 1, "state": None})
    e = _acp.Engine(root, job="views-misuse", ring_bytes=64 << 20, ring_slots=1, shm_dir=shm)
    staging = e.begin_save(1, [("a", "U8", (4096,))], values)
    view = staging.buffer(0)
    view[:] = b"\\x01" * 4096
    part = view[0:4096]
    del view
    gc.collect()
    try:
        staging.finish().wait()
    except BufferError as err:
        assert "tensor `a`" in str(err), err
        print("refused", flush=True)
        del part
        gc.collect()
        staging.finish().wait()
    else:
        part[:] = b"\\x02" * 4096  # into the committed, resident image
    del staging
    loaded = e.load(1)
    assert bytes(loaded.buffer(0)) == b"\\x01" * 4096, "the resident copy changed"
    del loaded
    # A larger image remaps the only slot.
    big = e.begin_save(2, [("a", "U8", (48 << 20,))], values)
    big.copy_from([])
    big.finish().wait()
    if "part" in dir():
        part[:] = b"\\x03" * 4096
    e.close()
    print("ok", flush=True)
    """
)


def test_a_surviving_slice_never_writes_after_commit(tmp_path: Path, shm_dir: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-c", MISUSE, str(tmp_path / "root"), str(shm_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr)
    assert p.stdout.split() == ["refused", "ok"], p.stdout
