"""The GIL is released for the engine's work: another Python thread runs
while a copy, a load or a wait is in progress.

The check is deterministic rather than timed: with a huge switch interval,
the main thread gets the GIL back from the worker only when the worker
releases it. If the call under test holds the GIL, the main thread runs only
after the call returned and sees ``finished`` set; if it releases it, the
main thread runs during the call and sees it unset.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import acp

SIZE = 64 << 20  # long enough for the main thread to wake up during the copy


@pytest.fixture
def no_preemption() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    yield
    sys.setswitchinterval(old)


def ran_during(call: Callable[[], Any]) -> bool:
    """Whether the main thread ran Python code while ``call`` ran in a thread."""
    started = threading.Event()
    finished = threading.Event()
    errors: list[BaseException] = []

    def work() -> None:
        started.set()
        try:
            call()
        except BaseException as e:  # reported below
            errors.append(e)
        finished.set()

    t = threading.Thread(target=work)
    t.start()
    started.wait()
    during = not finished.is_set()
    t.join()
    if errors:
        raise errors[0]
    return during


@pytest.mark.usefixtures("no_preemption")
def test_copy_from_releases_the_gil(make_ckpt: Any) -> None:
    ckpt = make_ckpt(ring_bytes=4 * SIZE)
    src = torch.ones(SIZE, dtype=torch.uint8)
    staging = ckpt._engine.begin_save(1, [("w", "U8", (SIZE,))], '{"acp.codec":1,"state":null}')
    assert staging is not None
    assert ran_during(lambda: staging.copy_from([(0, src.data_ptr(), SIZE)]))
    h = staging.finish()
    assert ran_during(h.wait)


@pytest.mark.usefixtures("no_preemption")
def test_load_and_copy_into_release_the_gil(make_ckpt: Any) -> None:
    ckpt = make_ckpt(ring_bytes=4 * SIZE)
    ckpt.save(1, {"w": torch.ones(SIZE, dtype=torch.uint8)}).wait()
    loaded: list[Any] = []
    assert ran_during(lambda: loaded.append(ckpt._engine.load(1, storage_only=True)))
    dst = torch.zeros(SIZE, dtype=torch.uint8)
    assert ran_during(lambda: loaded[0].copy_into([(0, dst.data_ptr(), SIZE)]))
    assert bool(dst.all())


@pytest.mark.usefixtures("no_preemption")
def test_a_save_waiting_for_a_slot_does_not_block_python(make_ckpt: Any) -> None:
    """A save that waits for a free slot holds no GIL: the slot is freed
    here, by Python code, while it waits (with the GIL held it would time
    out instead)."""
    ckpt: acp.Checkpointer = make_ckpt(ring_slots=1, full_timeout=60.0)
    ckpt.save(1, {"w": torch.ones(4)}).wait()
    held = [ckpt._engine.load(1)]  # pins the only slot
    entered = threading.Event()
    result: list[Any] = []

    def save() -> None:
        entered.set()
        try:
            result.append(ckpt.save(2, {"w": torch.ones(4)}).wait())
        except BaseException as e:  # reported below
            result.append(e)

    t = threading.Thread(target=save)
    t.start()
    entered.wait()
    held.clear()  # frees the slot, from this thread, while the save waits
    t.join(timeout=120)
    assert not t.is_alive()
    assert isinstance(result[0], acp.SaveStats), result
    assert ckpt.steps() == [1, 2]
