"""CUDA tensors: device-to-host copies into pinned ring slots, restore to
the device, in-place loads into device tensors. These run wherever a CUDA
device is present; elsewhere they are reported as skipped ("no CUDA device")."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import acp
from acp.torch import DTYPES

from .helpers import assert_same

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


def cuda_state() -> tuple[nn.Module, Any, dict[str, Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        loss = model(torch.randn(4, 32, device="cuda")).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),  # "step" tensors stay on the CPU: a mixed state
        "cuda_rng": torch.cuda.get_rng_state_all(),
        "strided": torch.arange(64.0, device="cuda").reshape(8, 8).t(),
        "empty": torch.zeros(0, device="cuda"),
        "scalar": torch.tensor(2.5, device="cuda"),
    }
    return model, opt, state


def test_cuda_state_round_trips_to_the_device(ckpt: acp.Checkpointer) -> None:
    _, _, state = cuda_state()
    stats = ckpt.save(1, state).wait()
    assert stats.tensors > 0
    out = ckpt.load()
    state["strided"] = state["strided"].contiguous()
    assert_same(state, out)
    assert out["model"]["0.weight"].device.type == "cuda"
    out = ckpt.load(storage_only=True)
    assert_same(state, out)


def test_cuda_state_to_the_cpu(ckpt: acp.Checkpointer) -> None:
    _, _, state = cuda_state()
    ckpt.save(1, state).wait()
    out = ckpt.load(map_location="cpu")
    assert out["model"]["0.weight"].device.type == "cpu"
    assert torch.equal(out["model"]["0.weight"], state["model"]["0.weight"].cpu())


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_every_dtype_on_the_device(ckpt: acp.Checkpointer, dtype: torch.dtype) -> None:
    x = torch.randint(0, 2 if dtype == torch.bool else 100, (5, 3)).to(dtype)
    ckpt.save(1, {"x": x.cuda()}).wait()
    assert torch.equal(ckpt.load(map_location="cpu")["x"].view(torch.uint8), x.view(torch.uint8))


def test_load_into_device_tensors_in_place(ckpt: acp.Checkpointer) -> None:
    model, _, state = cuda_state()
    ckpt.save(1, {"model": state["model"]}).wait()
    x = torch.randn(3, 32, device="cuda")
    expected = model(x).detach()
    ptrs = [p.data_ptr() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    stats = ckpt.load(into={"model": model.state_dict()})
    assert stats.source == "ram"
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    assert torch.equal(model(x).detach(), expected)


def test_repeated_saves_reuse_pinned_slots(ckpt: acp.Checkpointer) -> None:
    w = torch.randn(1 << 16, device="cuda")
    for step in range(1, 6):
        w.add_(1)
        ckpt.save(step, {"w": w}).wait()
        assert torch.equal(ckpt.load(step)["w"], w)
    ckpt.save(6, {"w": torch.randn(1 << 18, device="cuda")}).wait()  # a bigger image
    ckpt.save(7, {"w": w}).wait()
    assert torch.equal(ckpt.load(7)["w"], w)


def test_restores_stay_right_when_a_storage_load_regrows_a_pinned_slot(
    ckpt: acp.Checkpointer,
) -> None:
    # Restores from RAM keep the slots' CUDA registrations; a load from
    # storage into a slot that must grow remaps it, and the registration of
    # its old mapping must not serve the next copies.
    small = torch.arange(1 << 16, device="cuda", dtype=torch.float32)
    big = torch.arange(1 << 21, device="cuda", dtype=torch.float32).neg()
    ckpt.save(1, {"w": small}).wait()
    ckpt.save(2, {"w": small + 1}).wait()
    for _ in range(2):  # from RAM: the pinned slot serves both
        out = {"w": torch.zeros_like(small)}
        assert ckpt.load(2, into=out).source == "ram"
        assert torch.equal(out["w"], small + 1)
    ckpt.save(3, {"w": big}).wait()
    ckpt.save(4, {"w": small + 2}).wait()
    for step, want in ((3, big), (1, small), (3, big), (4, small + 2), (2, small + 1)):
        out = {"w": torch.zeros_like(want)}
        ckpt.load(step, into=out, storage_only=True)
        assert torch.equal(out["w"], want), step
        out = {"w": torch.zeros_like(want)}
        ckpt.load(step, into=out)
        assert torch.equal(out["w"], want), step
        assert torch.equal(ckpt.load(step)["w"], want), step
