"""The persist policy from Python: ``save(persist=...)``, the policy
keywords and the default (coalescing with one rank), ``wait()`` on a save
that is not persisted, ``snapshots()``, the outcome in ``SaveStats`` and the
persist figures in ``stats()``; ``load()`` of a RAM snapshot, before and
after a SIGKILL."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import acp
from tests.conftest import MakeCkpt


def _state(step: int) -> dict[str, object]:
    import numpy as np

    return {"w": np.full(1000, step, dtype=np.float32), "step": step}


def test_persist_false_keeps_a_ram_snapshot_and_wait_returns(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt(ring_slots=3)
    stats = ckpt.save(1, _state(1), persist=False).wait()
    assert (stats.outcome, stats.persisted, stats.done) == ("resident", False, True)
    assert ckpt.steps() == []
    assert ckpt.snapshots() == [1]
    persisted = ckpt.save(2, _state(2), persist=True).wait()
    assert (persisted.outcome, persisted.persisted) == ("persisted", True)
    assert ckpt.steps() == [2]
    figures = ckpt.stats()
    assert figures["persist"]["staged"] == 2
    assert figures["persist"]["persisted"] == 1
    assert figures["persist"]["resident"] == 1
    assert figures["figures"]["saves_resident"] == 1
    assert figures["figures"]["saves_committed"] == 1
    # One rank coalesces in the engine: no agreement to count.
    assert figures["coalesce"] is None
    assert "acp_storage_bytes_written_total" in ckpt.stats("prometheus")


def test_persist_every_decides_by_step(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt(ring_slots=3, persist_every=2)
    outcomes = [ckpt.save(s, _state(s)).wait().outcome for s in range(1, 6)]
    assert outcomes == ["resident", "persisted", "resident", "persisted", "resident"]
    assert ckpt.steps() == [2, 4]
    ckpt.close()  # commits the newest snapshot, step 5
    with make_ckpt(persist_every=2) as again:
        assert again.steps() == [2, 4, 5]


def test_coalescing_is_chosen_by_name(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt(ring_slots=3, persist_policy="coalesce")
    first = ckpt.save(1, _state(1)).wait()
    assert first.outcome == "persisted"  # nothing was in flight
    ckpt.wait()
    assert ckpt.steps() == [1]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"persist_every": 2, "persist_interval": 1.0},
        {"persist_policy": "sometimes"},
        {"persist_every": 0},
        {"persist_policy": "coalesce", "world_size": 2, "rank": 0},
        {"background_nice": 25},
    ],
)
def test_impossible_policies_are_refused(make_ckpt: MakeCkpt, kwargs: dict[str, object]) -> None:
    with pytest.raises(acp.ConfigError, match=r"persist_policy|background_nice"):
        make_ckpt(**kwargs)


def test_load_serves_a_newer_ram_snapshot_over_an_older_committed_step(
    make_ckpt: MakeCkpt,
) -> None:
    import numpy as np

    ckpt = make_ckpt(ring_slots=3)
    ckpt.save(1, _state(1), persist=True).wait()
    ckpt.save(2, _state(2), persist=False).wait()
    ckpt.wait()  # the snapshot is hashed in the background
    assert ckpt.steps() == [1]
    state = ckpt.load()
    assert state["step"] == 2
    assert np.array_equal(state["w"], _state(2)["w"])
    assert ckpt.last_load is not None
    assert ckpt.last_load.source == "ram"
    # By its step too, though it is not committed.
    assert ckpt.load(2)["step"] == 2
    assert ckpt.load(storage_only=True)["step"] == 1


CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    import acp
    root, shm, job = sys.argv[1:4]
    ckpt = acp.Checkpointer(root, job=job, shm_dir=shm, ring_bytes=32 << 20,
                            ring_slots=3, mlock=False)
    ckpt.save(1, {"w": np.full(1000, 1.0, dtype=np.float32), "step": 1},
              persist=True).wait()
    ckpt.save(2, {"w": np.full(1000, 2.0, dtype=np.float32), "step": 2},
              persist=False)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_killed_after_a_ram_only_save_restores_it_from_ram(tmp_path: Path, shm_dir: Path) -> None:
    import numpy as np

    root = tmp_path / "ckpt"
    job = "ram-only-crash"
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(shm_dir), job],
        capture_output=True,
        text=True,
        check=False,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    with acp.Checkpointer(
        root, job=job, shm_dir=shm_dir, ring_bytes=32 << 20, ring_slots=3, mlock=False
    ) as ckpt:
        assert 2 in ckpt.stats()["engine"]["resident_steps"]
        state = ckpt.load()
        assert state["step"] == 2
        assert np.array_equal(state["w"], np.full(1000, 2.0, dtype=np.float32))
        assert ckpt.last_load is not None
        assert ckpt.last_load.source == "ram"
        ckpt.wait()
        assert ckpt.steps() == [1, 2]  # committed on open, in the background


def test_the_default_coalesces_with_one_rank_and_persists_every_save_with_several(
    make_ckpt: MakeCkpt, tmp_path: Path
) -> None:
    faults = acp._acp.FaultInjector()
    ckpt = make_ckpt(ring_slots=4, faults=faults)
    # Step 1's persist hangs on its first storage operation until healed:
    # steps 2 and 3 arrive while it is in flight.
    faults.arm_stall(0, 600.0)
    first = ckpt.save(1, _state(1))
    second = ckpt.save(2, _state(2))
    third = ckpt.save(3, _state(3))
    # Superseded by step 3 at once (persisted, it would wait for step 1).
    done = second.done()
    if not done:
        faults.heal()
    assert done
    assert second.wait().outcome == "superseded"
    faults.heal()
    assert (first.wait().outcome, third.wait().outcome) == ("persisted", "persisted")
    assert ckpt.steps() == [1, 3]
    # With several ranks the default is every save: coalescing would be refused.
    make_ckpt(root=tmp_path / "ranks", job="ranks-default", world_size=2, rank=0).close()
