"""PyTorch states through the real engine: round trips, dtypes, views, tied
weights, in-place loads, refusals."""

from __future__ import annotations

import glob
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import acp
from acp.torch import DTYPES

from .conftest import MakeCkpt, slot_dir
from .helpers import assert_same, bits


def train_some(steps: int, seed: int = 0) -> tuple[nn.Module, Any, Any, Any, list[float]]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.BatchNorm1d(16), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu")
    losses = [one_step(model, opt, sched) for _ in range(steps)]
    return model, opt, sched, scaler, losses


def one_step(model: nn.Module, opt: Any, sched: Any) -> float:
    x = torch.randn(6, 8)
    loss = model(x).pow(2).mean() + 0.01 * float(np.random.rand()) + 0.01 * random.random()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.detach())


def full_state(model: nn.Module, opt: Any, sched: Any, scaler: Any) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        },
        "epoch": 3,
        "best": 1.0,
        "tag": ("run", 1),
    }


def test_training_state_round_trips_bit_exact(ckpt: acp.Checkpointer) -> None:
    random.seed(1)
    np.random.seed(1)
    model, opt, sched, scaler, _ = train_some(3)
    state = full_state(model, opt, sched, scaler)
    h = ckpt.save(10, state)
    stats = h.wait()
    assert stats.done
    assert not stats.skipped
    assert stats.error is None
    assert stats.bytes
    assert stats.bytes >= stats.tensor_bytes > 0
    assert stats.stall_secs >= stats.copy_secs >= 0
    assert h.done()
    out = ckpt.load()
    assert_same(state, out)
    # the types PyTorch's loaders care about
    assert type(out["optim"]["param_groups"][0]["betas"]) is tuple
    assert all(type(k) is int for k in out["optim"]["state"])
    assert type(out["model"]) is type(state["model"])
    assert ckpt.last_load is not None
    assert ckpt.last_load.source == "ram"
    assert ckpt.steps() == [10]
    assert ckpt.latest() == 10


def test_resumed_training_matches_uninterrupted(ckpt: acp.Checkpointer) -> None:
    random.seed(2)
    np.random.seed(2)
    model, opt, sched, scaler, _ = train_some(3, seed=5)
    ckpt.save(3, full_state(model, opt, sched, scaler)).wait()
    expected = [one_step(model, opt, sched) for _ in range(4)]

    model2, opt2, sched2, _, _ = train_some(0, seed=99)
    state = ckpt.load(3)
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optim"])
    sched2.load_state_dict(state["sched"])
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    assert [one_step(model2, opt2, sched2) for _ in range(4)] == expected


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_every_dtype(ckpt: acp.Checkpointer, dtype: torch.dtype) -> None:
    state = {"x": random_tensor(dtype, (3, 7)), "s": random_tensor(dtype, ())}
    ckpt.save(1, state).wait()
    assert_same(state, ckpt.load())


def safetensors_reads(dtype: torch.dtype) -> bool:
    """Whether the installed safetensors' torch binding reads ``dtype``
    (0.8 has no ``F8_E8M0``)."""
    from safetensors.torch import load, save

    try:
        return load(save({"t": random_tensor(dtype, (2,))}))["t"].dtype == dtype
    except Exception:  # its errors share no narrower type
        return False


def test_all_dtypes_in_one_file_with_safetensors(ckpt: acp.Checkpointer) -> None:
    from safetensors import safe_open

    state = {str(d).removeprefix("torch."): random_tensor(d, (5,)) for d in DTYPES}
    state["nested"] = {"w": torch.arange(4.0)}  # type: ignore[dict-item]
    ckpt.save(2, state).wait()
    files = glob.glob(str(Path(ckpt.root) / "**" / "*.safetensors"), recursive=True)
    assert len(files) == 1
    readable = {str(d).removeprefix("torch.") for d in DTYPES if safetensors_reads(d)}
    # Complex tensors (Llama's rotary `freqs_cis`) among them.
    assert {"complex64", "float32", "bfloat16", "float8_e4m3fn"} <= readable
    with safe_open(files[0], framework="pt") as f:
        assert set(f.keys()) == {*(k for k in state if k != "nested"), "nested.w"}
        for k, t in state.items():
            if k in readable:
                assert torch.equal(bits(f.get_tensor(k)), bits(t)), k  # type: ignore[arg-type]


