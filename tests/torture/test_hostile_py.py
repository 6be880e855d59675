"""Hostile checkpoints seen from Python: nothing a default load reads may run
code, and a crafted value raises ``acp.CheckpointCorrupt`` naming its key,
never a raw Python error."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import acp
import acp.dcp
from tests.conftest import MakeCkpt

# DCP warns on every single-process call that it assumes a single process.
dcp_warning = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def plant(path: str) -> str:
    """What the hostile pickle calls when it is unpickled: leaves a marker."""
    Path(path).write_text("code ran on load")
    return "planted"


class Hostile:
    """An object whose pickle calls :func:`plant` when it is unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (plant, (self.marker,))


def hostile_dcp_checkpoint(make_ckpt: MakeCkpt, marker: Path) -> acp.Checkpointer:
    """A step saved by ``dcp.save`` through acp whose ``trap`` value is a
    pickle that runs :func:`plant`; saving it runs nothing."""
    ckpt = make_ckpt()
    state = {"w": torch.ones(3), "trap": Hostile(marker), "epoch": 3}
    dcp.save(state, checkpoint_id=1, storage_writer=acp.dcp.StorageWriter(ckpt), no_dist=True)
    assert not marker.exists()
    return ckpt


@dcp_warning
@pytest.mark.parametrize("storage_only", [False, True], ids=["from-ram", "from-storage"])
def test_dcp_default_load_never_unpickles_code(
    make_ckpt: MakeCkpt, tmp_path: Path, storage_only: bool
) -> None:
    marker = tmp_path / "marker"
    ckpt = hostile_dcp_checkpoint(make_ckpt, marker)
    target = {"w": torch.zeros(3), "trap": None, "epoch": 0}
    reader = acp.dcp.StorageReader(ckpt, storage_only=storage_only)
    with pytest.raises(CheckpointException, match=r"`trap` is a DCP value that torch\.load"):
        dcp.load(target, storage_reader=reader, no_dist=True)
    assert not marker.exists(), "a default load ran code from the checkpoint"
    # load_bytes=False still refuses every byte entry, the harmless one too.
    with pytest.raises(CheckpointException, match="`epoch` is a pickled DCP value"):
        dcp.load(
            {"w": torch.zeros(3), "epoch": 0},
            storage_reader=acp.dcp.StorageReader(ckpt, load_bytes=False),
            no_dist=True,
        )
    assert not marker.exists()


