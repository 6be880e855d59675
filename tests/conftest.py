"""Shared fixtures: a checkpointer per test on its own root, job and
shared-memory directory, closed (and its shared memory removed) afterwards."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import acp

SMALL_RING = 32 << 20
"""Test rings are small: every checkpoint in the suite is a few MiB."""

LARGE = os.environ.get("ACP_TEST_LARGE") == "1"


def slot_dir(shm_dir: Path) -> Path:
    """The per-user directory that holds this user's ring slots under
    ``shm_dir`` (``acp-u{euid}``, as acp-core's ``staging::user_dir`` names it)."""
    return shm_dir / f"acp-u{os.geteuid()}"


def flip_in_slot(shm_dir: Path, needle: bytes) -> None:
    """Flips a byte of the one ring slot holding ``needle``."""
    hit = 0
    for slot in sorted(slot_dir(shm_dir).iterdir()):
        data = bytearray(slot.read_bytes())
        at = data.find(needle)
        if at >= 0:
            data[at + 100] ^= 0xFF
            slot.write_bytes(bytes(data))
            hit += 1
    assert hit == 1


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A private directory for ring slots, on tmpfs when there is one."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    d = base / f"acp-test-{uuid.uuid4().hex[:12]}"
    d.mkdir(mode=0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def two_ranks(make: Callable[..., Any], root: Path, shm_dir: Path, **kwargs: Any) -> list[Any]:
    """Rank 0 and rank 1 of a two-rank job, both in this process: ``make``
    is ``acp.Checkpointer`` or ``acp._acp.Engine``, given a small ring in
    ``shm_dir``, unlocked, and ``kwargs`` (``job`` among them)."""
    kwargs.setdefault("ring_bytes", SMALL_RING)
    kwargs.setdefault("mlock", False)
    return [make(root, rank=r, world_size=2, shm_dir=shm_dir, **kwargs) for r in (0, 1)]


def save_raw(engines: list[Any], step: int, names: list[str]) -> list[Any]:
    """Has each engine (``acp._acp.Engine``) save one F32 tensor of four
    elements named ``names[i]`` as ``step``; their handles."""
    handles = []
    for e, name in zip(engines, names):
        st = e.begin_save(step, [(name, "F32", (4,))], '{"acp.codec": 1, "state": null}')
        assert st is not None
        st.buffer(0)[:] = bytes(range(16))
        handles.append(st.finish())
    return handles


MakeCkpt = Callable[..., acp.Checkpointer]


@pytest.fixture
def make_ckpt(tmp_path: Path, shm_dir: Path) -> Iterator[MakeCkpt]:
    """Opens checkpointers on ``tmp_path / "ckpt"`` with a job unique to the
    test (so shared-memory slots never collide); closes them at the end."""
    opened: list[acp.Checkpointer] = []
    job = f"t-{uuid.uuid4().hex[:16]}"

    def make(**kwargs: Any) -> acp.Checkpointer:
        kwargs.setdefault("job", job)
        kwargs.setdefault("ring_bytes", SMALL_RING)
        kwargs.setdefault("shm_dir", shm_dir)
        kwargs.setdefault("mlock", False)
        root = kwargs.pop("root", tmp_path / "ckpt")
        ckpt = acp.Checkpointer(root, **kwargs)
        opened.append(ckpt)
        return ckpt

    yield make
    for ckpt in opened:
        ckpt.close()


@pytest.fixture
def ckpt(make_ckpt: MakeCkpt) -> acp.Checkpointer:
    return make_ckpt()


# --- the suite leaves /dev/shm as it found it -------------------------------

_SHM = Path("/dev/shm")


def _shm_entries() -> set[str]:
    """acp's entries in /dev/shm owned by this user: rings (in the per-user
    directory and, from older builds, at the top), test and demo dirs."""
    if not _SHM.is_dir():
        return set()
    found: set[str] = set()
    for p in _SHM.iterdir():
        try:
            mine = p.lstat().st_uid == os.geteuid()
        except FileNotFoundError:
            continue
        if not mine or "acp" not in p.name:
            continue
        found.add(p.name)
        if p.name == f"acp-u{os.geteuid()}" and p.is_dir():
            found.update(f"{p.name}/{q.name}" for q in p.iterdir())
    return found


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_SHM_BEFORE] = _shm_entries()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = session.config.stash.get(_SHM_BEFORE, None)
    if before is None:
        return
    left = sorted(_shm_entries() - before)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        line = f"/dev/shm: the suite left {len(left)} acp entries behind: {left[:10]}"
        if reporter is not None:
            reporter.write_line(line, red=True)
        if exitstatus == 0:
            session.exitstatus = 1


_SHM_BEFORE = pytest.StashKey[set[str]]()
