"""A small MindSpore training run for the subprocess tests of
``test_mindspore.py`` (run as a script; not collected by pytest).

    python ms_train.py MODE ROOT SHM JOB OUT [AT]

MODE:
  reference  train EPOCHS epochs without checkpoints; OUT gets the final parameters
  sigkill    train with AcpCheckpoint(every_n_steps=BATCHES); SIGKILL itself after global step AT
  resume     resume from ROOT (RAM first) and finish the EPOCHS epochs; OUT gets the
             final parameters, the resume point and the load source
  raise      train with the callback; raise inside training after global step AT;
             once the exception leaves Model.train, OUT gets the parameters as the
             newest save holds them and the process ends with os._exit(3)
  sigterm    as raise, but the process sends itself SIGTERM after global step AT
ACP_TEST_NO_EXCEPTION_SAVE=1 turns the callback's exception_save off.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import nn
from mindspore.dataset import NumpySlicesDataset
from mindspore.train import Callback, Model

import acp
import acp.mindspore as am

EPOCHS = 4
BATCHES = 4  # batches per epoch
BATCH = 8


class Net(nn.Cell):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Dense(8, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Dense(16, 4)

    def construct(self, x: Any) -> Any:
        return self.fc2(self.act(self.fc1(x)))


def dataset() -> Any:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCHES * BATCH, 8)).astype(np.float32)
    y = rng.standard_normal((BATCHES * BATCH, 4)).astype(np.float32)
    return NumpySlicesDataset((x, y), column_names=["x", "y"], shuffle=False).batch(BATCH)


def build() -> tuple[Net, Any, Model]:
    ms.set_seed(1)
    net = Net()
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
    return net, opt, Model(net, nn.MSELoss(), opt)


def params(*cells: Any) -> dict[str, np.ndarray[Any, Any]]:
    return {k: p.asnumpy().copy() for k, p in am.param_dict(*cells).items()}


class At(Callback):  # type: ignore[misc]
    """Runs ``action`` once the global step reaches ``at`` (after the
    callbacks before it, the AcpCheckpoint among them, handled the step)."""

    def __init__(self, at: int, action: Any) -> None:
        super().__init__()
        self.at = at
        self.action = action

    def on_train_step_end(self, run_context: Any) -> None:
        cb = run_context.original_args()
        if (cb.cur_epoch_num - 1) * cb.batch_num + (cb.cur_step_num - 1) % cb.batch_num + 1 == (
            self.at
        ):
            self.action()


def main() -> None:
    logging.basicConfig(level=logging.WARNING)  # the callback says what it persisted
    mode, root, shm, job, out = sys.argv[1:6]
    at = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    ms.set_device("CPU")
    net, opt, model = build()
    if mode == "reference":
        model.train(EPOCHS, dataset())
        np.savez(out, **params(net, opt))
        return
    # Every save persisted: the tests check which steps are committed.
    ckpt = acp.Checkpointer(
        root, job=job, shm_dir=shm, ring_bytes=8 << 20, mlock=False, persist_every=1
    )
    exception_save = os.environ.get("ACP_TEST_NO_EXCEPTION_SAVE") != "1"
    cb = am.AcpCheckpoint(ckpt, every_n_steps=BATCHES, keep=2, exception_save=exception_save)
    if mode == "resume":
        r = am.resume(ckpt, net, opt)
        assert r is not None
        assert ckpt.last_load is not None
        model.train(EPOCHS, dataset(), callbacks=[cb], initial_epoch=r.initial_epoch)
        info = {"step": r.step, "initial_epoch": r.initial_epoch, "source": ckpt.last_load.source}
        np.savez(out, info=np.array(json.dumps(info)), **params(net, opt))
        ckpt.close()
        return
    snapshot: dict[str, Any] = {}

    class Snap(Callback):  # type: ignore[misc]
        """Keeps the parameters as the newest save holds them."""

        def on_train_step_end(self, run_context: Any) -> None:
            if cb.last_saved is not None and cb.last_saved == cb._step:
                snapshot.clear()
                snapshot.update(params(net, opt), step=np.array(cb.last_saved))

    def stop() -> None:
        if mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        raise RuntimeError("boom inside training")

    try:
        model.train(EPOCHS, dataset(), callbacks=[cb, Snap(), At(at, stop)])
    except RuntimeError:
        np.savez(out, **snapshot)
        os._exit(3)  # no cleanup: what is committed was committed by the callback
    os._exit(4)


if __name__ == "__main__":
    main()
