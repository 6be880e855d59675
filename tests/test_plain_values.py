"""The plain-values view of a checkpoint's values tree: one definition in
acp-core (``acp._acp.plain_values``), used by ``acp inspect``/``diff`` and
by ``acp export --to mindspore``'s appended scalars."""

from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np

from acp import _acp, _codec
from acp.convert import plain_scalars


def _every_node() -> str:
    """The values JSON the codec writes for a state with every kind of node
    and every kind of dict key."""
    state = {
        "w": np.arange(2, dtype=np.float32),
        3: float("inf"),
        1.5: float("nan"),
        True: (1, b"\x00\x01\x02"),
        None: None,
        2**64: -(2**64) - 1,
        float("-inf"): [2**63, "s"],
        "rest": OrderedDict(lr=0.5, betas=(0.9, 0.999), tag="adam", ok=False),
    }
    return json.dumps(_codec.flatten(state, _codec.Adapters()).tree)


def test_described_view_pins_every_node() -> None:
    assert json.loads(_acp.plain_values(_every_node())) == {
        "w": "<tensor w>",
        "3": "inf",
        "1.5": "nan",
        "true": [1, "<3 bytes>"],
        "null": None,
        "18446744073709551616": "-18446744073709551617",
        "-inf": [2**63, "s"],
        "rest": {"lr": 0.5, "betas": [0.9, 0.999], "tag": "adam", "ok": False},
    }


def test_omitted_view_keeps_only_plain_json() -> None:
    assert json.loads(_acp.plain_values(_every_node(), describe=False)) == {
        "w": None,
        "3": None,
        "1.5": None,
        "true": [1, None],
        "null": None,
        "18446744073709551616": None,
        "-inf": [2**63, "s"],
        "rest": {"lr": 0.5, "betas": [0.9, 0.999], "tag": "adam", "ok": False},
    }


def test_mindspore_export_appends_the_plain_scalars() -> None:
    # In key order: the view's objects sort their keys.
    assert plain_scalars(_every_node()) == [
        ("-inf.0", 2**63),
        ("-inf.1", "s"),
        ("rest.betas.0", 0.9),
        ("rest.betas.1", 0.999),
        ("rest.lr", 0.5),
        ("rest.ok", False),
        ("rest.tag", "adam"),
        ("true.0", 1),
    ]


def test_plain_trees_come_back_as_they_are() -> None:
    assert json.loads(_acp.plain_values('{"a": [1, {"t": "tensor"}]}')) == {
        "a": [1, {"t": "tensor"}]
    }
