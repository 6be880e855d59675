"""The coalescing persist policy with several ranks (acp._coalesce): rank 0
decides which saves are persisted, every rank holds each save until it
learns the decision, so every rank writes the same steps and each persisted
step commits; the saves made while a persist is in flight stay RAM
snapshots on every rank, never written."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import acp

from .conftest import SMALL_RING


class _Store:
    """An in-memory store with torch.distributed.Store's set/get/check/add
    and delete_key."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def set(self, key: str, value: str) -> None:
        with self.lock:
            self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        with self.lock:
            return self.data[key]

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            return all(k in self.data for k in keys)

    def add(self, key: str, amount: int) -> int:
        with self.lock:
            value = int(self.data.get(key, b"0")) + amount
            self.data[key] = str(value).encode()
            return value

    def delete_key(self, key: str) -> bool:
        with self.lock:
            return self.data.pop(key, None) is not None

    def coalesce_keys(self) -> list[str]:
        with self.lock:
            return [k for k in self.data if "/coalesce/" in k]


def _in_threads(fn: Any, world: int) -> list[Any]:
    """Runs ``fn(rank)`` for every rank in its own thread; the results by
    rank, raising the first exception."""
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
        assert not t.is_alive(), "a rank hung"
    if errors:
        raise errors[0]
    return results


def _open(
    root: Path, shm_dir: Path, store: _Store, rank: int, world: int, **kwargs: Any
) -> acp.Checkpointer:
    kwargs.setdefault("commit_timeout", 60)
    kwargs.setdefault("ring_slots", 4)
    return acp.Checkpointer(
        root,
        job="coalesce",
        rank=rank,
        world_size=world,
        shm_dir=shm_dir,
        ring_bytes=SMALL_RING,
        mlock=False,
        store=store,
        release_on_close=True,
        **kwargs,
    )


def _state(step: int, rank: int) -> dict[str, object]:
    return {"w": torch.full((16384,), float(step * 10 + rank)), "step": step}


def _decisions(ckpt: acp.Checkpointer) -> list[tuple[int, bool]]:
    coalescer = ckpt._coalescer
    assert coalescer is not None
    return list(coalescer.decisions)


def _committed(root: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in root.glob("step-*/*.index.json"))


def _strays(root: Path) -> list[str]:
    """Names under the root that are neither committed steps nor the hint
    (a pending directory left behind, a half-written step)."""
    return sorted(
        p.name for p in root.iterdir() if not p.name.startswith("step-") and p.name != "latest"
    )


def _check_files(root: Path, step: int, world: int) -> None:
    for rank in range(world):
        data = root / f"step-{step:012d}" / f"rank-{rank:05d}.safetensors"
        assert torch.equal(load_file(data)[f"rank{rank}.w"], _state(step, rank)["w"]), (
            step,
            rank,
        )


def test_ranks_persist_the_steps_rank_0_decides(tmp_path: Path, shm_dir: Path) -> None:
    """Rank 0's persist of step 1 hangs: steps 2 and 3, saved meanwhile,
    are decided "not persisted" and stay snapshots on both ranks, never
    written; once step 1 commits, the next save is persisted by both."""
    root = tmp_path / "ckpt"
    store = _Store()
    faults = acp._acp.FaultInjector()
    ckpts = _in_threads(
        lambda r: _open(root, shm_dir, store, r, 2, faults=faults if r == 0 else None), 2
    )
    try:
        faults.arm_stall(0, 600.0)
        try:
            first = [c.save(1, _state(1, r)) for r, c in enumerate(ckpts)]
            later = [[c.save(s, _state(s, r)) for r, c in enumerate(ckpts)] for s in (2, 3)]
            outcomes = {h.wait().outcome for hs in later for h in hs}
            assert not first[0].done()
        finally:
            faults.heal()
        assert outcomes <= {"resident", "superseded"}, outcomes
        assert [h.wait().outcome for h in first] == ["persisted"] * 2
        fourth = [c.save(4, _state(4, r)) for r, c in enumerate(ckpts)]
        assert [h.wait().outcome for h in fourth] == ["persisted"] * 2
        want = [(1, True), (2, False), (3, False), (4, True)]
        assert [_decisions(c) for c in ckpts] == [want, want]
        for r, c in enumerate(ckpts):
            c.wait(60)
            assert c.stats()["coalesce"] == {
                "persisted": 2,
                "not_persisted": 2,
                "released": 0,
                "not_staged": 0,
                "waiting": 0,
                "leader": r == 0,
            }
        assert _committed(root) == [1, 4]
        for step in (1, 4):
            _check_files(root, step, 2)
        for never in (2, 3):
            assert not list(root.glob(f"*{never:012d}*")), never
        # Every decision was read by rank 1: the store kept none of them.
        assert store.coalesce_keys() == []
        got = _in_threads(lambda r: ckpts[r].load(storage_only=True), 2)
        for r, state in enumerate(got):
            assert state["step"] == 4
            assert torch.equal(state["w"], _state(4, r)["w"])
    finally:
        _in_threads(lambda r: ckpts[r].close(), 2)
    assert _strays(root) == []