@dcp_warning
def test_dcp_allow_pickle_is_the_explicit_old_path(make_ckpt: MakeCkpt, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    ckpt = hostile_dcp_checkpoint(make_ckpt, marker)
    target: dict[str, Any] = {"w": torch.zeros(3), "trap": None, "epoch": 0}
    reader = acp.dcp.StorageReader(ckpt, allow_pickle=True)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert marker.read_text() == "code ran on load"
    assert target["trap"] == "planted"
    assert target["epoch"] == 3


def blank(value: Any) -> Any:
    """``value``'s dict structure with every leaf None: what DCP loads into
    (it flattens nested dicts into keys)."""
    if isinstance(value, dict):
        return {k: blank(v) for k, v in value.items()}
    return None


@dcp_warning
def test_dcp_plain_values_round_trip_by_default(make_ckpt: MakeCkpt) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    plain = {
        "epoch": 7,
        "loss": 0.125,
        "name": "run1",
        "flags": [True, None, 2, 3.5, "x"],
        "nested": {"a": {"b": [1, 2, (3, 4)]}},
        "on": False,
    }
    state = {"model": model.state_dict(), "optim": opt.state_dict(), **plain}
    ckpt = make_ckpt()
    dcp.save(state, checkpoint_id=1, storage_writer=acp.dcp.StorageWriter(ckpt), no_dist=True)

    model2 = torch.nn.Linear(4, 2)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    model2(torch.randn(3, 4)).sum().backward()
    opt2.step()  # creates the state tensors the load fills in
    target: dict[str, Any] = {
        "model": model2.state_dict(),
        "optim": opt2.state_dict(),
        **{k: blank(v) for k, v in plain.items()},
    }
    dcp.load(target, storage_reader=acp.dcp.StorageReader(ckpt), no_dist=True)
    for k, v in plain.items():
        assert target[k] == v, k
    want_groups = opt.state_dict()["param_groups"]
    assert target["optim"]["param_groups"] == want_groups
    assert target["optim"]["param_groups"][0]["betas"] == (0.9, 0.95)
    for k, t in model.state_dict().items():
        assert torch.equal(target["model"][k], t), k
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(target["optim"]["state"][pid][k], v), (pid, k)


# --------------------------------------------------------------------------
# crafted values JSON: every malformed node is CheckpointCorrupt naming its key

T = {"t": "tensor", "fw": "torch", "name": "w"}  # a well-formed reference to the saved tensor


def deep(levels: int) -> Any:
    node: Any = 0
    for _ in range(levels):
        node = [node]
    return node


# (id, the node under key `x`, the key path the error must name; or the
# tensor, for a reference field only the framework's adapter reads)
HOSTILE_VALUES: list[tuple[str, Any, str]] = [
    ("dict-no-k", {"t": "dict", "v": [1]}, "x"),
    ("dict-no-v", {"t": "dict", "k": ["a"]}, "x"),
    ("dict-k-not-list", {"t": "dict", "k": "a", "v": [1]}, "x"),
    ("dict-v-not-list", {"t": "dict", "k": ["a"], "v": 1}, "x"),
    ("dict-lengths-differ", {"t": "dict", "k": ["a", "b"], "v": [1]}, "x"),
    ("dict-key-list", {"t": "dict", "k": [[1]], "v": [1]}, "x"),
    ("dict-key-tuple", {"t": "dict", "k": [{"t": "tuple", "v": []}], "v": [1]}, "x"),
    ("dict-key-dict", {"t": "dict", "k": [{"t": "dict", "k": [], "v": []}], "v": [1]}, "x"),
    ("dict-key-bad-int", {"t": "dict", "k": [{"t": "int", "v": "1e5"}], "v": [1]}, "x"),
    ("dict-meta", {"t": "dict", "k": [], "v": [], "meta": {}}, "x"),
    ("tensor-fw-list", {"t": "tensor", "fw": ["torch"], "name": "w"}, "x"),
    ("tensor-fw-number", {"t": "tensor", "fw": 1, "name": "w"}, "x"),
    ("tensor-field-dict", {**T, "x": {"t": "tensor"}}, "x"),
    (
        "odict-bad-meta",
        {"t": "odict", "k": [], "v": [], "meta": {"t": "bytes", "v": 3}},
        "x._metadata",
    ),
    ("nested-bad-child", {"t": "dict", "k": ["a"], "v": [{"t": "tuple"}]}, "x.a"),
    ("list-bad-child", [1, {"t": "int", "v": 5}], "x.1"),
    ("tuple-no-v", {"t": "tuple"}, "x"),
    ("tuple-v-not-list", {"t": "tuple", "v": {"a": 1}}, "x"),
    ("int-no-v", {"t": "int"}, "x"),
    ("int-not-decimal", {"t": "int", "v": "0x10"}, "x"),
    ("int-number", {"t": "int", "v": 5}, "x"),
    ("int-too-long", {"t": "int", "v": "9" * 5000}, "x"),
    ("float-no-bits", {"t": "float"}, "x"),
    ("float-short-bits", {"t": "float", "bits": "7ff8"}, "x"),
    ("float-bits-not-hex", {"t": "float", "bits": "zz" * 8}, "x"),
    ("float-bits-number", {"t": "float", "bits": 1.5}, "x"),
    ("bytes-no-v", {"t": "bytes"}, "x"),
    ("bytes-bad-base64", {"t": "bytes", "v": "not base64!"}, "x"),
    ("bytes-bad-padding", {"t": "bytes", "v": "abc"}, "x"),
    ("bytes-v-list", {"t": "bytes", "v": [1, 2]}, "x"),
    ("no-tag", {"a": 1}, "x"),
    ("unknown-tag", {"t": "pickle", "v": "gASV"}, "x"),
    ("tag-not-string", {"t": ["dict"], "k": [], "v": []}, "x"),
    ("tensor-no-name", {"t": "tensor", "fw": "torch"}, "x"),
    ("tensor-name-number", {"t": "tensor", "fw": "torch", "name": 3}, "x"),
    ("tensor-unknown-name", {"t": "tensor", "fw": "torch", "name": "nope"}, ""),
    ("tensor-no-fw", {"t": "tensor", "name": "w"}, "x"),
    ("tensor-unknown-fw", {"t": "tensor", "fw": "jax", "name": "w"}, "x"),
    ("tensor-bad-device", {**T, "dev": "bogus:0"}, "tensor `w`"),
    ("tensor-device-number", {**T, "dev": 7}, "tensor `w`"),
    ("tensor-device-list", {**T, "dev": ["cpu"]}, "x"),
    ("tensor-param-dict", {**T, "param": {"a": 1}}, "x"),
    ("value-no-fw", {"t": "value", "kind": "dtype", "v": "float32"}, "x"),
    ("value-unknown-fw", {"t": "value", "fw": "os", "kind": "system", "v": "true"}, "x"),
    ("value-no-kind", {"t": "value", "fw": "torch", "v": "float32"}, "x"),
    ("value-unknown-kind", {"t": "value", "fw": "torch", "kind": "module", "v": "x"}, "x"),
    ("value-bad-dtype", {"t": "value", "fw": "torch", "kind": "dtype", "v": "os"}, "x"),
    ("value-dtype-list", {"t": "value", "fw": "torch", "kind": "dtype", "v": [1]}, "x"),
    ("value-bad-device", {"t": "value", "fw": "torch", "kind": "device", "v": "bogus"}, "x"),
    ("value-device-dict", {"t": "value", "fw": "torch", "kind": "device", "v": {}}, "x"),
    ("value-size-strings", {"t": "value", "fw": "torch", "kind": "size", "v": ["a"]}, "x"),
    ("value-size-number", {"t": "value", "fw": "torch", "kind": "size", "v": 3}, "x"),
    # torch.Size takes these, and failed only once the size was used.
    ("value-size-past-i64", {"t": "value", "fw": "torch", "kind": "size", "v": [2**63]}, "x"),
    (
        "value-size-below-i64",
        {"t": "value", "fw": "torch", "kind": "size", "v": [-(2**63) - 1]},
        "x",
    ),
    ("value-size-bool", {"t": "value", "fw": "torch", "kind": "size", "v": [True]}, "x"),
    ("value-numpy-dtype", {"t": "value", "fw": "numpy", "kind": "dtype", "v": "nope"}, "x"),
    ("value-numpy-dtype-list", {"t": "value", "fw": "numpy", "kind": "dtype", "v": [1]}, "x"),
]
# Trees nested past the format's depth limit cannot be saved (the engine
# refuses them) and a forged header holding one is refused by the engine's
# reader (format/header_tests.rs); the decoder's own check of such trees is
# tested directly below.


def save_raw_values(ckpt: acp.Checkpointer, step: int, state_node: Any) -> None:
    """Commits ``step`` with one tensor ``w`` (4 float32) and the raw values
    JSON ``{"acp.codec": 1, "state": state_node}``, bypassing the encoder."""
    save_raw_json(ckpt, step, {"acp.codec": 1, "state": state_node})


def save_raw_json(
    ckpt: acp.Checkpointer,
    step: int,
    values: Any,
    spec: tuple[str, tuple[int, ...]] = ("F32", (4,)),
) -> None:
    """Commits ``step`` with one tensor ``w`` (the 16 bytes of 4 float32,
    stored under the dtype and shape ``spec``) and the raw values JSON
    ``values``, bypassing every encoder."""
    import json

    staging = ckpt._engine.begin_save(step, [("w", *spec)], json.dumps(values))
    assert staging is not None
    src = torch.arange(4, dtype=torch.float32)
    staging.copy_from([(0, src.data_ptr(), 16)])
    staging.finish().wait()


@pytest.mark.parametrize(("node", "key"), [pytest.param(n, k, id=i) for i, n, k in HOSTILE_VALUES])
def test_hostile_values_raise_checkpoint_corrupt(make_ckpt: MakeCkpt, node: Any, key: str) -> None:
    ckpt = make_ckpt()
    # `x` is the only reference to the tensor: its fields are the ones used.
    state = {"t": "dict", "k": ["x"], "v": [node]}
    try:
        save_raw_values(ckpt, 1, state)
    except acp.CheckpointCorrupt:
        # The engine's own parser refuses it (a values document deeper than
        # serde_json reads): no step to load, nothing decoded.
        assert ckpt.steps() == []
        return
    where = key if key.startswith("tensor") else f"key `{key}`" if key else "step 1"
    for load in (
        lambda: ckpt.load(1),
        lambda: ckpt.load(1, storage_only=True),
        lambda: ckpt.load(1, into={"x": None}),
    ):
        with pytest.raises(acp.CheckpointCorrupt) as e:
            load()
        assert where in str(e.value)
        assert "step 1" in str(e.value)


@pytest.mark.parametrize(
    "keys", [["a", "a"], [1, True], [1, 1.0], [1, {"t": "int", "v": "1"}]], ids=repr
)
def test_dict_keys_equal_once_decoded_are_corrupt(make_ckpt: MakeCkpt, keys: list[Any]) -> None:
    """A saved dict never has two equal keys: a tree with them was merged
    silently (the last value won, a tensor reference dropped)."""
    ckpt = make_ckpt()
    node = {"t": "dict", "k": keys, "v": [{"t": "tensor", "fw": "torch", "name": "w"}, 2]}
    save_raw_values(ckpt, 1, {"t": "dict", "k": ["x"], "v": [node]})
    with pytest.raises(acp.CheckpointCorrupt, match=r"step 1: key `x`: .*keys are equal"):
        ckpt.load(1)


@pytest.mark.parametrize("levels", [200, 100_000])
def test_values_nested_past_any_reader_are_corrupt_not_a_recursion_error(levels: int) -> None:
    """The engine refuses such values itself today (serde_json's limit);
    the codec must not depend on it: its check is iterative and bounded."""
    from acp import _codec

    text = '{"acp.codec":1,"state":' + "[" * levels + "]" * levels + "}"
    with pytest.raises(acp.CheckpointCorrupt, match="step 3"):
        _codec.parse(text, step=3)
    with pytest.raises(acp.CheckpointCorrupt, match=r"step 3: key `0\.0\.0.*nested deeper"):
        _codec.check_tree(deep(levels if levels < 1000 else 900), step=3)


@pytest.mark.parametrize(("node", "key"), [pytest.param(n, k, id=i) for i, n, k in HOSTILE_VALUES])
def test_the_quick_tree_check_never_passes_what_the_full_one_refuses(node: Any, key: str) -> None:
    """``check_tree`` first tries a quick check without key paths: it may
    only pass a tree the full check passes (else a hostile tree would
    reach the decoder unchecked)."""
    from acp import _codec

    for tree in (
        node,
        {"t": "dict", "k": ["x"], "v": [node]},
        {"t": "dict", "k": ["w", "x", "y"], "v": [T, node, T]},  # beside references
        [1, {"t": "tuple", "v": [node]}],
    ):
        try:
            _codec.check_tree(tree, step=1)
        except acp.CheckpointCorrupt:
            assert _codec._quick_refs(tree) is None


def test_the_quick_tree_check_passes_what_states_hold() -> None:
    """Encoded states take the quick check (the restore of a state of many
    tensors builds no key paths), and deep ones stop at the same limit."""
    import json

    from acp import _codec

    sd = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2)).state_dict()
    opt = torch.optim.Adam(torch.nn.Linear(2, 2).parameters())
    state = {
        "model": sd,
        "optim": opt.state_dict(),
        "step": 7,
        "big": 2**70,
        "nan": float("nan"),
        "blob": b"\x00\x01",
        "pair": (1, "a"),
        3: None,
        "dtype": torch.float16,
    }
    tree = json.loads(_codec.flatten(state, _codec.Adapters()).json())[_codec.STATE_KEY]
    _codec.check_tree(tree, step=1)
    refs = _codec._quick_refs(tree)
    assert refs is not None
    assert sorted(r["name"] for r in refs) == sorted(r["name"] for r in _codec.tensor_refs(tree))
    assert _codec._quick_refs(deep(_codec.MAX_DEPTH - 1)) == []
    assert _codec._quick_refs(deep(_codec.MAX_DEPTH)) is None


