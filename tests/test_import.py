"""The package surface: what ``import acp`` loads and exports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import acp


def test_import_acp_imports_no_framework() -> None:
    code = (
        "import sys, acp; "
        "loaded = [m for m in ('torch', 'numpy', 'mindspore') if m in sys.modules]; "
        "print(','.join(loaded))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert out.strip() == ""


def test_an_open_checkpointer_has_the_imported_frameworks_adapters(tmp_path: Path) -> None:
    # A restarted process's first load must not import (or, without cached
    # bytecode, compile) the adapter of a framework the job already uses;
    # and a framework the job never imported stays unimported.
    code = (
        "import sys, numpy, acp; "
        f"ck = acp.Checkpointer({str(tmp_path / 'root')!r}, ring_bytes=1 << 20, "
        f"shm_dir={str(tmp_path)!r}, release_on_close=True); "
        "loaded = [m for m in ('acp._numpy', 'acp.torch', 'torch', 'mindspore') "
        "if m in sys.modules]; "
        "ck.close(); print(','.join(loaded))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert out.strip() == "acp._numpy"


def test_version_matches_extension() -> None:
    assert acp.__version__ == acp._acp.__version__
    assert acp.__version__.count(".") == 2


@pytest.mark.parametrize(
    ("name", "builtin"),
    [
        ("CheckpointNotFound", FileNotFoundError),
        ("CheckpointExists", FileExistsError),
        ("InvalidInput", ValueError),
        ("ConfigError", ValueError),
        ("StorageError", OSError),
        ("NoSpace", OSError),
        ("AcpTimeout", TimeoutError),
        ("CheckpointCorrupt", None),
        ("BusyError", None),
        ("EngineClosed", None),
        ("Unsupported", None),
    ],
)
def test_exception_hierarchy(name: str, builtin: type[BaseException] | None) -> None:
    cls = getattr(acp, name)
    assert issubclass(cls, acp.AcpError)
    assert cls.__module__ == "acp"
    if builtin is not None:
        assert issubclass(cls, builtin)
    e = cls("step 3: something")
    assert str(e) == "step 3: something"


def test_no_space_is_a_storage_error() -> None:
    assert issubclass(acp.NoSpace, acp.StorageError)


def test_cli_stub_prints_help(capfd: pytest.CaptureFixture[str]) -> None:
    from acp import cli

    assert cli.main([]) == 2
    assert "usage: acp" in capfd.readouterr().err.lower()
    assert cli.main(["--version"]) == 0
    assert acp.__version__ in capfd.readouterr().out


def test_rank_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "RANK_ID", "RANK_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delitem(sys.modules, "torch.distributed", raising=False)
    assert acp.rank_and_world_size() == (0, 1)
    monkeypatch.setenv("RANK_ID", "3")
    monkeypatch.setenv("RANK_SIZE", "8")
    assert acp.rank_and_world_size() == (3, 8)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert acp.rank_and_world_size() == (1, 2)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(acp.ConfigError, match="RANK"):
        acp.rank_and_world_size()
