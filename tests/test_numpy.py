"""NumPy arrays and scalars: names, dtypes and round trips."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import acp
from acp import _codec

np = pytest.importorskip("numpy")


def names(state: object) -> list[str]:
    return [t.name for t in _codec.flatten(state, _codec.Adapters()).tensors]


def test_tensor_names_are_dotted_paths_and_unique() -> None:
    a = np.zeros(2)
    state = {"a.b": a, "a": {"b": np.ones(2)}, 3: {"w": np.ones(1)}, "": np.ones(1)}
    assert names(state) == ["a.b", "a.b#2", "3.w", "tensor"]


def test_same_array_twice_is_one_tensor() -> None:
    a = np.arange(6)
    assert names({"x": a, "y": a, "z": a[:]}) == ["x"]
    assert names({"x": a, "y": a[1:]}) == ["x", "y"]


def test_unsupported_numpy_values() -> None:
    with pytest.raises(acp.InvalidInput, match=r"`o`.*object"):
        _codec.flatten({"o": np.array([None])}, _codec.Adapters())
    with pytest.raises(acp.InvalidInput, match=r"`c`.*complex128"):
        _codec.flatten({"c": np.zeros(2, np.complex128)}, _codec.Adapters())
    with pytest.raises(acp.InvalidInput, match=r"`m`.*subclass"):
        _codec.flatten({"m": np.ma.masked_array([1, 2])}, _codec.Adapters())


DTYPES = ["float64", "float32", "float16", "int64", "int32", "int16", "int8"]
DTYPES += ["uint64", "uint32", "uint16", "uint8", "bool", "complex64"]


def test_numpy_round_trip(ckpt: acp.Checkpointer) -> None:
    rng = np.random.default_rng(0)
    arrays = {d: (rng.random((3, 5)) * 100).astype(d) for d in DTYPES}
    state: dict[str, Any] = {
        "arrays": arrays,
        "strided": np.arange(40, dtype=np.int32).reshape(5, 8)[::2, 1::3],
        "fortran": np.asfortranarray(np.arange(12.0).reshape(3, 4)),
        "big_endian": np.arange(5, dtype=">i4"),
        "zero_d": np.array(3.5),
        "empty": np.zeros((0, 4), np.float32),
        "scalars": [np.float32(1.5), np.int64(-3), np.bool_(True)],
        "np_rng": np.random.RandomState(5).get_state(),
        "pcg": np.random.default_rng(7).bit_generator.state,
        "dtype": np.dtype("<f4"),
    }
    ckpt.save(1, state).wait()
    out = ckpt.load(1)
    for d, a in arrays.items():
        assert out["arrays"][d].dtype == a.dtype
        np.testing.assert_array_equal(out["arrays"][d], a)
    np.testing.assert_array_equal(out["strided"], state["strided"])
    np.testing.assert_array_equal(out["fortran"], state["fortran"])
    np.testing.assert_array_equal(out["big_endian"], state["big_endian"])
    assert out["zero_d"].shape == ()
    assert out["empty"].shape == (0, 4)
    assert [type(s) for s in out["scalars"]] == [np.float32, np.int64, np.bool_]
    assert out["scalars"] == state["scalars"]
    assert out["dtype"] == np.dtype("<f4")
    # numpy's legacy RNG state: a tuple holding an ndarray
    name, keys, pos, has_gauss, cached = out["np_rng"]
    assert type(out["np_rng"]) is tuple
    assert name == "MT19937"
    np.testing.assert_array_equal(keys, state["np_rng"][1])
    assert (pos, has_gauss, cached) == state["np_rng"][2:]
    r = np.random.RandomState()
    r.set_state(out["np_rng"])
    assert r.random() == np.random.RandomState(5).random()
    assert out["pcg"] == state["pcg"]


def test_into_numpy_arrays(ckpt: acp.Checkpointer) -> None:
    ckpt.save(1, {"a": np.arange(6.0), "n": 3}).wait()
    target = {"a": np.zeros(6), "n": 0}
    keep = target["a"]
    stats = ckpt.load(into=target)
    assert target["a"] is keep
    np.testing.assert_array_equal(keep, np.arange(6.0))
    assert target["n"] == 3
    assert stats.step == 1


def test_into_numpy_arrays_sharing_memory(ckpt: acp.Checkpointer) -> None:
    """Two checkpoint arrays into overlapping memory are refused by key
    before anything is copied; a tied array (one tensor saved twice) may
    be loaded into one array twice."""
    w = np.arange(4.0)
    ckpt.save(1, {"a": np.zeros(4), "b": np.ones(4), "t1": w, "t2": w}).wait()
    base = np.full(6, -1.0)
    with pytest.raises(acp.InvalidInput, match=r"key `a` and key `b` share memory"):
        ckpt.load(1, into={"a": base[:4], "b": base[2:], "t1": np.zeros(4), "t2": np.zeros(4)})
    np.testing.assert_array_equal(base, np.full(6, -1.0))
    tied = np.zeros(4)
    ckpt.load(1, into={"a": base[:4], "b": np.zeros(4), "t1": tied, "t2": tied})
    np.testing.assert_array_equal(tied, w)
    # A NumPy array and a torch tensor over the same memory: each framework
    # checks its own targets, the engine both, and names them (it said
    # "tensors 0 and 1").
    ckpt.save(2, {"a": np.zeros(4), "t": torch.ones(4)}).wait()
    buf = np.full(6, -1.0)  # float64: `a` takes bytes 0..32, `t` bytes 24..40
    with pytest.raises(acp.InvalidInput, match=r"tensors `(a` and `t|t` and `a)` overlaps"):
        ckpt.load(2, into={"a": buf[:4], "t": torch.from_numpy(buf.view(np.float32)[6:10])})
    np.testing.assert_array_equal(buf, np.full(6, -1.0))
