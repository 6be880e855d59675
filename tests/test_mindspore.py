"""MindSpore through the real engine: every dtype, networks and optimizers
in place, load_param_into_net-like reports, the Model.train callback
(SIGKILL and resume from RAM, an exception, SIGTERM), conversion to and
from MindSpore's formats, refusals."""

from __future__ import annotations

import ctypes
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import mindspore as ms
import mindspore.common.dtype as mstype
import numpy as np
import pytest
from mindspore import Parameter, Tensor, mint, nn
from mindspore.dataset import NumpySlicesDataset
from mindspore.train import Model

import acp
import acp._mindspore_codec as codec
import acp.mindspore as am

from .conftest import SMALL_RING, MakeCkpt

ms.set_device("CPU")

HERE = Path(__file__).parent
FP8 = (mstype.float8_e4m3fn, mstype.float8_e5m2)


def raw(t: Any) -> bytes:
    """A CPU tensor's bytes, read at ``data_ptr()`` (asnumpy() refuses fp8)."""
    n = math.prod(t.shape) * mstype.type_size_in_bytes(t.dtype)
    if not t.is_contiguous():
        t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), n) if n else b""


def random_tensor(dtype: Any, shape: tuple[int, ...], seed: int = 0) -> Any:
    rng = np.random.default_rng(seed)
    n = math.prod(shape) * mstype.type_size_in_bytes(dtype)
    t = mint.empty(shape, dtype=dtype, device="CPU")
    if dtype == mstype.bool_:
        data = rng.integers(0, 2, n, dtype=np.uint8)
    else:
        data = rng.integers(0, 256, n, dtype=np.uint8)
    if n:
        ctypes.memmove(t.data_ptr(), data.ctypes.data, n)
    return t


def assert_same_tensor(a: Any, b: Any, key: str = "") -> None:
    assert type(b) is type(a) or (isinstance(a, Parameter) and isinstance(b, Parameter)), key
    assert b.dtype == a.dtype, key
    assert tuple(b.shape) == tuple(a.shape), key
    assert raw(b) == raw(a), f"{key}: values differ"
    if isinstance(a, Parameter):
        assert b.name == a.name, key
        assert b.requires_grad == a.requires_grad, key


class Net(nn.Cell):  # type: ignore[misc]
    def __init__(self, hidden: int = 16, dtype: Any = mstype.float32) -> None:
        super().__init__()
        self.fc1 = nn.Dense(8, hidden, dtype=dtype)
        self.act = nn.ReLU()
        self.fc2 = nn.Dense(hidden, 4, dtype=dtype)

    def construct(self, x: Any) -> Any:
        return self.fc2(self.act(self.fc1(x)))


def trained(steps: int = 3, seed: int = 1) -> tuple[Net, Any]:
    ms.set_seed(seed)
    net = Net()
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
    step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        x = Tensor(rng.standard_normal((4, 8)).astype(np.float32))
        y = Tensor(rng.standard_normal((4, 4)).astype(np.float32))
        step(x, y)
    return net, opt


def fresh(seed: int = 7) -> tuple[Net, Any]:
    ms.set_seed(seed)
    net = Net()
    return net, nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)


