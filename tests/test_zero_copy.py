"""``load(zero_copy=True)``: fresh tensors that view the loaded image (issue
16 target 5): bit-exact while later saves run, the slot pinned until they
are gone, and read-only. And a fresh load of an image in private memory
(not a ring slot), which hands that memory to its tensors: writable, and
nothing of acp reads it again."""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

import acp
from acp import _acp

from .conftest import MakeCkpt, save_raw, two_ranks
from .helpers import run_child


def state(seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(128, 64, generator=g),
        "b": torch.randn(64, generator=g).to(torch.bfloat16),
        "p": torch.nn.Parameter(torch.randn(8, generator=g)),
        "empty": torch.zeros(0),
        "step": seed,
    }


def test_views_stay_exact_while_later_saves_run_and_dropping_them_frees_the_slot(
    make_ckpt: MakeCkpt,
) -> None:
    ckpt = make_ckpt(ring_slots=2)
    saved = state(1)
    ckpt.save(1, saved).wait()
    out = ckpt.load(1, zero_copy=True)
    assert ckpt.last_load is not None
    assert ckpt.last_load.source == "ram"
    w = out["w"]
    # A view of the slot, not a tensor of its own.
    assert w._base is not None
    assert isinstance(out["p"], torch.nn.Parameter)
    for step in range(2, 7):
        ckpt.save(step, state(step)).wait()
        # The pinned slot keeps step 1 resident: saves use the other slot.
        assert 1 in ckpt.snapshots()
    for k in ("w", "b", "p", "empty"):
        assert torch.equal(out[k], saved[k]), k  # type: ignore[arg-type]
    assert out["step"] == 1
    # A copying load of the same step still works beside the views.
    assert torch.equal(ckpt.load(1)["w"], saved["w"])  # type: ignore[arg-type]
    del out, w
    gc.collect()
    for step in range(7, 10):
        ckpt.save(step, state(step)).wait()
    assert 1 not in ckpt.snapshots()


