"""The worker of ``goodput.py``: trains an MLP with AdamW until it is killed, checkpointing
as its mode says, and reports every step and checkpoint to the supervisor as JSON lines on a
pipe (``--fd``). Run by the supervisor, not by hand:

    python goodput_worker.py --kind acp --fd 5 --root DIR --job NAME --shm-dir DIR --every 1

On start it restores the newest checkpoint of its mode, if any; with ``--probe`` it restores,
reports and exits. With ``--world 2`` it is one rank of a data-parallel job (``--rank``, a gloo
group on ``127.0.0.1:--port``, ``ACP_NODE_ID=--node``): each rank computes the gradient of its
half of the batch and the ranks average them (one all-reduce per step), so every rank holds the
same state; each rank checkpoints its whole state as its own file (acp: ``replicas=--replicas``
peer copies on the other node; torch: ``rank-R-step-N.pt``, the newest two kept, restored at the
newest step every rank has).

Events: ``start``, ``imported`` (torch is imported), ``opened`` (model built, checkpointer
open), ``restored`` (step, checksum, seconds, source) or ``fresh``, then per step ``step``
(step, checksum) and the mode's checkpoint events: acp ``saved`` (the save returned: the step
is in the shared-memory ring), ``skipped``, ``committed`` and, with replicas, ``replicated``
(this rank's image of the step is in the other node's RAM); torch ``durable`` (renamed and the
directory fsynced); dcp ``staged`` (``async_save`` returned) and ``durable`` (its future
completed and the directory was renamed ``step-N``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any

STRIDE = 97
"""The checksum reads every STRIDE-th element of every tensor."""


@dataclass(frozen=True)
class Model:
    """The worker's model, data and threads (the same in every mode)."""

    d_in: int = 512
    hidden: int = 2048
    layers: int = 3
    classes: int = 16
    batch: int = 16
    threads: int = 1
    data_seed: int = 1234

    def flags(self) -> list[str]:
        return [f"--{k.replace('_', '-')}={v}" for k, v in asdict(self).items()]


QUICK_MODEL = Model(d_in=64, hidden=256, layers=2, batch=16)
"""The model of ``goodput.py --quick``."""

REALISTIC_MODEL = Model(d_in=512, hidden=4096, layers=6, batch=64)
"""The model of ``goodput.py --regime realistic``: about 86 M parameters, so about 1 GiB of
state with AdamW's two moments (0.96 GiB). A step is a second or two of compute on one thread,
most of it AdamW's update over the 86 M parameters (measured: 2.0 to 2.3 s per step with the
2-core machine under a load average of 6, about the same with a batch of 8; ``--threads`` and
``--batch`` tune it), so that checkpoint size and step time stand in the ratio large-model
training has."""