NEWER_DTYPES = {
    torch.complex64: "C64",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.float8_e8m0fnu: "F8_E8M0",
}
"""The dtypes format version 5 added, and their safetensors names."""


def header_of(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))  # type: ignore[no-any-return]


@pytest.mark.parametrize("compress", ["none", "zstd"])
def test_newer_dtypes_persist_and_say_their_format_version(
    make_ckpt: MakeCkpt, tmp_path: Path, compress: str
) -> None:
    root = tmp_path / "newer"
    state = {
        "freqs_cis": torch.polar(torch.ones(64, 16), torch.randn(64, 16)),
        **{str(d).removeprefix("torch."): random_tensor(d, (300,)) for d in NEWER_DTYPES},
        "w": torch.randn(40, 40),
    }
    with make_ckpt(root=root, compress=compress, release_on_close=True) as ckpt:
        ckpt.save(1, state).wait()
        assert_same(state, ckpt.load())
    # A fresh process: from storage, with and without `into=`.
    with make_ckpt(root=root, compress=compress, job="other", release_on_close=True) as ckpt:
        assert_same(state, ckpt.load())
        into = {k: torch.zeros_like(v) for k, v in state.items()}
        ckpt.load(into=into)
        assert_same(state, into)
    if compress == "none":
        (file,) = glob.glob(str(root / "step-*" / "*.safetensors"))
        header = header_of(file)
        # An older acp refuses the file as a newer format, not as corrupt.
        assert header["__metadata__"]["acp.version"] == "5"
        for d, name in NEWER_DTYPES.items():
            assert header[str(d).removeprefix("torch.")]["dtype"] == name


def test_a_state_of_older_dtypes_stays_format_version_1(ckpt: acp.Checkpointer) -> None:
    ckpt.save(1, {"w": torch.randn(4), "h": torch.randn(4).half()}).wait()
    (file,) = glob.glob(str(Path(ckpt.root) / "step-*" / "*.safetensors"))
    assert header_of(file)["__metadata__"]["acp.version"] == "1"


def test_zero_d_and_empty_tensors(ckpt: acp.Checkpointer) -> None:
    state = {
        "scalar": torch.tensor(3.25),
        "int_scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0),
        "empty2d": torch.zeros(3, 0, dtype=torch.bfloat16),
        "only_empty": [torch.zeros(0, 5), torch.zeros(0, 5)],
    }
    ckpt.save(1, state).wait()
    assert_same(state, ckpt.load())


def test_only_plain_values(ckpt: acp.Checkpointer) -> None:
    state = {"epoch": 4, "lr": [0.1, 0.01], "done": False}
    ckpt.save(1, state).wait()
    assert_same(state, ckpt.load())


def test_non_contiguous_tensors_and_views(ckpt: acp.Checkpointer) -> None:
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    state = {
        "transposed": base.t(),
        "sliced": base[1:5:2, 3:],
        "offset_view": base[2],
        "expanded": torch.arange(3.0).reshape(3, 1).expand(3, 4),
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "narrow_int": torch.arange(20, dtype=torch.int16)[::3],
    }
    ckpt.save(1, state).wait()
    out = ckpt.load()
    for k, t in state.items():
        assert out[k].is_contiguous(), k
        assert torch.equal(out[k], t), k
        assert out[k].dtype == t.dtype


def test_tied_weights_are_saved_once_and_restored_shared(ckpt: acp.Checkpointer) -> None:
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    sd = model.state_dict()
    assert sd["emb.weight"].data_ptr() == sd["head.weight"].data_ptr()
    other = sd["emb.weight"][1:]  # shares storage at another offset: a separate tensor
    h = ckpt.save(1, {"model": sd, "other": other, "again": sd["emb.weight"]})
    stats = h.wait()
    assert stats.tensors == 2
    out = ckpt.load()
    assert out["model"]["emb.weight"] is out["model"]["head.weight"]
    assert out["again"] is out["model"]["emb.weight"]
    assert torch.equal(out["other"], other)
    assert out["other"].data_ptr() != out["model"]["emb.weight"].data_ptr()


