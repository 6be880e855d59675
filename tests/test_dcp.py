"""torch.distributed.checkpoint through acp: dcp.save, dcp.async_save and
dcp.load on acp's StorageWriter, Stager and StorageReader, single process."""

from __future__ import annotations

import gc
import json
import struct
from dataclasses import fields as _fields
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

import acp
import acp.dcp

from .conftest import MakeCkpt
from .helpers import bits

# DCP warns on every single-process call that it assumes a single process.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def make_state(seed: int = 0) -> dict[str, Any]:
    """A model and Adam state after two steps, plus odd dtypes and plain values."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "extra": {
            "bf16": torch.randn(5, 3).to(torch.bfloat16),
            "ids": torch.arange(7, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
            "fp8": torch.randn(4).to(torch.float8_e4m3fn),
            "cplx": torch.randn(3, dtype=torch.complex64),  # no safetensors dtype: raw bytes
            "strided": torch.randn(6, 4).t(),  # a non-contiguous view
            "scalar": torch.tensor(2.5),
        },
        "rng": torch.get_rng_state(),
        "epoch": 3,
        "note": "dcp pickles non-tensor values itself",
    }


def zeroed(state: Any) -> Any:
    """``state`` with every tensor replaced by a zeroed copy and plain values
    replaced by None: what a fresh process would load into."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeroed(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeroed(v) for v in state]
    return None


