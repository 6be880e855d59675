"""The state codec on its own: types preserved through JSON, refusals name
the key, tensor names are unique. No engine involved."""

from __future__ import annotations

import json
import math
import random
import struct
from collections import OrderedDict
from typing import Any

import pytest

import acp
from acp import _codec


def round_trip(state: object) -> Any:
    flat = _codec.flatten(state, _codec.Adapters())
    assert not flat.tensors
    text = flat.json()
    node = _codec.parse(text, step=0)
    return _codec.Decoder(_codec.Adapters(), lambda ref, key: None).value(node, "")


def same(a: object, b: object) -> bool:
    """Equal values of identical types, all the way down (nan equals nan)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)  # type: ignore[arg-type]
    if isinstance(a, dict):
        assert isinstance(b, dict)
        return list(a) == list(b) and all(
            type(k1) is type(k2) and same(a[k1], b[k2]) for k1, k2 in zip(a, b)
        )
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple))
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


PLAIN_STATES = {
    "scalars": {"i": 3, "f": 1.0, "neg0": -0.0, "s": "é ✓", "b": True, "n": None},
    "awkward floats": [0.1 + 0.2, 5e-324, 1.7976931348623157e308, 1e-310, 2.0**-1074],
    "non-finite": [math.nan, math.inf, -math.inf, struct.unpack("<d", b"\x01\x00" * 4)[0]],
    "big ints": [2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**40, -(10**40)],
    "int keys": {0: "a", 1: {2: "b"}, -5: [], 2**70: 1},
    "odd keys": {1.5: 1, True: 2, None: 3, "x": 4},
    "tuples": (1, (2.0, "3"), [(), (None,)]),
    "bytes": {"raw": b"\x00\xffabc", "empty": b""},
    "python random": random.Random(1234).getstate(),
    "nested empty": {"a": {}, "b": [], "c": (), "d": ""},
    "list root": [1, [2, [3, [4]]]],
}


@pytest.mark.parametrize("name", list(PLAIN_STATES))
def test_plain_values_round_trip_with_types(name: str) -> None:
    state = PLAIN_STATES[name]
    assert same(round_trip(state), state)


def test_ordered_dict_and_its_metadata_survive() -> None:
    sd: OrderedDict[str, Any] = OrderedDict([("b", 1), ("a", 2)])
    sd._metadata = OrderedDict([("", {"version": 2})])  # type: ignore[attr-defined]
    out = round_trip({"model": sd})
    assert type(out["model"]) is OrderedDict
    assert list(out["model"]) == ["b", "a"]
    assert out["model"]._metadata == {"": {"version": 2}}
    assert type(out["model"]._metadata) is OrderedDict


def test_dict_order_is_kept() -> None:
    state = {k: i for i, k in enumerate("zyxabc")}
    assert list(round_trip(state)) == list("zyxabc")


def test_python_random_state_restores_the_stream() -> None:
    r = random.Random(99)
    r.random()
    state = round_trip({"rng": r.getstate()})
    expected = [r.random() for _ in range(5)]
    r2 = random.Random()
    r2.setstate(state["rng"])
    assert [r2.random() for _ in range(5)] == expected


class Custom:
    pass


@pytest.mark.parametrize(
    ("state", "key", "what"),
    [
        ({"optim": {"state": {3: {"fn": lambda x: x}}}}, "optim.state.3.fn", "function"),
        ({"a": [1, Custom()]}, "a.1", "Custom"),
        ({"s": {1, 2}}, "s", "set"),
        ({"c": 1j}, "c", "complex"),
        ({"r": range(3)}, "r", "range"),
        ({"t": (1, frozenset())}, "t.1", "frozenset"),
        ({"k": {(1, 2): 3}}, "k.(1, 2)", "dict key of type `tuple`"),
        ({"bad": "\udc80"}, "bad", "not valid Unicode"),
        ({"ba": bytearray(b"x")}, "ba", "bytearray"),
    ],
)
def test_refusals_name_the_key(state: object, key: str, what: str) -> None:
    with pytest.raises(acp.InvalidInput) as e:
        _codec.flatten(state, _codec.Adapters())
    assert f"`{key}`" in str(e.value)
    assert what in str(e.value)
    assert isinstance(e.value, ValueError)


def test_subclasses_of_builtins_are_refused() -> None:
    class MyInt(int):
        pass

    with pytest.raises(acp.InvalidInput, match="MyInt"):
        _codec.flatten({"x": MyInt(3)}, _codec.Adapters())


def test_a_state_that_contains_itself_is_refused() -> None:
    a: list[Any] = [1]
    a.append(a)
    with pytest.raises(acp.InvalidInput, match="contains itself"):
        _codec.flatten({"a": a}, _codec.Adapters())


def test_shared_plain_containers_are_fine() -> None:
    shared = [1, 2]
    out = round_trip({"a": shared, "b": shared})
    assert out == {"a": [1, 2], "b": [1, 2]}


def test_json_is_strict_and_versioned() -> None:
    flat = _codec.flatten({"x": math.nan}, _codec.Adapters())
    tree = json.loads(flat.json())
    assert tree["acp.codec"] == _codec.CODEC_VERSION
    assert "NaN" not in flat.json()


def test_a_newer_codec_is_refused() -> None:
    text = json.dumps({"acp.codec": _codec.CODEC_VERSION + 1, "state": {}})
    with pytest.raises(acp.Unsupported, match="newer"):
        _codec.parse(text, step=7)


def test_values_not_written_by_acp_are_refused() -> None:
    with pytest.raises(acp.InvalidInput, match="step 7"):
        _codec.parse("[1, 2]", step=7)


def test_unknown_framework_module_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(_codec.ADAPTER_MODULES, "fakefw", "acp._no_such_adapter")
    adapters = _codec.Adapters()
    with pytest.raises(
        acp.InvalidInput, match=r"key `w`: fakefw values need acp\._no_such_adapter"
    ):
        adapters.get("fakefw", "w")


def test_plain_values_round_trip_through_the_engine(ckpt: acp.Checkpointer) -> None:
    """The values tree crosses serde_json in the engine: floats and big ints
    must come back bit for bit, dict order kept."""
    ckpt.save(1, PLAIN_STATES).wait()
    assert same(ckpt.load(1, storage_only=True), PLAIN_STATES)
    assert same(ckpt.load(1), PLAIN_STATES)