def test_a_transpose_over_the_same_bytes_is_not_a_tied_weight(ckpt: acp.Checkpointer) -> None:
    # Same first byte, same shape, same dtype, other strides: other values.
    w = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    assert w.t().data_ptr() == w.data_ptr()
    assert w.t().shape == w.shape
    stats = ckpt.save(1, {"w": w, "wt": w.t()}).wait()
    assert stats.tensors == 2
    out = ckpt.load()
    assert torch.equal(out["w"], w)
    assert torch.equal(out["wt"], w.t())


def test_load_into_tensors_sharing_memory(ckpt: acp.Checkpointer) -> None:
    """``load(into=)``: a tied weight (one tensor in the checkpoint) may be
    loaded into one tensor twice; two checkpoint tensors into overlapping
    contiguous host memory are refused, naming both keys, before anything
    is copied."""
    w = torch.arange(8.0)
    ckpt.save(1, {"a": w, "b": w, "c": torch.ones(4), "d": torch.zeros(4)}).wait()
    shared = torch.zeros(8)
    ckpt.load(1, into={"a": shared, "b": shared})
    assert torch.equal(shared, w)

    base = torch.full((6,), -1.0)
    for c, d in [(base[:4], base[2:]), (base[2:], base[:4])]:
        with pytest.raises(acp.InvalidInput, match=r"`[cd]` and key `[cd]` share memory"):
            ckpt.load(1, into={"c": c, "d": d})
        assert torch.equal(base, torch.full((6,), -1.0))  # nothing was copied
    # Separate memory loads, tightly packed.
    packed = torch.full((8,), -1.0)
    ckpt.load(1, into={"c": packed[:4], "d": packed[4:]})
    assert torch.equal(packed, torch.tensor([1.0] * 4 + [0.0] * 4))


def test_load_into_strided_views_sharing_memory(ckpt: acp.Checkpointer) -> None:
    """``load(into=)`` into strided views (which torch fills, not the
    engine): views whose elements interleave but never meet load; views
    sharing an element with another target, contiguous or not, or with
    each other (an expanded view), are refused by key before anything is
    copied."""
    a, b = torch.arange(8.0).reshape(2, 4), torch.arange(8.0, 16.0).reshape(2, 4)
    ckpt.save(1, {"a": a, "b": b, "c": torch.ones(4), "one": torch.tensor([7.0])}).wait()
    fresh = lambda: torch.full((2, 8), -1.0)  # noqa: E731
    base = fresh()
    ckpt.load(1, into={"a": base[:, :4], "b": base[:, 4:]})  # column blocks
    assert torch.equal(base, torch.cat([a, b], dim=1))
    base = fresh()
    ckpt.load(1, into={"a": base[:, ::2], "b": base[:, 1::2]})  # interleaved columns
    assert torch.equal(base[:, ::2], a)
    assert torch.equal(base[:, 1::2], b)
    base = fresh()
    # A contiguous target inside a strided one's span, between its elements.
    ckpt.load(1, into={"a": base[:, ::2], "one": base[0, 1:2]})
    assert torch.equal(base[:, ::2], a)
    assert base[0, 1].item() == 7.0

    base = fresh()
    refused = [
        ({"a": base[:, :4], "b": base[:, 2:6]}, "a", "b"),  # strided and strided
        ({"a": base[:, ::2], "c": base[0, 1:5]}, "a", "c"),  # strided and contiguous
        ({"c": base[1, :4], "a": base.t()[::2].t()}, "a", "c"),  # the other order
        ({"a": base[:, 1::2], "one": base[1, 3:4]}, "a", "one"),  # one element met
    ]
    for into, first, second in refused:
        with pytest.raises(acp.InvalidInput, match=rf"`{first}` and key `{second}` share memory"):
            ckpt.load(1, into=into)
        assert torch.equal(base, fresh())  # nothing was copied
    with pytest.raises(acp.InvalidInput, match="`c` is an expanded view"):
        ckpt.load(1, into={"c": torch.zeros(1).expand(4)})
    # Elements that share memory where no stride is 0 (a hand-made view).
    overlapping = torch.zeros(8).as_strided((2, 4), (1, 1))
    with pytest.raises(acp.InvalidInput, match="`a`'s elements share memory with each other"):
        ckpt.load(1, into={"a": overlapping})
    assert not overlapping.any()


