"""Deeply nested states: the writer accepts exactly what the reader reads.
A state nested at the limit saves, commits and loads back equal; one level
deeper is refused by ``save()`` with its key path, before anything is staged.
(It used to pass ``save()``, fail at commit with ``CheckpointCorrupt``, stay
resident, and make every later open re-flush it and ``close()`` raise.)"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import pytest
import torch

import acp
from acp import _acp, _codec
from tests.conftest import MakeCkpt

DEPTH = 62
"""The deepest nesting of dicts, lists and tuples a state may have."""

KINDS = ["dict", "tuple", "list", "odict", "mixed"]


def leaf() -> dict[str, Any]:
    """The deepest values: a framework value whose JSON is two levels deep
    (the most any value adds), a tensor, a tagged big int."""
    return {"size": torch.Size([2, 3]), "t": torch.arange(4.0), "big": 2**70}


def nested(depth: int, kind: str) -> Any:
    """``depth`` containers (the innermost being the leaf dict) around the leaf
    values; the key path to the innermost is ``a.0.a.0...``."""
    state: Any = leaf()
    for level in range(depth - 1):
        k = kind if kind != "mixed" else KINDS[level % 4]
        if k == "dict":
            state = {"a": state}
        elif k == "odict":
            state = OrderedDict(a=state)
            state._metadata = {"version": 1}
        elif k == "tuple":
            state = (state,)
        else:
            state = [state]
    return state


def key_path(depth: int, kind: str) -> str:
    parts = []
    for level in reversed(range(depth - 1)):
        k = kind if kind != "mixed" else KINDS[level % 4]
        parts.append("a" if k in ("dict", "odict") else "0")
    return ".".join(parts)


def equal(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def test_the_limit_fits_the_format() -> None:
    assert _acp.MAX_VALUES_DEPTH == 127
    assert _codec.MAX_STATE_DEPTH == DEPTH
    # The JSON of a state at the limit is exactly as deep as the format takes.
    text = _codec.flatten(nested(DEPTH, "dict"), _codec.Adapters()).json()
    depth = deepest = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (c == "\\", c != '"')
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    assert deepest == _acp.MAX_VALUES_DEPTH


@pytest.mark.parametrize("kind", KINDS)
def test_a_state_at_the_limit_commits_and_loads_back(make_ckpt: MakeCkpt, kind: str) -> None:
    ckpt = make_ckpt()
    state = nested(DEPTH, kind)
    ckpt.save(1, state).wait()
    assert equal(ckpt.load(1), state)
    assert equal(ckpt.load(1, storage_only=True), state)


@pytest.mark.parametrize("kind", KINDS)
def test_one_level_deeper_is_refused_by_save(make_ckpt: MakeCkpt, kind: str) -> None:
    ckpt = make_ckpt()
    ckpt.save(1, {"w": torch.ones(2)}).wait()
    with pytest.raises(acp.InvalidInput) as e:
        ckpt.save(2, nested(DEPTH + 1, kind)).wait()
    assert f"key `{key_path(DEPTH + 1, kind)}`" in str(e.value)
    assert f"deeper than {DEPTH} levels" in str(e.value)
    ckpt.close()  # nothing resident to flush: no error
    again = make_ckpt()
    assert again.steps() == [1]
    again.close()


@pytest.mark.parametrize("depth", [DEPTH + 1, 1000, 100_000])
def test_far_deeper_states_are_refused_without_recursion_error(
    make_ckpt: MakeCkpt, depth: int
) -> None:
    state: Any = 1
    for _ in range(depth):
        state = [state]
    ckpt = make_ckpt()
    with pytest.raises(acp.InvalidInput, match=f"deeper than {DEPTH} levels"):
        ckpt.save(1, state)
    ckpt.close()


def test_values_json_too_deep_for_the_reader_is_refused_by_the_engine(make_ckpt: MakeCkpt) -> None:
    """The engine checks what any caller (not only the codec) gives it."""
    ckpt = make_ckpt()
    engine = ckpt.engine
    at = "[" * 127 + "]" * 127
    deeper = {"acp.codec": 1, "state": json.loads(at)}
    with pytest.raises(acp.InvalidInput, match=r"values at `state(\[0\])+`.*deeper than 127"):
        engine.begin_save(2, [], json.dumps(deeper))
    staging = engine.begin_save(2, [], at)
    assert staging is not None
    staging.finish().wait()
    ckpt.close()