# --------------------------------------------------------------------------
# the codec version field


@pytest.mark.parametrize("version", [True, False, -1, 1.0, "1", None, [1]], ids=repr)
def test_a_codec_version_that_is_no_count_is_corrupt(make_ckpt: MakeCkpt, version: Any) -> None:
    """``true`` and ``-1`` were taken for version 1, ``1.0`` reported as newer."""
    ckpt = make_ckpt(release_on_close=True)
    save_raw_json(ckpt, 1, {"acp.codec": version, "state": None})
    with pytest.raises(acp.CheckpointCorrupt, match=r"step 1: field `acp\.codec`.* is not a"):
        ckpt.load(1)


def test_a_newer_codec_version_is_unsupported(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt(release_on_close=True)
    save_raw_json(ckpt, 1, {"acp.codec": 2, "state": None})
    with pytest.raises(
        acp.Unsupported, match="step 1: unsupported: state codec version 2 is newer"
    ):
        ckpt.load(1)


# --------------------------------------------------------------------------
# crafted DCP metadata: CheckpointCorrupt naming the step, the key, the field


def dcp_values(ckpt: acp.Checkpointer) -> dict[str, Any]:
    """The values of a step 1 that ``dcp.save`` writes of ``{"w": 4 float32}``:
    what :func:`save_raw_json` stores again, altered."""
    import json

    dcp.save(
        {"w": torch.arange(4, dtype=torch.float32)},
        checkpoint_id=1,
        storage_writer=acp.dcp.StorageWriter(ckpt),
        no_dist=True,
    )
    loaded = ckpt._engine.load(step=1)
    try:
        values: dict[str, Any] = json.loads(loaded.values_json)
    finally:
        del loaded
    return values


def _w(md: dict[str, Any]) -> dict[str, Any]:
    sdm: dict[str, Any] = md["state_dict_metadata"]["w"]
    return sdm


def _set(path: str, value: Any) -> Any:
    """A change to the DCP metadata: ``path`` (dot-separated, list indices
    as digits) set to ``value``, or deleted when ``value`` is ``_DEL``."""

    def change(md: dict[str, Any]) -> None:
        *head, last = path.split(".")
        node: Any = md
        for part in head:
            node = node[int(part)] if isinstance(node, list) else node[part]
        key: Any = int(last) if isinstance(node, list) else last
        if value is _DEL:
            del node[key]
        else:
            node[key] = value

    return change


_DEL = object()
W = "state_dict_metadata.w"
S = "storage_data.0"

# (id, the change, the key the error names (None: none), the field it names)
HOSTILE_DCP: list[tuple[str, Any, str | None, str]] = [
    ("no-sdm", _set("state_dict_metadata", _DEL), None, "state_dict_metadata"),
    ("sdm-list", _set("state_dict_metadata", []), None, "state_dict_metadata"),
    ("entry-number", _set(W, 5), "w", "state_dict_metadata"),
    ("no-type", _set(f"{W}.type", _DEL), "w", "type"),
    ("unknown-type", _set(f"{W}.type", "pickle"), "w", "type"),
    ("no-size", _set(f"{W}.size", _DEL), "w", "size"),
    ("size-string", _set(f"{W}.size", "4"), "w", "size"),
    ("size-negative", _set(f"{W}.size", [-4]), "w", "size[0]"),
    ("size-float", _set(f"{W}.size", [4.0]), "w", "size[0]"),
    ("size-bool", _set(f"{W}.size", [True]), "w", "size[0]"),
    ("size-huge", _set(f"{W}.size", [2**64]), "w", "size[0]"),
    ("no-chunks", _set(f"{W}.chunks", _DEL), "w", "chunks"),
    ("chunks-object", _set(f"{W}.chunks", {}), "w", "chunks"),
    ("chunk-string", _set(f"{W}.chunks.0", "x"), "w", "chunks[0]"),
    ("chunk-no-offsets", _set(f"{W}.chunks.0.offsets", _DEL), "w", "chunks[0].offsets"),
    ("chunk-offsets-string", _set(f"{W}.chunks.0.offsets", "0"), "w", "chunks[0].offsets"),
    ("chunk-offset-negative", _set(f"{W}.chunks.0.offsets", [-1]), "w", "chunks[0].offsets[0]"),
    ("chunk-size-negative", _set(f"{W}.chunks.0.sizes", [-4]), "w", "chunks[0].sizes[0]"),
    ("chunk-dims", _set(f"{W}.chunks.0.sizes", [4, 1]), "w", "chunks[0].sizes"),
    ("chunk-past-size", _set(f"{W}.chunks.0.sizes", [8]), "w", "chunks[0]"),
    ("chunk-offset-past-size", _set(f"{W}.chunks.0.offsets", [2]), "w", "chunks[0]"),
    ("no-properties", _set(f"{W}.properties", _DEL), "w", "properties"),
    ("properties-list", _set(f"{W}.properties", []), "w", "properties"),
    ("no-dtype", _set(f"{W}.properties.dtype", _DEL), "w", "properties.dtype"),
    ("dtype-not-torch", _set(f"{W}.properties.dtype", "os.system"), "w", "properties.dtype"),
    ("dtype-not-dtype", _set(f"{W}.properties.dtype", "torch.nn"), "w", "properties.dtype"),
    ("dtype-number", _set(f"{W}.properties.dtype", 7), "w", "properties.dtype"),
    ("layout-bad", _set(f"{W}.properties.layout", "torch.float32"), "w", "properties.layout"),
    ("grad-string", _set(f"{W}.properties.requires_grad", "yes"), "w", "properties.requires_grad"),
    ("strides-string", _set(f"{W}.properties.strides", "1"), "w", "properties.strides"),
    ("no-storage", _set("storage_data", _DEL), None, "storage_data"),
    ("storage-object", _set("storage_data", {}), None, "storage_data"),
    ("storage-no-index", _set(f"{S}.index", _DEL), None, "storage_data[0].index"),
    ("storage-fqn-number", _set(f"{S}.index.fqn", 3), None, "storage_data[0].index.fqn"),
    ("storage-unknown-key", _set(f"{S}.index.fqn", "nope"), "nope", "storage_data[0].index.fqn"),
    ("storage-offset-string", _set(f"{S}.index.offset", "0"), "w", "storage_data[0].index.offset"),
    ("storage-offset-no-chunk", _set(f"{S}.index.offset", [1]), "w", "storage_data[0].index"),
    ("storage-hint-negative", _set(f"{S}.index.index", -1), "w", "storage_data[0].index.index"),
    ("storage-no-name", _set(f"{S}.name", _DEL), "w", "storage_data[0].name"),
    ("storage-name-number", _set(f"{S}.name", 1), "w", "storage_data[0].name"),
    ("storage-name-unknown", _set(f"{S}.name", "ghost"), "w", "storage_data"),
    ("format-missing", _set("format", _DEL), None, "format"),
    ("format-version-string", _set("format_version", "1"), None, "format_version"),
    ("format-version-bool", _set("format_version", True), None, "format_version"),
    ("format-version-negative", _set("format_version", -1), None, "format_version"),
    ("version-number", _set("version", 3), None, "version"),
    ("planner-float", _set("planner_data.w", {"__float__": "x"}), None, "planner_data.w"),
    ("planner-tuple", _set("planner_data.w", {"__tuple__": 5}), None, "planner_data.w"),
    ("storage-meta-list", _set("storage_meta", [1]), None, "storage_meta"),
    ("modules-string", _set("storage_meta.modules", "m"), None, "storage_meta.modules"),
]


@dcp_warning
@pytest.mark.parametrize(
    ("change", "key", "field"), [pytest.param(c, k, f, id=i) for i, c, k, f in HOSTILE_DCP]
)
def test_hostile_dcp_metadata_is_corrupt_naming_key_and_field(
    make_ckpt: MakeCkpt, change: Any, key: str | None, field: str
) -> None:
    ckpt = make_ckpt(release_on_close=True)
    values = dcp_values(ckpt)
    change(values[acp.dcp.METADATA_KEY])
    save_raw_json(ckpt, 2, values)
    with pytest.raises(acp.CheckpointCorrupt) as e:
        acp.dcp.StorageReader(ckpt, step=2).read_metadata()
    message = str(e.value)
    assert message.startswith("step 2: DCP metadata: "), message
    assert f"field `{field}" in message, message
    if key is not None:
        assert f"key `{key}`" in message, message
    with pytest.raises(CheckpointException) as wrapped:
        dcp.load(
            {"w": torch.zeros(4)}, storage_reader=acp.dcp.StorageReader(ckpt, step=2), no_dist=True
        )
    # torch 2.11+ re-raises a failed read_metadata as an AssertionError
    # quoting its message; older versions keep the exception.
    assert message in str(wrapped.value)


@dcp_warning
def test_dcp_metadata_not_an_object_is_corrupt(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt(release_on_close=True)
    save_raw_json(ckpt, 2, {acp.dcp.METADATA_KEY: [1]})
    with pytest.raises(acp.CheckpointCorrupt, match=r"step 2: DCP metadata: .* is a list"):
        acp.dcp.StorageReader(ckpt, step=2).read_metadata()


@dcp_warning
@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (("I32", (4,)), r"metadata says dtype torch\.float32 \(F32\), .* `w` has dtype I32"),
        (("U8", (16,)), r"metadata says dtype torch\.float32 \(F32\), .* `w` has dtype U8"),
        (("F16", (8,)), r"metadata says dtype torch\.float32 \(F32\), .* `w` has dtype F16"),
    ],
    ids=["I32", "U8", "F16"],
)
def test_a_dcp_entry_of_another_dtype_is_refused_not_reinterpreted(
    make_ckpt: MakeCkpt, spec: tuple[str, tuple[int, ...]], match: str
) -> None:
    """The stored bytes have the size the metadata says: they were
    reinterpreted as float32 silently."""
    ckpt = make_ckpt(release_on_close=True)
    save_raw_json(ckpt, 2, dcp_values(ckpt), spec)
    for storage_only in (False, True):
        target = {"w": torch.zeros(4)}
        with pytest.raises(CheckpointException) as e:
            dcp.load(
                target,
                storage_reader=acp.dcp.StorageReader(ckpt, step=2, storage_only=storage_only),
                no_dist=True,
            )
        (exc, _), *_ = e.value.failures.values()
        assert isinstance(exc, acp.CheckpointCorrupt)
        assert exc.args[0].startswith("step 2: DCP key `w`: ")
        assert re.search(match, str(exc)), str(exc)
        assert torch.equal(target["w"], torch.zeros(4))


