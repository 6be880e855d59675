"""Rank 1 hangs (saves and loads nothing) while rank 0 saves, then loads:
both of rank 0's waits end in acp.AcpTimeout naming rank 1.

    hang.py ROOT OUT
"""

from __future__ import annotations

import datetime
import sys

import torch
from _common import checkpointer, init, write_result

import acp


def main() -> None:
    root, out = sys.argv[1], sys.argv[2]
    rank, _ = init()
    store = torch.distributed.distributed_c10d._get_default_store()
    ckpt = checkpointer(root, "hang", rank, commit_timeout=2)
    if rank == 0:
        errors = {}
        try:
            ckpt.save(1, {"w": torch.ones(4)}).wait()
        except acp.AcpTimeout as e:
            errors["save"] = str(e)
        try:
            ckpt.load()
        except acp.AcpTimeout as e:
            errors["load"] = str(e)
        errors["steps"] = ckpt.steps()  # type: ignore[assignment]
        write_result(out, "hang-rank0", errors)
        store.set("rank0-done", "1")
    else:
        store.wait(["rank0-done"], datetime.timedelta(seconds=120))
    ckpt.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
