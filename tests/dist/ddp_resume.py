"""DDP training that saves every step (replicated: each tensor written by one
rank), one rank SIGKILLed during a save, and the resumed run.

    ddp_resume.py ROOT OUT train STEPS KILL_STEP MODE   (MODE: stall | sealed)
    ddp_resume.py ROOT OUT resume STEPS

``train`` kills rank 1 at save KILL_STEP: ``stall`` in the middle of its copy
into the ring (that step can never commit), ``sealed`` right after the copy,
once rank 0 has sealed the step too (every rank holds it: the restart
commits it). Before the kill step's save, the previous step is committed.
Rank 0 records each step's state digest. ``resume`` loads the newest step
(every rank agrees on it), records where each file came from and the
state's digest, and trains STEPS more steps with saves.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch
from _common import checkpointer, init, state_digest, write_result
from torch.nn.parallel import DistributedDataParallel

import acp
import acp.checkpointer


def main() -> None:
    root, out, phase, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    rank, world = init()
    store = torch.distributed.distributed_c10d._get_default_store()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ckpt = checkpointer(root, "ddp", rank)
    assert ckpt.world_size == world

    def state(step: int) -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}

    start = 0
    if phase == "resume":
        loaded = ckpt.load()
        model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optim"])
        start = loaded["step"]
        assert ckpt.last_load is not None
        write_result(
            out,
            f"resume-rank{rank}",
            {
                "step": start,
                "digest": state_digest(state(start)),
                "source": ckpt.last_load.source,
                "ranks": ckpt.last_load.ranks,
                "rejected": ckpt.last_load.rejected,
                "steps": ckpt.steps(),
            },
        )
    kill_step = int(sys.argv[5]) if phase == "train" else -1
    mode = sys.argv[6] if phase == "train" else ""
    handles: dict[int, acp.SaveHandle] = {}
    digests: dict[int, str] = {}
    for step in range(start + 1, start + steps + 1):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, 16, generator=gen)
        ddp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        digests[step] = state_digest(state(step))
        if rank == 0:
            write_result(out, f"digests-{phase}", digests)
        if step == kill_step:
            handles[step - 1].wait()  # the previous step is committed
            if rank == 1 and mode == "stall":
                fill = acp.checkpointer._fill

                def dying_fill(staging: Any, tensors: Any) -> None:
                    fill(staging, tensors[: len(tensors) // 2])
                    os.kill(os.getpid(), signal.SIGKILL)

                acp.checkpointer._fill = dying_fill  # type: ignore[assignment]
        handles[step] = ckpt.save(step, state(step), replicated=True)
        if step == kill_step and mode == "sealed":
            if rank == 0:
                store.set("sealed", "1")
            else:
                store.wait(["sealed"])
                os.kill(os.getpid(), signal.SIGKILL)
    ckpt.wait()
    if phase == "resume":
        write_result(out, f"final-rank{rank}", {"steps": ckpt.steps(), "digests": digests})
    ckpt.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
