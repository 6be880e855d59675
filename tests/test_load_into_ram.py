"""``load(into=)`` from RAM through the kept load plan: each chunk of the
resident image is checked as it is copied, tensors that straddle chunks
arrive whole, and a byte changed in the slot after good loads is caught
at the next one (the tensors are then read from storage)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import torch

from .conftest import MakeCkpt, slot_dir
from .helpers import run_child

CHUNK = 64 << 10


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    # Sizes that are no multiple of the chunk: every tensor after the
    # first starts inside a chunk and most cross one or more edges.
    sizes = [100_003, 7, 50_000, 16_385, 1, 40_000]
    model = {f"w{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    return {
        "model": model,
        "optim": {
            "state": {i: {"exp_avg": torch.randn(n, generator=g)} for i, n in enumerate(sizes)},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": list(range(6))}],
        },
    }


def zeroed(s: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {k: torch.zeros_like(v) for k, v in s["model"].items()},
        "optim": {
            "state": {
                i: {"exp_avg": torch.zeros_like(v["exp_avg"])}
                for i, v in s["optim"]["state"].items()
            },
            "param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": []}],
        },
    }


def tensors(s: dict[str, Any]) -> list[torch.Tensor]:
    return [*s["model"].values(), *(v["exp_avg"] for v in s["optim"]["state"].values())]


def assert_same(want: dict[str, Any], got: dict[str, Any]) -> None:
    for a, b in zip(tensors(want), tensors(got)):
        assert torch.equal(a, b)
    assert got["optim"]["param_groups"] == want["optim"]["param_groups"]


def test_load_into_from_ram_straddling_chunks_and_a_changed_byte(
    make_ckpt: MakeCkpt, shm_dir: Path
) -> None:
    ckpt = make_ckpt(chunk_bytes=CHUNK)
    s = state()
    ckpt.save(1, s).wait()
    into = zeroed(s)
    for _ in range(3):  # the first plans, the next ones reuse the plan
        for t in tensors(into):
            t.zero_()
        stats = ckpt.load(1, into=into)
        assert stats.source == "ram"
        assert stats.rejected is None
        assert_same(s, into)
    assert ckpt._plans.load is not None
    # A byte of `w2` (which straddles a chunk edge) changed in the slot,
    # in its second chunk.
    w2 = s["model"]["w2"].numpy().tobytes()
    hit = 0
    for slot in sorted(slot_dir(shm_dir).iterdir()):
        data = bytearray(slot.read_bytes())
        at = data.find(w2)
        if at >= 0:
            edge = (at // CHUNK + 1) * CHUNK
            assert at < edge < at + len(w2)
            data[edge + 11] ^= 0x01
            slot.write_bytes(bytes(data))
            hit += 1
    assert hit == 1
    for t in tensors(into):
        t.zero_()
    stats = ckpt.load(1, into=into)
    assert stats.source == "storage"
    assert stats.rejected is not None
    assert "`model.w2`" in stats.rejected
    assert_same(s, into)


def test_a_kept_plan_keeps_the_targets_memory_while_it_copies(
    tmp_path: Path, shm_dir: Path
) -> None:
    """A load through the kept plan copies into the addresses the plan
    recorded, with the GIL released: a target that another thread rebinds
    right after the plan was found must stay alive until the copy is done,
    or its freed memory (then another tensor's) takes the checkpoint's
    bytes. Here the rebind and a same-size allocation run right after the
    plan lookup; the new tensor must keep its own bytes. In a child process:
    a regression can write into unmapped memory."""
    script = textwrap.dedent(
        f"""
        import torch, acp
        n = 8 << 20
        ckpt = acp.Checkpointer({str(tmp_path / "ckpt")!r}, shm_dir={str(shm_dir)!r},
                                job="kp", ring_bytes=160 << 20, mlock=False)
        ckpt.save(1, {{"w": torch.ones(n)}}).wait()
        d = {{"w": torch.zeros(n)}}
        ckpt.load(1, into=d)
        assert ckpt._plans.load is not None
        plans, found, junk = ckpt._plans, ckpt._plans.for_load, []

        def for_load(*args):
            plan = found(*args)
            assert plan is not None, "the kept plan was not reused"
            d["w"] = None  # another thread rebinds the target
            junk.append(torch.full((n,), 7.0))  # and the memory is reused
            return plan

        plans.for_load = for_load
        ckpt.load(1, into=d)
        print("overwritten", int((junk[0] != 7.0).sum()), flush=True)
        ckpt.close()
        """
    )
    proc = run_child(script, tmp_path)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    assert "overwritten 0" in proc.stdout, proc.stdout