@dcp_warning
def test_a_dcp_entry_of_another_size_is_corrupt(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt(release_on_close=True)
    values = dcp_values(ckpt)
    md = values[acp.dcp.METADATA_KEY]
    _w(md)["size"] = [8]
    _w(md)["chunks"][0]["sizes"] = [8]
    save_raw_json(ckpt, 2, values)
    with pytest.raises(CheckpointException, match=r"\(8,\) torch\.float32 \(32 bytes\), but .* 16"):
        dcp.load(
            {"w": torch.zeros(8)}, storage_reader=acp.dcp.StorageReader(ckpt, step=2), no_dist=True
        )


@dcp_warning
def test_a_complex_dcp_entry_stored_as_raw_bytes_still_loads(make_ckpt: MakeCkpt) -> None:
    """Before acp had a dtype code for complex64, acp.dcp stored such
    tensors as ``U8`` bytes: those files stay readable."""
    ckpt = make_ckpt(release_on_close=True)
    values = dcp_values(ckpt)
    md = values[acp.dcp.METADATA_KEY]
    _w(md)["properties"]["dtype"] = "torch.complex64"
    _w(md)["properties"]["strides"] = [1]
    _w(md)["size"] = [2]
    _w(md)["chunks"][0]["sizes"] = [2]
    save_raw_json(ckpt, 2, values, ("U8", (16,)))
    target = {"w": torch.zeros(2, dtype=torch.complex64)}
    dcp.load(target, storage_reader=acp.dcp.StorageReader(ckpt, step=2), no_dist=True)
    assert torch.equal(target["w"], torch.arange(4, dtype=torch.float32).view(torch.complex64))
