"""Figures of saves and loads: ``stats()``, the ``acp`` logger and the
Prometheus text format."""

from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path

import pytest
import torch

import acp
import acp.metrics

from .conftest import MakeCkpt

SAMPLE = re.compile(r'^[a-z_]+\{(?:[a-z_]+="(?:[^"\\]|\\.)*",?)*\} -?[0-9.e+-]+$')


def test_figures_of_saves_and_loads(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt()
    for step in (1, 2):
        ckpt.save(step, {"w": torch.ones(1000) * step, "step": step}).wait()
    ckpt.load()
    f = ckpt.stats()["figures"]
    assert f["saves_committed"] == 2
    assert f["saves_failed"] == 0
    assert f["saves_in_flight"] == 0
    assert f["last_committed_step"] == 2
    assert f["bytes_committed"] > 2 * 4000
    assert f["stall_secs"]["count"] == 2
    assert f["stall_secs"]["max"] >= f["stall_secs"]["mean"] > 0
    assert f["flush_secs"]["count"] == 2
    assert f["save_to_commit_secs"]["last"] >= f["flush_secs"]["last"]
    assert f["flush_bytes_per_sec"]["last"] > 0
    assert f["staging_bytes_per_sec"]["mean"] > 0
    assert f["loads"]["ram"]["count"] == 1
    assert f["loads"]["ram"]["bytes_per_sec"] > 0


def test_log_lines(make_ckpt: MakeCkpt, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="acp")
    ckpt = make_ckpt()
    ckpt.save(7, {"w": torch.zeros(10)}).wait()
    ckpt.wait()
    ckpt.load(storage_only=True)
    text = caplog.text
    assert "opened" in text
    assert "step 7 staged" in text
    assert "step 7 committed" in text
    assert "step 7 loaded from storage" in text

    def level(needle: str) -> int:
        return next(r.levelno for r in caplog.records if needle in r.getMessage())

    assert level("step 7 committed") == logging.INFO
    assert level("step 7 staged") == logging.DEBUG
    assert level("loaded from storage") == logging.INFO


def test_a_failed_save_is_counted_and_logged(
    make_ckpt: MakeCkpt, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="acp")
    ckpt = make_ckpt(faults=acp._acp.FaultInjector(fail_at=0, sticky=True), persist_on_open=False)
    h = ckpt.save(3, {"w": torch.zeros(10)})
    with pytest.raises(acp.StorageError):
        h.wait()
    f = ckpt.stats()["figures"]
    assert f["saves_failed"] == 1
    assert f["saves_committed"] == 0
    assert any(
        r.levelno == logging.ERROR and "step 3 failed" in r.getMessage() for r in caplog.records
    )


def test_prometheus_text(make_ckpt: MakeCkpt) -> None:
    ckpt = make_ckpt()
    ckpt.save(1, {"w": torch.ones(100)}).wait()
    ckpt.load()
    text = ckpt.stats(format="prometheus")
    assert "# TYPE acp_saves_total counter" in text
    assert "# TYPE acp_save_stall_seconds summary" in text
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    for ln in lines:
        assert SAMPLE.match(ln), ln
    committed = [
        ln for ln in lines if ln.startswith("acp_saves_total") and 'result="committed"' in ln
    ]
    assert committed
    assert committed[0].endswith(" 1.0")
    assert any(ln.startswith("acp_loads_total") and 'source="ram"' in ln for ln in lines)
    assert str(ckpt.root) in acp.metrics.prometheus_text()
    with pytest.raises(acp.InvalidInput):
        ckpt.stats(format="xml")  # type: ignore[call-overload]
    ckpt.close()
    assert str(ckpt.root) not in acp.metrics.prometheus_text()


def fs_type(path: Path) -> str:
    """The file system type of ``path``, as ``stat -f`` names it."""
    return subprocess.run(
        ["stat", "-f", "-c", "%T", str(path)], check=True, capture_output=True, text=True
    ).stdout.strip()


def test_a_ring_outside_memory_is_named_in_a_warning(
    make_ckpt: MakeCkpt, shm_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # This machine's /dev/shm is a tmpfs and its /tmp is not: both cases run.
    on_disk = tmp_path / "shm-on-disk"
    on_disk.mkdir()
    assert fs_type(shm_dir) == "tmpfs"
    assert fs_type(on_disk) != "tmpfs"
    caplog.set_level(logging.WARNING, logger="acp")
    for d, in_ram in ((shm_dir, True), (on_disk, False)):
        caplog.clear()
        ckpt = make_ckpt(shm_dir=d, release_on_close=True)
        assert ckpt._engine.open_report()["shm_in_ram"] is in_ram
        warned = [r for r in caplog.records if "is not in memory (not a tmpfs)" in r.getMessage()]
        assert len(warned) == (0 if in_ram else 1), d
        if warned:
            assert str(d) in warned[0].getMessage()
            assert "ACP_SHM_DIR" in warned[0].getMessage()
        ckpt.close()