@pytest.mark.parametrize("ahead", [1, 2])
def test_a_rank_ahead_of_rank_0_still_persists_the_chosen_step(
    tmp_path: Path, shm_dir: Path, ahead: int
) -> None:
    """Rank 1 stages steps 1..1+ahead before rank 0 saves step 1: when the
    decision "persist step 1" reaches it, newer snapshots were sealed, and
    its held step 1 is still in its ring: step 1 commits with both ranks'
    bytes (without the hold, rank 1 lost step 1 and rank 0 waited
    ``commit_timeout`` for its file)."""
    root = tmp_path / "ckpt"
    store = _Store()
    ckpts = _in_threads(lambda r: _open(root, shm_dir, store, r, 2, commit_timeout=20), 2)
    try:
        ahead_handles = [ckpts[1].save(s, _state(s, 1)) for s in range(1, 2 + ahead)]
        assert ckpts[1].engine.held() == list(range(1, 2 + ahead))
        lead = ckpts[0].save(1, _state(1, 0))
        assert lead.wait().outcome == "persisted"
        assert ahead_handles[0].wait().outcome == "persisted"
        assert _committed(root) == [1]
        _check_files(root, 1, 2)
        # Rank 0 catches up: its next save is persisted (step 1 is done),
        # by rank 1 too, from the snapshot it still holds.
        step2 = ckpts[0].save(2, _state(2, 0))
        assert step2.wait().outcome == "persisted"
        assert ahead_handles[1].wait().outcome == "persisted"
        _check_files(root, 2, 2)
        for s in range(3, 2 + ahead):
            ckpts[0].save(s, _state(s, 0)).wait()
    finally:
        _in_threads(lambda r: ckpts[r].close(), 2)
    assert _committed(root)[-1] == 1 + ahead
    assert _strays(root) == []


def test_wait_returns_once_the_decisions_are_applied(tmp_path: Path, shm_dir: Path) -> None:
    """``wait()`` on a rank waits for rank 0's decisions on its held saves,
    then for the persists they queued: the chosen step is committed."""
    root = tmp_path / "ckpt"
    store = _Store()
    ckpts = _in_threads(lambda r: _open(root, shm_dir, store, r, 2), 2)
    try:
        ckpts[1].save(1, _state(1, 1))
        ckpts[0].save(1, _state(1, 0))
        ckpts[1].wait(120)
        assert ckpts[1].engine.held() == []
        assert ckpts[1].steps() == [1]
    finally:
        _in_threads(lambda r: ckpts[r].close(), 2)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_saving_in_lockstep_on_slow_storage_write_only_decided_steps(
    tmp_path: Path, shm_dir: Path, world: int
) -> None:
    """Each rank saves steps 1..40 on its own thread, at its own pace
    between barriers, to a storage throttled so that a persist takes many
    saves: every committed step is one rank 0 decided to persist (or the
    last, committed by close), every rank applied the same decisions and
    wrote those steps' bytes, no other step left anything on storage."""
    root = tmp_path / "ckpt"
    store = _Store()
    slow = acp._acp.FaultInjector()
    slow.throttle(4 << 20, 64 << 10)
    ckpts = _in_threads(
        lambda r: _open(root, shm_dir, store, r, world, faults=slow, chunk_bytes=64 << 10),
        world,
    )
    barrier = threading.Barrier(world)
    steps = 40
    decisions: list[list[tuple[int, bool]]] = [[] for _ in range(world)]

    def train(rank: int) -> None:
        for step in range(1, steps + 1):
            barrier.wait(timeout=120)
            # The step's compute, longer on some ranks than others (the
            # invariants below hold whatever the timing).
            time.sleep(0.005 * (1 + (step + rank) % 3))
            ckpts[rank].save(step, _state(step, rank))
        ckpts[rank].close()
        decisions[rank] = _decisions(ckpts[rank])

    _in_threads(train, world)
    assert all(d == decisions[0] for d in decisions), decisions
    assert [s for s, _ in decisions[0]] == list(range(1, steps + 1))
    chosen = {s for s, persist in decisions[0] if persist}
    committed = _committed(root)
    assert set(committed) == chosen | {steps}, (committed, decisions[0])
    for step in committed:
        _check_files(root, step, world)
    assert _strays(root) == []
    for step in set(range(1, steps + 1)) - set(committed):
        assert not list(root.glob(f"*{step:012d}*")), step


def test_ranks_release_their_holds_when_rank_0_is_gone(
    tmp_path: Path, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 0 is gone (closed) before the others save: each hold is released
    after the bounded wait (``commit_timeout``), with a log line, and close
    ends, reporting that the newest step could not commit without rank 0;
    nothing pending is left behind."""
    root = tmp_path / "ckpt"
    store = _Store()
    ckpts = _in_threads(lambda r: _open(root, shm_dir, store, r, 3, commit_timeout=1.0), 3)
    ckpts[0].close()
    caplog.set_level(logging.WARNING, logger="acp")
    handles = [[ckpts[r].save(s, _state(s, r)) for s in (1, 2)] for r in (1, 2)]
    for hs in handles:
        assert [h.wait().outcome for h in hs] == ["superseded", "resident"]
    assert all(ckpts[r].engine.held() == [] for r in (1, 2))
    assert "no persist decision for step 1 from rank 0" in caplog.text
    for r in (1, 2):
        counts = ckpts[r].stats()["coalesce"]
        assert (counts["released"], counts["persisted"], counts["leader"]) == (2, 0, False)
    started = time.monotonic()
    errors = _in_threads(lambda r: _close_error(ckpts[r]) if r else None, 3)
    assert time.monotonic() - started < 60
    for r in (1, 2):
        assert isinstance(errors[r], acp.AcpTimeout), errors[r]
        assert "rank 0 did not commit" in str(errors[r])
    assert _committed(root) == []
    assert _strays(root) == []


def _close_error(ckpt: acp.Checkpointer) -> BaseException | None:
    try:
        ckpt.close()
    except acp.AcpError as e:
        return e
    return None
