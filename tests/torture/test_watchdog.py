"""The watchdog: a flush that makes no progress for ``stall_timeout`` (a
hung disk, simulated by a storage operation that blocks) is reported to
every waiter with what is stuck; ``close()`` and interpreter exit return
within that bound; once the disk answers again, the flushes finish.

The bounds checked here are liveness, not speed: the stall lasts 600 s,
the watchdog 1 s, and the test allows 60 s."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import acp
from acp import _acp
from tests.conftest import MakeCkpt

from ._torture import assert_state, job, run_trainer, state

HUNG = 600.0
LIVENESS = 60.0


def test_a_hung_flush_is_reported_with_what_is_stuck(make_ckpt: MakeCkpt) -> None:
    faults = _acp.FaultInjector()
    ckpt = make_ckpt(faults=faults, stall_timeout=1.0)
    ckpt.save(1, state(1)).wait()
    faults.arm_stall(1, HUNG)  # the first chunk write of step 2 hangs
    h = ckpt.save(2, state(2))
    t0 = time.monotonic()
    with pytest.raises(acp.AcpTimeout) as e:
        h.wait()
    msg = str(e.value)
    assert "flush stuck: step 2: writing" in msg, msg
    assert "rank-00000.safetensors (chunk 0)" in msg, msg
    assert str(ckpt.root) in msg, msg
    # Every other wait says the same.
    with pytest.raises(acp.AcpTimeout, match="flush stuck: step 2"):
        ckpt.wait()
    with pytest.raises(acp.AcpTimeout, match="flush stuck: step 2"):
        h.wait(timeout=5)
    assert not h.done()
    assert h.stats.error is None  # still running: a poll does not fail it
    # The previous step is untouched.
    assert_state(ckpt.load(1, storage_only=True), 1)
    # The disk answers again: the flush goes on and commits.
    faults.heal()
    h.wait()
    assert ckpt.steps() == [1, 2]
    assert time.monotonic() - t0 < LIVENESS


def test_close_gives_up_on_a_hung_flush_and_the_flush_finishes_later(
    make_ckpt: MakeCkpt, tmp_path: Path
) -> None:
    faults = _acp.FaultInjector()
    # Every save persisted: step 3 queues behind step 2 (coalescing may
    # let step 3 take the place of a step 2 not yet started).
    ckpt = make_ckpt(faults=faults, stall_timeout=1.0, persist_every=1)
    ckpt.save(1, state(1)).wait()
    faults.arm_stall(1, HUNG)
    ckpt.save(2, state(2))
    ckpt.save(3, state(3))  # queued behind the stuck one
    t0 = time.monotonic()
    with pytest.raises(acp.AcpTimeout, match="flush stuck: step 2"):
        ckpt.close()
    assert time.monotonic() - t0 < LIVENESS
    assert ckpt.closed
    # Once the cause is gone, the queued flushes finish and commit.
    faults.heal()
    deadline = time.monotonic() + LIVENESS
    while True:
        try:
            again = make_ckpt()
            break
        except acp.BusyError:  # the old flush thread still holds the ring
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert again.steps() == [1, 2, 3]
    assert_state(again.load(), 3)


def test_a_save_waiting_for_a_slot_behind_a_hung_flush_is_told(make_ckpt: MakeCkpt) -> None:
    faults = _acp.FaultInjector()
    ckpt = make_ckpt(faults=faults, stall_timeout=1.0, ring_slots=1)
    ckpt.save(1, state(1)).wait()
    faults.arm_stall(1, HUNG)
    ckpt.save(2, state(2))  # takes the only slot; its flush hangs
    with pytest.raises(acp.AcpTimeout, match="step 3: waiting for a free ring slot: flush stuck"):
        ckpt.save(3, state(3))
    faults.heal()
    ckpt.wait()
    ckpt.save(3, state(3)).wait()
    assert ckpt.steps() == [1, 2, 3]


@pytest.mark.parametrize(("mode", "code"), [("exit-hung-close", 1), ("exit-hung-no-close", 0)])
def test_interpreter_exit_never_hangs_on_a_hung_flush(
    tmp_path: Path, shm_dir: Path, mode: str, code: int
) -> None:
    p = run_trainer(mode, tmp_path / "ckpt", shm_dir, job(), STALL_TIMEOUT="1.0")
    out, err = p.communicate(timeout=LIVENESS)
    assert p.returncode == code, err
    assert "NOT REACHED" not in out
    if mode == "exit-hung-close":
        assert "AcpTimeout" in err, err
        assert "flush stuck: step 2" in err, err