def _emit(fd: int, kind: str, **data: Any) -> None:
    """One event to the supervisor: a JSON line, written in one call (atomic under PIPE_BUF)."""
    os.write(fd, (json.dumps({"ev": kind, **data}) + "\n").encode())


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Trainer:
    """The model, AdamW and a data stream that is a function of the step alone, so a resumed
    run needs nothing but the step, the model and the optimizer."""

    def __init__(self, m: Model, rank: int = 0, world: int = 1) -> None:
        import torch
        from torch import nn

        # A fixed thread count makes these CPU kernels deterministic; the supervisor's
        # checksums verify it. (torch.use_deterministic_algorithms would import
        # torch._inductor: seconds added to every restart.)
        torch.set_num_threads(m.threads)
        torch.manual_seed(m.data_seed)
        self.m, self.rank, self.world = m, rank, world
        g = torch.Generator().manual_seed(m.data_seed)
        self.teacher = torch.randn(m.d_in, m.classes, generator=g)
        blocks: list[nn.Module] = []
        width = m.d_in
        for _ in range(m.layers):
            blocks += [nn.Linear(width, m.hidden), nn.GELU()]
            width = m.hidden
        blocks.append(nn.Linear(width, m.classes))
        self.model = nn.Sequential(*blocks)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.01)
        self.step = 0

    def train_step(self) -> None:
        import torch
        import torch.nn.functional as F

        self.step += 1
        g = torch.Generator().manual_seed(self.m.data_seed * 1_000_003 + self.step)
        x = torch.randn(self.m.batch, self.m.d_in, generator=g)
        y = (
            x @ self.teacher + 0.5 * torch.randn(self.m.batch, self.m.classes, generator=g)
        ).argmax(1)
        if self.world > 1:  # this rank's share of the batch
            x, y = x[self.rank :: self.world], y[self.rank :: self.world]
        loss = F.cross_entropy(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        if self.world > 1:
            self._average_grads()
        self.opt.step()

    def _average_grads(self) -> None:
        """Data parallel: the mean of the ranks' gradients, one all-reduce of a flat buffer.
        With two ranks each element is one sum of two values, the same on either rank and in
        every run (float addition commutes), so the ranks stay bit-identical."""
        import torch
        import torch.distributed as dist

        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def init_opt_state(self) -> None:
        """AdamW's state as its first step creates it (zeros), so a checkpoint loads in place."""
        import torch

        for group in self.opt.param_groups:
            for p in group["params"]:
                self.opt.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": self.step}

    def checksum(self) -> str:
        """A digest of every STRIDE-th element of every parameter and optimizer tensor."""
        h = hashlib.blake2b(digest_size=8)
        for p in self.model.parameters():
            h.update(p.detach().reshape(-1)[::STRIDE].numpy().tobytes())
            state = self.opt.state.get(p, {})
            for key in sorted(state):
                h.update(state[key].reshape(-1)[::STRIDE].numpy().tobytes())
        return h.hexdigest()

    def state_bytes(self) -> int:
        n = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return 3 * n  # parameters, exp_avg, exp_avg_sq


class AcpStore:
    """``ckpt.save`` every ``every`` steps; restore: ``ckpt.load``, RAM first."""

    def __init__(self, a: argparse.Namespace, tr: Trainer, fd: int) -> None:
        import acp

        self.acp, self.tr, self.fd, self.every = acp, tr, fd, a.every
        slot = tr.state_bytes() + (4 << 20)
        # "all" is explicit: the Checkpointer's own default coalesces.
        policy: dict[str, Any] = {"persist_every": 1} if a.acp_persist == "all" else {}
        if a.acp_persist == "coalesce":
            policy["persist_policy"] = "coalesce"
        elif a.acp_persist.startswith("every:"):
            policy["persist_every"] = int(a.acp_persist[6:])
        # Snapshots that stay in RAM keep cycling through the ring while a
        # persist is in flight only with a third slot.
        slots = 2 if a.acp_persist == "all" else 3
        self.replicas = a.world > 1 and a.replicas > 0
        if self.replicas:
            # And the protected snapshot and the one being replicated stay.
            slots = 4
        if a.world > 1:
            policy["replicas"] = a.replicas
        self.ckpt = acp.Checkpointer(
            a.root,
            job=a.job,
            shm_dir=a.shm_dir,
            ring_slots=slots,
            ring_bytes=slots * slot,
            keep_last=2,
            on_full=a.acp_on_full,
            **policy,
        )
        # With overlapped saves (ACP_OVERLAP=1 in the environment), each
        # optimizer step first waits for the previous save's copy; without,
        # the hook finds nothing pending.
        self.ckpt.staged_before(tr.opt)
        self.pending: list[Any] = []
        self.replicating: list[Any] = []
        # An overlapped save whose copy may still run, and its stall: it is
        # reported saved only once sealed (by the hook, before the next
        # optimizer step): a kill before that loses it.
        self.sealing: tuple[Any, float] | None = None

    def restore(self) -> dict[str, Any] | None:
        opened = self.ckpt.stats()["engine"]
        self.tr.init_opt_state()
        template = self.tr.state()
        try:
            # With several ranks the load is collective: every rank gets the same step, from
            # its own RAM, a peer's replica (``replicas``) or storage.
            stats = self.ckpt.load(into=template)
        except self.acp.CheckpointNotFound:
            self.tr.opt.state.clear()  # a fresh run starts with AdamW's lazy state
            return None
        self.tr.opt.load_state_dict(template["optim"])
        self.tr.step = template["step"]
        return {
            "source": stats.source,
            "verified": stats.verified,
            "resident_at_open": opened["resident_steps"],
            "persisted_on_open": opened["persisting_steps"],
        }

    def _saved(self, h: Any, stall: float) -> None:
        """Reports a save whose image is in the ring (sealed), or its error."""
        if h.stats.error is not None:
            _emit(self.fd, "error", step=h.step, error=h.stats.error)
            return
        _emit(self.fd, "saved", step=h.step, stall=stall)
        self.pending.append(h)
        if self.replicas:
            self.replicating.append(h)

    def after_step(self) -> None:
        step = self.tr.step
        if self.sealing is not None:  # the optimizer's hook sealed it (or dropped it)
            self.ckpt.staged()
            self._saved(*self.sealing)
            self.sealing = None
        if step % self.every == 0:
            t0 = time.perf_counter()
            h = self.ckpt.save(step, self.tr.state())
            stall = time.perf_counter() - t0
            if h.skipped:
                _emit(self.fd, "skipped", step=step, stall=stall)
            elif h.staged:
                self._saved(h, stall)
            else:
                self.sealing = (h, stall)
        waiting = []
        for h in self.replicating:
            try:
                h.wait_replicated(0)
            except TimeoutError:
                waiting.append(h)
            except Exception as e:  # a failed replication is reported
                _emit(self.fd, "error", step=h.step, error=f"replication: {e}")
            else:
                _emit(self.fd, "replicated", step=h.step)
        self.replicating = waiting
        still = []
        for h in self.pending:
            if not h.done():
                still.append(h)
                continue
            try:
                if h.wait().persisted:
                    _emit(self.fd, "committed", step=h.step)
            except self.acp.AcpError as e:
                _emit(self.fd, "error", step=h.step, error=str(e))
        self.pending = still

    def close(self) -> None:
        self.ckpt.close()


class TorchStore:
    """``torch.save`` every ``every`` steps: temp file, fsync, rename, fsync of the directory.
    One rank: ``state.pt``. Several: each rank its own ``rank-R-step-N.pt``, the newest two
    kept (a kill may land between two ranks' renames), restored at the newest step every
    rank has (an all-reduce of the ranks' newest steps, MIN)."""

    def __init__(self, a: argparse.Namespace, tr: Trainer, fd: int) -> None:
        self.tr, self.fd, self.every = tr, fd, a.every
        self.root = a.root
        os.makedirs(self.root, exist_ok=True)
        self.path = os.path.join(self.root, "state.pt")
        for name in os.listdir(self.root):
            if name.endswith(".tmp") and name.startswith(self._prefix()):
                os.unlink(os.path.join(self.root, name))  # a save the kill interrupted

    def _prefix(self) -> str:
        return f"rank-{self.tr.rank}-step-" if self.tr.world > 1 else "state.pt"

    def _file(self, step: int) -> str:
        if self.tr.world == 1:
            return self.path
        return os.path.join(self.root, f"{self._prefix()}{step}.pt")

    def _steps(self) -> list[int]:
        """This rank's complete files' steps (several ranks), oldest first."""
        p = self._prefix()
        names = [n[len(p) : -3] for n in os.listdir(self.root) if n.startswith(p)]
        return sorted(int(n) for n in names if n.isdigit())

    def restore(self) -> dict[str, Any] | None:
        import torch

        if self.tr.world > 1:
            import torch.distributed as dist

            newest = torch.tensor([max(self._steps(), default=0)])
            dist.all_reduce(newest, op=dist.ReduceOp.MIN)
            step = int(newest.item())
            if step == 0:
                return None
            path = self._file(step)
        elif not os.path.exists(self.path):
            return None
        else:
            path = self.path
        sd = torch.load(path, weights_only=True)
        self.tr.model.load_state_dict(sd["model"])
        self.tr.opt.load_state_dict(sd["optim"])
        self.tr.step = int(sd["step"])
        return {"source": "file"}

    def after_step(self) -> None:
        import torch

        if self.tr.step % self.every:
            return
        t0 = time.perf_counter()
        path = self._file(self.tr.step)
        tmp = path + ".tmp"
        torch.save(self.tr.state(), tmp)
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(self.root)
        _emit(self.fd, "durable", step=self.tr.step, stall=time.perf_counter() - t0)
        if self.tr.world > 1:
            for old in self._steps()[:-2]:
                os.unlink(self._file(old))

    def close(self) -> None:
        pass


class DcpStore:
    """``dcp.async_save`` every ``every`` steps into ``tmp-N``, renamed ``step-N`` once complete;
    at most one save in flight (the next one waits). The newest two complete ones are kept."""

    def __init__(self, a: argparse.Namespace, tr: Trainer, fd: int) -> None:
        import torch.distributed.checkpoint as dcp

        self.dcp, self.tr, self.fd, self.every = dcp, tr, fd, a.every
        self.root = a.root
        os.makedirs(self.root, exist_ok=True)
        for name in os.listdir(self.root):
            if name.startswith("tmp-"):  # a save the kill interrupted
                shutil.rmtree(os.path.join(self.root, name))
        self.inflight: tuple[int, Any] | None = None

    def complete(self) -> list[int]:
        names = os.listdir(self.root)
        return sorted(int(n[5:]) for n in names if n.startswith("step-") and n[5:].isdigit())

    def restore(self) -> dict[str, Any] | None:
        done = self.complete()
        if not done:
            return None
        self.tr.init_opt_state()
        state = self.tr.state()
        self.dcp.load(state, checkpoint_id=self._dir("step", done[-1]), no_dist=True)
        self.tr.opt.load_state_dict(state["optim"])
        self.tr.step = int(state["step"])
        return {"source": "dir", "dir_step": done[-1]}

    def _dir(self, kind: str, step: int) -> str:
        return os.path.join(self.root, f"{kind}-{step}")

    def _finish(self) -> None:
        """Publishes the save in flight, which has completed."""
        assert self.inflight is not None
        step, fut = self.inflight
        self.inflight = None
        fut.result()
        os.replace(self._dir("tmp", step), self._dir("step", step))
        _fsync(self.root)
        _emit(self.fd, "durable", step=step)
        for old in self.complete()[:-2]:
            shutil.rmtree(self._dir("step", old))

    def after_step(self) -> None:
        if self.inflight is not None and self.inflight[1].done():
            self._finish()
        if self.tr.step % self.every:
            return
        t0 = time.perf_counter()
        if self.inflight is not None:
            self.inflight[1].result()
            self._finish()
        fut = self.dcp.async_save(
            self.tr.state(), checkpoint_id=self._dir("tmp", self.tr.step), no_dist=True
        )
        self.inflight = (self.tr.step, fut)
        _emit(self.fd, "staged", step=self.tr.step, stall=time.perf_counter() - t0)

    def close(self) -> None:
        if self.inflight is not None:
            self._finish()


class NoStore:
    """The bare loop."""

    def __init__(self, a: argparse.Namespace, tr: Trainer, fd: int) -> None:
        pass

    def restore(self) -> dict[str, Any] | None:
        return None

    def after_step(self) -> None:
        pass

    def close(self) -> None:
        pass


STORES = {"acp": AcpStore, "torch": TorchStore, "dcp": DcpStore, "bare": NoStore}


def worker(a: argparse.Namespace) -> int:
    """Trains until killed (or, with ``--probe``, restores, reports and exits)."""
    fd = a.fd
    _emit(fd, "start", pid=os.getpid())
    warnings.filterwarnings("ignore")  # DCP warns on every no_dist call
    import torch

    _emit(fd, "imported", torch=torch.__version__)
    if a.world > 1:
        import datetime

        import torch.distributed as dist

        os.environ["ACP_NODE_ID"] = a.node
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{a.port}",
            rank=a.rank,
            world_size=a.world,
            timeout=datetime.timedelta(seconds=120),
        )
    t0 = time.perf_counter()
    tr = Trainer(Model(**{k: getattr(a, k) for k in asdict(Model())}), a.rank, a.world)
    t1 = time.perf_counter()
    store = STORES[a.kind](a, tr, fd)
    _emit(fd, "opened", build_secs=t1 - t0, open_secs=time.perf_counter() - t1)
    t0 = time.perf_counter()
    info = store.restore()
    secs = time.perf_counter() - t0
    if info is None:
        _emit(fd, "fresh", state_bytes=tr.state_bytes())
    else:
        _emit(fd, "restored", step=tr.step, ck=tr.checksum(), secs=secs, **info)
    if a.probe:
        store.close()
        return 0
    while True:
        tr.train_step()
        _emit(fd, "step", step=tr.step, ck=tr.checksum())
        store.after_step()