def same_params(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert list(a) == list(b)
    for k, v in a.items():
        assert raw(v) == raw(b[k]), k


# --------------------------------------------------------------------------
# tensors and dtypes


@pytest.mark.parametrize("dtype", list(am.DTYPES), ids=str)
def test_every_dtype_round_trips_bit_exact(ckpt: acp.Checkpointer, dtype: Any) -> None:
    state = {
        "t": random_tensor(dtype, (3, 5), 1),
        "scalar": random_tensor(dtype, (), 2),
        "empty": random_tensor(dtype, (0, 4), 3),
    }
    if dtype not in FP8:  # MindSpore's CPU backend cannot make fp8 Parameters
        state["p"] = Parameter(random_tensor(dtype, (2, 3), 4), name="layer.w", requires_grad=False)
    ckpt.save(1, state).wait()
    out = ckpt.load()
    for k, v in state.items():
        assert_same_tensor(v, out[k], k)
    # in place, into tensors of the same kind
    into = {k: random_tensor(dtype, tuple(v.shape), 9) for k, v in state.items()}
    ckpt.load(into=into)
    for k, v in state.items():
        assert raw(into[k]) == raw(v), k


def test_dtype_table_covers_the_engine() -> None:
    floats = ["F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"]
    ints = ["I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL"]
    assert sorted(am.DTYPES.values()) == sorted([*floats, *ints, "C64"])
    assert am.dtype_to_safetensors(mstype.bfloat16) == "BF16"
    assert am.dtype_from_safetensors("F16") == mstype.float16


def test_parameters_tied_views_and_dtype_values(ckpt: acp.Checkpointer) -> None:
    p = Parameter(Tensor(np.arange(6, dtype=np.float32).reshape(2, 3)), name="shared")
    base = Tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
    view = base.transpose()  # non-contiguous
    state = {"a": p, "b": p, "view": view, "dt": mstype.bfloat16, "n": 3}
    h = ckpt.save(1, state)
    assert h.wait().tensors == 2  # p once, the view
    out = ckpt.load()
    assert out["a"] is out["b"]
    assert out["a"].name == "shared"
    np.testing.assert_array_equal(out["view"].asnumpy(), view.asnumpy())
    assert out["dt"] == mstype.bfloat16
    assert out["n"] == 3


def test_load_into_views_sharing_memory_is_refused(ckpt: acp.Checkpointer) -> None:
    """Two checkpoint tensors into views of one tensor that overlap are
    refused by key before anything is copied; views that do not overlap
    load."""
    ckpt.save(1, {"a": Tensor(np.zeros(4, np.float32)), "b": Tensor(np.ones(4, np.float32))}).wait()
    base = Tensor(np.full(8, -1.0, np.float32))
    with pytest.raises(acp.InvalidInput, match=r"key `a` and key `b` share memory"):
        ckpt.load(1, into={"a": base[0:4], "b": base[2:6]})
    np.testing.assert_array_equal(base.asnumpy(), np.full(8, -1.0, np.float32))
    ckpt.load(1, into={"a": base[0:4], "b": base[4:8]})
    np.testing.assert_array_equal(base.asnumpy(), [0.0] * 4 + [1.0] * 4)


def test_save_reads_cpu_memory_in_place() -> None:
    """On the CPU, the adapter hands the tensor's own memory to the engine:
    no asnumpy(), no copy."""
    p = Parameter(Tensor(np.ones((64, 64), np.float32)), name="w")
    adapter = codec.Adapter()
    info = adapter.describe(p, "w")
    assert info is not None
    transfer = adapter.stage(None, [(0, p, info)])
    assert transfer.host == [(0, p.data_ptr(), 64 * 64 * 4)]


def test_device_path_round_trips(ckpt: acp.Checkpointer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors not in host memory go through asnumpy() (bf16 and fp8 as
    unsigned views) on save and through set_data/assign_value on load."""
    monkeypatch.setattr(codec, "on_host", lambda t: False)
    state = {str(d): random_tensor(d, (4, 3), i) for i, d in enumerate(am.DTYPES)}
    state["p"] = Parameter(random_tensor(mstype.bfloat16, (5,), 9), name="p")
    ckpt.save(1, state).wait()
    out = ckpt.load()
    into = {k: random_tensor(v.dtype, tuple(v.shape), 99) for k, v in state.items()}
    into = {k: v if v.dtype in FP8 else Parameter(v, name=k) for k, v in into.items()}
    ckpt.load(into=into)
    for k, v in state.items():
        assert raw(out[k]) == raw(v), k
        assert raw(into[k]) == raw(v), k


@pytest.mark.parametrize(
    ("make", "dtype"),
    [
        (lambda: Tensor(np.ones(3, np.complex128)), "Complex128"),
        (lambda: mint.empty((3,), dtype=mstype.hifloat8), "HiFloat8"),
        (lambda: Tensor(np.ones(3, np.int8), mstype.qint4x2), "Int4"),
    ],
    ids=["complex128", "hifloat8", "int4"],
)
def test_mindspore_only_dtypes_are_refused_naming_the_key(
    ckpt: acp.Checkpointer, make: Any, dtype: str
) -> None:
    with pytest.raises(acp.InvalidInput, match=rf"key `model\.w`: MindSpore dtype {dtype}"):
        ckpt.save(1, {"model": {"w": make()}})
    assert ckpt.steps() == []


def test_cells_and_other_values_are_refused(ckpt: acp.Checkpointer) -> None:
    with pytest.raises(acp.InvalidInput, match=r"key `net`: .*param_dict"):
        ckpt.save(1, {"net": Net()})


# --------------------------------------------------------------------------
# networks, optimizers, load_param_into_net


def test_network_and_optimizer_in_place_from_ram(ckpt: acp.Checkpointer) -> None:
    net, opt = trained()
    am.save(ckpt, 3, net, opt, epoch=2, loss_scale=1024.0).wait()
    saved = am.param_dict(net, opt)
    assert {"fc1.weight", "moments.fc1.weight", "global_step", "learning_rate"} <= set(saved)

    net2, opt2 = fresh()
    before = {k: p.data_ptr() for k, p in am.param_dict(net2, opt2).items()}
    param_not_load, ckpt_not_load = report = am.load_into_net(ckpt, net2, opt2)
    assert (param_not_load, ckpt_not_load) == ([], [])
    assert report.step == 3
    assert report.values == {"epoch": 2, "loss_scale": 1024.0}
    assert report.stats is not None
    assert report.stats.source == "ram"
    assert ckpt.last_load is report.stats
    loaded = am.param_dict(net2, opt2)
    same_params(saved, loaded)
    # filled in place: the parameters keep their memory
    assert {k: p.data_ptr() for k, p in loaded.items()} == before
    x = Tensor(np.ones((2, 8), np.float32))
    np.testing.assert_array_equal(net2(x).asnumpy(), net(x).asnumpy())


def test_load_params_feeds_mindspores_own_loader(ckpt: acp.Checkpointer) -> None:
    net, opt = trained()
    am.save(ckpt, 1, net, opt).wait()
    params = am.load_params(ckpt)
    assert all(isinstance(p, Parameter) and p.name == k for k, p in params.items())
    net2, opt2 = fresh()
    param_not_load, ckpt_not_load = ms.load_param_into_net(net2, params)
    assert param_not_load == []
    assert set(ckpt_not_load) == set(am.param_dict(opt2)) - set(am.param_dict(net2))
    same_params(am.param_dict(net), am.param_dict(net2))


def test_missing_and_unexpected_reported_like_load_param_into_net(
    ckpt: acp.Checkpointer,
) -> None:
    net, _ = trained()
    params = am.param_dict(net)
    del params["fc2.bias"]
    params["extra.w"] = Parameter(Tensor(np.ones(2, np.float32)), name="extra.w")
    params["accu_grads.x"] = Parameter(Tensor(np.ones(2, np.float32)), name="accu_grads.x")
    am.save(ckpt, 1, params=params).wait()

    target, opt = fresh()
    ours = am.load_into_net(ckpt, target, opt)
    theirs_net, theirs_opt = fresh()
    theirs = ms.load_param_into_net(theirs_net, am.load_params(ckpt))
    theirs_opt_only = ms.load_param_into_net(theirs_opt, am.load_params(ckpt))
    assert "fc2.bias" in ours.param_not_load
    assert "moments.fc1.weight" in ours.param_not_load
    assert set(ours.ckpt_not_load) == {"extra.w", "accu_grads.x"}
    assert set(ours.param_not_load) == set(theirs[0]) | set(theirs_opt_only[0])
    assert set(ours.ckpt_not_load) == set(theirs[1]) & set(theirs_opt_only[1])
    np.testing.assert_array_equal(target.fc1.weight.asnumpy(), net.fc1.weight.asnumpy())


def test_prefixed_names_match_unless_strict(ckpt: acp.Checkpointer) -> None:
    net, _ = trained()
    ckpt.save(1, {"backbone": dict(am.param_dict(net))}).wait()  # names backbone.fc1.weight ...
    strict, _ = fresh()
    assert sorted(am.load_into_net(ckpt, strict, strict_load=True).param_not_load) == sorted(
        am.param_dict(net)
    )
    loose, _ = fresh()
    theirs, _ = fresh()
    report = am.load_into_net(ckpt, loose)
    ms_dict = {
        f"backbone.{k}": Parameter(v.copy(), name=f"backbone.{k}")
        for k, v in am.param_dict(net).items()
    }
    assert ms.load_param_into_net(theirs, ms_dict)[0] == report.param_not_load == []
    assert report.ckpt_not_load == []
    same_params(am.param_dict(net), am.param_dict(loose))


def test_prefix_matching_uses_each_saved_tensor_once() -> None:
    targets = {"fc.weight": 1, "weight": 2, "bias": 3}
    saved = ["fc.weight", "model.bias", "model.weight"]
    matched, missing = am.network._match(targets, saved, strict_load=False)
    assert matched == {"fc.weight": "fc.weight", "weight": "model.weight", "bias": "model.bias"}
    assert missing == []
    matched, missing = am.network._match(
        {"fc.weight": 1, "weight": 2}, ["fc.weight"], strict_load=False
    )
    assert (matched, missing) == ({"fc.weight": "fc.weight"}, ["weight"])


def test_float_types_convert_unless_strict(ckpt: acp.Checkpointer) -> None:
    net16 = Net(dtype=mstype.float16)
    am.save(ckpt, 1, net16).wait()
    net32, _ = fresh()
    with pytest.raises(
        acp.InvalidInput, match=r"parameter `fc1\.weight`: dtype mismatch.*F16.*F32"
    ):
        am.load_into_net(ckpt, net32, strict_load=True)
    am.load_into_net(ckpt, net32)
    assert net32.fc1.weight.dtype == mstype.float32
    np.testing.assert_array_equal(
        net32.fc1.weight.asnumpy(), net16.fc1.weight.asnumpy().astype(np.float32)
    )


def test_shape_mismatch_names_the_parameter_and_loads_nothing(ckpt: acp.Checkpointer) -> None:
    am.save(ckpt, 1, Net(hidden=16)).wait()
    other = Net(hidden=32)
    before = {k: raw(p) for k, p in am.param_dict(other).items()}
    with pytest.raises(
        acp.InvalidInput, match=r"parameter `fc1\.weight`: shape mismatch.*\[16, 8\].*\[32, 8\]"
    ):
        am.load_into_net(ckpt, other)
    assert {k: raw(p) for k, p in am.param_dict(other).items()} == before


def test_a_torch_checkpoint_loads_into_a_mindspore_net(ckpt: acp.Checkpointer) -> None:
    torch = pytest.importorskip("torch")
    net, _ = trained()
    sd = {k: torch.from_numpy(p.asnumpy().copy()) for k, p in am.param_dict(net).items()}
    ckpt.save(1, {"model": sd, "epoch": 4}).wait()
    target, _ = fresh()
    report = am.load_into_net(ckpt, target)
    assert (report.param_not_load, report.ckpt_not_load) == ([], [])
    assert report.values == {"epoch": 4}
    same_params(am.param_dict(net), am.param_dict(target))


def test_a_dtype_mindspore_lacks_names_the_parameter(
    ckpt: acp.Checkpointer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint written by torch with fp8 weights, loaded where this
    MindSpore has no fp8 (older versions have none): refused by name."""
    torch = pytest.importorskip("torch")
    ckpt.save(1, {"w": torch.zeros(4, dtype=torch.float8_e5m2)}).wait()
    monkeypatch.delitem(codec._FROM_NAME, "F8_E5M2")

    class One(nn.Cell):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.w = Parameter(Tensor(np.zeros(4, np.float32)), name="w")

    with pytest.raises(
        acp.InvalidInput, match=r"parameter `w`: dtype F8_E5M2 has no MindSpore type"
    ):
        am.load_into_net(ckpt, One())
    with pytest.raises(acp.InvalidInput, match=r"tensor `w`: dtype F8_E5M2 has no MindSpore type"):
        am.export_ckpt(ckpt, ckpt.root.parent / "out.ckpt")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "empty parameter name"),
        (" w", "leading or trailing whitespace"),
        ("w\n", "leading or trailing whitespace"),
        ("a\tb", "non-printable character"),
        ("x" * 1025, "at most 1024"),
        (3, "parameter names are strings"),
    ],
    ids=["empty", "leading-space", "trailing-newline", "tab", "too-long", "int"],
)
def test_names_mindspore_would_reject(ckpt: acp.Checkpointer, name: Any, message: str) -> None:
    params = {name: Parameter(Tensor(np.ones(2, np.float32)), name="ok")}
    with pytest.raises(acp.InvalidInput, match=message):
        am.save(ckpt, 1, params=params)
    assert ckpt.steps() == []


