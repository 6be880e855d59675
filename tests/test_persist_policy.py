"""The persist policy from Python: ``save(persist=...)``, the policy
keywords, ``wait()`` on a save that is not persisted, ``snapshots()``, the
outcome in ``SaveStats`` and the persist figures in ``stats()``."""

from __future__ import annotations

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
