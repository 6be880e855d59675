"""Receiving a peer's image straight into the memory that keeps it
(``Engine.begin_replica``: a replica slot; ``Engine.begin_peer_image``: the
buffer the next load verifies and reads), as ``acp.replica`` does over
gloo: bit-exact and verified, a corrupted one rejected by name, and no
view of the buffer outliving its seal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import acp
from acp import _acp


def state() -> dict[str, object]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(300, 1024, generator=g), "step": 1}


def saved(tmp_path: Path) -> tuple[acp.Checkpointer, _acp.ReplicaImage, bytes]:
    """A one-rank job that saved step 1, its resident image pinned, and
    the image's digests."""
    shm = tmp_path / "shm-a"
    shm.mkdir()
    ckpt = acp.Checkpointer(tmp_path / "ckpt", job="receipt", shm_dir=shm, ring_bytes=16 << 20)
    ckpt.save(1, state()).wait()
    e = ckpt._engine
    image = e.pin_resident(1)
    return ckpt, image, e.resident_digests(image)


def test_a_replica_received_into_its_slot_is_bit_exact_and_sealed_after_its_views(
    tmp_path: Path,
) -> None:
    ckpt, image, digests = saved(tmp_path)
    r, s, n, chunk, _ = image.meta()
    shm = tmp_path / "shm-b"
    shm.mkdir()
    holder = _acp.Engine(
        tmp_path / "ckpt-b", job="receipt", rank=1, world_size=2, shm_dir=shm,
        ring_bytes=16 << 20, replicas_held=1,
    )  # fmt: skip
    try:
        receipt = holder.begin_replica(r, s, n, chunk)
        view = receipt.buffer()
        view[:] = image.buffer()
        # As gloo receives it: a tensor over the slot.
        into = torch.frombuffer(view, dtype=torch.uint8)
        assert into.numel() == n
        del view
        # A tensor over the slot is alive: sealing it now could let a
        # write through the tensor change a complete replica.
        with pytest.raises(BufferError, match="still in use"):
            receipt.finish(digests)
        assert holder.replicas() == []
        del into
        receipt.finish(digests)
        with pytest.raises(acp.InvalidInput, match="already finished"):
            receipt.buffer()
        assert [(m[0], m[1], m[4]) for m in holder.replicas()] == [(r, s, digests)]
        held = holder.pin_replica(r, s)
        assert held is not None
        assert bytes(held.buffer()) == bytes(image.buffer())
        del held
    finally:
        holder.close()
        del image
        ckpt.close()


def test_digests_that_do_not_describe_the_image_are_refused(tmp_path: Path) -> None:
    ckpt, image, digests = saved(tmp_path)
    r, s, n, chunk, _ = image.meta()
    try:
        receipt = ckpt._engine.begin_peer_image(1, r, s, n, chunk)
        with pytest.raises(acp.InvalidInput, match="digests"):
            receipt.finish(digests[32:])
    finally:
        del image
        ckpt.close()


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_peer_image_received_for_a_replaced_node_is_verified_before_use(
    tmp_path: Path, corrupt: bool
) -> None:
    ckpt, image, digests = saved(tmp_path)
    r, s, n, chunk, _ = image.meta()
    sent = bytearray(image.buffer())
    del image
    ckpt.close()
    # The node is replaced: an empty shared-memory directory.
    fresh = tmp_path / "shm-new"
    fresh.mkdir()
    again = acp.Checkpointer(tmp_path / "ckpt", job="receipt", shm_dir=fresh, ring_bytes=16 << 20)
    try:
        receipt = again._engine.begin_peer_image(3, r, s, n, chunk)
        view = receipt.buffer()
        view[:] = sent
        if corrupt:
            view[n - 100] ^= 0x5A
        del view
        receipt.finish(digests)
        got = again.load(step=1)
        want = state()["w"]
        assert isinstance(want, torch.Tensor)
        assert torch.equal(got["w"], want)
        stats = again.last_load
        assert stats is not None
        if corrupt:
            assert stats.source == "storage"
            assert stats.rejected is not None
            assert "rank 3's replica (torch.distributed)" in stats.rejected
            assert "rank 0's image of step 1" in stats.rejected
        else:
            assert stats.source == "peer"
            assert stats.rejected is None
    finally:
        again.close()


def test_a_peer_image_claim_is_checked_before_memory_is_sized(tmp_path: Path) -> None:
    """The header a peer sends (rank, length, chunk size) is a claim: memory
    for a restore is sized by it only once it describes an image of a rank
    of the job that a slot of its ring could have held (a stale or buggy
    peer's 64 MiB claim for a 16 MiB ring, the image of a rank outside the
    job, another chunk size are refused, naming the replica)."""
    ckpt, image, _ = saved(tmp_path)
    r, s, n, chunk, _ = image.meta()
    e = ckpt._engine
    try:
        with pytest.raises(acp.InvalidInput, match=r"replica of rank 0's step 1.*ring"):
            e.begin_peer_image(1, r, s, 64 << 20, chunk)
        with pytest.raises(acp.InvalidInput, match="rank 1's step 1"):
            e.begin_peer_image(1, r + 1, s, n, chunk)
        with pytest.raises(acp.InvalidInput, match="chunks"):
            e.begin_peer_image(1, r, s, n, chunk * 2)
    finally:
        del image
        ckpt.close()


def test_images_fetched_for_a_restore_and_not_loaded_are_dropped(tmp_path: Path) -> None:
    """A restore may fetch an image its load never takes (another rank's
    file no tensor was missing from): it stayed in the engine's memory
    until the engine closed. ``drop_peer_images`` frees what is left, as
    the collective ``load()`` does once its load ended."""
    ckpt, image, digests = saved(tmp_path)
    r, s, n, chunk, _ = image.meta()
    sent = bytearray(image.buffer())
    del image
    try:
        e = ckpt._engine
        receipt = e.begin_peer_image(3, r, s, n, chunk)
        view = receipt.buffer()
        view[:] = sent
        del view
        receipt.finish(digests)
        assert e.drop_peer_images() == 1
        assert e.drop_peer_images() == 0
    finally:
        ckpt.close()
