"""The RAM tier's lifecycle from Python: ``release_on_close``, and the
wheel's ``acp ls --shm`` / ``acp gc --shm`` beside a live trainer in
another process. Every test uses its own shared-memory directory."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import acp

from .conftest import SMALL_RING, MakeCkpt, slot_dir
from .helpers import run_child


def ring_files(shm_dir: Path) -> list[str]:
    d = slot_dir(shm_dir)
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def acp_cli(*args: object) -> Any:
    """``python -m acp.cli ARGS --json`` (the wheel's ``acp``), exit 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "acp.cli", *map(str, args), "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    return json.loads(proc.stdout)


def test_close_keeps_the_ring_by_default(make_ckpt: MakeCkpt, shm_dir: Path) -> None:
    ckpt = make_ckpt()
    ckpt.save(1, {"w": torch.ones(100)}).wait()
    ckpt.close()
    assert len(ring_files(shm_dir)) == 2


def test_release_on_close_removes_the_ring(make_ckpt: MakeCkpt, shm_dir: Path) -> None:
    ckpt = make_ckpt(release_on_close=True)
    ckpt.save(1, {"w": torch.ones(100)}).wait()
    ckpt.save(2, {"w": torch.full((100,), 2.0)}).wait()
    assert ring_files(shm_dir)
    ckpt.close()
    assert ring_files(shm_dir) == []
    assert not slot_dir(shm_dir).exists()
    assert ckpt.closed
    with make_ckpt(release_on_close=True) as again:
        assert again.steps() == [1, 2]


def test_release_on_close_keeps_the_only_copy_of_a_step(
    make_ckpt: MakeCkpt, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="acp")
    faults = acp._acp.FaultInjector()
    ckpt = make_ckpt(release_on_close=True, faults=faults)
    ckpt.save(1, {"w": torch.ones(100)}).wait()
    faults.arm(0, sticky=True)  # the storage dies: step 2 stays in RAM only
    with pytest.raises(acp.StorageError):
        ckpt.save(2, {"w": torch.full((100,), 2.0)}).wait()
    ckpt.close()
    assert len(ring_files(shm_dir)) == 2
    assert any(
        "only copy of step(s) [2]" in r.getMessage() and r.levelno == logging.WARNING
        for r in caplog.records
    )
    # The next trainer commits it, then releases the ring.
    with make_ckpt(release_on_close=True) as again:
        again.wait()
        assert again.steps() == [1, 2]
    assert ring_files(shm_dir) == []


HOLDER = textwrap.dedent(
    """
    import sys, torch, acp
    root, shm, job = sys.argv[1:4]
    kw = dict(job=job, shm_dir=shm, ring_bytes=32 << 20, mlock=False, release_on_close=True)
    with acp.Checkpointer(root, **kw) as ckpt:
        ckpt.save(1, {"w": torch.ones(100)}).wait()
        print("ready", flush=True)
        sys.stdin.read()  # until the parent closes our stdin
    """
)


def test_ls_and_gc_shm_beside_a_live_trainer(tmp_path: Path, shm_dir: Path) -> None:
    # A dead job's ring, fully committed, and one whose only step is lost
    # from its root (the only copy).
    for job, root in [("dead", tmp_path / "a"), ("lost", tmp_path / "b")]:
        with acp.Checkpointer(
            root, job=job, shm_dir=shm_dir, ring_bytes=SMALL_RING, mlock=False, shm_ttl=0
        ) as ckpt:
            ckpt.save(4, {"w": torch.ones(100)}).wait()
    for p in (tmp_path / "b").glob("step-*"):
        for f in p.iterdir():
            f.unlink()
        p.rmdir()
    live_job = f"live-{uuid.uuid4().hex[:8]}"
    with subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "c"), str(shm_dir), live_job],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdin is not None
        assert child.stdout is not None
        try:
            assert child.stdout.readline().strip() == "ready"
            check_beside(child.pid, live_job, tmp_path, shm_dir)
        finally:
            child.stdin.close()
            assert child.wait(timeout=120) == 0
    # The trainer released its own ring on close.
    assert ring_files(shm_dir) == []


