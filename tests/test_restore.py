"""Restores into the caller's tensors from storage in one pass (issue 16
target 4), and its failure rules."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import acp

from .conftest import MakeCkpt


def state(seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(256, 64, generator=g),
            "b": torch.randn(64, generator=g).to(torch.bfloat16),
            "idx": torch.randint(0, 1000, (300,), generator=g),
        },
        "epoch": seed,
    }


def template() -> dict[str, object]:
    return {
        "model": {
            "w": torch.zeros(256, 64),
            "b": torch.zeros(64, dtype=torch.bfloat16),
            "idx": torch.zeros(300, dtype=torch.int64),
        },
        "epoch": -1,
    }


def same(a: dict[str, object], b: dict[str, object]) -> bool:
    ma, mb = a["model"], b["model"]
    assert isinstance(ma, dict)
    assert isinstance(mb, dict)
    return a["epoch"] == b["epoch"] and all(torch.equal(ma[k], mb[k]) for k in ma)


def data_file(ckpt: acp.Checkpointer, step: int) -> Path:
    (path,) = Path(ckpt.root).glob(f"*{step}/*.safetensors")
    return path


def flip_last_tensor_byte(path: Path) -> None:
    """Flips a byte of the last tensor's data in the file at ``path``."""
    with path.open("r+b") as f:
        f.seek(-10, 2)
        b = f.read(1)
        f.seek(-10, 2)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_storage_load_is_opened_pending_and_read_by_its_copy(ckpt: acp.Checkpointer) -> None:
    saved = state(1)
    ckpt.save(1, saved).wait()
    loaded = ckpt.engine.load(1, storage_only=True, defer=True)
    # Planned from the verified header: nothing read yet.
    assert loaded.pending
    assert not loaded.failed
    assert loaded.source == "storage"
    names = [e[0] for e in loaded.entries()]
    w = torch.zeros(256, 64)
    i = names.index("model.w")
    loaded.copy_into([(i, w.data_ptr(), w.numel() * 4)])
    assert not loaded.pending
    model = saved["model"]
    assert isinstance(model, dict)
    assert torch.equal(w, model["w"])
    assert loaded.report()["source"] == "storage"
    # From RAM, the slot's check is done by the copy: pending, from RAM.
    from_ram = ckpt.engine.load(1, defer=True)
    assert from_ram.pending
    assert from_ram.source == "ram"
    w2 = torch.zeros(256, 64)
    from_ram.copy_into([(i, w2.data_ptr(), w2.numel() * 4)])
    assert not from_ram.pending
    assert torch.equal(w2, model["w"])
    assert from_ram.report()["source"] == "ram"


def test_load_into_from_storage_fills_every_tensor_and_keeps_its_plan(
    ckpt: acp.Checkpointer,
) -> None:
    for step in (1, 2):
        ckpt.save(step, state(step)).wait()
    into = template()
    for step in (1, 2, 1):  # the second load of a structure reuses its plan
        stats = ckpt.load(step, into=into, storage_only=True)
        assert stats.source == "storage"
        assert stats.step == step
        assert same(into, state(step))


@pytest.mark.parametrize("fresh", [False, True], ids=["into", "fresh"])
def test_a_chunk_failing_during_the_read_falls_back_to_the_previous_step(
    ckpt: acp.Checkpointer, fresh: bool
) -> None:
    ckpt.save(1, state(1)).wait()
    ckpt.save(2, state(2)).wait()
    path = data_file(ckpt, 2)
    flip_last_tensor_byte(path)
    into = template()

    def load(fallback: bool) -> dict[str, object]:
        if fresh:
            got: dict[str, object] = ckpt.load(storage_only=True, fallback=fallback)
            return got
        ckpt.load(into=into, storage_only=True, fallback=fallback)
        return into

    with pytest.raises(acp.CheckpointCorrupt, match=path.name):
        load(fallback=False)
    # The values are assigned only after the tensors verified.
    assert into["epoch"] == -1
    got = load(fallback=True)
    assert ckpt.last_load is not None
    assert ckpt.last_load.step == 1
    assert same(got, state(1))


