"""Broken storage, as users meet it: disk full on a real small file system,
a read-only file system, permission denied, the checkpoint directory
deleted under the engine, an I/O error. Each time the save's handle raises
with the path and the cause, nothing half-written is committed, the
previous committed checkpoint stays loadable, the failed step's resident
copy stays restorable (a restarted trainer commits it), and the next save
works once the cause is gone.

The file systems are real tmpfs mounts made by the test (as root); where
mounting is impossible the test is skipped and says why."""

from __future__ import annotations

import errno
import os
import shutil
import time
import traceback
from pathlib import Path

import pytest

import acp
from acp import _acp
from tests.conftest import MakeCkpt

from ._torture import assert_state, remount, small_fs, state

N = 500_000  # 2 MB of float32 per step


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".") and p.is_dir())


def check_failed(e: BaseException, root: Path, code: int, words: str) -> None:
    assert isinstance(e, acp.StorageError), repr(e)
    msg = str(e)
    assert str(root) in msg, msg
    assert words in msg, msg
    assert e.errno == code, (e.errno, msg)
    assert e.filename is not None
    assert str(e.filename).startswith(str(root)), e.filename


def restored_after_restart(make_ckpt: MakeCkpt, root: Path, step: int) -> acp.Checkpointer:
    """A restarted trainer commits the failed step from its resident slot."""
    ckpt = make_ckpt(root=root, ring_bytes=64 << 20, full_timeout=20.0)
    assert ckpt.stats()["engine"]["persisting_steps"] == [step]
    assert_state(ckpt.load(), step, N)
    assert ckpt.last_load is not None
    assert ckpt.last_load.source == "ram"
    assert_state(ckpt.load(storage_only=True), step, N)
    return ckpt


def test_disk_full_on_a_real_small_file_system(make_ckpt: MakeCkpt, tmp_path: Path) -> None:
    with small_fs(tmp_path / "fs", "8m") as fs:
        root = fs / "ckpt"
        ckpt = make_ckpt(root=root, ring_bytes=64 << 20)
        ckpt.save(1, state(1, N)).wait()
        # Leave less room than one more checkpoint needs.
        junk = fs / "junk"
        junk.write_bytes(b"\0" * (shutil.disk_usage(fs).free - (512 << 10)))
        h = ckpt.save(2, state(2, N))
        with pytest.raises(acp.NoSpace) as e:
            h.wait()
        check_failed(e.value, root, errno.ENOSPC, "no space left on device")
        assert ckpt.steps() == [1]
        assert leftovers(root) == []
        assert_state(ckpt.load(1, storage_only=True), 1, N)
        ckpt.close()
        # Space is freed: the restarted trainer commits step 2 from RAM,
        # and saves go on.
        junk.unlink()
        again = restored_after_restart(make_ckpt, root, 2)
        again.save(3, state(3, N)).wait()
        assert again.steps() == [1, 2, 3]


def test_disk_full_then_freed_the_next_save_works_in_process(
    make_ckpt: MakeCkpt, tmp_path: Path
) -> None:
    with small_fs(tmp_path / "fs", "8m") as fs:
        root = fs / "ckpt"
        ckpt = make_ckpt(root=root, ring_bytes=64 << 20)
        ckpt.save(1, state(1, N)).wait()
        junk = fs / "junk"
        junk.write_bytes(b"\0" * (shutil.disk_usage(fs).free - (512 << 10)))
        with pytest.raises(acp.NoSpace):
            ckpt.save(2, state(2, N)).wait()
        junk.unlink()
        ckpt.save(3, state(3, N)).wait()
        assert ckpt.steps() == [1, 3]
        assert_state(ckpt.load(), 3, N)


def test_read_only_file_system(make_ckpt: MakeCkpt, tmp_path: Path) -> None:
    with small_fs(tmp_path / "fs", "32m") as fs:
        root = fs / "ckpt"
        ckpt = make_ckpt(root=root, ring_bytes=64 << 20)
        ckpt.save(1, state(1, N)).wait()
        remount(fs, "ro")
        try:
            h = ckpt.save(2, state(2, N))
            with pytest.raises(acp.StorageError) as e:
                h.wait()
            check_failed(e.value, root, errno.EROFS, "Read-only file system")
            assert ckpt.steps() == [1]
            assert_state(ckpt.load(1, storage_only=True), 1, N)
        finally:
            remount(fs, "rw")
        ckpt.close()
        again = restored_after_restart(make_ckpt, root, 2)
        again.save(3, state(3, N)).wait()
        assert again.steps() == [1, 2, 3]


def test_io_error(make_ckpt: MakeCkpt, tmp_path: Path) -> None:
    faults = _acp.FaultInjector()
    root = tmp_path / "ckpt"
    ckpt = make_ckpt(root=root, faults=faults, ring_bytes=64 << 20)
    ckpt.save(1, state(1, N)).wait()
    faults.arm(2, errno.EIO, True)  # from the second chunk write on: a dead disk
    h = ckpt.save(2, state(2, N))
    with pytest.raises(acp.StorageError) as e:
        h.wait()
    check_failed(e.value, root.resolve(), errno.EIO, "Input/output error")
    assert ckpt.steps() == [1]
    assert leftovers(root) == []
    faults.heal()
    assert_state(ckpt.load(1, storage_only=True), 1, N)
    ckpt.close()
    again = restored_after_restart(make_ckpt, root, 2)
    again.save(3, state(3, N)).wait()
    assert again.steps() == [1, 2, 3]


