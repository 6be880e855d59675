# examples/quickstart.py: `python examples/quickstart.py`
import shutil
import tempfile
from pathlib import Path

import torch

import acp

model = torch.nn.Linear(16, 4)
opt = torch.optim.AdamW(model.parameters())


def train_step() -> None:
    opt.zero_grad()
    model(torch.randn(8, 16)).square().mean().backward()
    opt.step()


# A real job: acp.Checkpointer("/mnt/ckpt/run1"), ring in /dev/shm. Here: both in a temp dir.
tmp = Path(tempfile.mkdtemp(prefix="acp-readme-"))
ckpt = acp.Checkpointer(tmp / "run1", shm_dir=tmp)  # job id, rank and world size: sensible defaults
ckpt.reserve({"model": model.state_dict(), "optim": opt.state_dict()})  # optional: ring now
start, steps, epoch = (ckpt.latest() or 0) + 1, 10, 0  # a restarted job goes on after its newest
for step in range(start, steps):
    train_step()
    h = ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": epoch})
    # save() returned once the tensors were copied into the ring: training goes on
h.wait()  # the newest save is durable and committed, or this raises its error
# (older saves may have been superseded while a persist ran: persist_policy)

state = ckpt.load()  # the newest committed step (from RAM when resident)
assert torch.equal(state["model"]["weight"], model.weight.detach())
sd = {"model": model.state_dict(), "optim": opt.state_dict()}
ckpt.load(into=sd)  # the model's tensors (and a trained optimizer's) filled in place
opt.load_state_dict(sd["optim"])  # a fresh optimizer's state arrives in sd["optim"]
print("committed steps:", ckpt.steps(), "newest:", ckpt.latest())
ckpt.close()  # Checkpointer is also a context manager
shutil.rmtree(tmp)  # a real job keeps both: its next run restores from the ring in RAM
