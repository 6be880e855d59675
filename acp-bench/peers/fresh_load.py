"""A fresh ``load()`` of this rank's step from its resident slot (``state =
ckpt.load()``, the tensors made by the load), against a 2-thread memcpy of
the same tensors into new tensors made right before it (what any fresh
load has to do: memory for the tensors, then their bytes), and
``load(into=)`` of the same step against a 2-thread memcpy into tensors
already touched, each load run right after its memcpy.

    python acp-bench/peers/fresh_load.py --mib 256 --tensors 292 --repeats 9

The state is ``--tensors`` fp32 tensors of about the same size, in one
process, saved twice (both ring slots written once) before the runs. Prints
one JSON line: the medians, and the medians of the per-pair ratios.

New tensors are new memory for both (``mallopt(M_MMAP_THRESHOLD, 128 KiB)``,
fixed: glibc otherwise raises the threshold after the first free, and then
hands one side memory the other just freed, whose pages are already there),
as they are for a restarted process's first load.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

import acp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from baselines import copy_ranges

MiB = 1 << 20


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def new_memory_for_new_tensors() -> None:
    """Each allocation above 128 KiB mapped afresh (glibc; elsewhere a no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 << 10)


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="the state's size in MiB")
    p.add_argument("--tensors", type=int, default=292, help="tensors in the state")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--dir", default=None, help="where the checkpoint root goes")
    a = p.parse_args(argv)
    torch.set_num_threads(2)
    new_memory_for_new_tensors()
    numel = a.mib * MiB // 4 // a.tensors
    state = {f"t{i}": torch.randn(numel) for i in range(a.tensors)}
    srcs = list(state.values())
    nbytes = sum(t.numel() * 4 for t in srcs)
    warm = [torch.empty_like(t).fill_(1) for t in srcs]
    into = {k: torch.empty_like(v) for k, v in state.items()}
    got: dict[str, list[float]] = {k: [] for k in ("fresh", "memcpy_new", "into", "memcpy_warm")}
    with (
        tempfile.TemporaryDirectory(dir=a.dir) as d,
        tempfile.TemporaryDirectory(
            prefix="acp-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
        ) as shm,
    ):
        ckpt = acp.Checkpointer(
            d,
            job="fresh-load",
            shm_dir=shm,
            ring_slots=2,
            ring_bytes=2 * nbytes + (64 << 20),
            incremental=False,
            release_on_close=True,
        )
        try:
            ckpt.reserve(state)
            for step in (1, 2):
                ckpt.save(step, state).wait()

            def ranges(dsts: list[torch.Tensor]) -> list[tuple[int, int, int]]:
                return [(d.data_ptr(), s.data_ptr(), s.numel() * 4) for d, s in zip(dsts, srcs)]

            def new_copy() -> None:
                dsts = [torch.empty_like(t) for t in srcs]  # alive until copied
                copy_ranges(ranges(dsts), 2)

            warm_pairs = ranges(warm)
            for _ in range(a.repeats):
                got["memcpy_new"].append(timed(new_copy))
                gc.collect()
                t = time.perf_counter()
                out = ckpt.load(2)
                got["fresh"].append(time.perf_counter() - t)
                last = ckpt.last_load
                assert last is not None
                assert last.source == "ram", last.source
                assert all(torch.equal(out[k], v) for k, v in state.items())
                del out
                gc.collect()
                got["memcpy_warm"].append(timed(lambda: copy_ranges(warm_pairs, 2)))
                got["into"].append(timed(lambda: ckpt.load(2, into=into)))
                assert all(torch.equal(into[k], v) for k, v in state.items())
        finally:
            ckpt.close()

    def ratio(num: str, den: str) -> float:
        return statistics.median(x / y for x, y in zip(got[num], got[den]))

    out_line = {
        "mib": a.mib,
        "tensors": a.tensors,
        **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in got.items()},
        "fresh_over_memcpy_new": ratio("fresh", "memcpy_new"),
        "into_over_memcpy_warm": ratio("into", "memcpy_warm"),
    }
    print(json.dumps(out_line))
    return out_line


if __name__ == "__main__":
    main()
