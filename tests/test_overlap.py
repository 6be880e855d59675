"""Overlapped saves (``Checkpointer(overlap=True)``, ``ACP_OVERLAP``): the
large tensors are copied after ``save()`` returned, and the save is sealed
only when none of them changed meanwhile (``acp._overlap``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import acp
from acp._overlap import EAGER_BELOW
from tests.conftest import MakeCkpt

BIG = 512 * 1024  # fp32 elements: 2 MiB, copied in the background


def model() -> tuple[torch.nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(1024, 512), torch.nn.BatchNorm1d(512), torch.nn.Linear(512, 1024)
    )
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def train_step(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    m(torch.randn(16, 1024)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def state_of(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, object]:
    return {"model": m.state_dict(), "opt": opt.state_dict()}


def copy_of(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def pending_second_save(
    ckpt: acp.Checkpointer, m: torch.nn.Module, opt: torch.optim.Optimizer
) -> tuple[acp.SaveHandle, dict[str, torch.Tensor]]:
    """Trains and saves step 1, trains again and saves step 2, whose copy is
    left pending; returns its handle and the model's state it must hold."""
    train_step(m, opt)
    ckpt.save(1, state_of(m, opt), persist=False)
    ckpt.staged()  # what the optimizer hook does (a no-op when it did)
    train_step(m, opt)
    ref = copy_of(m)
    h = ckpt.save(2, state_of(m, opt), persist=False)
    assert h._pending is not None
    return h, ref


def test_a_loop_with_the_optimizer_hook_seals_every_save_bit_exact(
    make_ckpt: MakeCkpt,
) -> None:
    m, opt = model()
    ckpt = make_ckpt(overlap=True, ring_slots=6, ring_bytes=6 * (16 << 20))
    ckpt.staged_before(opt)
    handles, refs = [], {}
    for step in range(1, 6):
        train_step(m, opt)
        # A plain value that changes at every save (the kept save plan
        # does not fit such a state: each save takes the full path).
        state = {**state_of(m, opt), "step": step}
        handles.append(ckpt.save(step, state, persist=False))
        refs[step] = copy_of(m)
    # Each save overlaps, sealed by the hook before the next optimizer step.
    assert all(h._pending is None for h in handles[:-1])
    assert all(h.done() for h in handles[:-1])
    assert all(h.staged for h in handles[:-1])
    assert handles[-1]._pending is not None  # no optimizer step after it yet
    assert not handles[-1].staged  # a crash now would lose it
    ckpt.wait()
    for h in handles:
        s = h.wait()
        assert s.error is None, s
        assert s.outcome == "resident", s
    overlapped = [h.stats for h in handles]
    assert all(s.overlap_copy_secs is not None for s in overlapped)
    assert all(s.overlap_wait_secs is not None for s in overlapped)
    for step in sorted(ckpt.snapshots()):
        got = ckpt.load(step)
        assert got["step"] == step
        assert same(got["model"], refs[step]), step
    # The optimizer state is the one of the step too.
    got = ckpt.load(5)
    for k, v in opt.state_dict()["state"][0].items():
        assert torch.equal(got["opt"]["state"][0][k], v), k


def test_a_tensor_changed_before_staged_drops_the_save_and_is_copied_eagerly_next(
    make_ckpt: MakeCkpt,
) -> None:
    m, opt = model()
    ckpt = make_ckpt(overlap=True)
    train_step(m, opt)
    ckpt.save(1, state_of(m, opt), persist=True).wait()
    ref1 = copy_of(m)
    h = ckpt.save(2, state_of(m, opt), persist=True)
    assert h._pending is not None
    assert not h.done()
    with torch.no_grad():
        m[0].weight.add_(1.0)  # the optimizer step the hook would have held
    assert ckpt.staged() is False
    assert h.done()
    assert not h.staged
    with pytest.raises(acp.InvalidInput, match=r"step 2 \(overlap\).*`model.0.weight` changed"):
        h.wait()
    assert "model.0.weight" in (h.stats.error or "")
    assert ckpt.staged() is None  # nothing pending any more
    # The previous checkpoint stays the newest, in RAM and in storage.
    ckpt.wait()
    assert ckpt.steps() == [1]
    assert 2 not in ckpt.snapshots()
    assert same(ckpt.load()["model"], ref1)
    # From now on that tensor is copied in the stall: changing it after
    # save() returned no longer matters, and the saved bytes are the old ones.
    ref3 = copy_of(m)
    h3 = ckpt.save(3, state_of(m, opt), persist=True)
    assert h3._pending is not None  # the other large tensors still overlap
    with torch.no_grad():
        m[0].weight.add_(1.0)
    assert ckpt.staged() is True
    h3.wait()
    assert same(ckpt.load(3)["model"], ref3)
    assert ckpt.stats()["figures"]["saves_failed"] == 1