def assert_loaded(want: Any, got: Any, key: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), key
        assert got.dtype == want.dtype, key
        assert got.shape == want.shape, key
        assert torch.equal(bits(got), bits(want)), f"{key}: bytes differ"
    elif isinstance(want, dict):
        assert set(got) == set(want), key
        for k in want:
            assert_loaded(want[k], got[k], f"{key}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), key
        for i, (w, g) in enumerate(zip(want, got)):
            assert_loaded(w, g, f"{key}.{i}")
    else:
        assert got == want, f"{key}: {got!r} != {want!r}"


def snapshot(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, list):
        return [snapshot(v) for v in state]
    return state


def data_file(root: Path, step: int) -> Path:
    files = sorted((root / f"step-{step:012d}").glob("*.safetensors"))
    assert len(files) == 1, files
    return files[0]


def header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def test_save_then_load_is_bit_exact_and_from_ram(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt()
    state = make_state()
    want = snapshot(state)
    writer = acp.dcp.StorageWriter(ckpt)
    dcp.save(state, checkpoint_id=10, storage_writer=writer, no_dist=True)
    assert ckpt.steps() == [10]
    assert writer.last_save is not None
    assert writer.last_save["committed"]

    target = zeroed(state)
    reader = acp.dcp.StorageReader(ckpt)
    dcp.load(target, checkpoint_id=10, storage_reader=reader, no_dist=True)
    assert_loaded(want, target)
    assert reader.last_load is not None
    assert reader.last_load["source"] == "ram"


def test_load_into_strided_and_missing_targets(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt()
    state = {"w": torch.randn(6, 4), "v": torch.randn(3, 5)}
    dcp.save(state, checkpoint_id=1, storage_writer=acp.dcp.StorageWriter(ckpt), no_dist=True)
    # A transposed target takes the strided path, not the engine's direct copy.
    w_t = torch.zeros(4, 6)
    target = {"w": w_t.t(), "v": torch.zeros(3, 5, dtype=torch.float64)}
    dcp.load(target, storage_reader=acp.dcp.StorageReader(ckpt), no_dist=True)
    assert torch.equal(w_t.t(), state["w"])
    assert torch.equal(target["v"], state["v"].double())  # copied across dtypes, as DCP does


def test_async_save_stages_into_the_ring(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt()
    state = make_state()
    want = snapshot(state)
    writer = acp.dcp.StorageWriter(ckpt)
    writer.reset(7)
    future = dcp.async_save(
        state, storage_writer=writer, async_stager=acp.dcp.Stager(writer), no_dist=True
    )
    # Staging is over once async_save returns: training may change the tensors.
    with torch.no_grad():
        for t in state["model"].values():
            t.add_(1.0)
    metadata = future.result()
    assert ckpt.steps() == [7]
    assert isinstance(metadata, Metadata)
    assert "model.0.weight" in metadata.state_dict_metadata
    md = metadata.state_dict_metadata["extra.strided"]
    assert isinstance(md, TensorStorageMetadata)
    if "strides" in _fields(TensorProperties):  # torch 2.12 and later record them
        assert md.properties.strides == (1, 4)  # the staged tensor's, not a placeholder's

    target = zeroed(state)
    dcp.load(target, checkpoint_id=7, storage_reader=acp.dcp.StorageReader(ckpt), no_dist=True)
    assert_loaded(want, target)


def test_the_writer_is_its_own_stager(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt()
    state = {"w": torch.randn(64, 64), "step": 5}
    writer = acp.dcp.StorageWriter(ckpt, step=3)
    dcp.async_save(state, storage_writer=writer, no_dist=True).result()
    dcp.async_save(state, storage_writer=writer, no_dist=True).result()  # the next step: 4
    assert ckpt.steps() == [3, 4]
    target = {"w": torch.zeros(64, 64), "step": 0}
    dcp.load(target, storage_reader=acp.dcp.StorageReader(ckpt), no_dist=True)
    assert torch.equal(target["w"], state["w"])
    assert target["step"] == 5


def test_async_checkpoint_id_must_match_the_staged_step(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt()
    writer = acp.dcp.StorageWriter(ckpt)  # no step named: stages as step 0
    future = dcp.async_save(
        {"w": torch.ones(4)}, checkpoint_id=9, storage_writer=writer, no_dist=True
    )
    # DCP wraps errors of its steps in CheckpointException, with their text.
    with pytest.raises(CheckpointException, match=r"staged as step 0.*names step 9"):
        future.result()
    assert ckpt.steps() == [0]


def test_restores_from_ram_after_a_fresh_engine(
    make_ckpt: MakeCkpt, tmp_path: Path, shm_dir: Path
) -> None:
    job = f"fresh-{tmp_path.name}"
    first = acp.Checkpointer(
        tmp_path / "ckpt", job=job, ring_bytes=32 << 20, shm_dir=shm_dir, mlock=False
    )
    state = make_state(1)
    want = snapshot(state)
    dcp.save(state, checkpoint_id=4, storage_writer=acp.dcp.StorageWriter(first), no_dist=True)
    first.close()
    del first  # the closed engine holds its ring's locks until it is dropped
    gc.collect()

    second = make_ckpt(job=job)  # a new engine on the same root, job and shared memory
    reader = acp.dcp.StorageReader(second)
    target = zeroed(state)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert_loaded(want, target)
    assert reader.last_load is not None
    assert reader.last_load["source"] == "ram"
    assert reader.last_load["step"] == 4

    reader = acp.dcp.StorageReader(second, storage_only=True)
    target = zeroed(state)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert_loaded(want, target)
    assert reader.last_load is not None
    assert reader.last_load["source"] == "storage"


def test_writer_and_reader_on_a_root_path(tmp_path: Path, shm_dir: Path) -> None:
    root = tmp_path / "ckpt"
    opts: dict[str, Any] = {"job": f"dcp-{tmp_path.name}", "ring_bytes": 32 << 20}
    opts.update(shm_dir=str(shm_dir), mlock=False)
    writer = acp.dcp.StorageWriter(root, **opts)
    try:
        dcp.save({"w": torch.arange(10.0)}, checkpoint_id=2, storage_writer=writer, no_dist=True)
    finally:
        writer.close()
    reader = acp.dcp.StorageReader(root, **opts)
    try:
        target = {"w": torch.zeros(10)}
        step_dir = root / "step-000000000002"
        dcp.load(target, checkpoint_id=str(step_dir), storage_reader=reader, no_dist=True)
        assert torch.equal(target["w"], torch.arange(10.0))
    finally:
        reader.close()


def test_an_engine_on_a_root_path_reads_the_acp_variables(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACP_COMPRESS", "zstd")
    monkeypatch.setenv("ACP_REPLICAS", "1")  # a Checkpointer's setting: no engine keyword
    root = tmp_path / "ckpt"
    opts: dict[str, Any] = {"job": f"dcp-{tmp_path.name}", "ring_bytes": 32 << 20}
    opts.update(shm_dir=str(shm_dir), mlock=False)
    writer = acp.dcp.StorageWriter(root, **opts)
    try:
        dcp.save({"w": torch.arange(4096.0)}, checkpoint_id=2, storage_writer=writer, no_dist=True)
    finally:
        writer.close()
    index = json.loads((root / "step-000000000002/model.safetensors.index.json").read_text())
    assert index["metadata"]["acp"]["format_version"] == 4  # compressed: a container's version
    monkeypatch.setenv("ACP_RING_SLOTS", "two")
    with pytest.raises(acp.ConfigError, match="ACP_RING_SLOTS='two'"):
        acp.dcp.StorageReader(root, **opts)


def test_metadata_is_stored_as_json_not_pickle(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt()
    state = {"layer": {"w": torch.ones(8, 8), "b": torch.zeros(8)}}
    dcp.save(state, checkpoint_id=1, storage_writer=acp.dcp.StorageWriter(ckpt), no_dist=True)
    root = Path(ckpt.root)
    step_dir = root / "step-000000000001"
    assert not list(step_dir.glob("*.metadata")), "no DCP pickle file"
    path = data_file(root, 1)
    head = header(path)
    values = head["__metadata__"]["acp.values"]
    assert "\x80" not in values  # no pickle protocol opcode
    stored = json.loads(values)[acp.dcp.METADATA_KEY]
    md = acp.dcp.metadata_from_json(stored)
    assert set(md.state_dict_metadata) == {"layer.w", "layer.b"}
    assert md.planner_data == {"layer.w": ("layer", "w"), "layer.b": ("layer", "b")}
    # With tensors only, DCP pickles nothing: the file holds exactly the two
    # tensors, with their own dtypes, and no zip/pickle bytes at all.
    tensors = {k: v for k, v in head.items() if k != "__metadata__"}
    assert {k: v["dtype"] for k, v in tensors.items()} == {"layer.w": "F32", "layer.b": "F32"}
    raw = path.read_bytes()
    assert b"PK\x03\x04" not in raw
    assert b"\x80\x02" not in raw
    assert b"\x80\x04" not in raw


def test_metadata_json_round_trip() -> None:
    strides = {"strides": (1, 4)} if "strides" in _fields(TensorProperties) else {}
    props = TensorProperties(dtype=torch.bfloat16, **strides)
    md = Metadata(
        state_dict_metadata={
            "a": TensorStorageMetadata(
                properties=props,
                size=torch.Size([4, 6]),
                chunks=[
                    ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 6])),
                    ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 6])),
                ],
            ),
            "b": BytesStorageMetadata(),
        },
        planner_data={"a": ("a",), "b": ("opt", "param_groups", 0, "lr"), "x": [1.5, None]},
        storage_data={
            MetadataIndex("a", [0, 0], 0): "a",
            MetadataIndex("a", [2, 0], 1): "a@2,0",
            MetadataIndex("b"): "b",
        },
        storage_meta=StorageMeta(checkpoint_id="3", save_id="s", modules=["m"]),
        version="1.0.0",
    )
    text = json.dumps(acp.dcp.metadata_to_json(md))
    back = acp.dcp.metadata_from_json(json.loads(text))
    assert back == md
    assert [i.index for i in back.storage_data] == [0, 1, None]


def test_metadata_refuses_what_json_cannot_hold() -> None:
    md = Metadata(state_dict_metadata={}, planner_data={"k": object()}, storage_data={})
    with pytest.raises(TypeError, match=r"planner_data\.k"):
        acp.dcp.metadata_to_json(md)
    with pytest.raises(ValueError, match="newer"):
        acp.dcp.metadata_from_json({"format": "acp-dcp", "format_version": 99})
    bad = acp.dcp.metadata_to_json(Metadata(state_dict_metadata={}, storage_data={}))
    bad["state_dict_metadata"] = {
        "x": {"type": "tensor", "properties": {"dtype": "os.system"}, "size": [], "chunks": []}
    }
    with pytest.raises(
        acp.CheckpointCorrupt, match=r"key `x`: field `properties\.dtype`: .*not a torch dtype"
    ):
        acp.dcp.metadata_from_json(bad)


def test_checkpoint_ids(make_ckpt: MakeCkpt, tmp_path: Path) -> None:
    ckpt = make_ckpt()
    writer = acp.dcp.StorageWriter(ckpt)
    for cid in (5, "6", Path(ckpt.root) / "step-000000000007"):
        dcp.save({"w": torch.ones(2)}, checkpoint_id=cid, storage_writer=writer, no_dist=True)
    assert ckpt.steps() == [5, 6, 7]
    assert acp.dcp.StorageWriter.validate_checkpoint_id("step-000000000001")
    assert not acp.dcp.StorageReader.validate_checkpoint_id("/some/dir/run1")
    with pytest.raises(ValueError, match="not under this checkpoint root"):
        writer.reset(tmp_path / "elsewhere" / "step-000000000008")
    with pytest.raises(ValueError, match="neither a step number"):
        writer.reset("latest")
    with pytest.raises(CheckpointException, match="CheckpointExists"):
        dcp.save({"w": torch.ones(2)}, checkpoint_id=5, storage_writer=writer, no_dist=True)


def test_reader_can_refuse_pickled_values(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt()
    state = {"w": torch.ones(3), "epoch": 3}
    dcp.save(state, checkpoint_id=1, storage_writer=acp.dcp.StorageWriter(ckpt), no_dist=True)
    reader = acp.dcp.StorageReader(ckpt, load_bytes=False)
    with pytest.raises(CheckpointException, match="`epoch` is a pickled DCP value"):
        dcp.load({"w": torch.zeros(3), "epoch": 0}, storage_reader=reader, no_dist=True)
    only_tensors = {"w": torch.zeros(3)}
    dcp.load(
        only_tensors, storage_reader=acp.dcp.StorageReader(ckpt, load_bytes=False), no_dist=True
    )
    assert torch.equal(only_tensors["w"], torch.ones(3))


def test_reader_refuses_a_checkpoint_not_saved_through_dcp(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt()
    ckpt.save(1, {"w": torch.ones(2)}).wait()
    with pytest.raises(ValueError, match=r"not saved through torch\.distributed"):
        acp.dcp.StorageReader(ckpt).read_metadata()
    # How DCP reports it depends on torch's version: 2.11 says "metadata is None".
    with pytest.raises(CheckpointException):
        dcp.load({"w": torch.zeros(2)}, storage_reader=acp.dcp.StorageReader(ckpt), no_dist=True)
    # The refused load is not kept alive by the exception's frames: after
    # close() the ring is free for the next checkpointer at once (it was
    # `BusyError`, naming this process, until a garbage collection).
    enabled = gc.isenabled()
    gc.disable()
    try:
        caught: list[BaseException] = []
        try:
            dcp.load(
                {"w": torch.zeros(2)}, storage_reader=acp.dcp.StorageReader(ckpt), no_dist=True
            )
        except CheckpointException as e:
            caught.append(e)  # held, as a caller logging it later would
        assert caught
        ckpt.close()
        make_ckpt().close()
    finally:
        if enabled:
            gc.enable()
