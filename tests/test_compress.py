"""Compressed checkpoints: ``compress=`` and ``ACP_COMPRESS`` write
compressed data files that load back bit-exact from storage."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import acp

from .conftest import MakeCkpt

np = pytest.importorskip("numpy")


def index_of(root: Path, step: int) -> dict:
    path = root / f"step-{step:012}" / "model.safetensors.index.json"
    return json.loads(path.read_text())


def state() -> dict:
    rng = np.random.default_rng(0)
    return {
        "w": (rng.standard_normal((256, 256)) * 0.02).astype(np.float32),
        "i": np.arange(1000, dtype=np.int64),
        "mask": rng.random(333) > 0.5,
    }


def check(out: dict, want: dict) -> None:
    for k, v in want.items():
        assert out[k].dtype == v.dtype, k
        assert np.array_equal(out[k], v), k


@pytest.mark.parametrize("mode", ["zstd", "none"])
def test_compress_keyword_writes_and_loads_back(
    make_ckpt: MakeCkpt, tmp_path: Path, mode: str
) -> None:
    ckpt = make_ckpt(compress=mode, compress_level=5)
    want = state()
    ckpt.save(3, want).wait()
    files = index_of(tmp_path / "ckpt", 3)["metadata"]["acp"]["files"]
    entry = files["rank-00000.safetensors"]
    assert ("stored_size" in entry) == (mode == "zstd")
    check(ckpt.load(3, storage_only=True), want)


def test_compress_from_the_environment(
    make_ckpt: MakeCkpt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACP_COMPRESS", "zstd")
    ckpt = make_ckpt()
    want = state()
    ckpt.save(4, want).wait()
    acp_meta = index_of(tmp_path / "ckpt", 4)["metadata"]["acp"]
    assert acp_meta["format_version"] == 4  # a step with a container (QUICK_FRAME_VERSION)
    assert "stored_size" in acp_meta["files"]["rank-00000.safetensors"]
    check(ckpt.load(4, storage_only=True), want)


def test_bad_compress_values_are_config_errors(make_ckpt: MakeCkpt) -> None:
    # ACP_COMPRESS / ACP_COMPRESS_LEVEL: tests/test_env_config.py, with every variable.
    with pytest.raises(acp.ConfigError, match="compress"):
        make_ckpt(compress="lz4")
    with pytest.raises(acp.ConfigError, match="compress_level"):
        make_ckpt(compress="zstd", compress_level=99)


def acp_cli(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "acp.cli", *map(str, args)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )


def test_inspect_shows_the_codec_and_export_writes_a_plain_file(
    make_ckpt: MakeCkpt, tmp_path: Path
) -> None:
    ckpt = make_ckpt(compress="zstd")
    ckpt.save(5, state()).wait()
    root = tmp_path / "ckpt"
    (f,) = json.loads(acp_cli("inspect", root, "--json").stdout)["files"]
    assert f["codec"] == "zstd"
    assert 0 < f["stored_size"] < f["size"]
    text = acp_cli("inspect", root).stdout
    assert "codec: zstd" in text, text
    assert "ratio" in text, text
    out = tmp_path / "plain.safetensors"
    acp_cli("export", root, out, "--to", "safetensors")
    data = out.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    assert json.loads(data[8 : 8 + header_len])["__metadata__"]["acp.version"] == "1"


@pytest.mark.parametrize("mode", ["zstd", "none"])
def test_save_stats_and_persist_stats_give_staged_and_stored_bytes(
    make_ckpt: MakeCkpt, tmp_path: Path, mode: str
) -> None:
    ckpt = make_ckpt(compress=mode)
    s = ckpt.save(5, state()).wait()
    file = tmp_path / "ckpt" / "step-000000000005" / "rank-00000.safetensors"
    assert s.stored_bytes == file.stat().st_size
    assert s.bytes is not None
    assert s.compression_ratio is not None
    assert s.compression_ratio == s.stored_bytes / s.bytes
    if mode == "zstd":
        assert s.stored_bytes < s.bytes
    else:
        assert s.stored_bytes == s.bytes
    persist = ckpt.stats()["persist"]
    assert persist["bytes_written"] == s.bytes
    assert persist["bytes_stored"] == s.stored_bytes
    assert persist["compression_ratio"] == s.compression_ratio
    lines = ckpt.stats("prometheus").splitlines()
    stored = [x for x in lines if x.startswith("acp_storage_bytes_stored_total{")]
    assert [x.rsplit(" ", 1)[1] for x in stored] == [repr(float(s.stored_bytes))]