def test_duplicate_parameter_names_across_cells() -> None:
    with pytest.raises(
        acp.InvalidInput, match=r"parameter `fc1\.weight`: two different parameters"
    ):
        am.param_dict(Net(), Net())


def test_not_a_tensor_in_a_parameter_dict(ckpt: acp.Checkpointer) -> None:
    with pytest.raises(acp.InvalidInput, match=r"parameter `w`: a numpy.ndarray is not"):
        am.save(ckpt, 1, params={"w": np.ones(2)})


# --------------------------------------------------------------------------
# the Model.train callback


def small_dataset(batches: int = 3) -> Any:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batches * 4, 8)).astype(np.float32)
    y = rng.standard_normal((batches * 4, 4)).astype(np.float32)
    return NumpySlicesDataset((x, y), column_names=["x", "y"], shuffle=False).batch(4)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("every_n_steps", 0),
        ("every_n_steps", -2),
        ("every_n_steps", True),
        ("every_n_steps", 1.5),
        ("every_n_steps", "10"),
        ("keep", 0),
    ],
)
def test_callback_refuses_bad_options(ckpt: acp.Checkpointer, option: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"every_n_steps": 5, option: value}
    with pytest.raises(acp.ConfigError, match=rf"config `{option}`"):
        am.AcpCheckpoint(ckpt, **kwargs)