def test_a_fresh_load_from_ram_is_filled_by_the_pass_that_checks_the_slot(
    ckpt: acp.Checkpointer,
) -> None:
    ckpt.save(1, state(1)).wait()
    # Opened pending from RAM, as load(into=) opens it: the fresh tensors
    # are the copy's destinations.
    out = ckpt.load()
    assert same(out, state(1))
    assert ckpt.last_load is not None
    assert (ckpt.last_load.source, ckpt.last_load.verified) == ("ram", True)
    # The tensors own their memory: a write does not reach the slot.
    model = out["model"]
    assert isinstance(model, dict)
    model["w"].add_(1)
    assert same(ckpt.load(), state(1))
    assert same(ckpt.load(zero_copy=True), state(1))


def test_values_only_into_still_verifies_the_step(ckpt: acp.Checkpointer) -> None:
    ckpt.save(1, state(1)).wait()
    path = data_file(ckpt, 1)
    with path.open("r+b") as f:
        f.seek(-10, 2)
        b = f.read(1)
        f.seek(-10, 2)
        f.write(bytes([b[0] ^ 0xFF]))
    into: dict[str, object] = {"epoch": -1}
    with pytest.raises(acp.CheckpointCorrupt):
        ckpt.load(1, into=into, storage_only=True)
    assert into == {"epoch": -1}


def test_a_device_or_strided_target_reads_the_image_then_copies(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt()
    saved = state(3)
    ckpt.save(3, saved).wait()
    into = template()
    model = into["model"]
    assert isinstance(model, dict)
    # A non-contiguous target: copied out of the read image, not in the read.
    model["w"] = torch.zeros(64, 256).t()
    stats = ckpt.load(3, into=into, storage_only=True)
    assert stats.source == "storage"
    assert same(into, saved)


@pytest.mark.parametrize("keep", [True, False], ids=["keep_restored", "off"])
def test_a_new_nodes_restore_is_resident_again_for_the_next_restart(
    make_ckpt: MakeCkpt, tmp_path: Path, keep: bool
) -> None:
    # The job saved on another node: this node's ring is empty.
    (tmp_path / "other-node").mkdir()
    first = make_ckpt(shm_dir=tmp_path / "other-node", release_on_close=True)
    first.save(1, state(1)).wait()
    first.close()
    # The replaced node restores from storage, streamed into the tensors.
    node = make_ckpt(keep_restored=keep)
    into = template()
    assert node.load(into=into).source == "storage"
    assert same(into, state(1))
    node.wait()
    assert node.snapshots() == ([1] if keep else [])
    # It dies before its next save; its successor on the node restores
    # from RAM when the step was kept, else from storage again.
    node.close()
    again = make_ckpt()
    into = template()
    assert again.load(into=into).source == ("ram" if keep else "storage")
    assert same(into, state(1))


def test_the_dying_checkpoint_gives_up_a_slow_reread_of_the_restored_step(
    make_ckpt: MakeCkpt, tmp_path: Path
) -> None:
    """A SIGTERM (or an exception in ``guard()``) right after a new node's
    restore: the dying checkpoint has nothing to persist, and does not wait
    out the re-read that would make the restored step resident again
    (``keep_restored``): the step is on storage."""
    n = 16 << 20  # 64 MiB of float32
    big = {"w": torch.arange(n, dtype=torch.float32)}
    (tmp_path / "other-node").mkdir()
    first = make_ckpt(
        shm_dir=tmp_path / "other-node",
        release_on_close=True,
        ring_bytes=160 << 20,
        chunk_bytes=1 << 20,
    )
    first.save(1, big).wait()
    first.close()
    slow = acp._acp.FaultInjector()
    node = make_ckpt(ring_bytes=160 << 20, chunk_bytes=1 << 20, faults=slow)
    into = {"w": torch.zeros(n, dtype=torch.float32)}
    assert node.load(into=into).source == "storage"
    assert torch.equal(into["w"], big["w"])
    # The re-read now reads 8 MiB a second: 8 s for the whole file; the
    # reads it has in flight when told to stop (8 of 1 MiB) about 1 s.
    slow.throttle(8 << 20, 1 << 20)
    time.sleep(0.3)
    report = node.dying_checkpoint()
    assert report.ok, report.error
    assert report.committed_step == 1
    assert report.secs < 5, report
    slow.throttle(0, 1 << 20)
    assert node.snapshots() == []
