"""A RAM snapshot's two costs, against a 2-thread memcpy of the same bytes in
the same run: the background check a ``persist=False`` save starts (timed from
``save()`` returning to ``wait()`` returning, which waits for it) and a
restore of the snapshot from RAM (``load(step, into=)``, checked before use).

    python acp-bench/peers/snapshot_restore.py --mib 256 --saves 8

Prints one JSON line of medians (the first two saves not counted).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

import acp

MiB = 1 << 20


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="state size in MiB (32 tensors)")
    p.add_argument("--saves", type=int, default=8)
    p.add_argument("--dir", default=None, help="where the checkpoint root goes")
    p.add_argument(
        "--persist",
        action="store_true",
        help="persist each save (a committed step restored from its resident slot), for comparison",
    )
    a = p.parse_args(argv)
    torch.set_num_threads(2)
    state = {f"t{i}": torch.randn(a.mib * MiB // 4 // 32) for i in range(32)}
    into = {k: torch.empty_like(v) for k, v in state.items()}
    src = torch.cat(list(state.values()))
    dst = torch.empty_like(src)
    background, restore, memcpy = [], [], []
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        ckpt = acp.Checkpointer(
            d, release_on_close=True, ring_bytes=4 * a.mib * MiB + (64 << 20), keep_last=1
        )
        try:
            for step in range(a.saves):
                ckpt.save(step, state, persist=a.persist)
                t = time.perf_counter()
                ckpt.wait()
                background.append(time.perf_counter() - t)
                t = time.perf_counter()
                dst.copy_(src)
                memcpy.append(time.perf_counter() - t)
                t = time.perf_counter()
                ckpt.load(step, into=into)
                restore.append(time.perf_counter() - t)
                assert ckpt.last_load is not None
                assert ckpt.last_load.source == "ram", ckpt.last_load.source
        finally:
            ckpt.close()
    for k, v in state.items():
        assert torch.equal(v, into[k]), k

    def ms(xs: list[float]) -> float:
        return statistics.median(xs[2:]) * 1e3

    out = {
        "mib": a.mib,
        "persisted": a.persist,
        "background_ms": ms(background),
        "restore_ms": ms(restore),
        "memcpy_ms": ms(memcpy),
        "restore_over_memcpy": ms(restore) / ms(memcpy),
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