def test_callback_saves_every_n_keeps_k_and_resumes(make_ckpt: MakeCkpt) -> None:
    # Every save persisted (coalescing could supersede step 4 with step 6).
    ckpt = make_ckpt(persist_every=1)
    net, opt = fresh(3)
    model = Model(net, nn.MSELoss(), opt)
    cb = am.AcpCheckpoint(ckpt, every_n_steps=2, keep=2)
    model.train(2, small_dataset(3), callbacks=[cb])  # steps 1..6
    assert cb.last_saved == 6
    assert ckpt.steps() == [4, 6]
    state = ckpt.load(6)
    assert {k: state[k] for k in ("epoch", "step", "step_in_epoch", "batch_num")} == {
        "epoch": 2,
        "step": 6,
        "step_in_epoch": 3,
        "batch_num": 3,
    }
    net2, opt2 = fresh(4)
    r = am.resume(ckpt, net2, opt2)
    assert r is not None
    assert (r.step, r.epoch, r.initial_epoch) == (6, 2, 2)
    same_params(am.param_dict(net, opt), am.param_dict(net2, opt2))
    # a second Model.train call resumed at epoch 2 saves steps 8 (mid-epoch) and 9 (the end)
    model2 = Model(net2, nn.MSELoss(), opt2)
    cb2 = am.AcpCheckpoint(ckpt, every_n_steps=4, keep=3)
    model2.train(3, small_dataset(3), callbacks=[cb2], initial_epoch=r.initial_epoch)
    assert ckpt.steps() == [6, 8, 9]
    r2 = am.resume(ckpt, *fresh(5), step=8)
    assert r2 is not None
    assert (r2.step, r2.epoch, r2.step_in_epoch, r2.initial_epoch) == (8, 3, 2, 2)