def test_parameters_and_requires_grad_survive(ckpt: acp.Checkpointer) -> None:
    p = nn.Parameter(torch.randn(3))
    frozen = nn.Parameter(torch.randn(2), requires_grad=False)
    leaf = torch.randn(4, requires_grad=True)
    ckpt.save(1, {"p": p, "frozen": frozen, "leaf": leaf, "plain": torch.ones(1)}).wait()
    out = ckpt.load()
    assert type(out["p"]) is nn.Parameter
    assert out["p"].requires_grad
    assert type(out["frozen"]) is nn.Parameter
    assert not out["frozen"].requires_grad
    assert type(out["leaf"]) is torch.Tensor
    assert out["leaf"].requires_grad
    assert out["leaf"].is_leaf
    assert not out["plain"].requires_grad
    assert torch.equal(out["p"].detach(), p.detach())


def test_torch_values_round_trip(ckpt: acp.Checkpointer) -> None:
    state = {"size": torch.Size([2, 3]), "dtype": torch.bfloat16, "device": torch.device("cpu")}
    ckpt.save(1, state).wait()
    assert_same(state, ckpt.load())


def test_loaded_tensors_own_their_memory(ckpt: acp.Checkpointer) -> None:
    ckpt.save(1, {"w": torch.arange(1000.0)}).wait()
    out = ckpt.load()
    ckpt.save(2, {"w": torch.zeros(1000)}).wait()
    ckpt.save(3, {"w": torch.ones(1000)}).wait()  # the slots are reused
    assert torch.equal(out["w"], torch.arange(1000.0))
    out["w"].add_(1)  # writable
    assert torch.equal(ckpt.load(1)["w"], torch.arange(1000.0))


def test_load_into_copies_in_place(ckpt: acp.Checkpointer) -> None:
    model, opt, sched, scaler, _ = train_some(2, seed=3)
    ckpt.save(5, full_state(model, opt, sched, scaler)).wait()
    x = torch.randn(4, 8)
    model.eval()
    expected = model(x).detach()

    params = list(model.parameters())
    ptrs = [p.data_ptr() for p in params]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5).add_(1)
    assert not torch.equal(model(x), expected)
    sd = model.state_dict()
    stats = ckpt.load(into={"model": sd})
    assert isinstance(stats, acp.LoadStats)
    assert stats.step == 5
    assert stats.source == "ram"
    assert stats.copied_bytes > 0
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert torch.equal(model(x).detach(), expected)


def test_load_into_a_fresh_optimizer(ckpt: acp.Checkpointer) -> None:
    model, opt, _sched, _scaler, _ = train_some(3, seed=4)
    ckpt.save(1, {"model": model.state_dict(), "optim": opt.state_dict()}).wait()
    model2 = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.BatchNorm1d(16), nn.Linear(16, 4))
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.5)
    into = {"model": model2.state_dict(), "optim": opt2.state_dict()}
    assert into["optim"]["state"] == {}
    ckpt.load(into=into)
    opt2.load_state_dict(into["optim"])
    assert_same(opt.state_dict(), opt2.state_dict())
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_load_into_selects_top_level_keys(ckpt: acp.Checkpointer) -> None:
    ckpt.save(1, {"a": torch.ones(3), "b": torch.full((2,), 2.0), "epoch": 9}).wait()
    target = {"a": torch.zeros(3)}
    ckpt.load(into=target)
    assert list(target) == ["a"]
    assert torch.equal(target["a"], torch.ones(3))


