"""The engine's kept save plans directly (``Engine.save_plan``,
``begin_save_planned``, ``Staging.copy_planned``): what a checkpointer's
repeated saves of an unchanged state use."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import acp
from acp import _acp

VALUES = json.dumps({"acp.codec": 1, "state": None})
SPECS = [("a", "F32", (4,)), ("b", "U8", (3,)), ("empty", "F32", (0,))]


@pytest.fixture
def engine(tmp_path: Path, shm_dir: Path) -> Iterator[_acp.Engine]:
    e = _acp.Engine(tmp_path / "root", job="plan", ring_bytes=16 << 20, shm_dir=shm_dir)
    yield e
    e.close()


def test_saves_from_one_plan_copy_the_current_bytes(engine: _acp.Engine) -> None:
    a = torch.arange(4.0)
    b = torch.tensor([7, 8, 9], dtype=torch.uint8)
    host = [(0, a.data_ptr(), 16), (1, b.data_ptr(), 3), (2, 0, 0)]
    plan = engine.save_plan(SPECS, VALUES, host)
    assert len(plan) == 3
    for step in (1, 1234567):
        a.add_(1)
        staging = engine.begin_save_planned(step, plan, extra_metadata={"format": "pt"})
        assert staging is not None
        assert [e[:2] for e in staging.entries()] == [("a", "F32"), ("b", "U8"), ("empty", "F32")]
        staging.copy_planned(plan)
        staging.finish().wait()
        loaded = engine.load(step)
        names = [e[0] for e in loaded.entries()]
        assert bytes(loaded.buffer(names.index("a"))) == a.numpy().tobytes()
        assert bytes(loaded.buffer(names.index("b"))) == b"\x07\x08\x09"


def test_a_plan_checks_its_input_once(engine: _acp.Engine) -> None:
    with pytest.raises(acp.InvalidInput, match="given twice"):
        engine.save_plan(SPECS + SPECS[:1], VALUES)
    with pytest.raises(acp.InvalidInput, match="values"):
        engine.save_plan(SPECS, "{")
    with pytest.raises(acp.InvalidInput, match=r"tensor `a`.*3 bytes given"):
        engine.save_plan(SPECS, VALUES, [(0, 4096, 3)])
    with pytest.raises(acp.InvalidInput, match="out of range"):
        engine.save_plan(SPECS, VALUES, [(3, 4096, 1)])


def test_copy_planned_needs_the_plan_the_staging_came_from(engine: _acp.Engine) -> None:
    a = torch.zeros(4)
    b = torch.zeros(3, dtype=torch.uint8)
    host = [(0, a.data_ptr(), 16), (1, b.data_ptr(), 3), (2, 0, 0)]
    plan = engine.save_plan(SPECS, VALUES, host)
    other = engine.save_plan(SPECS, VALUES, host)
    bare = engine.save_plan(SPECS, VALUES)
    staging = engine.begin_save_planned(1, plan)
    assert staging is not None
    with pytest.raises(acp.InvalidInput, match="not started from this plan"):
        staging.copy_planned(other)
    staging.abort()
    staging = engine.begin_save_planned(1, bare)
    assert staging is not None
    with pytest.raises(acp.InvalidInput, match="without host ranges"):
        staging.copy_planned(bare)
    staging.abort()
    # A staging from begin_save has entries of its own: not the plan's.
    staging = engine.begin_save(1, SPECS, VALUES)
    assert staging is not None
    with pytest.raises(acp.InvalidInput, match="not started from this plan"):
        staging.copy_planned(plan)
    staging.abort()


def test_a_planned_save_refuses_a_committed_step(engine: _acp.Engine) -> None:
    plan = engine.save_plan(SPECS, VALUES)
    staging = engine.begin_save_planned(1, plan)
    assert staging is not None
    staging.copy_from(
        [(0, torch.zeros(4).data_ptr(), 16), (1, torch.zeros(3, dtype=torch.uint8).data_ptr(), 3)]
    )
    staging.finish().wait()
    with pytest.raises(acp.CheckpointExists):
        engine.begin_save_planned(1, plan)