def test_a_mid_epoch_resume_replays_its_epoch_without_saving_the_saved_steps_again(
    make_ckpt: MakeCkpt,
) -> None:
    """README's resume recipe with a checkpoint taken mid-epoch: Model.train
    resumes at the start of that epoch and replays the steps up to it. The
    callback saved the replayed step again and the run failed with
    CheckpointExists; now it goes on, and the saved step stays the one the
    run resumed from."""
    ckpt = make_ckpt(persist_every=1)
    net, opt = fresh(3)
    cb = am.AcpCheckpoint(ckpt, every_n_steps=3, save_at_end=False)
    Model(net, nn.MSELoss(), opt).train(2, small_dataset(4), callbacks=[cb])  # steps 1..8
    assert ckpt.steps() == [3, 6]
    net2, opt2 = fresh(4)
    r = am.resume(ckpt, net2, opt2)
    assert r is not None
    assert (r.step, r.epoch, r.step_in_epoch, r.initial_epoch) == (6, 2, 2, 1)
    before = ckpt.load(6)
    cb2 = am.AcpCheckpoint(ckpt, every_n_steps=3, save_at_end=False)
    # Epochs 2 and 3 again: steps 5..12, of which 5 and 6 are replayed.
    Model(net2, nn.MSELoss(), opt2).train(3, small_dataset(4), callbacks=[cb2], initial_epoch=1)
    assert ckpt.steps() == [3, 6, 9, 12]
    assert cb2.last_saved == 12
    after = ckpt.load(6)
    same_params(before["params"], after["params"])


def test_resume_without_checkpoint_and_with_missing_parameters(
    make_ckpt: MakeCkpt,
) -> None:
    ckpt = make_ckpt()
    assert am.resume(ckpt, *fresh()) is None
    net, _ = trained()
    am.save(ckpt, 1, net).wait()
    with pytest.raises(acp.InvalidInput, match=r"no parameter .*`learning_rate`"):
        am.resume(ckpt, *fresh())
    r = am.resume(ckpt, *fresh(), allow_missing=True)
    assert r is not None
    assert "learning_rate" in r.load.param_not_load


