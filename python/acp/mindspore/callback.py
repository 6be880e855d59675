"""``AcpCheckpoint``: the ``Model.train`` callback that saves through acp."""

from __future__ import annotations

import logging
import operator
import os
import signal
import threading
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

from mindspore.train import Callback

from acp._acp import AcpError, ConfigError
from acp._mindspore_codec import type_name
from acp.checkpointer import Checkpointer, SaveHandle, internals
from acp.guard import ChainedSigterm
from acp.mindspore.params import state_dict

__all__ = ["AcpCheckpoint"]

log = logging.getLogger("acp.mindspore")


def _positive(option: str, value: object, *, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"config `{option}`: {value!r} is not a positive integer")
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"config `{option}`: {value!r} is not a positive integer") from None
    if n <= 0:
        raise ConfigError(f"config `{option}`: {n} is not a positive integer (it must be >= 1)")
    return int(n)


class AcpCheckpoint(Callback):  # type: ignore[misc]
    """A ``Model.train`` callback that saves through acp, in the spirit of
    ``ModelCheckpoint(config=CheckpointConfig(async_save=True,
    exception_save=True, keep_checkpoint_max=keep))``::

        ckpt = acp.Checkpointer("/mnt/ckpt/run1")
        cb = acp.mindspore.AcpCheckpoint(ckpt, every_n_steps=100, keep=3)
        r = acp.mindspore.resume(ckpt, model.train_network)
        model.train(epochs, data, callbacks=[cb], initial_epoch=r.initial_epoch if r else 0)

    - Every ``every_n_steps`` global steps it saves the train network's
      parameters (the network's and the optimizer's: moments, global step,
      learning rate, loss scale) with the epoch, the global step and the
      position in the epoch. Training waits only for the copy into the
      ring; the engine writes and commits in the background.
    - With ``keep``, only the newest ``keep`` committed steps stay on
      storage (the checkpointer's own ``keep_last`` works too).
    - When training ends, it saves the last step (``save_at_end``) and waits
      until everything is committed.
    - With ``exception_save``, when training raises, the newest complete
      resident checkpoint is flushed and committed before the exception
      leaves ``Model.train``; when the process receives SIGTERM (``sigterm``;
      main thread only), the same happens before the signal's previous
      handler runs (by default, the process then dies of SIGTERM).

    The global step is ``(epoch - 1) * batch_num + step in epoch``, which
    stays right when ``Model.train`` is resumed with ``initial_epoch``;
    ``initial_step`` overrides it (global step = ``initial_step`` + steps of
    this ``Model.train`` call).

    ``network`` saves another cell than the train network; ``extra``
    returns more plain values (e.g. RNG seeds) to store with each save.
    """

    def __init__(
        self,
        ckpt: Checkpointer,
        every_n_steps: int,
        *,
        keep: int | None = None,
        exception_save: bool = True,
        sigterm: bool = True,
        save_at_end: bool = True,
        overwrite: bool = False,
        network: Any = None,
        extra: Callable[[], Mapping[str, Any]] | None = None,
        initial_step: int | None = None,
        persist_timeout: float | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(ckpt, Checkpointer):
            raise ConfigError(f"config `ckpt`: expected an acp.Checkpointer, got {type_name(ckpt)}")
        self.ckpt = ckpt
        self.every_n_steps: int = _positive("every_n_steps", every_n_steps) or 0
        self.keep = _positive("keep", keep, allow_none=True)
        if initial_step is not None and (isinstance(initial_step, bool) or initial_step < 0):
            raise ConfigError(f"config `initial_step`: {initial_step!r} is not a step (>= 0)")
        self.initial_step = initial_step
        self.exception_save = bool(exception_save)
        self.sigterm = bool(sigterm)
        self.save_at_end = bool(save_at_end)
        self.overwrite = bool(overwrite)
        self.network = network
        self.extra = extra
        self.persist_timeout = persist_timeout
        self.last_saved: int | None = None
        """The newest step this callback saved."""
        self.handles: list[SaveHandle] = []
        """Saves not yet seen committed."""
        self.persisted: str | None = None
        """Why the exception path ran (``"exception"``, ``"SIGTERM"``), once it did."""
        self._step = 0
        self._sigterm: _Sigterm | None = None

    # --- the callback protocol ---------------------------------------------

    def on_train_begin(self, run_context: Any) -> None:
        if self.sigterm:
            self._install()

    def on_train_step_end(self, run_context: Any) -> None:
        cb = run_context.original_args()
        self._step = self._global_step(cb)
        self._collect()
        if self._step % self.every_n_steps == 0:
            self._save(cb)

    def on_train_end(self, run_context: Any) -> None:
        cb = run_context.original_args()
        if self.save_at_end and self._step > 0 and self.last_saved != self._step:
            self._save(cb)
        self.ckpt.wait(self.persist_timeout)
        for h in self.handles:
            h.wait(0)  # raises a failed save's error
        self.handles.clear()
        self._retain(force=True)

    def __exit__(self, *exc: object) -> None:
        try:
            if exc and exc[0] is not None and self.exception_save and self.persisted is None:
                self._persist("exception")
        finally:
            self._uninstall()

    # --- internals ---------------------------------------------------------

    def _global_step(self, cb: Any) -> int:
        if self.initial_step is not None:
            return self.initial_step + int(cb.cur_step_num)
        batch = int(cb.batch_num)
        return (int(cb.cur_epoch_num) - 1) * batch + (int(cb.cur_step_num) - 1) % batch + 1

    def _save(self, cb: Any) -> None:
        inner = internals(self.ckpt)
        resumed = inner.resumed_step
        if resumed is not None and self._step <= resumed:
            # Model.train resumed a mid-epoch step at the start of its epoch
            # (``initial_epoch``) and replays the steps up to it: they are
            # saved already (step `resumed` is what this run restored), and
            # saving one again failed the run with CheckpointExists.
            log.info(
                "acp: step %d replayed after the resume of step %d: not saved again",
                self._step,
                resumed,
            )
            return
        inner.resumed_step = None
        network = self.network if self.network is not None else cb.train_network
        batch = int(cb.batch_num)
        values: dict[str, Any] = {
            "epoch": int(cb.cur_epoch_num),
            "step": self._step,
            "step_in_epoch": (int(cb.cur_step_num) - 1) % batch + 1,
            "batch_num": batch,
        }
        manager = getattr(cb, "loss_scale_mananger", None)  # sic, MindSpore's spelling
        if manager is not None:
            values["loss_scale"] = float(manager.get_loss_scale())
        if self.extra is not None:
            values.update(self.extra())
        state = state_dict(network, **values)
        handle = self.ckpt.save(self._step, state, overwrite=self.overwrite)
        self.last_saved = self._step
        self.handles.append(handle)

    def _collect(self) -> None:
        """Forgets committed saves; applies retention when one committed."""
        done = [h for h in self.handles if h.done()]
        if not done:
            return
        self.handles = [h for h in self.handles if not h.done()]
        for h in done:
            stats = h.stats
            if stats.error is not None:
                log.error("acp: saving step %d failed: %s", h.step, stats.error)
        self._retain(force=False)

    def _retain(self, *, force: bool) -> None:
        if self.keep is not None and (force or not self.handles):
            self.ckpt.retain(self.keep)

    def _persist(self, why: str) -> None:
        """Flushes and commits every complete resident save; never raises
        (it runs while another exception or a signal is on its way)."""
        self.persisted = why
        if self.ckpt.closed:
            return
        try:
            self.ckpt.wait(self.persist_timeout)
            log.warning(
                "acp: %s during training: checkpoints up to step %s are committed",
                why,
                self.ckpt.latest(),
            )
        except AcpError as e:
            log.error(
                "acp: %s during training: persisting the newest checkpoint failed: %s", why, e
            )

    def _install(self) -> None:
        if self._sigterm is not None or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_IGN or previous is None:
            return  # ignored, or a handler Python cannot restore
        self._sigterm = _Sigterm(self)

    def _uninstall(self) -> None:
        handler, self._sigterm = self._sigterm, None
        if handler is not None:
            handler.restore()

    def __repr__(self) -> str:
        return (
            f"AcpCheckpoint({self.ckpt!r}, every_n_steps={self.every_n_steps}, keep={self.keep}, "
            f"last_saved={self.last_saved})"
        )


class _Sigterm(ChainedSigterm):
    """``AcpCheckpoint``'s SIGTERM handler: persists (with
    ``exception_save``), puts the previous handler back and hands it the
    signal; by default (``SIG_DFL``) the process then dies of SIGTERM, as it
    would without acp."""

    def __init__(self, callback: AcpCheckpoint) -> None:
        self._callback = callback
        super().__init__()

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        callback = self._callback
        if callback.exception_save:
            callback._persist("SIGTERM")
        callback._uninstall()
        if not self.call_previous(signum, frame):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