def test_load_into_mismatch_names_the_key_and_copies_nothing(ckpt: acp.Checkpointer) -> None:
    ckpt.save(1, {"m": {"a.weight": torch.ones(3, 4), "b": torch.ones(2)}}).wait()
    a = torch.zeros(3, 4)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"m": {"a.weight": a, "b": torch.zeros(3)}}, r"`m\.b`.*\[2\].*\[3\]"),
        ({"m": {"a.weight": a, "b": torch.zeros(2, dtype=torch.float16)}}, r"`m\.b`.*F32.*F16"),
        ({"m": {"a.weight": a, "b": torch.zeros(2), "c": torch.zeros(1)}}, r"`m\.c`: not in"),
        ({"m": {"a.weight": a, "b": {"x": torch.zeros(2)}}}, r"`m\.b`"),
        ({"zzz": torch.zeros(1)}, r"`zzz`: not in"),
    ]
    for into, pattern in cases:
        with pytest.raises(acp.InvalidInput, match=pattern):
            ckpt.load(into=into)
        assert torch.equal(a, torch.zeros(3, 4)), "copied before the error"


def test_load_into_assigns_plain_values_and_adds_missing_keys(ckpt: acp.Checkpointer) -> None:
    ckpt.save(1, {"m": {"w": torch.ones(2), "n": 3, "extra": {"t": torch.ones(1)}}}).wait()
    target: dict[str, Any] = {"m": {"w": torch.zeros(2), "n": None}}
    ckpt.load(into=target)
    assert target["m"]["n"] == 3
    assert torch.equal(target["m"]["extra"]["t"], torch.ones(1))
    target = {"m": {"w": 5, "n": 0}}
    ckpt.load(into=target)
    assert torch.equal(target["m"]["w"], torch.ones(2))


def test_load_with_map_location(ckpt: acp.Checkpointer) -> None:
    ckpt.save(1, {"w": torch.ones(2)}).wait()
    out = ckpt.load(map_location="cpu")
    assert out["w"].device.type == "cpu"
    out = ckpt.load(map_location={"cpu": "cpu"})
    assert out["w"].device.type == "cpu"
    with pytest.raises(acp.InvalidInput, match="map_location"):
        ckpt.load(map_location=lambda s, loc: s)
    # Many tensors: each saved device is mapped once, and one that cannot
    # be restored on is named with the first tensor saved on it.
    ckpt.save(2, {f"t{i}": torch.full((3,), float(i)) for i in range(50)}).wait()
    out = ckpt.load(2, map_location={"cpu": "cpu"})
    assert all(torch.equal(out[f"t{i}"], torch.full((3,), float(i))) for i in range(50))
    with pytest.raises(acp.InvalidInput, match=r"device meta is not supported"):
        ckpt.load(2, map_location={"cpu": "meta"})


class MyTensor(torch.Tensor):
    pass


UNSUPPORTED_TENSORS = [
    (torch.ones(2).as_subclass(MyTensor), r"`x`: tensor subclass `.*MyTensor`"),
    (
        torch.ones(2, dtype=torch.complex128),
        r"`x`: dtype torch.complex128 has no safetensors name \(torch.view_as_real\(\)",
    ),
    (
        torch.zeros(2, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
        r"`x`: dtype torch.float4_e2m1fn_x2 .*\(t.view\(torch.uint8\)",
    ),
    (torch.ones(2).to_sparse(), r"`x`: torch.sparse_coo"),
    (torch.empty(2, device="meta"), r"`x`: tensors on meta"),
]
"""Tensors acp refuses, and the error naming each (key `x`)."""


@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        *UNSUPPORTED_TENSORS,
        (nn.Linear(2, 2), r"`x`: .*Linear.*state_dict"),
        (torch.Generator(), r"`x`: .*Generator"),
    ],
)
def test_unsupported_torch_values_are_refused(
    ckpt: acp.Checkpointer, value: object, pattern: str
) -> None:
    with pytest.raises(acp.InvalidInput, match=pattern):
        ckpt.save(1, {"x": value})
    assert ckpt.steps() == []
    ckpt.save(1, {"x": torch.ones(1)}).wait()  # nothing was left half-way
    assert ckpt.steps() == [1]


@pytest.mark.parametrize(("target", "pattern"), UNSUPPORTED_TENSORS)
def test_unsupported_tensors_in_into_are_refused_before_any_copy(
    ckpt: acp.Checkpointer, target: torch.Tensor, pattern: str
) -> None:
    """``load(into=)`` reads only a tensor's dtype and shape while it plans
    (a first restore of many tensors); what else ``describe`` refuses is
    refused before anything is copied, naming the key."""
    ckpt.save(1, {"x": torch.ones(2), "y": torch.ones(3)}).wait()
    y = torch.zeros(3)
    with pytest.raises(acp.InvalidInput, match=pattern):
        ckpt.load(1, into={"x": target, "y": y})
    assert torch.equal(y, torch.zeros(3))  # nothing was loaded