def run_child(*args: object) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("ACP_TEST_NO_EXCEPTION_SAVE", None)
    return subprocess.run(
        [sys.executable, str(HERE / "ms_train.py"), *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
        timeout=240,
        env=env,
    )


def final(path: Path) -> dict[str, np.ndarray[Any, Any]]:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def test_sigkill_mid_training_resumes_from_ram_to_the_same_parameters(
    tmp_path: Path, shm_dir: Path
) -> None:
    root, job = tmp_path / "ckpt", "ms-kill"
    # 4 batches per epoch, a save every 4 steps; killed at step 10 (epoch 3)
    killed = run_child("sigkill", root, shm_dir, job, tmp_path / "killed.npz", 10)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (tmp_path / "killed.npz").exists() is False
    resumed = run_child("resume", root, shm_dir, job, tmp_path / "resumed.npz")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    reference = run_child("reference", root, shm_dir, "ref", tmp_path / "reference.npz")
    assert reference.returncode == 0, reference.stderr[-3000:]
    out = final(tmp_path / "resumed.npz")
    info = json.loads(str(out.pop("info")))
    assert info == {"step": 8, "initial_epoch": 2, "source": "ram"}
    expected = final(tmp_path / "reference.npz")
    assert list(out) == list(expected)
    for k in expected:
        np.testing.assert_array_equal(out[k], expected[k], err_msg=k)


def storage_state(root: Path, shm_dir: Path, job: str) -> tuple[list[int], Any]:
    with acp.Checkpointer(
        root, job=job, shm_dir=shm_dir, ring_bytes=SMALL_RING, persist_on_open=False
    ) as ckpt:
        steps = ckpt.steps()
        return steps, am.load_params(ckpt, storage_only=True) if steps else None


@pytest.mark.parametrize("how", ["raise", "sigterm"])
def test_exception_or_sigterm_commits_the_newest_save(
    tmp_path: Path, shm_dir: Path, how: str
) -> None:
    """The trainer dies right after the save of step 8 returned (the flush
    still running): an exception leaves Model.train and the process ends
    with os._exit, or SIGTERM arrives. Either way step 8 is committed on
    storage before the process is gone, and loads."""
    root, job = tmp_path / "ckpt", f"ms-{how}"
    child = run_child(how, root, shm_dir, job, tmp_path / "saved.npz", 8)
    expected_rc = 3 if how == "raise" else -signal.SIGTERM
    assert child.returncode == expected_rc, child.stderr[-3000:]
    assert "checkpoints up to step 8 are committed" in child.stderr
    steps, params = storage_state(root, shm_dir, job)
    assert steps == [4, 8]
    if how == "raise":
        saved = final(tmp_path / "saved.npz")
        assert int(saved.pop("step")) == 8
        assert set(saved) <= set(params)
        for k, v in saved.items():
            np.testing.assert_array_equal(params[k].asnumpy(), v, err_msg=k)


def test_sigterm_handler_is_restored_after_training(ckpt: acp.Checkpointer) -> None:
    before = signal.getsignal(signal.SIGTERM)
    net, opt = fresh()
    cb = am.AcpCheckpoint(ckpt, every_n_steps=100)
    Model(net, nn.MSELoss(), opt).train(1, small_dataset(2), callbacks=[cb])
    assert signal.getsignal(signal.SIGTERM) == before
    assert cb.last_saved == 2  # save_at_end
    assert ckpt.steps() == [2]


# --------------------------------------------------------------------------
# conversion


@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_export_and_import_round_trip(ckpt: acp.Checkpointer, tmp_path: Path, fmt: str) -> None:
    net, opt = trained()
    extra = {
        "bf16": Parameter(random_tensor(mstype.bfloat16, (3, 4), 5), name="bf16"),
        "f16": Parameter(random_tensor(mstype.float16, (7,), 6), name="f16"),
        "i64": Parameter(random_tensor(mstype.int64, (2,), 7), name="i64"),
    }
    params = {**am.param_dict(net, opt), **extra}
    am.save(ckpt, 5, params=params, epoch=3, tag="run-a").wait()

    out = am.export_ckpt(ckpt, tmp_path / f"model.{fmt}")
    assert out == tmp_path / f"model.{fmt}"
    theirs = ms.load_checkpoint(str(out), format=fmt)
    assert set(theirs) >= set(params)
    for k, p in params.items():
        assert theirs[k].dtype == p.dtype, k
        assert raw(theirs[k]) == raw(p), k
    assert int(theirs["epoch"].asnumpy()) == 3

    step = am.import_ckpt(out, ckpt, 11)
    assert step == 11
    back = am.load_params(ckpt, 11)
    for k, p in params.items():
        assert raw(back[k]) == raw(p), k
    target, target_opt = fresh()
    report = am.load_into_net(ckpt, target, target_opt, step=11)
    assert report.param_not_load == []
    same_params(am.param_dict(net, opt), am.param_dict(target, target_opt))


def test_import_takes_the_step_from_the_file(ckpt: acp.Checkpointer, tmp_path: Path) -> None:
    net, _ = trained()
    path = tmp_path / "ms.ckpt"
    ms.save_checkpoint(net, str(path), append_dict={"step_num": 42, "note": "hi"})
    assert am.import_ckpt(path, ckpt) == 42
    state = ckpt.load(42)
    assert state["note"] == "hi"
    same_params(am.param_dict(net), {k: state["params"][k] for k in am.param_dict(net)})


def test_export_a_torch_checkpoint_by_path(
    make_ckpt: MakeCkpt, tmp_path: Path, shm_dir: Path
) -> None:
    torch = pytest.importorskip("torch")
    ckpt = make_ckpt()
    sd = {"fc.weight": torch.randn(3, 2).to(torch.bfloat16), "fc.bias": torch.arange(3.0)}
    ckpt.save(7, {"model": sd, "step": 7}).wait()
    ckpt.close()
    out = am.export_ckpt(
        ckpt.root,
        tmp_path / "from_torch",
        format="safetensors",
        open_kwargs={"shm_dir": shm_dir, "ring_bytes": SMALL_RING, "job": "export"},
    )
    assert out.name == "from_torch.safetensors"
    theirs = ms.load_checkpoint(str(out), format="safetensors")
    assert theirs["model.fc.weight"].dtype == mstype.bfloat16
    assert raw(theirs["model.fc.weight"]) == sd["fc.weight"].view(torch.uint8).numpy().tobytes()
    np.testing.assert_array_equal(theirs["model.fc.bias"].asnumpy(), sd["fc.bias"].numpy())


def test_write_ckpt_from_raw_bytes_keeps_every_type(tmp_path: Path) -> None:
    """What `acp export --to mindspore` hands over: names, dtypes, shapes,
    bytes. bf16 stays bf16 (not widened), integers keep their width."""
    # MindSpore cannot serialise fp8 on the CPU, nor read complex64 back.
    dtypes = [d for d in am.DTYPES if d not in FP8 and d != mstype.complex64]
    tensors = {str(d): random_tensor(d, (3, 2), i) for i, d in enumerate(dtypes)}
    items = [(k, am.dtype_to_safetensors(t.dtype), t.shape, raw(t)) for k, t in tensors.items()]
    for fmt in ("ckpt", "safetensors"):
        out = am.write_ckpt(items, tmp_path / "w", format=fmt, append={"step_num": 3, "tag": "x"})
        assert out == tmp_path / f"w.{fmt}"
        back = ms.load_checkpoint(str(out), format=fmt)
        for k, t in tensors.items():
            assert back[k].dtype == t.dtype, k
            assert raw(back[k]) == raw(t), k
        assert int(back["step_num"].asnumpy()) == 3
        assert ("tag" in back) == (fmt == "ckpt")  # safetensors cannot hold strings
    out = am.write_ckpt(items[:1], tmp_path / "w.ckpt")  # replaces the read-only file
    assert set(ms.load_checkpoint(str(out))) == {items[0][0]}
    with pytest.raises(acp.InvalidInput, match=r"tensor `a`: 3 bytes for F32 \[1\]"):
        am.write_ckpt([("a", "F32", (1,), b"abc")], tmp_path / "x.ckpt")
    with pytest.raises(acp.InvalidInput, match="leading or trailing whitespace"):
        am.write_ckpt([(" a", "F32", (1,), b"abcd")], tmp_path / "x.ckpt")
    with pytest.raises(acp.InvalidInput, match=r"tensor `f8`: MindSpore .* cannot write fp8"):
        am.write_ckpt([("f8", "F8_E4M3", (4,), b"abcd")], tmp_path / "x.safetensors")
    for fmt in ("ckpt", "safetensors"):
        with pytest.raises(acp.InvalidInput, match=r"tensor `c`: MindSpore .* complex64"):
            am.write_ckpt([("c", "C64", (1,), b"\0" * 8)], tmp_path / f"c.{fmt}")
        assert not (tmp_path / f"c.{fmt}").exists()


def test_conversion_bad_input(ckpt: acp.Checkpointer, tmp_path: Path) -> None:
    with pytest.raises(acp.InvalidInput, match="format 'pt'"):
        am.export_ckpt(ckpt, tmp_path / "x.pt", format="pt")
    with pytest.raises(acp.CheckpointNotFound, match="no such file"):
        am.import_ckpt(tmp_path / "missing.ckpt", ckpt, 1)
    with pytest.raises(acp.CheckpointNotFound):
        am.export_ckpt(ckpt, tmp_path / "x.ckpt")


def hostile_ckpt(path: Path, tensor_type: str, dims: list[int], content: bytes) -> Path:
    """A MindSpore ``.ckpt`` of one parameter ``w``, written field by field."""
    from mindspore.train.checkpoint_pb2 import Checkpoint

    c = Checkpoint()
    v = c.value.add()
    v.tag = "w"
    v.tensor.tensor_type = tensor_type
    v.tensor.dims.extend(dims)
    v.tensor.tensor_content = content
    path.write_bytes(c.SerializeToString())
    return path


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        # MindSpore's loader pads a short tensor with zeros: bytes never in the file.
        (("Float32", [4], b"\0\0\xc0\x3f"), "4 bytes for Float32 [4] (16 expected)"),
        (("Float32", [1], b"\1\2\3"), "3 bytes for Float32 [1] (4 expected)"),
        (("Float32", [1], b"\0" * 8), "8 bytes for Float32 [1] (4 expected)"),
        # Sized by its dims (4 TiB), not by the 4 bytes the file holds.
        (("Float32", [2**20, 2**20], b"\0" * 4), "4398046511104 expected"),
        (("Bogus", [1], b"\0"), "unknown tensor type 'Bogus'"),
    ],
    ids=["short", "odd", "long", "terabyte", "bad-type"],
)
def test_import_refuses_a_ckpt_whose_bytes_differ_from_its_dims(
    ckpt: acp.Checkpointer,
    tmp_path: Path,
    bad: tuple[str, list[int], bytes],
    why: str,
) -> None:
    src = hostile_ckpt(tmp_path / "evil.ckpt", *bad)
    with pytest.raises(acp.CheckpointCorrupt, match=r"evil\.ckpt: parameter `w`") as e:
        am.import_ckpt(src, ckpt, 1)
    assert why in str(e.value)
    assert ckpt.steps() == []


