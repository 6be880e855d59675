#!/usr/bin/env python3
"""Where a save's time goes until it is committed: stall, queue, flush, commit.

    python acp-bench/peers/save_commit.py --dir /work/scratch            # 256 MiB, 2,244 tensors
    python acp-bench/peers/save_commit.py --mib 1024 --tensors 64 --saves 12

Saves the same fp32 state again and again, as ``compare.py``'s save row does (one
``ckpt.save`` then ``handle.wait()``, the next save at once; ``keep_last=2``, so each commit
retires a step; ``incremental=False``), and prints the medians of the engine's own split of
each save after the first two (one into each ring slot): the stall, the time queued behind
the flush thread, the flush (write, hash, fsync of the data file) and the commit (index,
publish, hint, retention), next to the whole save as the caller saw it. No baseline is run
here: compare the figures of two builds in alternation (``compare.py`` runs the memcpy and fio
floors).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

import acp

FIELDS = ("stall_secs", "queue_secs", "flush_secs", "commit_secs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--mib", type=int, default=256, help="state size in MiB (256)")
    ap.add_argument("--tensors", type=int, default=2244, help="tensors in the state (2244)")
    ap.add_argument("--saves", type=int, default=10, help="saves, the first two untimed (10)")
    ap.add_argument("--keep-last", type=int, default=2, help="retention (2; 0: keep all)")
    ap.add_argument("--dir", default=None, help="where the checkpoint root goes (system temp)")
    a = ap.parse_args()
    if a.saves < 3 or a.tensors < 1 or a.mib < 1:
        ap.error("--saves must be at least 3, --tensors and --mib positive")
    numel = (a.mib << 20) // 4 // a.tensors
    state = {f"t{i}": torch.randn(numel) for i in range(a.tensors)}
    base = tempfile.mkdtemp(prefix="acp-save-commit-", dir=a.dir)
    shm = tempfile.mkdtemp(prefix="acp-save-commit-", dir="/dev/shm")
    ckpt = acp.Checkpointer(
        os.path.join(base, "ckpt"),
        job=f"save-commit-{os.getpid()}",
        ring_slots=2,
        ring_bytes=2 * ((a.mib + 64) << 20),
        keep_last=a.keep_last or None,
        shm_dir=shm,
        incremental=False,
        release_on_close=True,
    )
    rows: list[dict[str, float]] = []
    try:
        ckpt.reserve(state)
        for step in range(1, a.saves + 1):
            t0 = time.perf_counter()
            stats = ckpt.save(step, state).wait()
            row = {f: getattr(stats, f) or 0.0 for f in FIELDS}
            row["total"] = time.perf_counter() - t0
            rows.append(row)
    finally:
        ckpt.close()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
    timed = rows[2:]
    med = {k: statistics.median(r[k] for r in timed) * 1e3 for k in ("total", *FIELDS)}
    print(
        f"{a.mib} MiB in {a.tensors} tensors, {len(timed)} saves, load {os.getloadavg()[0]:.1f}: "
        + ", ".join(f"{k.removesuffix('_secs')} {v:.0f} ms" for k, v in med.items())
    )


if __name__ == "__main__":
    main()