def test_views_of_a_storage_load_are_exact(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt()
    saved = state(4)
    ckpt.save(4, saved).wait()
    out = ckpt.load(4, zero_copy=True, storage_only=True)
    assert ckpt.last_load is not None
    assert ckpt.last_load.source == "storage"
    assert out["w"]._base is not None
    assert torch.equal(out["w"], saved["w"])  # type: ignore[arg-type]


def test_zero_copy_copies_what_an_adapter_cannot_view(make_ckpt: MakeCkpt) -> None:
    """NumPy arrays beside torch tensors: the tensors view the image, the
    arrays (whose adapter makes no views) are copies, and both are exact."""
    ckpt = make_ckpt()
    saved = {**state(5), "arr": np.arange(1000, dtype=np.float32)}
    ckpt.save(5, saved).wait()
    out = ckpt.load(5, zero_copy=True)
    assert out["w"]._base is not None
    assert torch.equal(out["w"], saved["w"])  # type: ignore[arg-type]
    assert np.array_equal(out["arr"], saved["arr"])


def test_zero_copy_with_into_is_refused(ckpt: acp.Checkpointer) -> None:
    ckpt.save(1, state(1)).wait()
    with pytest.raises(acp.InvalidInput, match="zero_copy"):
        ckpt.load(1, into=state(0), zero_copy=True)


def test_a_write_through_a_view_is_refused(tmp_path: Path, shm_dir: Path) -> None:
    """The pages are read-only: an in-place op faults (the child dies of
    SIGSEGV) instead of changing the resident checkpoint; a copy load in a
    fresh process afterwards sees the saved bytes."""
    script = textwrap.dedent(
        f"""
        import torch, acp
        ckpt = acp.Checkpointer({str(tmp_path / "ckpt")!r}, shm_dir={str(shm_dir)!r},
                                job="zc", ring_bytes=32 << 20, mlock=False)
        ckpt.save(1, {{"w": torch.ones(1024)}}).wait()
        out = ckpt.load(1, zero_copy=True)
        print("loaded", flush=True)
        out["w"].add_(1)
        print("written", flush=True)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,  # where a core dump would go
    )
    assert "loaded" in proc.stdout, proc.stderr
    assert "written" not in proc.stdout
    assert proc.returncode == -signal.SIGSEGV, proc.stderr
    with acp.Checkpointer(
        tmp_path / "ckpt", shm_dir=shm_dir, job="zc", ring_bytes=32 << 20, mlock=False
    ) as ckpt:
        assert torch.equal(ckpt.load(1)["w"], torch.ones(1024))


def test_a_view_given_as_into_is_refused_not_written(tmp_path: Path, shm_dir: Path) -> None:
    """Zero-copy views passed back as ``into=`` (from RAM or from storage;
    contiguous, or strided views that torch fills) are refused with an
    error naming the tensor, where the load wrote into
    their read-only pages and the process died of SIGSEGV; the views keep
    the saved bytes, and their clones take the load. In a child process, so
    that a regression fails this test, not the whole run."""
    script = textwrap.dedent(
        f"""
        import torch, acp
        ckpt = acp.Checkpointer({str(tmp_path / "ckpt")!r}, shm_dir={str(shm_dir)!r},
                                job="zi", ring_bytes=32 << 20, mlock=False)
        saved = {{"w": torch.arange(1024, dtype=torch.float32), "b": torch.ones(16),
                  "m": torch.arange(4096, dtype=torch.float32).reshape(64, 64)}}
        ckpt.save(1, saved).wait()
        views = ckpt.load(1, zero_copy=True)
        strided = {{"m": views["m"].t()}}  # torch fills a strided target itself
        for into, storage_only in ((views, False), (views, True), (strided, False)):
            try:
                ckpt.load(1, into=into, storage_only=storage_only)
            except acp.InvalidInput as e:
                print("refused:", e, flush=True)
        assert all(torch.equal(views[k], saved[k]) for k in saved)
        copies = {{k: torch.zeros_like(v) for k, v in views.items()}}
        ckpt.load(1, into=copies)
        assert all(torch.equal(copies[k], saved[k]) for k in saved)
        print("intact", flush=True)
        del views
        ckpt.close()
        """
    )
    proc = run_child(script, tmp_path)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    refusals = [line for line in proc.stdout.splitlines() if line.startswith("refused:")]
    assert len(refusals) == 3, proc.stdout
    assert all("read-only view" in r for r in refusals), refusals
    assert "tensor `w`" in refusals[0], refusals
    assert "`m`" in refusals[2], refusals
    assert "intact" in proc.stdout


def test_dropped_views_free_their_slot_without_a_garbage_collection(
    make_ckpt: MakeCkpt,
) -> None:
    """An evaluation loop: each step saved, loaded zero-copy, evaluated,
    dropped. The views must go (and unpin their slot) when the caller
    drops them: a reference cycle of the load kept them until the garbage
    collector ran, and a save waiting for a slot pauses the collector, so
    the third save waited out `full_timeout` and failed."""
    ckpt = make_ckpt(ring_slots=2, full_timeout=5.0)
    enabled = gc.isenabled()
    gc.disable()
    try:
        for s in range(1, 5):
            ckpt.save(s, {"w": torch.full((1 << 16,), float(s))}).wait()
            views = ckpt.load(zero_copy=True)
            assert float(views["w"][0]) == s
            gone = weakref.ref(views["w"])
            del views
            assert gone() is None, f"step {s}: the view outlived the caller's reference"
    finally:
        if enabled:
            gc.enable()
    assert ckpt.snapshots() == [4, 3]


def test_a_fresh_load_of_private_memory_hands_it_to_the_tensors(
    tmp_path: Path, shm_dir: Path
) -> None:
    """Rank 0 loads rank 1's file from rank 1's slot on this node: the
    image is copied into private memory for the load, and the tensors are
    views of that copy (not a second copy), writable; rank 1's resident
    image is unchanged by writes through them. A load of a ring slot still
    copies."""
    ckpts = two_ranks(acp.Checkpointer, tmp_path / "ckpt", shm_dir, job="give")
    try:
        saved = state(3)
        handles = [c.save(1, saved if c.rank == 1 else state(9)) for c in ckpts]
        for h in handles:
            h.wait()  # a step commits once both ranks wrote
        out = ckpts[0].load(1, rank=1)
        assert ckpts[0].last_load is not None
        assert ckpts[0].last_load.source == "ram"
        for k in ("w", "b", "p", "empty"):
            assert torch.equal(out[k], saved[k]), k  # type: ignore[arg-type]
        assert out["w"]._base is not None  # a view of the private image
        assert isinstance(out["p"], torch.nn.Parameter)
        out["w"].add_(1)
        with torch.no_grad():
            out["p"].mul_(2)
        assert torch.equal(out["w"], saved["w"] + 1)  # type: ignore[operator]
        # Rank 1's resident image, and a new load of it, are not changed.
        again = ckpts[0].load(1, rank=1)
        assert torch.equal(again["w"], saved["w"])  # type: ignore[arg-type]
        own = ckpts[1].load(1)
        assert ckpts[1].last_load is not None
        assert ckpts[1].last_load.source == "ram"
        assert torch.equal(own["w"], saved["w"])  # type: ignore[arg-type]
        assert own["w"]._base is None  # a ring slot: copied
        del out, again
        gc.collect()
    finally:
        for c in ckpts:
            c.close()


def test_a_given_image_is_not_read_again(tmp_path: Path, shm_dir: Path) -> None:
    """``Loaded.give``: only private memory is given; once given, its
    views are writable and everything that would read the image refuses."""
    engines = two_ranks(_acp.Engine, tmp_path / "root", shm_dir, job="given")
    try:
        for h in save_raw(engines, 1, ["t0", "t1"]):  # names are unique across ranks
            h.wait()  # a step commits once both ranks wrote
        slot = engines[1].load(1)
        assert slot.source == "ram"
        assert not slot.give()  # a ring slot is never given
        assert slot.buffer(0).readonly
        private = engines[0].load(1, rank=1)
        assert private.source == "ram"
        assert private.give()
        assert private.given
        assert private.give()  # idempotent
        view = private.buffer(0)
        assert not view.readonly
        assert bytes(view) == bytes(range(16))
        view[0] = 200
        assert not private.protect()
        t = torch.empty(4)
        with pytest.raises(acp.InvalidInput, match="handed to the tensors"):
            private.copy_into([(0, t.data_ptr(), 16)])
        # A protected image is not given.
        protected = engines[0].load(1, rank=1)
        assert protected.protect()
        assert not protected.give()
        del slot, private, protected, view
        gc.collect()
    finally:
        for e in engines:
            e.close()