def test_acp_import_refuses_a_ckpt_claiming_terabytes(tmp_path: Path) -> None:
    """The command line reads .ckpt files through the same check (one
    case: each run starts MindSpore, seconds apiece)."""
    src = hostile_ckpt(tmp_path / "evil.ckpt", "Float32", [2**20, 2**20], b"\0" * 4)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "acp.cli",
            "import",
            str(src),
            "--to",
            str(tmp_path / "d"),
            "--step",
            "1",
            "--shm-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr  # corrupt, not an internal error
    assert "evil.ckpt: parameter `w`" in proc.stderr, proc.stderr
    assert "4398046511104 expected" in proc.stderr, proc.stderr


def test_import_of_a_ckpt_that_is_not_protobuf_is_corrupt(
    ckpt: acp.Checkpointer, tmp_path: Path
) -> None:
    src = tmp_path / "garbage.ckpt"
    src.write_bytes(b"\xff" * 100)
    with pytest.raises(acp.CheckpointCorrupt, match=r"garbage\.ckpt: not a MindSpore checkpoint"):
        am.import_ckpt(src, ckpt, 1)


# --------------------------------------------------------------------------
# rank


def test_rank_from_mindspore_then_ascend_then_torchrun_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for var in ("RANK", "WORLD_SIZE", "RANK_ID", "RANK_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delitem(sys.modules, "torch.distributed", raising=False)
    assert am.rank_and_world_size() == (0, 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert am.rank_and_world_size() == (1, 2)
    monkeypatch.setenv("RANK_ID", "3")
    monkeypatch.setenv("RANK_SIZE", "8")
    assert am.rank_and_world_size() == (3, 8)  # MindSpore is imported: Ascend's first

    from mindspore.communication import management

    monkeypatch.setattr(management.GlobalComm, "INITED", True)
    monkeypatch.setattr(management, "get_rank", lambda *a: 5)
    monkeypatch.setattr(management, "get_group_size", lambda *a: 16)
    assert am.rank_and_world_size() == (5, 16)
    assert acp.rank_and_world_size() == (5, 16)  # the Checkpointer's default too