def test_a_storage_freed_before_staged_drops_the_save(make_ckpt: MakeCkpt) -> None:
    """A storage freed under its tensor after save() returned
    (``untyped_storage().resize_(0)``, as FSDP frees parameters) does not
    change the tensor's version counter; the save is dropped all the same,
    not sealed with whatever the freed memory held. (The background copy
    is let finish first here, so that it never reads freed memory.)"""
    ckpt = make_ckpt(overlap=True)
    w, b = torch.ones(BIG), torch.full((BIG,), 2.0)
    ckpt.save(1, {"w": w, "b": b}).wait()
    h = ckpt.save(2, {"w": w, "b": b})
    assert h._pending is not None
    pending = ckpt._overlaps.pending
    assert pending is not None
    pending.copy.result(timeout=60)  # the copy is done: nothing reads w any more
    version = w._version
    w.untyped_storage().resize_(0)
    assert w._version == version  # unseen by the version counter
    assert ckpt.staged() is False
    with pytest.raises(acp.InvalidInput, match=r"`w` changed \(or its storage was freed"):
        h.wait()
    ckpt.wait()
    assert ckpt.steps() == [1]


def test_running_statistics_changed_by_the_forward_pass_are_saved_as_they_were(
    make_ckpt: MakeCkpt,
) -> None:
    # BatchNorm changes its running statistics in place inside the kernel,
    # without bumping their version counters: small tensors are therefore
    # copied in the stall.
    m, opt = model()
    bn = m[1]
    assert isinstance(bn, torch.nn.BatchNorm1d)
    mean = bn.running_mean
    assert mean is not None
    assert mean.nbytes < EAGER_BELOW <= m[0].weight.nbytes
    ckpt = make_ckpt(overlap=True)
    ckpt.staged_before(opt)
    h, ref = pending_second_save(ckpt, m, opt)
    version = mean._version
    m(torch.randn(16, 1024)).square().mean().backward()  # the next forward and backward
    assert mean._version == version  # unseen by the version counter...
    assert not torch.equal(mean, ref["1.running_mean"])  # ...but changed
    opt.step()  # the hook seals step 2 first
    assert h.done()
    assert h.wait().error is None
    ckpt.wait()  # hashed: loadable from RAM
    assert same(ckpt.load(2)["model"], ref)


def test_close_seals_a_pending_save_and_commits_it(make_ckpt: MakeCkpt, tmp_path: Path) -> None:
    m, opt = model()
    ckpt = make_ckpt(overlap=True)
    h, ref = pending_second_save(ckpt, m, opt)
    ckpt.close()  # commits the newest snapshot: step 2, sealed first
    assert h.done()
    assert h.stats.error is None
    again = make_ckpt()
    assert again.steps() == [2]
    assert same(again.load(storage_only=True)["model"], ref)


def test_load_and_wait_seal_first(make_ckpt: MakeCkpt) -> None:
    m, opt = model()
    ckpt = make_ckpt(overlap=True)
    train_step(m, opt)
    ckpt.save(1, state_of(m, opt), persist=True)
    ckpt.wait()
    ref = copy_of(m)
    train_step(m, opt)
    h = ckpt.save(2, state_of(m, opt), persist=False)
    assert h._pending is not None
    # load(into=) writes what the pending copy reads: the save is sealed first.
    ckpt.load(1, into=state_of(m, opt))
    assert h.done()
    assert h.stats.error is None
    assert same(m.state_dict(), ref)
    h3 = ckpt.save(3, state_of(m, opt), persist=False)
    ckpt.wait()
    assert h3.done()
    assert h3.stats.error is None


def test_per_save_override_and_states_that_cannot_overlap(make_ckpt: MakeCkpt) -> None:
    m, opt = model()
    ckpt = make_ckpt()  # overlap off by default
    for step in (1, 2):
        train_step(m, opt)
        assert ckpt.save(step, state_of(m, opt), persist=False)._pending is None
    train_step(m, opt)
    assert ckpt.save(3, state_of(m, opt), persist=False, overlap=True)._pending is not None
    ckpt.staged()
    # NumPy arrays have no version counter: copied in the stall.
    arrays = {"w": np.ones(BIG, dtype=np.float32)}
    for step in (4, 5):
        h = ckpt.save(step, arrays, persist=False, overlap=True)
        assert h._pending is None
        assert h.wait().error is None
    # Small tensors only: nothing to overlap.
    small = {"b": torch.ones(16)}
    for step in (6, 7):
        assert ckpt.save(step, small, persist=False, overlap=True)._pending is None


