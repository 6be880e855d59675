"""The extension module directly: the pointer intake checks, the lifetime of
memoryviews over slots and loaded checkpoints."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import acp
from acp import _acp

VALUES = json.dumps({"acp.codec": 1, "state": None})


@pytest.fixture
def engine(tmp_path: Path, shm_dir: Path) -> Iterator[_acp.Engine]:
    e = _acp.Engine(tmp_path / "root", job="bindings", ring_bytes=16 << 20, shm_dir=shm_dir)
    yield e
    e.close()


SPECS = [("a", "F32", (4,)), ("b", "U8", (3,)), ("empty", "F32", (0,))]


def begin(engine: _acp.Engine, step: int = 1) -> _acp.Staging:
    staging = engine.begin_save(step, SPECS, VALUES)
    assert staging is not None
    return staging


def test_fill_through_buffers_and_copy_from(engine: _acp.Engine) -> None:
    staging = begin(engine)
    assert [e[0] for e in staging.entries()] == ["a", "b", "empty"]
    assert [e[3] for e in staging.entries()] == [16, 3, 0]
    buf = staging.buffer(0)
    assert not buf.readonly
    assert buf.nbytes == 16
    buf[:] = torch.arange(4.0).numpy().tobytes()
    b = torch.tensor([7, 8, 9], dtype=torch.uint8)
    staging.copy_from([(1, b.data_ptr(), 3), (2, 0, 0)])
    with pytest.raises(BufferError, match="tensor `a`"):
        staging.finish()  # the view is alive: it could still write
    del buf
    h = staging.finish()
    h.wait()
    loaded = engine.load(1)
    names = [e[0] for e in loaded.entries()]
    a = loaded.buffer(names.index("a"))
    assert a.readonly
    assert bytes(a) == torch.arange(4.0).numpy().tobytes()
    assert bytes(loaded.buffer(names.index("b"))) == b"\x07\x08\x09"


def test_copy_from_checks_its_input(engine: _acp.Engine) -> None:
    staging = begin(engine)
    a = torch.zeros(4)
    cases = [
        ([(0, a.data_ptr(), 12)], "12 bytes given"),
        ([(5, a.data_ptr(), 16)], "out of range"),
        ([(0, a.data_ptr(), 16), (0, a.data_ptr(), 16)], "given twice"),
        ([(0, 0, 16)], "null address"),
        ([(0, 2**64 - 8, 16)], "wraps"),
    ]
    for items, pattern in cases:
        with pytest.raises(acp.InvalidInput, match=pattern):
            staging.copy_from(items)
    view = torch.frombuffer(staging.buffer(1), dtype=torch.uint8)
    with pytest.raises(acp.InvalidInput, match="overlaps"):
        staging.copy_from([(1, view.data_ptr(), 3)])  # the slot itself as a source
    del view
    staging.abort()


def test_finish_refuses_while_a_view_is_exported(engine: _acp.Engine) -> None:
    staging = begin(engine)
    t = torch.frombuffer(staging.buffer(0), dtype=torch.float32)
    t.fill_(1.5)
    with pytest.raises(BufferError, match="tensor `a`"):
        staging.finish()
    del t
    staging.finish().wait()
    with pytest.raises(acp.InvalidInput, match="already finished"):
        staging.finish()
    with pytest.raises(acp.InvalidInput, match="already finished"):
        staging.buffer(0)


def test_abort_frees_the_slot(tmp_path: Path, shm_dir: Path) -> None:
    e = _acp.Engine(
        tmp_path, job="abort", ring_bytes=4 << 20, ring_slots=1, on_full="skip", shm_dir=shm_dir
    )
    try:
        staging = begin(e)
        assert e.begin_save(2, SPECS, VALUES) is None  # the only slot is taken
        staging.abort()
        staging.abort()  # idempotent
        again = e.begin_save(2, SPECS, VALUES)
        assert again is not None
        del again  # dropping aborts too
        gc.collect()
        assert e.begin_save(3, SPECS, VALUES) is not None
    finally:
        e.close()


def test_loaded_views_keep_the_checkpoint_alive(engine: _acp.Engine) -> None:
    staging = begin(engine)
    staging.buffer(0)[:] = torch.full((4,), 3.0).numpy().tobytes()
    staging.finish().wait()
    loaded = engine.load(1)
    i = [e[0] for e in loaded.entries()].index("a")
    view = loaded.buffer(i)[4:]  # a slice of the view
    del loaded
    gc.collect()
    assert bytes(view) == torch.full((3,), 3.0).numpy().tobytes()


def test_copy_into_checks_its_input(engine: _acp.Engine) -> None:
    staging = begin(engine)
    staging.buffer(0)[:] = torch.arange(4.0).numpy().tobytes()
    staging.finish().wait()
    loaded = engine.load(1)
    names = [e[0] for e in loaded.entries()]
    ia, ib = names.index("a"), names.index("b")
    dst = torch.zeros(8)
    with pytest.raises(acp.InvalidInput, match="overlaps"):
        loaded.copy_into([(ia, dst.data_ptr(), 16), (ib, dst.data_ptr() + 8, 3)])
    with pytest.raises(acp.InvalidInput, match="bytes given"):
        loaded.copy_into([(ia, dst.data_ptr(), 32)])
    loaded.copy_into([(ia, dst.data_ptr(), 16)])
    assert torch.equal(dst[:4], torch.arange(4.0))
    assert loaded.report()["source"] == "ram"
    assert loaded.source == "ram"
    assert loaded.step == 1


def test_engine_reports(engine: _acp.Engine) -> None:
    report = engine.open_report()
    assert report["io"] in ("uring", "psync")
    assert set(report) >= {"mlocked", "resident_steps", "discarded_half_staged"}
    staging = begin(engine)
    h = staging.finish()
    r = h.wait(timeout=60)
    assert r["step"] == 1
    assert r["bytes"] > 0
    assert h.report() == r
    assert _acp.SaveHandle.skipped(9).wait()["skipped"]


def test_views_in_garbage_cycles_are_freed_safely(tmp_path: Path) -> None:
    """A view caught in a reference cycle (say, a traceback's frame) is
    collected without crashing the interpreter, and keeps its bytes valid
    until then."""
    import subprocess
    import sys
    import textwrap

    # In a child: a crash there is a failed test, not a dead test runner.
    code = textwrap.dedent(
        f"""
        import gc, acp
        ckpt = acp.Checkpointer(
            {str(tmp_path / "root")!r}, job="gc-cycle", shm_dir={str(tmp_path)!r},
            ring_bytes=8 << 20,
        )
        import numpy as np
        ckpt.save(1, {{"w": np.arange(16, dtype=np.float32)}}).wait()
        loaded = ckpt.engine.load()
        v = loaded.buffer(0)
        c = [v]
        c.append(c)
        del loaded, v, c
        gc.collect()
        ckpt.close()
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    gc.collect()
