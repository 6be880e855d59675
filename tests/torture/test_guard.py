"""The dying checkpoint: SIGTERM (acp's handler installed) or an exception
escaping ``guard()`` flushes and commits the newest completely staged
checkpoint before the process exits, with a documented exit status; a save
interrupted while staging is aborted (the one before it persists); the
previous SIGTERM handler is chained; SIGKILL after staging loses nothing
(the restarted trainer commits the resident slot)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

import acp
from tests.conftest import MakeCkpt

from ._torture import assert_state, job, run_trainer, state, wait_line


def reopen(root: Path, shm: Path, job_id: str) -> acp.Checkpointer:
    return acp.Checkpointer(root, job=job_id, shm_dir=shm, ring_bytes=256 << 20, mlock=False)


def finish(p: object, timeout: float = 120) -> tuple[int, str, str]:
    import subprocess

    assert isinstance(p, subprocess.Popen)
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


@pytest.mark.parametrize("mode", ["sigterm-idle", "sigterm-guard"])
def test_sigterm_commits_the_step_still_flushing(tmp_path: Path, shm_dir: Path, mode: str) -> None:
    root, j = tmp_path / "ckpt", job()
    p = run_trainer(mode, root, shm_dir, j)
    wait_line(p, "READY")
    p.send_signal(signal.SIGTERM)
    code, _, err = finish(p)
    assert code == acp.EXIT_TERMINATED == 143, err
    assert "dying checkpoint (signal)" in err, err
    with reopen(root, shm_dir, j) as ckpt:
        assert ckpt.steps() == [1, 2]
        assert ckpt.stats()["engine"]["persisting_steps"] == []
        assert_state(ckpt.load(storage_only=True), 2)


@pytest.mark.parametrize("mode", ["sigterm-after-copy", "sigterm-during-copy"])
def test_sigterm_during_staging_aborts_that_save(tmp_path: Path, shm_dir: Path, mode: str) -> None:
    root, j = tmp_path / "ckpt", job()
    p = run_trainer(mode, root, shm_dir, j)
    code, out, err = finish(p)
    assert code == 143, err
    assert "SAVE_RETURNED" not in out, "save() finished although SIGTERM came during its staging"
    if mode == "sigterm-during-copy":
        # The trainer holds the copy open, half done, until the signal has
        # been delivered; the handler runs before the copy goes on.
        assert "HALF_COPIED" in out, out
        assert "COPY_RESUMED" not in out, out
    with reopen(root, shm_dir, j) as ckpt:
        engine = ckpt.stats()["engine"]
        # Step 2 was aborted (its slot freed), not left half-staged.
        assert 2 not in engine["resident_steps"]
        assert engine["persisting_steps"] == []
        assert ckpt.steps() == [1]
        loaded = ckpt.load()
        assert loaded["step"] == 1


def test_sigterm_chains_the_previous_handler(tmp_path: Path, shm_dir: Path) -> None:
    root, j = tmp_path / "ckpt", job()
    p = run_trainer("sigterm-chain", root, shm_dir, j)
    wait_line(p, "READY")
    p.send_signal(signal.SIGTERM)
    code, _, err = finish(p)
    assert code == 143, err
    assert (tmp_path / "previous-handler-ran").read_text() == str(int(signal.SIGTERM))


@pytest.mark.parametrize("mode", ["sigterm-twice", "sigterm-twice-guard"])
def test_a_sigterm_after_the_dying_checkpoint_does_not_run_it_again(
    tmp_path: Path, shm_dir: Path, mode: str
) -> None:
    """A second SIGTERM once the dying checkpoint is done (the process
    exiting) ran it again while the interpreter unwound the first exit,
    and printed a SystemExit traceback; inside ``guard(sigterm=True)``, whose
    handler the exit uninstalled, it killed the process by the signal.
    With nothing staged since, it is ignored: one dying checkpoint, a
    clean exit with its status."""
    root, j = tmp_path / "ckpt", job()
    p = run_trainer(mode, root, shm_dir, j)
    wait_line(p, "READY")
    p.send_signal(signal.SIGTERM)
    code, _, err = finish(p)
    assert code == 143, err
    assert err.count("dying checkpoint (signal)") == 1, err
    assert "Traceback" not in err, err
    with reopen(root, shm_dir, j) as ckpt:
        assert ckpt.steps() == [1, 2]


@pytest.mark.parametrize("mode", ["sigterm-dead-disk", "sigterm-hung-disk"])
def test_a_failed_dying_checkpoint_exits_74_and_the_restart_commits_it(
    tmp_path: Path, shm_dir: Path, mode: str
) -> None:
    root, j = tmp_path / "ckpt", job()
    env = {"STALL_TIMEOUT": "1.5"}
    p = run_trainer(mode, root, shm_dir, j, **env)
    wait_line(p, "READY")
    p.send_signal(signal.SIGTERM)
    # The hung disk never returns: the watchdog bounds the dying checkpoint.
    code, _, err = finish(p, timeout=60)
    assert code == acp.EXIT_SAVE_FAILED == 74, err
    assert "dying checkpoint (signal) failed" in err, err
    assert "acp persist" in err, err
    if mode == "sigterm-hung-disk":
        assert "flush stuck: step 2" in err, err
    else:
        assert "Input/output error" in err, err
    # The newest staged step is still resident: the restart commits it.
    with reopen(root, shm_dir, j) as ckpt:
        assert ckpt.stats()["engine"]["persisting_steps"] == [2]
        assert_state(ckpt.load(), 2)
        ckpt.wait()  # the load served RAM while the restart commits it
        assert ckpt.steps() == [1, 2]


def test_an_exception_escaping_guard_commits_the_last_staged_step(
    tmp_path: Path, shm_dir: Path
) -> None:
    root, j = tmp_path / "ckpt", job()
    code, _, err = finish(run_trainer("exception", root, shm_dir, j))
    assert code == 1, err
    assert "RuntimeError: boom in training" in err, err
    assert "acp: dying checkpoint committed step 2" in err, err
    with reopen(root, shm_dir, j) as ckpt:
        assert ckpt.steps() == [1, 2]
        assert_state(ckpt.load(storage_only=True), 2)


def test_an_exception_inside_save_aborts_that_save(tmp_path: Path, shm_dir: Path) -> None:
    root, j = tmp_path / "ckpt", job()
    code, _, err = finish(run_trainer("exception-in-save", root, shm_dir, j))
    assert code == 1, err
    assert "ValueError: boom inside save" in err, err
    with reopen(root, shm_dir, j) as ckpt:
        engine = ckpt.stats()["engine"]
        assert 2 not in engine["resident_steps"], engine
        assert ckpt.steps() == [1]
        assert_state(ckpt.load(), 1)


def test_an_exception_with_a_dead_disk_exits_74(tmp_path: Path, shm_dir: Path) -> None:
    root, j = tmp_path / "ckpt", job()
    code, _, err = finish(run_trainer("exception-dead-disk", root, shm_dir, j))
    assert code == 74, err
    assert "RuntimeError: boom in training" in err, err
    assert "dying checkpoint failed" in err, err
    with reopen(root, shm_dir, j) as ckpt:
        assert ckpt.stats()["engine"]["persisting_steps"] == [2]
        assert_state(ckpt.load(), 2)


def test_sigkill_after_staging_loses_no_step(tmp_path: Path, shm_dir: Path) -> None:
    """The OOM killer: SIGKILL once save() returned, before the flush."""
    root, j = tmp_path / "ckpt", job()
    code, _, err = finish(run_trainer("oom-kill", root, shm_dir, j))
    assert code == -signal.SIGKILL, err
    with reopen(root, shm_dir, j) as ckpt:
        engine = ckpt.stats()["engine"]
        assert engine["persisting_steps"] == [2]
        state = ckpt.load()  # from RAM, while step 2 is committed in the background
        assert ckpt.last_load is not None
        assert ckpt.last_load.source == "ram"
        assert_state(state, 2)
        ckpt.wait()
        assert ckpt.steps() == [1, 2]
        assert_state(ckpt.load(storage_only=True), 2)


def test_dying_checkpoint_in_process(make_ckpt: MakeCkpt) -> None:
    faults = acp._acp.FaultInjector()
    ckpt = make_ckpt(faults=faults)
    assert ckpt.dying_checkpoint().ok  # nothing staged: nothing to do
    ckpt.save(1, state(1)).wait()
    faults.arm_stall(1, 0.5)
    ckpt.save(2, state(2))
    with pytest.raises(KeyError), ckpt.guard():
        raise KeyError("x")
    report = ckpt.last_dying
    assert report is not None
    assert (report.cause, report.ok, report.staged_step, report.committed_step) == (
        "exception",
        True,
        2,
        2,
    )
    # Normal exit from the block: nothing to do, the checkpointer goes on.
    with ckpt.guard():
        ckpt.save(3, state(3))
    assert ckpt.last_dying is report
    ckpt.wait()
    assert ckpt.steps() == [1, 2, 3]


def test_acp_persist_commits_what_an_oom_killed_trainer_left(tmp_path: Path, shm_dir: Path) -> None:
    """The same OOM kill, recovered by the command-line tool instead of a
    restarted trainer."""
    import json
    import subprocess
    import sys

    root, j = tmp_path / "ckpt", job()
    code, _, err = finish(run_trainer("oom-kill", root, shm_dir, j))
    assert code == -signal.SIGKILL, err
    cmd = [sys.executable, "-m", "acp.cli", "persist", str(root), "--job", j]
    run = subprocess.run(
        [*cmd, "--shm-dir", str(shm_dir), "--json", "-q"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2" in json.dumps(json.loads(run.stdout)), run.stdout
    with reopen(root, shm_dir, j) as ckpt:
        assert ckpt.steps() == [1, 2]
        assert ckpt.stats()["engine"]["persisting_steps"] == []
        assert_state(ckpt.load(storage_only=True), 2)


def test_sigterm_commits_the_newest_ram_only_snapshot(tmp_path: Path, shm_dir: Path) -> None:
    """Steps saved with persist=False: the dying checkpoint commits the
    newest of them, never the older one."""
    root, j = tmp_path / "ckpt", job()
    p = run_trainer("sigterm-ram-only", root, shm_dir, j)
    wait_line(p, "READY")
    p.send_signal(signal.SIGTERM)
    code, _, err = finish(p)
    assert code == acp.EXIT_TERMINATED, err
    with reopen(root, shm_dir, j) as ckpt:
        assert ckpt.steps() == [1, 3]
        assert ckpt.stats()["engine"]["persisting_steps"] == []
        assert_state(ckpt.load(storage_only=True), 3)


def test_sigkill_with_ram_only_snapshots_commits_the_newest_on_restart(
    tmp_path: Path, shm_dir: Path
) -> None:
    root, j = tmp_path / "ckpt", job()
    code, _, err = finish(run_trainer("kill-ram-only", root, shm_dir, j))
    assert code == -signal.SIGKILL, err
    with reopen(root, shm_dir, j) as ckpt:
        assert ckpt.stats()["engine"]["persisting_steps"] == [3]
        assert_state(ckpt.load(), 3)
        ckpt.wait()  # the load served RAM while the restart commits it
        assert ckpt.steps() == [1, 3]


def test_a_save_after_the_dying_checkpoint_makes_the_next_sigterm_run_one(
    make_ckpt: MakeCkpt,
) -> None:
    """Code that caught the exit and saved again is not left unprotected:
    only a SIGTERM with nothing staged since the last dying checkpoint is
    ignored."""
    ckpt = make_ckpt()
    handler = ckpt.install_sigterm_handler()
    try:
        ckpt.save(1, state(1)).wait()
        assert not handler.done_already(ckpt)
        handler.finished(ckpt)
        assert handler.done_already(ckpt)
        ckpt.save(2, state(2)).wait()
        assert not handler.done_already(ckpt)
    finally:
        handler.uninstall()
