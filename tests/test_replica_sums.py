"""A replica travels with the xxh3 quick sums its sender took beside its
blake3 digests: a replica slot keeps them bound to the digests, and a
restore from a peer checks the bytes against them instead of hashing the
image again. Bytes changed on the way are refused by name (the sums
differ, then the digests) and the load falls back to storage; sums damaged
on the way over intact bytes only send the image to the digests, which
pass it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import acp
from acp import _acp


def state() -> dict[str, object]:
    g = torch.Generator().manual_seed(11)
    # Several digest chunks (chunk_bytes below), so each has its own sum.
    return {"w": torch.randn(64, 1024, generator=g), "step": 1}


CHUNK = 64 << 10


def saved(tmp_path: Path) -> tuple[acp.Checkpointer, _acp.ReplicaImage, bytes, bytes]:
    shm = tmp_path / "shm-a"
    shm.mkdir()
    ckpt = acp.Checkpointer(
        tmp_path / "ckpt", job="sums", shm_dir=shm, ring_bytes=16 << 20, chunk_bytes=CHUNK
    )
    ckpt.save(1, state()).wait()
    e = ckpt._engine
    image = e.pin_resident(1)
    digests, sums = e.resident_hashes(image)
    return ckpt, image, digests, sums


def holder_of(tmp_path: Path) -> _acp.Engine:
    shm = tmp_path / "shm-b"
    shm.mkdir()
    return _acp.Engine(
        tmp_path / "ckpt-b", job="sums", rank=1, world_size=2, shm_dir=shm,
        ring_bytes=16 << 20, replicas_held=1, chunk_bytes=CHUNK,
    )  # fmt: skip


def received(holder: _acp.Engine, image: _acp.ReplicaImage) -> _acp.Receipt:
    """``image`` received whole into a replica slot of ``holder``, as a
    transport receives it; ``finish`` seals it."""
    r, s, n, chunk, _ = image.meta()
    receipt = holder.begin_replica(r, s, n, chunk)
    view = receipt.buffer()
    view[:] = image.buffer()
    del view
    return receipt


def test_the_sender_has_one_quick_sum_per_digest(tmp_path: Path) -> None:
    ckpt, image, digests, sums = saved(tmp_path)
    try:
        n = image.meta()[2]
        assert len(digests) == 32 * -(-n // CHUNK)
        assert len(sums) == 8 * (len(digests) // 32)
        assert ckpt._engine.resident_digests(image) == digests
    finally:
        del image
        ckpt.close()


def test_a_replica_slot_keeps_the_sums_it_was_sent_with(tmp_path: Path) -> None:
    ckpt, image, digests, sums = saved(tmp_path)
    r, s, _, _, _ = image.meta()
    holder = holder_of(tmp_path)
    try:
        with pytest.raises(acp.InvalidInput, match="quick sums"):
            received(holder, image).finish(digests, sums + bytes(8))
        received(holder, image).finish(digests, sums)
        held = holder.pin_replica(r, s)
        assert held is not None
        # What a restore of this replica is sent: the sender's digests and sums.
        assert holder.resident_hashes(held) == (digests, sums)
        del held
    finally:
        holder.close()
        del image
        ckpt.close()


@pytest.mark.parametrize("damage", ["none", "bytes", "sums"])
def test_a_peer_image_is_checked_by_its_sums_and_refused_by_name(
    tmp_path: Path, damage: str
) -> None:
    ckpt, image, digests, sums = saved(tmp_path)
    r, s, n, chunk, _ = image.meta()
    sent = bytearray(image.buffer())
    del image
    ckpt.close()
    again, receipt = restarted_with_peer_image(tmp_path, (r, s, n, chunk), sent, damage)
    try:
        got_sums = bytearray(sums)
        if damage == "sums":
            got_sums[0] ^= 1
        receipt.finish(digests, bytes(got_sums))
        rejected = loads_bit_exact(again, 1, "storage" if damage == "bytes" else "peer")
        if damage == "bytes":
            assert rejected is not None
            assert "rank 3's replica (torch.distributed)" in rejected
            assert "rank 0's image of step 1" in rejected
        else:
            assert rejected is None
    finally:
        again.close()


def restarted_with_peer_image(
    tmp_path: Path, meta: tuple[int, int, int, int], sent: bytearray, damage: str
) -> tuple[acp.Checkpointer, _acp.Receipt]:
    """A checkpointer on the same root with empty RAM, and ``sent`` (rank
    ``meta[0]``'s image) received from rank 3 for its next load, one byte
    changed in transit when ``damage == "bytes"`` (its sums then still
    describe the bytes sent); finish the receipt next."""
    r, s, n, chunk = meta
    fresh = tmp_path / "shm-new"
    fresh.mkdir()
    again = acp.Checkpointer(
        tmp_path / "ckpt", job="sums", shm_dir=fresh, ring_bytes=16 << 20, chunk_bytes=CHUNK
    )
    receipt = again._engine.begin_peer_image(3, r, s, n, chunk)
    view = receipt.buffer()
    view[:] = sent
    if damage == "bytes":
        view[n - 100] ^= 0x5A
    del view
    return again, receipt


def loads_bit_exact(ckpt: acp.Checkpointer, step: int, source: str) -> str | None:
    """Loads ``step`` from ``source``, bit-exact; returns what was rejected."""
    got = ckpt.load(step=step)
    want = state()["w"]
    assert isinstance(want, torch.Tensor)
    assert torch.equal(got["w"], want)
    stats = ckpt.last_load
    assert stats is not None
    assert stats.source == source
    return stats.rejected


def test_a_replica_sealed_with_its_sums_alone_takes_its_digests_later(tmp_path: Path) -> None:
    # What an exchange does: the holder seals the replica with the sums
    # (the step counts as replicated), the digests follow when the sender
    # has them.
    ckpt, image, digests, sums = saved(tmp_path)
    r, s, _, _, _ = image.meta()
    holder = holder_of(tmp_path)
    try:
        assert ckpt._engine.resident_sums(image) == sums
        received(holder, image).finish(b"", sums)
        assert [(m[0], m[1], m[4]) for m in holder.replicas()] == [(r, s, b"")]
        held = holder.pin_replica(r, s)
        assert held is not None
        # Served as held: its sums, no digests, and nothing hashed again.
        assert holder.resident_sums(held) == sums
        assert holder.digests_to_send(held) is None
        with pytest.raises(acp.InvalidInput, match="quick sums alone"):
            holder.resident_hashes(held)
        del held
        assert not holder.add_replica_digests(r, s, digests[:-32]), "one per chunk"
        assert not holder.add_replica_digests(r, s + 1, digests), "no such replica"
        assert holder.add_replica_digests(r, s, digests)
        assert not holder.add_replica_digests(r, s, digests), "it has digests now"
        assert [(m[0], m[1], m[4]) for m in holder.replicas()] == [(r, s, digests)]
        held = holder.pin_replica(r, s)
        assert held is not None
        assert holder.digests_to_send(held) == (digests, sums)
        del held
    finally:
        holder.close()
        del image
        ckpt.close()


def test_a_replica_without_sums_or_digests_is_refused(tmp_path: Path) -> None:
    ckpt, image, _, _ = saved(tmp_path)
    r, s, n, chunk, _ = image.meta()
    holder = holder_of(tmp_path)
    try:
        receipt = holder.begin_replica(r, s, n, chunk)
        with pytest.raises(acp.InvalidInput, match="digests"):
            receipt.finish(b"", b"")
        assert holder.replicas() == []
    finally:
        holder.close()
        del image
        ckpt.close()


def test_the_digests_sent_after_the_sums_are_a_persisted_steps_only(tmp_path: Path) -> None:
    shm = tmp_path / "shm-a"
    shm.mkdir()
    ckpt = acp.Checkpointer(
        tmp_path / "ckpt", job="sums", shm_dir=shm, ring_bytes=16 << 20, chunk_bytes=CHUNK
    )
    try:
        ckpt.save(1, state(), persist=False).wait()
        e = ckpt._engine
        e.wait_idle()
        snap = e.pin_resident(1)
        # A RAM snapshot: summed (by the flush thread, or now), never hashed
        # with blake3 for its replicas.
        assert len(e.resident_sums(snap)) == 8 * -(-snap.meta()[2] // CHUNK)
        assert e.digests_to_send(snap) is None
        del snap
        ckpt.save(2, state(), persist=True).wait()
        kept = e.pin_resident(2)
        got = e.digests_to_send(kept)
        assert got is not None
        assert got == e.resident_hashes(kept)
        del kept
    finally:
        ckpt.close()


@pytest.mark.parametrize("committed", [False, True])
@pytest.mark.parametrize("damage", ["none", "bytes"])
def test_a_peer_image_with_sums_alone_is_checked_by_them_or_by_the_index(
    tmp_path: Path, committed: bool, damage: str
) -> None:
    # A replica of a RAM snapshot has its sums alone: they check it. Once
    # its step is committed, the index's digests do (blake3), as the sums
    # bind it to no digests.
    shm = tmp_path / "shm-a"
    shm.mkdir()
    ckpt = acp.Checkpointer(
        tmp_path / "ckpt", job="sums", shm_dir=shm, ring_bytes=16 << 20, chunk_bytes=CHUNK
    )
    ckpt.save(1, {"w": torch.zeros(4), "step": 0}).wait()
    ckpt.save(2, state(), persist=committed).wait()
    e = ckpt._engine
    image = e.pin_resident(2)
    r, s, n, chunk, _ = image.meta()
    sums = e.resident_sums(image)
    sent = bytearray(image.buffer())
    del image
    ckpt.close()  # persists the newest resident step
    if not committed:
        shutil.rmtree(tmp_path / "ckpt" / "step-000000000002")
    again, receipt = restarted_with_peer_image(tmp_path, (r, s, n, chunk), sent, damage)
    try:
        receipt.finish(b"", sums)
        if damage == "bytes" and not committed:
            # No other copy of a RAM snapshot: refused by name, not loaded.
            with pytest.raises(acp.CheckpointNotFound, match="rank 3's replica"):
                again.load(step=2)
            return
        rejected = loads_bit_exact(again, 2, "storage" if damage == "bytes" else "peer")
        if damage == "bytes":
            assert rejected is not None
            assert "rank 3's replica" in rejected
        else:
            assert rejected is None
    finally:
        again.close()


def test_a_persist_waits_while_its_step_is_sent_to_its_holders(tmp_path: Path) -> None:
    """The replica exchange marks its step (``exchange_started``): the
    step's persist pauses until it ends (``exchange_ended``), so that the
    replication goes first; another step's exchange holds nothing back."""
    shm = tmp_path / "shm"
    shm.mkdir()
    with acp.Checkpointer(
        tmp_path / "ckpt", job="yield", shm_dir=shm, ring_bytes=16 << 20, chunk_bytes=CHUNK,
        release_on_close=True,
    ) as ckpt:  # fmt: skip
        e = ckpt.engine
        e.exchange_started(1)
        h = ckpt.save(1, state(), persist=True)
        with pytest.raises(acp.AcpTimeout):
            h.wait(timeout=0.5)
        e.exchange_started(2)
        e.exchange_ended(1)
        stats = h.wait(timeout=5)
        assert stats.step == 1
        # It says how long it waited (at least the 0.5 s above).
        assert stats.replica_wait_secs is not None
        assert stats.replica_wait_secs >= 0.4
        # Step 2's exchange is marked; step 3's persist does not wait for it.
        stats = ckpt.save(3, state(), persist=True).wait(timeout=5)
        assert stats.step == 3
        assert stats.replica_wait_secs == 0.0
        e.exchange_ended(2)
        assert ckpt.steps() == [1, 3]