KINDS = ["acp", "bare", "dcp", "torch"]
"""The modes a worker runs (``bare``: no checkpoints)."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--kind", choices=KINDS, required=True)
    ap.add_argument("--fd", type=int, required=True, help="the event pipe's write end")
    ap.add_argument("--every", type=int, default=1, help="checkpoint every N steps")
    ap.add_argument("--root", required=True, help="checkpoint directory")
    ap.add_argument("--job", help="acp's job name (names its shared-memory slots)")
    ap.add_argument("--shm-dir", help="acp's shared-memory directory")
    ap.add_argument("--acp-on-full", choices=["wait", "skip"], default="wait")
    ap.add_argument("--acp-persist", default="all", help="all, coalesce or every:N")
    ap.add_argument("--probe", action="store_true", help="restore, report and exit")
    ap.add_argument("--world", type=int, default=1, help="ranks of the job (1 or 2)")
    ap.add_argument("--rank", type=int, default=0, help="this process's rank")
    ap.add_argument("--port", type=int, default=0, help="the gloo group's port (--world 2)")
    ap.add_argument("--node", default="a", help="ACP_NODE_ID of this rank (--world 2)")
    ap.add_argument("--replicas", type=int, default=0, help="acp's peer replicas (--world 2)")
    for name, value in asdict(Model()).items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return worker(parse(argv))


if __name__ == "__main__":
    sys.exit(main())