@pytest.mark.parametrize("then", ["next-save", "restart"])
def test_checkpoint_directory_deleted_while_saving(
    make_ckpt: MakeCkpt, tmp_path: Path, then: str
) -> None:
    faults = _acp.FaultInjector()
    root = (tmp_path / "ckpt").resolve()
    ckpt = make_ckpt(root=root, faults=faults, ring_bytes=64 << 20)
    ckpt.save(1, state(1, N)).wait()
    faults.arm_stall(1, 600.0)  # step 2's pending directory exists, its write waits
    h = ckpt.save(2, state(2, N))
    deadline = time.monotonic() + 60
    while not leftovers(root):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    shutil.rmtree(root)  # rm -rf under the engine
    faults.heal()
    with pytest.raises(acp.StorageError) as e:
        h.wait()
    check_failed(e.value, root, errno.ENOENT, "No such file or directory")
    if then == "next-save":
        # The root is made again; saving goes on.
        ckpt.save(3, state(3, N)).wait()
        assert ckpt.steps() == [3]
        assert_state(ckpt.load(storage_only=True), 3, N)
    else:
        ckpt.close()
        again = restored_after_restart(make_ckpt, root, 2)
        again.save(3, state(3, N)).wait()
        assert again.steps() == [2, 3]


NOBODY = 65534


def test_permission_denied(tmp_path: Path) -> None:
    """The trainer runs as another user (root bypasses permissions): a
    forked child drops to uid 65534; the parent takes write permission
    away from the checkpoint directory, then gives it back."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the trainer as another user")
    base = Path("/tmp") / f"acp-perm-{os.getpid()}-{time.monotonic_ns()}"
    base.mkdir(mode=0o755)
    root, shm = base / "ckpt", base / "shm"
    for d in (root, shm):
        d.mkdir(mode=0o700)
        os.chown(d, NOBODY, NOBODY)
    to_parent_r, to_parent_w = os.pipe()
    to_child_r, to_child_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the trainer, as nobody
        code = 0
        out = os.fdopen(to_parent_w, "w", buffering=1)
        cmd = os.fdopen(to_child_r)
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            kw = {"job": "perm", "shm_dir": shm, "ring_bytes": 64 << 20, "mlock": False}
            ckpt = acp.Checkpointer(root, **kw)  # type: ignore[arg-type]
            ckpt.save(1, state(1, N)).wait()
            out.write("saved 1\n")
            cmd.readline()  # the parent made the root read-only for us
            h = ckpt.save(2, state(2, N))
            try:
                h.wait()
                out.write("error none\n")
            except acp.StorageError as e:
                check_failed(e, root, errno.EACCES, "Permission denied")
                assert ckpt.steps() == [1]
                assert_state(ckpt.load(1, storage_only=True), 1, N)
                out.write("failed 2 as expected\n")
            cmd.readline()  # write permission is back
            ckpt.close()
            again = acp.Checkpointer(root, **kw)  # type: ignore[arg-type]
            assert again.stats()["engine"]["persisting_steps"] == [2]
            assert_state(again.load(), 2, N)
            again.save(3, state(3, N)).wait()
            assert again.steps() == [1, 2, 3]
            again.close()
            out.write("done\n")
        except BaseException:
            out.write("child failed: " + traceback.format_exc().replace("\n", " | ") + "\n")
            code = 1
        finally:
            out.flush()
            os._exit(code)
    os.close(to_parent_w)
    os.close(to_child_r)
    lines = os.fdopen(to_parent_r)
    cmd = os.fdopen(to_child_w, "w", buffering=1)
    try:
        assert lines.readline().strip() == "saved 1"
        os.chmod(root, 0o500)
        cmd.write("go\n")
        assert lines.readline().strip() == "failed 2 as expected"
        os.chmod(root, 0o700)
        cmd.write("go\n")
        assert lines.readline().strip() == "done"
    finally:
        os.chmod(root, 0o700)
        cmd.close()
        _, status = os.waitpid(pid, 0)
        lines.close()
        shutil.rmtree(base, ignore_errors=True)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_load_lets_go_of_its_slot_without_the_garbage_collector(make_ckpt: MakeCkpt) -> None:
    """A loaded checkpoint pins its ring slot. The load's helpers used to
    keep it in a reference cycle, so the slot stayed pinned until the next
    collection, which `save` pauses: with every slot pinned so, the next
    save waited for a slot for its whole `full_timeout` (found by the
    restart-after-rm -rf test)."""
    import gc

    ckpt = make_ckpt(ring_bytes=64 << 20, full_timeout=5.0)
    ckpt.save(1, state(1, N)).wait()
    was = gc.isenabled()
    gc.disable()
    try:
        gc.collect()
        assert_state(ckpt.load(), 1, N)  # from RAM: pins slot 1 while it runs
        assert_state(ckpt.load(storage_only=True), 1, N)  # read into slot 2
        target = {"w": state(0, N)["w"], "b": state(0, N)["b"], "step": 0}
        ckpt.load(1, into=target)
        assert_state(target, 1, N)
        alive = [o for o in gc.get_objects() if type(o) is _acp.Loaded]
        assert alive == []
        ckpt.save(2, state(2, N)).wait()  # needs a slot no load still pins
    finally:
        if was:
            gc.enable()
    assert ckpt.steps() == [1, 2]
