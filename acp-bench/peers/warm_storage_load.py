"""``load(into=, storage_only=True)`` of a step saved compressed (``compress="zstd"``) and of
the same step saved plain, in one process, each load right after the other, against a
2-thread memcpy of the same bytes run right before them.

    python acp-bench/peers/warm_storage_load.py --mib 128 --repeats 9 --dir /work

A compressed file is read with buffered reads, so after its first load its frames are in the
page cache and each load is bound by the CPU: the frames' checks, the decode, the blake3 of
every chunk and the copy into the tensors, which is what this measures (the engine's work on
that path, not the disk's). A plain file is read with ``O_DIRECT``, from the disk every time,
so its row is the disk's rate on this host as much as acp's. The state is ``--tensors`` fp32
tensors drawn from normal(0, 0.02), like a trained model's weights. Prints one JSON line: the
medians, and the medians of the per-load ratios to the memcpy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

import acp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from baselines import copy_ranges

MiB = 1 << 20


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=128, help="the state's size in MiB")
    p.add_argument("--tensors", type=int, default=64, help="tensors in the state")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--dir", default=None, help="where the checkpoint roots go")
    a = p.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    numel = a.mib * MiB // 4 // a.tensors
    state = {f"w{i}": torch.randn(numel, generator=g) * 0.02 for i in range(a.tensors)}
    into = {k: torch.empty_like(v) for k, v in state.items()}
    pairs = [(into[k].data_ptr(), v.data_ptr(), v.numel() * 4) for k, v in state.items()]
    got: dict[str, list[float]] = {"memcpy": [], "zstd": [], "plain": []}
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        ckpts = {}
        try:
            for codec, compress in (("zstd", "zstd"), ("plain", "none")):
                ckpts[codec] = acp.Checkpointer(
                    os.path.join(d, codec),
                    job=f"warm-storage-{codec}-{os.getpid()}",
                    compress=compress,
                    incremental=False,
                    release_on_close=True,
                )
                ckpts[codec].save(1, state).wait()
                ckpts[codec].load(1, into=into, storage_only=True)  # the frames into the cache
            for _ in range(a.repeats):
                t = time.perf_counter()
                copy_ranges(pairs, 2)
                got["memcpy"].append(time.perf_counter() - t)
                for codec, ckpt in ckpts.items():
                    for x in into.values():
                        x.fill_(7.0)
                    t0 = time.perf_counter()
                    ckpt.load(1, into=into, storage_only=True)
                    got[codec].append(time.perf_counter() - t0)
                    last = ckpt.last_load
                    assert last is not None
                    assert last.source == "storage", last.source
                    assert all(torch.equal(into[k], v) for k, v in state.items()), codec
        finally:
            for ckpt in ckpts.values():
                ckpt.close()

    def ratio(num: str) -> float:
        return statistics.median(x / y for x, y in zip(got[num], got["memcpy"]))

    out = {
        "mib": a.mib,
        "tensors": a.tensors,
        **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in got.items()},
        "zstd_over_memcpy": ratio("zstd"),
        "plain_over_memcpy": ratio("plain"),
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
