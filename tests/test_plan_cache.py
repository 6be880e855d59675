"""The plans a checkpointer keeps from one save or ``load(into=)`` to the
next (``acp._plan``): reused while the state is unchanged, and never when
it changed in any way the plan depends on."""

from __future__ import annotations

import gc
import struct
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
import torch

import acp
from acp import _load
from acp._codec import Entry

from .conftest import MakeCkpt


def state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "a": torch.randn(4, 3),
        "b": torch.arange(6, dtype=torch.int32),
        "nested": {"c": torch.randn(5), "step": 1, "lr": 0.5},
    }


def roundtrip(ckpt: acp.Checkpointer, step: int, s: dict[str, Any]) -> Any:
    ckpt.save(step, s).wait()
    return ckpt.load(step)


def same(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return (
            isinstance(y, torch.Tensor)
            and x.dtype == y.dtype
            and x.shape == y.shape
            and x.requires_grad == y.requires_grad
            and torch.equal(x.detach(), y.detach())
        )
    if isinstance(x, dict):
        return (
            isinstance(y, dict)
            and [(type(k), k) for k in x] == [(type(k), k) for k in y]
            and all(type(x[k]) is type(y[k]) and same(x[k], y[k]) for k in x)
        )
    if isinstance(x, float):
        return isinstance(y, float) and struct.pack(">d", x) == struct.pack(">d", y)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(same(a, b) for a, b in zip(x, y))
    return type(x) is type(y) and x == y


# --- save: a change of the state takes the full path ------------------------

Change = Callable[[dict[str, Any]], None]


def _replace(s: dict[str, Any]) -> None:
    s["a"] = torch.randn(4, 3)


def _resize(s: dict[str, Any]) -> None:
    s["a"].resize_(20)  # a new storage, a new shape


def _set(s: dict[str, Any]) -> None:
    s["a"].set_(torch.full((4, 3), 7.0))  # same object and shape, other memory


def _dtype(s: dict[str, Any]) -> None:
    s["a"] = s["a"].double()


def _add_key(s: dict[str, Any]) -> None:
    s["nested"]["d"] = torch.ones(2)


def _remove_key(s: dict[str, Any]) -> None:
    del s["nested"]["c"]


def _strided(s: dict[str, Any]) -> None:
    s["a"] = torch.randn(3, 4).t()  # same shape, not contiguous


def _value(s: dict[str, Any]) -> None:
    s["nested"]["step"] = 2


def _value_type(s: dict[str, Any]) -> None:
    s["nested"]["step"] = True  # == 1, but a bool


def _negative_zero(s: dict[str, Any]) -> None:
    s["nested"]["lr"] = -0.0


def _zero(s: dict[str, Any]) -> None:
    s["nested"]["lr"] = 0.0


def _requires_grad(s: dict[str, Any]) -> None:
    s["nested"]["c"].requires_grad_()


def _parameter(s: dict[str, Any]) -> None:
    s["a"] = torch.nn.Parameter(s["a"])


def _parameter_no_grad(s: dict[str, Any]) -> None:
    # The same memory, shape, strides, dtype and requires_grad: only the type.
    s["a"] = torch.nn.Parameter(s["a"], requires_grad=False)


def _key_type(s: dict[str, Any]) -> None:
    s["nested"] = {1: s["a"]}


def _key_type_bool(s: dict[str, Any]) -> None:
    s["nested"] = {True: s["a"]}  # == 1, but a bool


def _tie(s: dict[str, Any]) -> None:
    s["nested"]["c"] = s["a"]  # now the same tensor twice


def _ordered(s: dict[str, Any]) -> None:
    s["nested"] = OrderedDict(s["nested"])


def _metadata(s: dict[str, Any]) -> None:
    s["nested"]._metadata[""]["version"] = 2


def _swap(s: dict[str, Any]) -> None:
    # A tensor and a plain value change places in the same dict: the same
    # keys, values and tensors, in other positions.
    n = s["nested"]
    n["c"], n["step"] = n["step"], n["c"]


def _value_among_tensors(s: dict[str, Any]) -> None:
    # A dict of tensors only (signed as one batch) gains a plain value.
    s["b"] = 3


def _tensor_in_list(s: dict[str, Any]) -> None:
    s["nested"]["lr"] = [s["a"], s["b"]]


SAVE_CHANGES: dict[str, Change] = {
    "swap": _swap,
    "value_among_tensors": _value_among_tensors,
    "tensor_in_list": _tensor_in_list,
    "replace": _replace,
    "resize": _resize,
    "set": _set,
    "dtype": _dtype,
    "add_key": _add_key,
    "remove_key": _remove_key,
    "strided": _strided,
    "value": _value,
    "value_type": _value_type,
    "negative_zero": _negative_zero,
    "requires_grad": _requires_grad,
    "parameter": _parameter,
    "parameter_no_grad": _parameter_no_grad,
    "key_type": _key_type,
    "tie": _tie,
    "ordered": _ordered,
}


@pytest.mark.parametrize("change", SAVE_CHANGES.values(), ids=SAVE_CHANGES.keys())
def test_a_changed_state_saves_as_it_is(make_ckpt: MakeCkpt, change: Change) -> None:
    ckpt = make_ckpt()
    s = state()
    roundtrip(ckpt, 1, s)
    roundtrip(ckpt, 2, s)  # the plan is kept and reused
    change(s)
    assert same(s, roundtrip(ckpt, 3, s))
    assert same(s, roundtrip(ckpt, 4, s))  # and the new plan


def test_in_place_changes_of_a_kept_tensor_are_saved(make_ckpt: MakeCkpt) -> None:
    # The same tensor objects in the same containers, changed in place.
    ckpt = make_ckpt()
    s = {"sq": torch.randn(3, 3), "pair": [torch.randn(2), torch.arange(3)]}
    roundtrip(ckpt, 1, s)
    roundtrip(ckpt, 2, s)
    s["sq"].t_()  # the same address and shape, other strides
    assert same(s["sq"], roundtrip(ckpt, 3, s)["sq"])
    s["pair"].reverse()  # the same tensors, in other places
    got = roundtrip(ckpt, 4, s)
    assert all(same(x, y) for x, y in zip(s["pair"], got["pair"]))
    s["sq"].data = s["sq"].data.view(torch.int32)  # the same bytes as another dtype
    assert same(s["sq"], roundtrip(ckpt, 5, s)["sq"])


def test_a_dict_of_tensors_only_keeps_their_types(make_ckpt: MakeCkpt) -> None:
    # A dict whose values are all tensors is recorded in one step: the
    # types of its values are part of that record.
    ckpt = make_ckpt()
    s = {"m": {"w": torch.randn(3), "b": torch.randn(2)}}
    roundtrip(ckpt, 1, s)
    roundtrip(ckpt, 2, s)
    s["m"]["w"] = torch.nn.Parameter(s["m"]["w"], requires_grad=False)  # the same memory
    assert same(s, roundtrip(ckpt, 3, s))
    s["m"]["w"] = s["m"]["w"].data
    assert same(s, roundtrip(ckpt, 4, s))


def test_a_state_of_several_frameworks_keeps_its_plan(make_ckpt: MakeCkpt) -> None:
    import numpy as np

    ckpt = make_ckpt()
    s = {"t": torch.randn(3), "n": np.arange(4.0), "v": torch.Size([2, 3])}
    assert roundtrip(ckpt, 1, s)["v"] == torch.Size([2, 3])
    s["t"].add_(1)
    got = roundtrip(ckpt, 2, s)
    assert same(s["t"], got["t"])
    assert (got["n"] == s["n"]).all()
    s["v"] = torch.Size([3, 2])  # a torch value, signed by value
    assert roundtrip(ckpt, 3, s)["v"] == torch.Size([3, 2])


def test_key_types_that_compare_equal_save_apart(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt()
    s = state()
    _key_type(s)
    assert same(s, roundtrip(ckpt, 1, s))
    _key_type_bool(s)
    assert same(s, roundtrip(ckpt, 2, s))


def test_zeros_of_either_sign_save_apart(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt()
    s = state()
    _zero(s)
    assert same(s, roundtrip(ckpt, 1, s))
    _negative_zero(s)
    assert same(s, roundtrip(ckpt, 2, s))


def test_ordered_dict_metadata_changes_are_saved(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt()
    s = state()
    _ordered(s)
    s["nested"]._metadata = {"": {"version": 1}}
    roundtrip(ckpt, 1, s)
    _metadata(s)
    assert roundtrip(ckpt, 2, s)["nested"]._metadata == s["nested"]._metadata


def test_a_kept_save_plan_copies_the_current_bytes(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt()
    s = state()
    roundtrip(ckpt, 1, s)
    s["a"].add_(1)  # in place: the same plan, new bytes
    s["nested"]["c"].zero_()
    assert same(s, roundtrip(ckpt, 2, s))


def count_full_walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that gets an item for each save that takes the full path
    (the state flattened, no kept plan)."""
    walks: list[int] = []
    real = acp.checkpointer.Checkpointer._flatten

    def counting(self: Any, *args: Any) -> Any:
        walks.append(1)
        return real(self, *args)

    monkeypatch.setattr(acp.checkpointer.Checkpointer, "_flatten", counting)
    return walks


def test_a_fresh_state_dict_each_save_reuses_the_plan(
    make_ckpt: MakeCkpt, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = torch.nn.Linear(3, 2)
    ckpt = make_ckpt()
    ckpt.save(1, {"model": model.state_dict()}).wait()
    walks = count_full_walks(monkeypatch)
    ckpt.save(2, {"model": model.state_dict()}).wait()
    assert walks == []
    model.weight.data = torch.randn(2, 3)  # a new tensor under the same key
    ckpt.save(3, {"model": model.state_dict()}).wait()
    assert walks == [1]
    assert same(dict(model.state_dict()), dict(ckpt.load(3)["model"]))


# --- load(into=): a change of into or of the checkpoint takes the full path --


def into_of(s: dict[str, Any]) -> dict[str, Any]:
    return {
        "a": torch.empty_like(s["a"]),
        "b": torch.empty_like(s["b"]),
        "nested": {"c": torch.empty_like(s["nested"]["c"]), "step": 0, "lr": 0.0},
    }


def saved_twice(make_ckpt: MakeCkpt) -> tuple[acp.Checkpointer, dict[str, Any], dict[str, Any]]:
    ckpt = make_ckpt()
    s = state()
    ckpt.save(1, s).wait()
    s2 = state()
    s2["a"].mul_(3)
    s2["nested"]["step"] = 7
    ckpt.save(2, s2).wait()
    return ckpt, s, s2


def test_a_kept_load_plan_copies_the_current_step(make_ckpt: MakeCkpt) -> None:
    ckpt, s, s2 = saved_twice(make_ckpt)
    into = into_of(s)
    ckpt.load(1, into=into)
    assert same(s, into)
    ckpt.load(2, into=into)  # the same structure: the kept plan
    assert same(s2, into)
    into["nested"]["step"] = 99  # assigned again by the kept plan
    ckpt.load(1, into=into)
    assert same(s, into)


def test_a_kept_load_plan_is_used(make_ckpt: MakeCkpt, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt, s, _ = saved_twice(make_ckpt)
    into = into_of(s)
    ckpt.load(1, into=into)
    planners: list[int] = []
    real = _load._IntoPlanner.__init__

    def counting(self: Any, *args: Any) -> None:
        planners.append(1)
        real(self, *args)

    monkeypatch.setattr(_load._IntoPlanner, "__init__", counting)
    ckpt.load(1, into=into)
    assert planners == []
    into["a"] = torch.empty_like(s["a"])
    ckpt.load(1, into=into)
    assert planners == [1]
    assert same(s, into)


def test_a_kept_load_plan_outlives_the_containers_it_assigns(
    make_ckpt: MakeCkpt, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An optimizer's param_groups: lists and tuples the plan assigns anew
    # at each load (fresh objects), which must not make the next load plan
    # again.
    ckpt = make_ckpt()
    s = state()
    s["groups"] = [{"params": [0, 1, 2], "betas": (0.9, 0.999), "lr": 1e-3}]
    ckpt.save(1, s).wait()
    into = into_of(s)
    into["groups"] = [{"params": [], "betas": (0.0, 0.0), "lr": 0.0}]
    planners: list[int] = []
    real = _load._IntoPlanner.__init__

    def counting(self: Any, *args: Any) -> None:
        planners.append(1)
        real(self, *args)

    monkeypatch.setattr(_load._IntoPlanner, "__init__", counting)
    for _ in range(4):
        for t in (into["a"], into["b"], into["nested"]["c"]):
            t.zero_()
        ckpt.load(1, into=into)
        assert same(s, into)
    assert planners == [1]
    group = into["groups"][0]
    into["groups"][0] = dict(group)  # a container it assigns into, replaced
    ckpt.load(1, into=into)
    assert planners == [1, 1]
    assert same(s, into)


def test_load_into_a_replaced_tensor(make_ckpt: MakeCkpt) -> None:
    ckpt, s, _ = saved_twice(make_ckpt)
    into = into_of(s)
    ckpt.load(1, into=into)
    old = into["a"]
    into["a"] = torch.empty_like(s["a"])
    ckpt.load(1, into=into)
    assert same(s, into)
    old.zero_()
    into["a"] = old  # back to the first tensor: planned again, filled
    ckpt.load(1, into=into)
    assert same(s, into)


def test_load_into_a_set_tensor(make_ckpt: MakeCkpt) -> None:
    ckpt, s, _ = saved_twice(make_ckpt)
    into = into_of(s)
    ckpt.load(1, into=into)
    other = torch.zeros_like(s["a"])
    into["a"].set_(other)  # same object and shape, other memory
    ckpt.load(1, into=into)
    assert torch.equal(other, s["a"])


@pytest.mark.parametrize(
    "change",
    [
        lambda i: i["a"].resize_(2),
        lambda i: i["a"].resize_(20),
        lambda i: i.__setitem__("a", i["a"].double()),
        lambda i: i.__setitem__("a", torch.empty(3, 4)),
        lambda i: i["nested"].__setitem__("extra", torch.empty(2)),
        lambda i: i.__setitem__("extra", 1),
    ],
    ids=["shrunk", "grown", "dtype", "shape", "nested_key_added", "key_added"],
)
def test_load_into_a_mismatched_into_is_refused(
    make_ckpt: MakeCkpt, change: Callable[[dict[str, Any]], Any]
) -> None:
    ckpt, s, _ = saved_twice(make_ckpt)
    into = into_of(s)
    ckpt.load(1, into=into)
    ckpt.load(1, into=into)
    change(into)
    with pytest.raises(acp.InvalidInput):
        ckpt.load(1, into=into)


def test_load_into_with_a_key_removed(make_ckpt: MakeCkpt) -> None:
    ckpt, s, s2 = saved_twice(make_ckpt)
    into = into_of(s)
    ckpt.load(1, into=into)
    del into["b"]
    ckpt.load(2, into=into)
    assert list(into) == ["a", "nested"]
    assert same(s2["a"], into["a"])
    assert same(s2["nested"], into["nested"])


def test_load_into_a_strided_tensor(make_ckpt: MakeCkpt) -> None:
    ckpt, s, _ = saved_twice(make_ckpt)
    into = into_of(s)
    ckpt.load(1, into=into)
    base = torch.zeros(3, 4)
    into["a"] = base.t()  # the right shape, not contiguous
    ckpt.load(1, into=into)
    assert torch.equal(base.t(), s["a"])


def test_load_into_a_new_container_assigns_into_it(make_ckpt: MakeCkpt) -> None:
    ckpt, s, _ = saved_twice(make_ckpt)
    first = into_of(s)
    ckpt.load(1, into=first)
    second = {**first, "nested": dict(first["nested"], step=0)}  # same tensors and shape
    ckpt.load(1, into=second)
    assert second["nested"]["step"] == 1


def test_load_into_from_a_checkpoint_of_another_structure(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt()
    s = state()
    ckpt.save(1, s).wait()
    other = state()
    other["a"] = torch.randn(2, 6)  # same bytes, another shape
    ckpt.save(2, other).wait()
    into = into_of(s)
    ckpt.load(1, into=into)
    with pytest.raises(acp.InvalidInput):
        ckpt.load(2, into=into)
    renamed = {"z" + k: v for k, v in s.items()}
    ckpt.save(3, renamed).wait()
    with pytest.raises(acp.InvalidInput):
        ckpt.load(3, into=into)


def test_a_state_that_came_to_contain_itself_is_refused(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt()
    s = state()
    roundtrip(ckpt, 1, s)
    s["nested"]["loop"] = s
    with pytest.raises(acp.InvalidInput, match="contains itself"):
        ckpt.save(2, s)


# --- save: plain values that change at every save keep the plan -------------


def valued_state(i: int) -> dict[str, Any]:
    """Tensors and plain values of every kind, the values depending on ``i``
    (their types do not): a training loop's step counter, scheduler state
    and the like."""
    torch.manual_seed(0)
    sched: OrderedDict[str, Any] = OrderedDict(
        last_epoch=i, _last_lr=[0.1 / (i + 1), 0.2], name=f"cosine-{i}-é"
    )
    sched._metadata = {"": {"version": i}}  # type: ignore[attr-defined]
    return {
        "w": torch.randn(4, 3),
        "step": i,
        "big": 2**70 + i,
        "neg": -(2**63) - i,
        "nan": float("nan") if i % 2 else float("inf"),
        "zero": -0.0 if i % 2 else 0.0,
        "flag": i % 2 == 0,
        "none": None,
        "blob": bytes([i % 256]) * (i + 1),
        "sched": sched,
        "groups": [{"lr": 1e-3 * i, "betas": (0.9, 0.99 + i * 1e-4), "params": [0, i]}],
    }


def test_changing_plain_values_keep_the_plan_and_save_as_they_are(
    make_ckpt: MakeCkpt, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = make_ckpt()
    s = valued_state(1)
    assert same(s, roundtrip(ckpt, 1, s))
    walks = count_full_walks(monkeypatch)
    for i in range(2, 6):
        fresh = valued_state(i)
        fresh["w"] = s["w"]  # the same tensor: only values change
        fresh["w"].add_(1)
        assert same(fresh, roundtrip(ckpt, i, fresh)), i
    assert walks == [], "the kept plan took every save"
    # Every step kept its own values.
    got = ckpt.load(3)
    assert got["step"] == 3
    assert got["sched"]["name"] == "cosine-3-é"
    assert got["sched"]._metadata == {"": {"version": 3}}


def test_a_kept_plan_refuses_a_value_the_codec_refuses(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt()
    s = {"w": torch.randn(3), "note": "ok"}
    roundtrip(ckpt, 1, s)
    roundtrip(ckpt, 2, s)
    s["note"] = "bad \ud800"  # a lone surrogate: not valid Unicode
    with pytest.raises(acp.InvalidInput, match="note"):
        ckpt.save(3, s)
    assert ckpt.steps() == [1, 2]
    s["note"] = "fine again"
    assert same(s, roundtrip(ckpt, 4, s))


def test_values_that_outgrow_the_header_move_the_data(make_ckpt: MakeCkpt) -> None:
    # The header is padded to a multiple of 4096 bytes: values that grow
    # past the padding move the data section, which the engine lays out
    # again from the kept plan.
    ckpt = make_ckpt()
    s = {"w": torch.randn(64, 64), "log": "x", "b": torch.arange(10)}
    roundtrip(ckpt, 1, s)
    for n in (10_000, 3, 50_000):
        s["log"] = "y" * n
        s["w"].mul_(2)
        assert same(s, roundtrip(ckpt, 1 + n, s)), n


def test_a_load_leaves_no_planning_behind(make_ckpt: MakeCkpt) -> None:
    """What only the planning of a ``load(into=)`` needs (an entry and a
    fill per tensor) is freed when the load returns, not left in a
    reference cycle for the garbage collector to walk."""
    ckpt = make_ckpt()
    state = {"model": {f"t{i}": torch.full((4,), float(i)) for i in range(50)}, "step": 3}
    ckpt.save(1, state).wait()
    into = {"model": {k: torch.zeros(4) for k in state["model"]}, "step": 0}
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        ckpt.load(into=into)
        left = [o for o in gc.get_objects() if type(o) is Entry]
    finally:
        if was:
            gc.enable()
    assert left == []
    assert into["step"] == 3
    assert all(torch.equal(into["model"][k], v) for k, v in state["model"].items())
