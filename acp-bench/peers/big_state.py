"""A large state saved with default settings: the ring sizes itself from the room at open.

    python acp-bench/peers/big_state.py --gib 8      # on a 24 GiB machine: one slot of the budget

Allocates one fp32 tensor of ``--gib`` GiB, opens ``acp.Checkpointer(root)`` with default
settings but a fresh ring directory in ``/dev/shm`` (``keep_last=1``, ``release_on_close``),
saves it ``--saves`` times (its values changed before each, outside the timing), waiting for
each commit, then loads the newest step with ``zero_copy=True`` and checks it. Prints, per save,
the stall and the time to committed, the ring's budget, the resident steps, and where the load
came from; the last line is one JSON line of the same. A state too large for two slots of the
budget saves in one (issue 16 target 6): each save after the first then takes the slot of the
step before. Removes its root and ring at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from typing import Any

import torch

import acp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--gib", type=float, default=8.0, help="state size in GiB (8)")
    ap.add_argument("--saves", type=int, default=3, help="saves (3)")
    ap.add_argument("--dir", default=None, help="where the checkpoint root goes (system temp)")
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="acp-big-", dir=a.dir)
    shm = tempfile.mkdtemp(prefix="acp-big-", dir="/dev/shm")
    out: dict[str, Any] = {"gib": a.gib, "saves": []}
    try:
        state = {"w": torch.empty(int(a.gib * (1 << 30)) // 4).fill_(0.0)}
        ckpt = acp.Checkpointer(root, shm_dir=shm, keep_last=1, release_on_close=True)
        try:
            for step in range(1, a.saves + 1):
                state["w"].fill_(float(step))
                t = time.perf_counter()
                handle = ckpt.save(step, state)
                stall = time.perf_counter() - t
                handle.wait()
                done = time.perf_counter() - t
                resident = ckpt.snapshots()
                out["saves"].append({"step": step, "stall_s": stall, "committed_s": done})
                print(
                    f"step {step}: stall {stall:.2f} s, committed after {done:.2f} s, "
                    f"resident {resident}",
                    flush=True,
                )
            got = ckpt.load(zero_copy=True)
            last = ckpt.last_load
            assert last is not None
            out["load_source"] = last.source
            out["load_right"] = bool((got["w"][:: 1 << 16] == float(a.saves)).all())
            del got
            print(f"load: step {last.step} from {last.source}, right: {out['load_right']}")
        finally:
            ckpt.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
