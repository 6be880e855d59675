"""A small trainer for the fault tests, run as a child process:
``python _trainer.py MODE ROOT SHM JOB``. Each mode sets up one fault
(SIGTERM at a chosen moment, an exception, a dead or hung disk, SIGKILL)
and prints ``READY`` when the parent may act. Uses NumPy (fast to import)."""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import acp
import acp.checkpointer
from acp import _acp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.torture._torture import state


def ready() -> None:
    print("READY", flush=True)


def train_forever() -> None:
    """The training loop the signal interrupts."""
    x = np.zeros(1000)
    while True:
        x += 1.0
        time.sleep(0.001)


def main() -> None:
    mode, root, shm, job = sys.argv[1:5]
    faults = _acp.FaultInjector()
    kwargs: dict[str, Any] = {
        "job": job,
        "shm_dir": shm,
        "ring_bytes": 256 << 20,
        "mlock": False,
        "faults": faults,
        "stall_timeout": float(os.environ.get("STALL_TIMEOUT", "300")),
    }
    ckpt = acp.Checkpointer(root, **kwargs)

    if mode == "sigterm-idle":
        # SIGTERM while training, step 2 still flushing (slowed by 1 s).
        ckpt.install_sigterm_handler()
        ckpt.save(1, state(1)).wait()
        faults.arm_stall(1, 1.0)
        ckpt.save(2, state(2))
        ready()
        train_forever()

    elif mode == "sigterm-guard":
        # The same inside guard(sigterm=True): the block unwinds first.
        with ckpt.guard(sigterm=True):
            ckpt.save(1, state(1)).wait()
            faults.arm_stall(1, 1.0)
            ckpt.save(2, state(2))
            ready()
            train_forever()

    elif mode in ("sigterm-after-copy", "sigterm-during-copy"):
        # SIGTERM while step 2 is being staged: it must be aborted, step 1
        # is what persists.
        ckpt.install_sigterm_handler()
        big = {"a": np.ones(8 << 20, dtype=np.uint8), "b": np.ones(8 << 20, np.uint8), "step": 1}
        ckpt.save(1, big).wait()
        real = acp.checkpointer.run_transfers

        def run_transfers(copy: Any, transfers: Any) -> None:
            def copy_then_term(items: Any) -> None:
                if mode == "sigterm-after-copy":
                    copy(items)
                    # Delivered now, handled at the next bytecode: right
                    # after the copy in Rust returned, before finish().
                    signal.raise_signal(signal.SIGTERM)
                    return
                # Half the tensors are copied, then another thread sends
                # SIGTERM while this one is blocked in native code with the
                # GIL released, as in the engine's copy, until the signal
                # has been delivered: Python's C-level handler writes to
                # the wakeup fd on delivery, whichever thread takes it. The
                # Python handler runs there (EINTR) or as soon as select()
                # returns: mid-copy, before the rest is copied or finish().
                assert len(items) == 2, items
                copy(items[:1])
                print("HALF_COPIED", flush=True)
                r, w = os.pipe()
                os.set_blocking(w, False)
                signal.set_wakeup_fd(w, warn_on_full_buffer=False)
                sender = threading.Thread(
                    target=os.kill, args=(os.getpid(), signal.SIGTERM), daemon=True
                )
                sender.start()
                select.select([r], [], [])
                print("COPY_RESUMED", flush=True)  # never: the handler raised
                copy(items[1:])

            real(copy_then_term, transfers)

        acp.checkpointer.run_transfers = run_transfers  # type: ignore[assignment]
        big["step"] = 2
        ckpt.save(2, big)
        print("SAVE_RETURNED", flush=True)
        train_forever()

    elif mode == "sigterm-loop":
        # Saves in a loop (no waits: staging and flushing overlap) until
        # SIGTERM; says which steps finished staging.
        ckpt.install_sigterm_handler()
        step = (ckpt.latest() or 0) + 1
        rng = np.random.default_rng(int(os.environ.get("SEED", "0")))
        while True:
            ckpt.save(step, state(step))
            print(f"STAGED {step}", flush=True)
            step += 1
            time.sleep(float(rng.uniform(0, 0.02)))

    elif mode == "sigterm-chain":
        marker = Path(root).parent / "previous-handler-ran"

        def previous(signum: int, frame: object) -> None:
            marker.write_text(str(signum))

        signal.signal(signal.SIGTERM, previous)
        ckpt.install_sigterm_handler()
        ckpt.save(1, state(1)).wait()
        ready()
        train_forever()

    elif mode == "sigterm-twice":
        # The scheduler sends SIGTERM again while the process exits: here
        # at exit, once the dying checkpoint is done.
        def again(signum: int, frame: object) -> None:
            import atexit

            def kill_again() -> None:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.5)  # handled meanwhile, between bytecodes

            atexit.register(kill_again)

        signal.signal(signal.SIGTERM, again)
        ckpt.install_sigterm_handler()
        ckpt.save(1, state(1)).wait()
        ckpt.save(2, state(2), persist=False)
        ready()
        train_forever()

    elif mode == "sigterm-twice-guard":
        # The same inside guard(sigterm=True), whose handler the exit
        # unwinds through.
        def kill_again_at_exit() -> None:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)

        import atexit

        atexit.register(kill_again_at_exit)
        with ckpt.guard(sigterm=True):
            ckpt.save(1, state(1)).wait()
            ckpt.save(2, state(2), persist=False)
            ready()
            train_forever()

    elif mode == "sigterm-dead-disk":
        ckpt.install_sigterm_handler()
        ckpt.save(1, state(1)).wait()
        faults.arm(0, 5, True)  # every later operation fails: EIO
        ckpt.save(2, state(2))
        ready()
        train_forever()

    elif mode == "sigterm-hung-disk":
        ckpt.install_sigterm_handler()
        ckpt.save(1, state(1)).wait()
        faults.arm_stall(1, 600.0)  # the first chunk write never returns
        ckpt.save(2, state(2))
        ready()
        train_forever()

    elif mode == "exception":
        with ckpt.guard():
            ckpt.save(1, state(1)).wait()
            faults.arm_stall(1, 1.0)
            ckpt.save(2, state(2))
            raise RuntimeError("boom in training")

    elif mode == "exception-in-save":
        with ckpt.guard():
            ckpt.save(1, state(1)).wait()
            real_fill = acp.checkpointer._fill

            def fill_then_fail(staging: Any, tensors: Any) -> None:
                real_fill(staging, tensors)  # fully copied, never finished
                raise ValueError("boom inside save")

            acp.checkpointer._fill = fill_then_fail
            ckpt.save(2, state(2))

    elif mode == "exception-dead-disk":
        with ckpt.guard():
            ckpt.save(1, state(1)).wait()
            faults.arm(0, 5, True)
            ckpt.save(2, state(2))
            raise RuntimeError("boom in training")

    elif mode in ("sigterm-ram-only", "kill-ram-only"):
        # Step 1 persisted, steps 2 and 3 RAM snapshots only: the dying
        # checkpoint (SIGTERM) or the restart (SIGKILL) commits step 3.
        if mode == "sigterm-ram-only":
            ckpt.install_sigterm_handler()
        ckpt.save(1, state(1)).wait()
        for s in (2, 3):
            stats = ckpt.save(s, state(s), persist=False).wait()
            assert stats.outcome == "resident", stats
        assert ckpt.steps() == [1], ckpt.steps()
        if mode == "kill-ram-only":
            os.kill(os.getpid(), signal.SIGKILL)
        ready()
        train_forever()

    elif mode == "oom-kill":
        # Staging of step 2 finished, its flush is held back: SIGKILL.
        ckpt.save(1, state(1)).wait()
        faults.arm_stall(0, 600.0)
        ckpt.save(2, state(2))
        os.kill(os.getpid(), signal.SIGKILL)

    elif mode == "exit-hung-close":
        # A hung disk at exit: close() (the with block) gives up after the
        # watchdog's stall timeout instead of hanging.
        with ckpt:
            ckpt.save(1, state(1)).wait()
            faults.arm_stall(1, 600.0)
            ckpt.save(2, state(2))
        print("NOT REACHED", flush=True)

    elif mode == "exit-hung-no-close":
        # A hung disk and no close(): the interpreter still exits.
        ckpt.save(1, state(1)).wait()
        faults.arm_stall(1, 600.0)
        ckpt.save(2, state(2))
        print("EXITING", flush=True)
        sys.exit(0)

    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
