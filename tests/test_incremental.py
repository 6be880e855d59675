"""Incremental checkpoints: ``incremental=`` and ``ACP_INCREMENTAL``; a
step whose frozen tensors the previous step already holds references
them, reports the chunks and bytes it did not write, and loads back
bit-exact from storage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import acp

from .conftest import MakeCkpt

np = pytest.importorskip("numpy")

CHUNK = 64 << 10


def entry_of(root: Path, step: int) -> dict:
    path = root / f"step-{step:012}" / "model.safetensors.index.json"
    return json.loads(path.read_text())["metadata"]["acp"]["files"]["rank-00000.safetensors"]


def state(step: int) -> dict:
    rng = np.random.default_rng(0)
    frozen = (rng.standard_normal((512, 512)) * 0.02).astype(np.float32)
    trained = np.random.default_rng(step).standard_normal(1000).astype(np.float32)
    return {"base": frozen, "adapter": trained, "mask": frozen[:10] > 0}


def check(out: dict, want: dict) -> None:
    for k, v in want.items():
        assert out[k].dtype == v.dtype, k
        assert np.array_equal(out[k], v), k


@pytest.mark.parametrize("compress", ["none", "zstd"])
def test_an_incremental_step_reports_reuse_and_loads_back(
    make_ckpt: MakeCkpt, tmp_path: Path, compress: str
) -> None:
    ckpt = make_ckpt(compress=compress, chunk_bytes=CHUNK)
    first = ckpt.save(1, state(1)).wait()
    assert (first.reused_chunks, first.reused_bytes) == (0, 0)
    s = ckpt.save(2, state(2)).wait()
    assert s.reused_chunks is not None
    assert s.reused_chunks > 0
    assert s.reused_bytes is not None
    assert s.reused_bytes >= 512 * 512 * 4 - 2 * CHUNK
    assert s.stored_bytes is not None
    assert s.bytes is not None
    assert s.stored_bytes < s.bytes - s.reused_bytes + CHUNK
    refs = entry_of(tmp_path / "ckpt", 2)["refs"]
    assert {r["step"] for r in refs} == {1}
    persist = ckpt.stats()["persist"]
    assert persist["chunks_reused"] == s.reused_chunks
    assert persist["bytes_reused"] == s.reused_bytes
    check(ckpt.load(2, storage_only=True), state(2))
    check(ckpt.load(1, storage_only=True), state(1))


def test_incremental_false_writes_every_step_whole(make_ckpt: MakeCkpt, tmp_path: Path) -> None:
    ckpt = make_ckpt(incremental=False, chunk_bytes=CHUNK)
    ckpt.save(1, state(1)).wait()
    s = ckpt.save(2, state(2)).wait()
    assert (s.reused_chunks, s.reused_bytes) == (0, 0)
    assert s.stored_bytes == s.bytes
    assert "refs" not in entry_of(tmp_path / "ckpt", 2)
    assert ckpt.stats()["persist"]["chunks_reused"] == 0


def test_acp_incremental_turns_it_off(
    make_ckpt: MakeCkpt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACP_INCREMENTAL", "0")
    ckpt = make_ckpt(chunk_bytes=CHUNK)
    ckpt.save(1, state(1)).wait()
    assert ckpt.save(2, state(2)).wait().reused_chunks == 0
    assert "refs" not in entry_of(tmp_path / "ckpt", 2)


def test_a_keyword_overrides_acp_incremental_and_bad_values_are_config_errors(
    make_ckpt: MakeCkpt, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACP_INCREMENTAL", "0")
    ckpt = make_ckpt(chunk_bytes=CHUNK, incremental=True)
    ckpt.save(1, state(1)).wait()
    assert ckpt.save(2, state(2)).wait().reused_chunks > 0
    monkeypatch.setenv("ACP_INCREMENTAL", "maybe")
    with pytest.raises(acp.ConfigError, match="ACP_INCREMENTAL"):
        make_ckpt(chunk_bytes=CHUNK)
