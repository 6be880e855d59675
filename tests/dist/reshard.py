"""FSDP2 (DTensor shards) through acp's DCP writer and reader: saved by one
world size, loaded by another.

    reshard.py ROOT OUT save   (steps 5, dcp.save, and 6, dcp.async_save)
    reshard.py ROOT OUT load   (each step into a freshly sharded model)

``save`` has rank 0 write each step's full tensors (model and Adam state)
to OUT/ref-STEP.safetensors; ``load`` compares against them on every rank.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from _common import checkpointer, init, write_result
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import acp
import acp.dcp


def full(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of the model and optimizer state dicts, unsharded
    (collective), named by its key path."""
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, x: Any) -> None:
        if isinstance(x, DTensor):
            out[prefix] = x.full_tensor().clone()
        elif isinstance(x, torch.Tensor):
            out[prefix] = x.clone()
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(f"{prefix}.{k}", x[k])

    walk("model", state["model"])
    walk("optim", state["optim"]["state"])
    return out


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def main() -> None:
    root, out, phase = sys.argv[1], sys.argv[2], sys.argv[3]
    rank, world = init()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ckpt = checkpointer(root, "reshard", rank)
    writer = acp.dcp.StorageWriter(ckpt)
    reader = acp.dcp.StorageReader(ckpt)
    result: dict[str, Any] = {}
    for step in (5, 6):
        if phase == "save":
            train_step(model, opt, 100 * step + rank)
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd, "extra": {"epoch": step}}
            if step == 5:
                # Checkpointer.save of DTensors: refused, pointing at DCP.
                try:
                    ckpt.save(step, state)
                    result["direct"] = "saved"
                except acp.InvalidInput as e:
                    result["direct"] = str(e)
                dcp.save(state, checkpoint_id=step, storage_writer=writer)
            else:
                writer.reset(step)
                stager = acp.dcp.Stager(writer)
                dcp.async_save(
                    state, checkpoint_id=step, storage_writer=writer, async_stager=stager
                ).result()
            ref = full(state)
            if rank == 0:
                save_file(ref, f"{out}/ref-{step}.safetensors")
            result[str(step)] = {"bytes": writer.last_save and writer.last_save.get("bytes")}
        else:
            train_step(model, opt, rank)  # creates the Adam state the load fills
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd, "extra": {"epoch": -1}}
            dcp.load(state, checkpoint_id=step, storage_reader=reader)
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            msd, osd = get_state_dict(model, opt)
            got = full({"model": msd, "optim": osd})
            want = load_file(f"{out}/ref-{step}.safetensors")
            assert sorted(got) == sorted(want), (sorted(got), sorted(want))
            bad = [k for k in want if not torch.equal(got[k], want[k])]
            assert reader.last_load is not None
            result[str(step)] = {
                "mismatched": bad,
                "epoch": state["extra"]["epoch"],
                "source": reader.last_load.get("source"),
                "ranks": reader.last_load.get("ranks"),
            }
    result["steps"] = ckpt.steps()
    write_result(out, f"{phase}-rank{rank}", result)
    ckpt.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
