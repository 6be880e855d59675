"""Restores of the same resident image share what was derived from its
header (the engine's parsed header, the entries and values Python reads,
the kept load plan); a slot rewritten by later saves, or a header byte
changed in shared memory between two loads, is read afresh, and
``load(into=)`` still gives exactly the saved state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import acp
from acp.checkpointer import internals

from .conftest import MakeCkpt, slot_dir


def state(k: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(k)
    return {
        "model": {f"w{i}": torch.randn(n, generator=g) for i, n in enumerate([5000, 7, 300])},
        "lr": 0.25 * k,
        "step": k,
    }


def zeroed(s: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: torch.zeros_like(v) for k, v in s["model"].items()}, "lr": 0.0, "step": 0}


def assert_same(want: dict[str, Any], got: dict[str, Any]) -> None:
    for k, v in want["model"].items():
        assert torch.equal(v, got["model"][k]), k
    assert (got["lr"], got["step"]) == (want["lr"], want["step"])


def opened(ckpt: acp.Checkpointer, step: int) -> Any:
    """The engine's load of ``step``, planned and not yet checked."""
    return internals(ckpt).load(step, False, False, None, defer=True)


def test_loads_of_one_image_share_its_entries_and_values(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt(ring_slots=2)
    ckpt.save(1, state(1)).wait()
    a, b = opened(ckpt, 1), opened(ckpt, 1)
    assert a.values_json is b.values_json
    assert all(x is y for x, y in zip(a.entries(), b.entries()))
    assert a.entries() is not b.entries()  # a new list each call
    first = a.values_json
    assert "0.25,1]" in first  # lr, step
    del a, b
    ckpt.save(2, state(2)).wait()
    c = opened(ckpt, 2)
    assert c.values_json is not first
    assert "0.5,2]" in c.values_json


@pytest.mark.parametrize("loads", [1, 2])
def test_a_slot_rewritten_by_later_saves_restores_each_step(
    make_ckpt: MakeCkpt, loads: int
) -> None:
    # Two slots: steps 3, 4 and 5 are saved into slots that held others,
    # with the same structure (the kept load plan is used) and other bytes.
    ckpt = make_ckpt(ring_slots=2)
    into = zeroed(state(1))
    for k in range(1, 6):
        s = state(k)
        ckpt.save(k, s).wait()
        for _ in range(loads):
            stats = ckpt.load(k, into=into)
            assert stats.source == "ram"
            assert_same(s, into)
            into = zeroed(s) if loads == 1 else into
    assert ckpt._plans.load is not None


def test_a_header_byte_changed_between_two_loads_is_not_served(
    make_ckpt: MakeCkpt, shm_dir: Path
) -> None:
    ckpt = make_ckpt(ring_slots=2)
    s = state(3)  # lr 0.75
    ckpt.save(1, s).wait()
    into = zeroed(s)
    for _ in range(2):  # the second through the kept header and plan
        assert ckpt.load(1, into=into).source == "ram"
        assert_same(s, into)
    # The value 0.75 in the slot's header becomes 0.25 (the same length).
    hit = 0
    for slot in sorted(slot_dir(shm_dir).iterdir()):
        data = bytearray(slot.read_bytes())
        at = data.find(b"0.75")
        if at >= 0 and data.find(b"0.75", at + 1) < 0:
            data[at + 2] = ord("2")
            slot.write_bytes(bytes(data))
            hit += 1
    assert hit == 1
    # Planned from the changed header, its check fails and the slot is
    # dropped; the load takes the step from storage, the next source,
    # planned from storage's own header.
    into["lr"] = -1.0
    stats = ckpt.load(1, into=into)
    assert stats.source == "storage"
    assert_same(s, into)
    ckpt.load(1, into=into)
    assert_same(s, into)