def test_restore_after_reopen_comes_from_ram_then_storage(make_ckpt: Any) -> None:
    first = make_ckpt()
    first.save(1, {"w": torch.arange(10.0)}).wait()
    first.close()
    second = make_ckpt()
    out = second.load()
    assert torch.equal(out["w"], torch.arange(10.0))
    assert second.last_load is not None
    assert second.last_load.source == "ram"
    out = second.load(storage_only=True)
    assert torch.equal(out["w"], torch.arange(10.0))
    assert second.last_load.source == "storage"
    assert second.last_load.verified


def test_save_and_load_figures(ckpt: acp.Checkpointer) -> None:
    h = ckpt.save(1, {"w": torch.ones(1 << 16)})
    before = h.stats
    assert before.stall_secs > 0
    assert before.tensor_bytes == 4 << 16
    s = h.wait()
    assert s.done
    assert s.bytes is not None
    assert s.bytes >= 4 << 16
    assert s.io in ("uring", "psync")
    assert s.total_secs is not None
    assert s.engine_stall_secs is not None
    assert s.total_secs >= s.engine_stall_secs
    assert s.flush_bytes_per_sec is None or s.flush_bytes_per_sec > 0
    assert h.stats == s
    ckpt.load()
    stats = ckpt.stats()
    assert stats["saves"] == 1
    assert stats["last_save"]["step"] == 1
    assert stats["last_load"]["source"] == "ram"
    assert stats["last_load"]["copied_bytes"] == 4 << 16
    assert stats["engine"]["io"] == s.io


def test_reserve_creates_the_free_slots_memory_and_keeps_checkpoints(
    make_ckpt: Any, shm_dir: Path
) -> None:
    ckpt = make_ckpt(ring_slots=3, ring_bytes=24 << 20)
    state = {"w": torch.randn(1 << 20), "step": 3}  # 4 MiB

    def slot_sizes() -> list[int]:
        return sorted(p.stat().st_size for p in slot_dir(shm_dir).iterdir() if p.is_file())

    assert all(n < 4 << 20 for n in slot_sizes())
    assert ckpt.reserve(state) == 3
    assert all(n >= 4 << 20 for n in slot_sizes())
    assert ckpt.steps() == []  # nothing saved
    assert ckpt.reserve(state) == 3  # idempotent

    ckpt.save(1, state).wait()
    ckpt.save(2, state).wait()
    free = ckpt.reserve(state)
    assert free < 3  # the slots holding steps 1 and 2 are left alone
    out = ckpt.load(2)
    assert torch.equal(out["w"], state["w"])

    with pytest.raises(acp.InvalidInput, match="ring_bytes"):
        ckpt.reserve({"big": torch.zeros(4 << 20)})  # 16 MiB > an 8 MiB slot
    with pytest.raises(acp.InvalidInput, match="nope"):
        ckpt.reserve({"nope": object()})


def test_the_readme_restore_gives_a_fresh_optimizer_its_saved_state(make_ckpt: MakeCkpt) -> None:
    """README's restore: ``load(into=sd)`` with a fresh optimizer's
    ``state_dict()`` adds the saved state to that dict (a fresh optimizer
    has no state tensors to fill), and ``opt.load_state_dict`` of it
    restores the optimizer exactly; the model is filled in place."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    ckpt = make_ckpt()
    ckpt.save(1, {"model": model.state_dict(), "optim": opt.state_dict()}).wait()
    fresh = torch.nn.Linear(8, 4)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    assert fresh_opt.state_dict()["state"] == {}
    sd = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
    ckpt.load(into=sd)
    fresh_opt.load_state_dict(sd["optim"])
    assert torch.equal(fresh.weight, model.weight)
    saved, got = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert sorted(got) == sorted(saved)
    for k in saved:
        for name, v in saved[k].items():
            assert torch.equal(got[k][name], v), (k, name)
