"""A real trained model through a compressed checkpoint: Resemblyzer's speaker
encoder (the ``resemblyzer`` wheel ships its trained weights and Adam state as
``pretrained.pt``; ``make venv`` installs it with ``--no-deps``). The file is
read with ``torch.load(weights_only=True)``, the package is never imported.
``acp-bench/peers/real_model.py`` measures the sizes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from .conftest import MakeCkpt

torch = pytest.importorskip("torch")


def pretrained() -> dict:
    spec = importlib.util.find_spec("resemblyzer")
    missing = "resemblyzer is not installed: `make venv` installs it (--no-deps)"
    assert spec is not None, missing
    assert spec.submodule_search_locations, missing
    (path,) = [
        Path(d) / "pretrained.pt"
        for d in spec.submodule_search_locations
        if (Path(d) / "pretrained.pt").is_file()
    ]
    return torch.load(path, weights_only=True, map_location="cpu")


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_trained_model_and_its_adam_state_round_trip_bit_exact_compressed(
    make_ckpt: MakeCkpt, dtype: torch.dtype
) -> None:
    ckpt_file = pretrained()
    want: dict[str, object] = {
        f"model.{k}": v.to(dtype) for k, v in ckpt_file["model_state"].items()
    }
    for pid, per in ckpt_file["optimizer_state"]["state"].items():
        want[f"adam.{pid}.exp_avg"] = per["exp_avg"]
        want[f"adam.{pid}.exp_avg_sq"] = per["exp_avg_sq"]
    want["step"] = ckpt_file["step"]
    ckpt = make_ckpt(compress="zstd", ring_bytes=64 << 20)
    s = ckpt.save(1, want).wait()
    # Trained float planes shrink: the file really holds compressed frames.
    assert s.stored_bytes is not None
    assert s.bytes is not None
    assert s.stored_bytes < s.bytes
    got = ckpt.load(1, storage_only=True)
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype, k
            assert got[k].shape == v.shape, k
            assert bits(got[k]) == bits(v), k
        else:
            assert got[k] == v, k
