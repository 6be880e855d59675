"""A load of another rank's file from its resident slot on this node (what a
rank of a replicated save reads for the tensors another rank wrote, and what
``load(step, rank=r)`` reads), against 2-thread memcpys of the same bytes in
the same run: into fresh memory (what a fresh load's tensors need) and into
memory already touched (what ``load(into=)`` fills).

    python acp-bench/peers/rank_file_load.py --mib 256 --repeats 9

Two ranks' engines run in this process; rank 0 loads rank 1's file. The image
is copied out of rank 1's slot into private memory, each chunk summed as it
lands; a fresh load then hands that memory to its tensors.

Then the data-parallel case: both ranks save the same state with
``replicated=True`` (each writes half of it), and rank 1 restores the whole
state with ``load(into=)``: its own half from its slot, the other half's
chunks read from rank 0's slot, each checked on its way into the
tensors; against a memcpy of the whole state into memory already touched.
And the same restore with a fresh ``load()``, against a memcpy into fresh
memory. Prints one JSON line of medians.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time

import torch

import acp

MiB = 1 << 20


def replicated_restore(
    ckpts: list[acp.Checkpointer],
    state: dict[str, torch.Tensor],
    into: dict[str, torch.Tensor],
    copy: tuple[torch.Tensor, torch.Tensor],
    repeats: int,
) -> dict[str, list[float]]:
    """The data-parallel case: ``state`` saved by both ranks with
    ``replicated=True`` (written once), restored whole by rank 1 with
    ``load(into=)`` and with a fresh ``load()``; each restore paired with a
    memcpy of ``copy``'s first tensor into its second (memory already
    touched) or into fresh memory. Returns the lists of seconds."""
    src, warm = copy
    handles = [c.save(2, state, replicated=True) for c in ckpts]
    for h in handles:
        h.wait()
    got: dict[str, list[float]] = {k: [] for k in ("into", "warm", "fresh", "memcpy_fresh")}
    for _ in range(repeats):
        for t_ in into.values():
            t_.zero_()
        t = time.perf_counter()
        ckpts[1].load(2, into=into)
        got["into"].append(time.perf_counter() - t)
        last = ckpts[1].last_load
        assert last is not None
        assert last.ranks == {0: "ram", 1: "ram"}, last.ranks
        assert all(torch.equal(into[k], v) for k, v in state.items())
        t = time.perf_counter()
        warm.copy_(src)
        got["warm"].append(time.perf_counter() - t)
        t = time.perf_counter()
        out = ckpts[1].load(2)
        got["fresh"].append(time.perf_counter() - t)
        assert all(torch.equal(out[k], v) for k, v in state.items())
        del out
        gc.collect()
        t = time.perf_counter()
        dst = torch.empty_like(src)
        dst.copy_(src)
        got["memcpy_fresh"].append(time.perf_counter() - t)
        del dst
    return got


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="each rank's state in MiB")
    p.add_argument("--tensors", type=int, default=32, help="tensors in each rank's state")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--dir", default=None, help="where the checkpoint root goes")
    a = p.parse_args(argv)
    torch.set_num_threads(2)
    numel = a.mib * MiB // 4 // a.tensors
    fresh, into_ms, memcpy_fresh, memcpy_warm = [], [], [], []
    with (
        tempfile.TemporaryDirectory(dir=a.dir) as d,
        tempfile.TemporaryDirectory(
            prefix="acp-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
        ) as shm,
    ):
        ckpts = [
            acp.Checkpointer(
                d,
                job="rank-file-load",
                rank=r,
                world_size=2,
                shm_dir=shm,
                ring_bytes=3 * a.mib * MiB + (64 << 20),
                release_on_close=True,
            )
            for r in (0, 1)
        ]
        try:
            states = [{f"r{r}.t{i}": torch.randn(numel) for i in range(a.tensors)} for r in (0, 1)]
            handles = [c.save(1, s) for c, s in zip(ckpts, states)]
            for h in handles:
                h.wait()
            into = {k: torch.empty_like(v) for k, v in states[1].items()}
            src = torch.cat(list(states[1].values()))
            warm = torch.empty_like(src)
            for _ in range(a.repeats):
                t = time.perf_counter()
                out = ckpts[0].load(1, rank=1)
                fresh.append(time.perf_counter() - t)
                assert ckpts[0].last_load is not None
                assert ckpts[0].last_load.source == "ram", ckpts[0].last_load.source
                assert torch.equal(out["r1.t0"], states[1]["r1.t0"])
                del out
                gc.collect()
                t = time.perf_counter()
                ckpts[0].load(1, rank=1, into=into)
                into_ms.append(time.perf_counter() - t)
                t = time.perf_counter()
                dst = torch.empty_like(src)
                dst.copy_(src)
                memcpy_fresh.append(time.perf_counter() - t)
                del dst
                t = time.perf_counter()
                warm.copy_(src)
                memcpy_warm.append(time.perf_counter() - t)
            rep = replicated_restore(ckpts, states[1], into, (src, warm), a.repeats)
        finally:
            for c in ckpts:
                c.close()
    med = {
        "fresh_ms": 1e3 * statistics.median(fresh),
        "into_ms": 1e3 * statistics.median(into_ms),
        "memcpy_fresh_ms": 1e3 * statistics.median(memcpy_fresh),
        "memcpy_warm_ms": 1e3 * statistics.median(memcpy_warm),
        "replicated_into_ms": 1e3 * statistics.median(rep["into"]),
        "memcpy_warm_replicated_ms": 1e3 * statistics.median(rep["warm"]),
        "replicated_fresh_ms": 1e3 * statistics.median(rep["fresh"]),
        "memcpy_fresh_replicated_ms": 1e3 * statistics.median(rep["memcpy_fresh"]),
    }
    out_line = {
        "mib": a.mib,
        "tensors": a.tensors,
        **med,
        "fresh_over_memcpy_fresh": med["fresh_ms"] / med["memcpy_fresh_ms"],
        "into_over_memcpy_warm": med["into_ms"] / med["memcpy_warm_ms"],
        "replicated_into_over_memcpy_warm": med["replicated_into_ms"]
        / med["memcpy_warm_replicated_ms"],
        "replicated_fresh_over_memcpy_fresh": med["replicated_fresh_ms"]
        / med["memcpy_fresh_replicated_ms"],
    }
    print(json.dumps(out_line))
    return out_line


if __name__ == "__main__":
    main()