def check_beside(pid: int, live_job: str, tmp_path: Path, shm_dir: Path) -> None:
    """``acp ls --shm`` and ``acp gc --shm`` while process ``pid`` holds
    the ring of ``live_job``."""
    ls = acp_cli("ls", "--shm", "--shm-dir", shm_dir)
    rings = {r["job"]: r for r in ls["rings"]}
    assert set(rings) == {"dead", "lost", live_job}
    assert rings[live_job]["live"] is True
    assert rings[live_job]["owner_pid"] == pid
    assert rings["dead"]["committed_steps"] == [4]
    assert rings["lost"]["only_copy_steps"] == [4]
    assert rings["dead"]["root"] == str((tmp_path / "a").resolve())

    dry = acp_cli("gc", "--shm", "--shm-dir", shm_dir, "--dry-run")
    assert dry["dry_run"] is True
    assert len(ring_files(shm_dir)) == 6
    gc = acp_cli("gc", "--shm", "--shm-dir", shm_dir)
    rows = {r["job"]: r for r in gc["rings"]}
    assert rows["dead"]["removed"] is True
    assert gc["freed_bytes"] == rows["dead"]["bytes"] == dry["freed_bytes"]
    assert rows["lost"]["removed"] is False
    assert "only copy" in rows["lost"]["reason"]
    assert rows[live_job]["removed"] is False
    # --force drops the only copy, never the live ring.
    gc = acp_cli("gc", "--shm", "--shm-dir", shm_dir, "--force")
    rows = {r["job"]: r for r in gc["rings"]}
    assert rows["lost"]["removed"] is True
    assert rows[live_job]["removed"] is False
    assert f"live process {pid}" in rows[live_job]["reason"]


def test_a_checkpointer_let_go_unclosed_persists_and_frees_its_ring(
    tmp_path: Path, shm_dir: Path
) -> None:
    """Dropping a checkpointer without ``close()`` (a script that makes a
    new one, a notebook cell run again) persists what it had queued and
    unlocks its ring: the next one on the same ring opens at once."""
    root = tmp_path / "ckpt"
    opts: dict[str, Any] = {
        "job": f"t-{uuid.uuid4().hex[:16]}",
        "ring_bytes": SMALL_RING,
        "shm_dir": shm_dir,
        "mlock": False,
    }
    first = acp.Checkpointer(root, **opts)
    # 12 MiB: its persist is still running when the checkpointer goes.
    handle = first.save(1, {"w": torch.arange(3 << 20, dtype=torch.float32)})
    del handle, first
    again = acp.Checkpointer(root, **opts)
    try:
        assert again.steps() == [1]
        assert again.snapshots() == [1]
        got = again.load()
        assert torch.equal(got["w"], torch.arange(3 << 20, dtype=torch.float32))
    finally:
        again.close()


def test_a_forked_child_refuses_the_checkpointer_and_exits_cleanly(
    tmp_path: Path, shm_dir: Path
) -> None:
    """A child forked after the open holds a copy of the checkpointer but
    none of its threads: a save or load there fails with an error naming
    both processes (it waited forever), close() lets go without touching
    the parent's ring, and the child's normal exit (which drops the copy)
    is clean (it aborted in the engine's drop, joining a thread the child
    does not have). The parent goes on saving and loading."""
    script = textwrap.dedent(
        f"""
        import os, sys, torch, acp
        ckpt = acp.Checkpointer({str(tmp_path / "ckpt")!r}, shm_dir={str(shm_dir)!r},
                                job="fk", ring_bytes=32 << 20, mlock=False)
        ckpt.save(1, {{"w": torch.ones(16)}}).wait()
        pid = os.fork()
        if pid == 0:
            for what, call in (("save", lambda: ckpt.save(2, {{"w": torch.ones(16)}})),
                               ("load", lambda: ckpt.load(1))):
                try:
                    call()
                    print("child", what, "ran", flush=True)
                except acp.InvalidInput as e:
                    print("child", what, "refused:", e, flush=True)
            ckpt.close()
            print("child closed", flush=True)
            sys.exit(0)  # a normal exit: the checkpointer is dropped here
        _, status = os.waitpid(pid, 0)
        print("child status", status, flush=True)
        ckpt.save(3, {{"w": torch.full((16,), 3.0)}}).wait()
        assert float(ckpt.load()["w"][0]) == 3.0
        ckpt.close()
        print("parent done", flush=True)
        """
    )
    proc = run_child(script, tmp_path)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    out = proc.stdout
    assert out.count("refused:") == 2, out
    assert "forked" in out, out
    assert "ran" not in out
    assert "child closed" in out, out
    assert "child status 0" in out, out
    assert "parent done" in out


def test_tensors_of_a_storage_load_do_not_hold_the_ring_after_close(
    tmp_path: Path, shm_dir: Path
) -> None:
    """A fresh load read from storage hands its image to the tensors; the
    load kept the engine's ring (its slot files locked) for as long as
    they lived, so closing and reopening the job, here or in another
    process, was BusyError while an evaluation kept the tensors."""
    root = tmp_path / "ckpt"
    ckpt = acp.Checkpointer(root, shm_dir=shm_dir, persist_every=1, mlock=False)
    for s in (1, 2, 3):
        ckpt.save(s, {"w": torch.full((1 << 16,), float(s))}).wait()
    state = ckpt.load(1)  # not resident: read from storage
    assert ckpt.last_load is not None
    assert ckpt.last_load.source == "storage"
    ckpt.close()
    acp.Checkpointer(root, shm_dir=shm_dir, mlock=False).close()
    assert torch.equal(state["w"], torch.full((1 << 16,), 1.0))