def test_acp_overlap_sets_the_default(make_ckpt: MakeCkpt, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACP_OVERLAP", "1")
    ckpt = make_ckpt()
    state = {"w": torch.ones(BIG)}
    ckpt.save(1, state, persist=False)
    assert ckpt.save(2, state, persist=False)._pending is not None
    assert ckpt.save(3, state, persist=False, overlap=False)._pending is None  # sealed 2 first


CHILD = textwrap.dedent(
    """
    import os, signal, sys, torch, acp
    root, shm, change = sys.argv[1], sys.argv[2], sys.argv[3] == "change"
    w = torch.arange(512 * 1024, dtype=torch.float32)
    ckpt = acp.Checkpointer(root, job="ov", shm_dir=shm, ring_bytes=64 << 20, mlock=False,
                            overlap=True)
    ckpt.install_sigterm_handler()
    ckpt.save(1, {"w": w}, persist=False)
    assert ckpt.staged() is True  # what the optimizer hook does before a step
    w.add_(1)
    h = ckpt.save(2, {"w": w}, persist=False)
    assert h._pending is not None
    if change:
        w.add_(1)
    print("PENDING", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    """
)


@pytest.mark.parametrize("change", ["keep", "change"])
def test_sigterm_with_a_save_pending_commits_it_unless_it_changed(
    tmp_path: Path, shm_dir: Path, change: str
) -> None:
    root = tmp_path / "ckpt"
    p = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(shm_dir), change],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    assert p.returncode == 143 == 128 + signal.SIGTERM, p.stderr
    assert "PENDING" in p.stdout
    with acp.Checkpointer(root, job="ov", shm_dir=shm_dir, ring_bytes=64 << 20, mlock=False) as c:
        want = 2 if change == "keep" else 1
        assert c.steps() == [want], p.stderr
        w = c.load(storage_only=True)["w"]
        assert torch.equal(w, torch.arange(512 * 1024, dtype=torch.float32) + (want - 1))
        if change == "change":
            assert "`w` changed" in p.stderr


def test_one_thread_seals_a_pending_save_the_others_find_nothing(make_ckpt: MakeCkpt) -> None:
    m, opt = model()
    ckpt = make_ckpt(overlap=True)
    h, ref = pending_second_save(ckpt, m, opt)
    results: list[bool | None] = []
    threads = [threading.Thread(target=lambda: results.append(ckpt.staged())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results, key=str) == [None, None, None, True]
    assert h.staged
    ckpt.wait()
    assert same(ckpt.load(2)["model"], ref)


def interrupt_the_next_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next wait for an overlapped copy raises KeyboardInterrupt (a
    Ctrl-C while it runs); the waits after it are as usual."""
    from acp import _overlap

    done = _overlap._done

    def interrupted(fut: object, timeout: float | None) -> bool:
        monkeypatch.setattr(_overlap, "_done", done)
        raise KeyboardInterrupt

    monkeypatch.setattr(_overlap, "_done", interrupted)


def test_an_interrupt_while_staged_waits_leaves_the_save_pending(
    make_ckpt: MakeCkpt, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt (Ctrl-C) inside ``staged()`` or ``wait()`` while
    the copy ran took the save out of ``pending`` for good: it was never
    sealed, and its handle's ``wait()`` raised a bare AssertionError."""

    m, opt = model()
    ckpt = make_ckpt(overlap=True)
    h, ref = pending_second_save(ckpt, m, opt)
    interrupt_the_next_wait(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        ckpt.staged()
    assert not h.done()
    assert h.wait().outcome == "resident"  # sealed now
    assert h.staged
    ckpt.wait()
    assert same(ckpt.load(2)["model"], ref)


def test_a_save_that_close_overtakes_is_dropped_and_frees_the_ring(
    make_ckpt: MakeCkpt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``close()`` from another thread while an overlapped ``save()`` was
    between starting its copy and handing it over: the save outlived the
    close, its staging kept the ring locked (a reopen in this process was
    BusyError) and its handle failed while the next open committed it.
    Now the save is dropped (``EngineClosed``) and the ring is free."""
    from acp import _overlap

    m, opt = model()
    ckpt = make_ckpt(overlap=True)
    train_step(m, opt)
    ckpt.save(1, state_of(m, opt), persist=True).wait()
    submit = _overlap.Copier.submit
    closer: list[threading.Thread] = []

    def close_meanwhile(self: _overlap.Copier, *args: object, **kwargs: object) -> object:
        fut = submit(self, *args, **kwargs)  # type: ignore[arg-type]
        t = threading.Thread(target=ckpt.close)
        t.start()
        closer.append(t)
        while not ckpt._closed:  # close() has begun: it settled nothing
            pass
        return fut

    monkeypatch.setattr(_overlap.Copier, "submit", close_meanwhile)
    train_step(m, opt)
    h = ckpt.save(2, state_of(m, opt), persist=False)
    closer[0].join(60)
    assert not closer[0].is_alive()
    with pytest.raises(acp.EngineClosed, match="closed during the save"):
        h.wait()
    again = make_ckpt()  # no BusyError: the ring was let go
    assert again.steps() == [1]
    assert again.snapshots() == [1] or 2 not in again.snapshots()


def test_an_interrupt_while_close_waits_still_closes_the_engine(
    make_ckpt: MakeCkpt, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt while ``close()`` waited for an overlapped copy
    left the engine open for good (a second close() returned at once): the
    save is dropped, the engine closed, and then the interrupt goes on."""

    m, opt = model()
    ckpt = make_ckpt(overlap=True)
    h, _ = pending_second_save(ckpt, m, opt)
    interrupt_the_next_wait(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        ckpt.close()
    assert ckpt._engine.closed
    with pytest.raises(acp.EngineClosed, match="close\\(\\) interrupted"):
        h.wait()
    again = make_ckpt()  # the ring was let go
    assert again.steps() == [1]
