"""The acp demonstration: train, SIGKILL, resume from RAM, check bit for bit.

Run it with ``python -m acp.demo`` (``make demo`` builds acp first). On the
CPU it:

1. trains a small MLP (about 5.5 M parameters; with Adam's state, 66 MB of
   checkpoint) for ``--steps`` steps without checkpoints: the *reference*
   run, which also times ``torch.save`` of the same state after every step;
2. trains it again in a child process with ``ckpt.save`` after every step,
   and SIGKILLs that child from here halfway through, right after a save
   returned, while its flush is in flight;
3. restarts the training, which restores the newest checkpoint from RAM
   (the shared-memory slot outlived the killed process) and trains to the
   end;
4. checks that every step's loss, before and after the kill, has the same
   float32 bits as the reference run's, and exits 1 if any differs (without
   the figures of step 5: a run that did not resume exactly times nothing);
5. times restores: acp from RAM, then acp from storage and ``torch.load``
   taking turns, each after the same cache drop (cold page cache when
   ``/proc/sys/vm/drop_caches`` can be written, else both warm).

Training is deterministic: fixed seeds, a fixed thread count, the data order
a function of the epoch, and the RNG states and data position saved in the
checkpoint. ``--perturb`` nudges one weight by 0.001 after the restore, to
show that the check fails when the resumed state is not exactly the saved one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

_TAG = "@acp-demo "


@dataclass(frozen=True)
class Config:
    """The model, the data and the run."""

    d_in: int = 512
    hidden: int = 1536
    layers: int = 3
    classes: int = 16
    dropout: float = 0.1
    batch: int = 128
    samples: int = 8192
    lr: float = 1e-3
    seed: int = 1234
    steps: int = 40
    kill_after: int = 20
    repeats: int = 5
    threads: int = 1


QUICK = Config(
    d_in=64, hidden=192, layers=2, samples=1024, batch=64, steps=12, kill_after=6, repeats=3
)


# --------------------------------------------------------------------------- training


def _build(cfg: Config) -> tuple[Any, Any, Any, Any]:
    """Model, optimizer, inputs and labels, all from the seed."""
    import torch
    from torch import nn

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed)
    inputs = torch.randn(cfg.samples, cfg.d_in, generator=g)
    teacher = torch.randn(cfg.d_in, cfg.classes, generator=g)
    labels = (inputs @ teacher + 0.5 * torch.randn(cfg.samples, cfg.classes, generator=g)).argmax(1)
    blocks: list[nn.Module] = []
    width = cfg.d_in
    for _ in range(cfg.layers):
        blocks += [nn.Linear(width, cfg.hidden), nn.GELU(), nn.Dropout(cfg.dropout)]
        width = cfg.hidden
    blocks.append(nn.Linear(width, cfg.classes))
    model = nn.Sequential(*blocks)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    return model, opt, inputs, labels


def _init_adam_state(opt: Any) -> None:
    """Creates Adam's per-parameter state as its first step would (zeros), so
    a checkpoint can be loaded into it in place."""
    import torch

    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }


def _state(model: Any, opt: Any, step: int, data: dict[str, int]) -> dict[str, Any]:
    """Everything a bit-exact resume needs."""
    import torch

    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "data": dict(data),
        "step": step,
    }


def _batch(cfg: Config, data: dict[str, int]) -> Any:
    """The next batch's indices; advances the data position."""
    import torch

    if data["pos"] + cfg.batch > cfg.samples:
        data["epoch"] += 1
        data["pos"] = 0
    g = torch.Generator().manual_seed(cfg.seed * 1000 + data["epoch"])
    order = torch.randperm(cfg.samples, generator=g)
    idx = order[data["pos"] : data["pos"] + cfg.batch]
    data["pos"] += cfg.batch
    return idx


def _train_step(run: _Run) -> int:
    """One optimizer step; returns the loss's float32 bits."""
    import torch.nn.functional as F

    idx = _batch(run.cfg, run.data)
    loss = F.cross_entropy(run.model(run.inputs[idx]), run.labels[idx])
    run.opt.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    run.opt.step()
    bits: int = struct.unpack("<I", struct.pack("<f", loss.item()))[0]
    return bits


def _bits_to_float(bits: int) -> float:
    value: float = struct.unpack("<f", struct.pack("<I", bits))[0]
    return value


def _emit(**event: Any) -> None:
    sys.stdout.write(_TAG + json.dumps(event) + "\n")
    sys.stdout.flush()


def _state_bytes(state: Any) -> int:
    import torch

    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_bytes(v) for v in state)
    return 0


def _checkpointer(args: argparse.Namespace, state_bytes: int) -> Any:
    import acp

    slot = state_bytes + (4 << 20)
    return acp.Checkpointer(
        args.root,
        job=args.job,
        ring_slots=3,
        ring_bytes=3 * slot,
        shm_dir=args.shm_dir,
    )


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _child_train(args: argparse.Namespace, cfg: Config) -> int:
    """A training run: ``--mode reference`` (torch.save timings, no acp) or
    ``--mode acp`` (``ckpt.save`` every step; ``--resume`` restores first)."""
    import torch

    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True)
    run = _Run(cfg, *_build(cfg))
    ckpt = None
    if args.mode == "acp":
        _init_adam_state(run.opt)  # the layout of the checkpoints, for load(into=...)
        template = _state(run.model, run.opt, 0, run.data)
        ckpt = _checkpointer(args, _state_bytes(template))
        if args.resume:
            _resume(ckpt, run, template, args.perturb)
        else:
            run.opt.state.clear()  # a fresh run starts with Adam's lazy state
    for step in range(run.start + 1, cfg.steps + 1):
        bits = _train_step(run)
        state = _state(run.model, run.opt, step, run.data)
        event: dict[str, Any] = {"event": "step", "step": step, "loss": bits}
        if ckpt is not None:
            t0 = time.perf_counter()
            handle = ckpt.save(step, state)
            event["stall"] = time.perf_counter() - t0
            event["copy"] = handle.stats.copy_secs
        else:
            event.update(_torch_saves(state, args.torch_file))
        _emit(**event)
    if ckpt is not None:
        ckpt.close()  # waits for the last flushes
        _emit(event="end")
    else:
        _emit(event="end", memcpy=_memcpy(_state(run.model, run.opt, 0, run.data), cfg.repeats))
    return 0


@dataclass
class _Run:
    """A training run's objects and position."""

    cfg: Config
    model: Any
    opt: Any
    inputs: Any
    labels: Any
    data: dict[str, int] = field(default_factory=lambda: {"epoch": 0, "pos": 0})
    start: int = 0


def _resume(ckpt: Any, run: _Run, template: dict[str, Any], perturb: bool) -> None:
    """Restores the newest checkpoint in place and reports where it came from."""
    import torch

    opened = ckpt.stats()["engine"]
    t0 = time.perf_counter()
    stats = ckpt.load(into=template)
    run.opt.load_state_dict(template["optim"])  # param_groups; the state tensors were filled
    torch.set_rng_state(template["rng"]["torch"])
    random.setstate(template["rng"]["python"])
    run.data = dict(template["data"])
    run.start = template["step"]
    secs = time.perf_counter() - t0
    if perturb:
        with torch.no_grad():
            w = next(run.model.parameters()).view(-1)
            w[0] += 1e-3
    _emit(
        event="restored",
        step=run.start,
        source=stats.source,
        secs=secs,
        load=stats.as_dict(),
        resident_steps=opened["resident_steps"],
        persisting_steps=opened["persisting_steps"],
    )


def _torch_saves(state: dict[str, Any], path: str) -> dict[str, float]:
    """Times torch.save of ``state`` with fsync, and without."""
    import torch

    t0 = time.perf_counter()
    torch.save(state, path)
    _fsync(path)
    t1 = time.perf_counter()
    torch.save(state, path + ".nofsync")
    t2 = time.perf_counter()
    return {"torch_save_fsync": t1 - t0, "torch_save": t2 - t1}


def _memcpy(state: dict[str, Any], repeats: int) -> list[float]:
    """Times copying every tensor of ``state`` into preallocated tensors."""
    import torch

    src = _tensors(state)
    dst = [torch.empty_like(t) for t in src]
    for d, s in zip(dst, src):
        d.copy_(s)  # fault the destination in
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for d, s in zip(dst, src):
            d.copy_(s)
        times.append(time.perf_counter() - t0)
    return times


def _tensors(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _drop_caches(paths: list[str], warm: bool) -> str:
    """Empties the page cache: 'cold' when it worked, 'cold (fadvise)' when
    only our files could be dropped, 'warm' when neither (or asked to)."""
    if warm:
        return "warm"
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "cold"
    except OSError:
        pass
    try:
        for path in _files(paths):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    except (OSError, AttributeError):
        return "warm"
    return "cold (fadvise)"


def _files(paths: list[str]) -> list[str]:
    out = []
    for p in paths:
        if os.path.isdir(p):
            out += [os.path.join(r, n) for r, _, names in os.walk(p) for n in names]
        elif os.path.exists(p):
            out.append(p)
    return out


def _child_restore(args: argparse.Namespace, cfg: Config) -> int:
    """Times restores into a model and its optimizer: acp from RAM, acp from
    storage, torch.load of the reference run's file."""
    import torch

    torch.set_num_threads(cfg.threads)
    model, opt, _, _ = _build(cfg)
    _init_adam_state(opt)
    template = _state(model, opt, 0, {"epoch": 0, "pos": 0})
    out: dict[str, Any] = {"event": "restore", "ram": [], "storage": [], "torch": []}
    with _checkpointer(args, _state_bytes(template)) as ckpt:
        for _ in range(cfg.repeats):
            t0 = time.perf_counter()
            stats = ckpt.load(into=template)
            opt.load_state_dict(template["optim"])
            out["ram"].append(time.perf_counter() - t0)
            out["ram_source"] = stats.source
            out.setdefault("ram_engine", []).append(stats.engine_secs)
            out.setdefault("ram_copy", []).append(stats.copy_secs)
            out["ram_verified"] = stats.verified
        # acp's storage restore and torch.load take turns, each after the
        # same cache drop, so that both see the same machine (a shared one
        # drifts between two blocks of runs) and the same cache state.
        for _ in range(cfg.repeats):
            out["cache"] = _drop_caches([args.root], args.warm)
            t0 = time.perf_counter()
            stats = ckpt.load(into=template, storage_only=True)
            opt.load_state_dict(template["optim"])
            out["storage"].append(time.perf_counter() - t0)
            out["storage_source"] = stats.source
            out.setdefault("storage_engine", []).append(stats.engine_secs)
            out.setdefault("storage_copy", []).append(stats.copy_secs)
            out["torch_cache"] = _drop_caches([args.torch_file], args.warm)
            t0 = time.perf_counter()
            sd = torch.load(args.torch_file, weights_only=True)
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])
            out["torch"].append(time.perf_counter() - t0)
            del sd
    _emit(**out)
    return 0


# --------------------------------------------------------------------------- parent


class _Child:
    """A child process of this module, read event by event."""

    def __init__(self, args: argparse.Namespace, role: str, *extra: str) -> None:
        cmd = [sys.executable, "-m", "acp.demo", "--role", role, *self.common(args), *extra]
        self.log_path = os.path.join(args.workdir, f"{role}-{len(os.listdir(args.workdir))}.log")
        self.log = open(self.log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.deadline = time.monotonic() + args.timeout

    @staticmethod
    def common(args: argparse.Namespace) -> list[str]:
        out = [
            "--root", args.root, "--job", args.job, "--workdir", args.workdir,
            "--torch-file", args.torch_file, "--steps", str(args.steps),
            "--threads", str(args.cfg.threads), "--repeats", str(args.cfg.repeats),
        ]  # fmt: skip
        if args.shm_dir:
            out += ["--shm-dir", args.shm_dir]
        if args.quick:
            out.append("--quick")
        if args.warm:
            out.append("--warm")
        return out

    def events(self) -> Any:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if time.monotonic() > self.deadline:
                self.kill()
                raise RuntimeError(f"child timed out; see {self.log_path}")
            if line.startswith(_TAG):
                yield json.loads(line[len(_TAG) :])

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)

    def finish(self, expect_killed: bool = False) -> None:
        rc = self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        self.log.close()
        ok = rc == -signal.SIGKILL if expect_killed else rc == 0
        if not ok:
            with open(self.log_path, errors="replace") as f:
                tail = f.read()[-4000:]
            raise RuntimeError(f"child exited with {rc}; its stderr:\n{tail}")


def _committed_steps(root: str) -> list[int]:
    """Committed steps, from the directory names alone (opening an engine
    here would take over the killed run's resident slots)."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(int(n[5:]) for n in names if n.startswith("step-") and n[5:].isdigit())


@dataclass
class _Figures:
    """What the parent collects from its children."""

    ref: dict[int, int] = field(default_factory=dict)
    got: dict[int, int] = field(default_factory=dict)
    stalls: list[float] = field(default_factory=list)
    torch_fsync: list[float] = field(default_factory=list)
    torch_nofsync: list[float] = field(default_factory=list)
    memcpy: list[float] = field(default_factory=list)
    killed_after: int = 0
    committed_at_kill: int | None = None
    restored: dict[str, Any] = field(default_factory=dict)
    restore: dict[str, Any] = field(default_factory=dict)
    mismatches: list[int] = field(default_factory=list)


def _say(text: str) -> None:
    print(text, flush=True)


def _reference(args: argparse.Namespace, cfg: Config, fig: _Figures) -> None:
    child = _Child(args, "train", "--mode", "reference")
    for ev in child.events():
        if ev["event"] == "step":
            fig.ref[ev["step"]] = ev["loss"]
            fig.torch_fsync.append(ev["torch_save_fsync"])
            fig.torch_nofsync.append(ev["torch_save"])
        elif ev["event"] == "end":
            fig.memcpy = ev["memcpy"]
    child.finish()
    first, last = _bits_to_float(fig.ref[1]), _bits_to_float(fig.ref[cfg.steps])
    _say(f"1. reference run, no acp: {len(fig.ref)} steps, loss {first:.4f} -> {last:.4f}")


def _killed(args: argparse.Namespace, cfg: Config, fig: _Figures) -> None:
    child = _Child(args, "train", "--mode", "acp")
    for ev in child.events():
        if ev["event"] == "step":
            fig.got[ev["step"]] = ev["loss"]
            fig.stalls.append(ev["stall"])
            fig.killed_after = ev["step"]
            if ev["step"] >= cfg.kill_after:
                child.kill()
                break
    child.finish(expect_killed=True)
    committed = _committed_steps(args.root)
    fig.committed_at_kill = committed[-1] if committed else None
    newest = fig.committed_at_kill
    if newest is None or newest < fig.killed_after:
        flight = (
            f"step {fig.killed_after} was in RAM only, its flush in flight "
            f"(newest committed: {newest})"
        )
    else:
        flight = f"every save had already committed (newest: {newest})"
    _say(
        f"2. acp run, ckpt.save every step: SIGKILLed right after the save of step "
        f"{fig.killed_after} returned; {flight}"
    )


def _resumed(args: argparse.Namespace, cfg: Config, fig: _Figures) -> None:
    extra = ["--mode", "acp", "--resume"] + (["--perturb"] if args.perturb else [])
    child = _Child(args, "train", *extra)
    for ev in child.events():
        if ev["event"] == "restored":
            fig.restored = ev
        elif ev["event"] == "step":
            fig.got[ev["step"]] = ev["loss"]
            fig.stalls.append(ev["stall"])
    child.finish()
    r = fig.restored
    _say(
        f"3. restarted: restored step {r['step']} from {r['source']} (source={r['source']}) in "
        f"{r['secs'] * 1e3:.1f} ms; resident at open: {r['resident_steps']}, flushed and "
        f"committed on open: {r['persisting_steps']}; trained steps {r['step'] + 1}..{cfg.steps}"
        + (" (--perturb: one weight nudged by 0.001 after the restore)" if args.perturb else "")
    )


def _check(cfg: Config, fig: _Figures) -> None:
    fig.mismatches = [s for s in range(1, cfg.steps + 1) if fig.got.get(s) != fig.ref.get(s)]
    if not fig.mismatches:
        _say(f"4. bit-exact: all {cfg.steps} losses equal the reference run's, float32 bit for bit")
        return
    s = fig.mismatches[0]
    have = "missing" if s not in fig.got else f"{_bits_to_float(fig.got[s])!r} (0x{fig.got[s]:08x})"
    want = f"{_bits_to_float(fig.ref[s])!r} (0x{fig.ref[s]:08x})"
    _say(
        f"4. MISMATCH: {len(fig.mismatches)} of {cfg.steps} losses differ from the reference "
        f"run's; first at step {s}: {have}, reference {want}"
    )


def _restores(args: argparse.Namespace, fig: _Figures) -> None:
    child = _Child(args, "restore")
    for ev in child.events():
        fig.restore = ev
    child.finish()


def _table(fig: _Figures) -> None:
    r = fig.restore
    rows = [
        ("save stall", "acp ckpt.save (returns once copied into RAM)", fig.stalls),
        ("", "torch.save + fsync (same state, same file system)", fig.torch_fsync),
        ("", "torch.save without fsync (not durable)", fig.torch_nofsync),
        ("", "memcpy of the same bytes (torch copy_), for scale", fig.memcpy),
        ("restore", f"acp load(into=...) from RAM (source={r['ram_source']})", r["ram"]),
        ("", f"acp load(into=...) from storage, {r['cache']} cache", r["storage"]),
        ("", f"torch.load + load_state_dict, {r.get('torch_cache', r['cache'])} cache", r["torch"]),
    ]
    _say("")
    _say(f"{'':10} {'':52} {'median':>8} {'min':>8} {'max':>8}   n   (ms)")
    for group, name, xs in rows:
        med, lo, hi = (statistics.median(xs) * 1e3, min(xs) * 1e3, max(xs) * 1e3)
        _say(f"{group:10} {name:52} {med:8.1f} {lo:8.1f} {hi:8.1f} {len(xs):3}")
    _say("")
    if r.get("ram_engine"):
        _say(
            f"acp restore from RAM, median: {statistics.median(r['ram_engine']) * 1e3:.1f} ms "
            "finding the slot"
            + (" and matching its digests to the step's index" if r.get("ram_verified") else "")
            + f", {statistics.median(r['ram_copy']) * 1e3:.1f} ms "
            + (
                "checking each chunk against its quick sum and copying it into the tensors"
                " (one pass)."
                if r.get("ram_verified")
                else "copying into the tensors."
            )
        )
    if r.get("storage_engine"):
        _say(
            f"acp restore from storage, median: {statistics.median(r['storage_engine']) * 1e3:.1f}"
            " ms opening the step, "
            f"{statistics.median(r['storage_copy']) * 1e3:.1f} ms reading, verifying and copying"
            " into the tensors (one pass)."
        )
    stall, tsave = statistics.median(fig.stalls), statistics.median(fig.torch_fsync)
    ram, tload = statistics.median(r["ram"]), statistics.median(r["torch"])
    _say(
        f"acp's save stall is {tsave / stall:.1f}x shorter than torch.save + fsync; its restore "
        f"from RAM is {tload / ram:.1f}x faster than torch.load."
    )


def _parent(args: argparse.Namespace, cfg: Config) -> int:
    started = time.monotonic()
    import torch  # to describe the model

    model, opt, _, _ = _build(cfg)
    _init_adam_state(opt)
    nparams = sum(p.numel() for p in model.parameters())
    nbytes = _state_bytes(_state(model, opt, 0, {"epoch": 0, "pos": 0}))
    del model, opt
    widths = "-".join([str(cfg.d_in)] + [str(cfg.hidden)] * cfg.layers + [str(cfg.classes)])
    _say(
        f"acp demo: MLP {widths} with dropout, Adam: {nparams / 1e6:.2f} M parameters, "
        f"{nbytes / 1e6:.1f} MB of checkpoint; {cfg.steps} steps, a save after each; "
        f"torch {torch.__version__}, {cfg.threads} training thread(s); work dir {args.workdir}"
    )
    fig = _Figures()
    _reference(args, cfg, fig)
    _killed(args, cfg, fig)
    _resumed(args, cfg, fig)
    _check(cfg, fig)
    if not fig.mismatches:
        _restores(args, fig)
        _table(fig)
    _say(f"(the demo took {time.monotonic() - started:.0f} s)")
    from_ram = fig.restored.get("source") == "ram"
    if not from_ram:
        _say(f"FAILED: the restart restored from {fig.restored.get('source')}, not from RAM")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": asdict(cfg), "state_bytes": nbytes, **asdict(fig)}, f, indent=1)
    return 0 if from_ram and not fig.mismatches else 1


def _args(argv: list[str] | None) -> tuple[argparse.Namespace, Config]:
    ap = argparse.ArgumentParser(
        prog="python -m acp.demo",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    ap.add_argument("--steps", type=int, help="training steps (default 40; 12 with --quick)")
    ap.add_argument("--kill-after", type=int, help="SIGKILL after this step (default: half)")
    ap.add_argument("--quick", action="store_true", help="a tiny model, for tests")
    ap.add_argument("--repeats", type=int, help="timed restores of each kind (default 5)")
    ap.add_argument("--threads", type=int, help="torch threads for training (default 1)")
    ap.add_argument("--workdir", help="where checkpoints go (default: a new temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument(
        "--perturb",
        action="store_true",
        help="nudge a weight after the restore (the check must fail)",
    )
    ap.add_argument("--json", help="also write the figures to this JSON file")
    ap.add_argument(
        "--warm",
        action="store_true",
        help="do not drop the page cache before restores (it is system-wide and needs root)",
    )
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per child process")
    ap.add_argument("--role", default="parent", choices=["parent", "train", "restore"],
                    help=argparse.SUPPRESS)  # fmt: skip
    for hidden in ("--mode", "--root", "--job", "--shm-dir", "--torch-file"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else Config()
    if args.steps is not None:
        cfg = replace(cfg, steps=args.steps, kill_after=max(1, args.steps // 2))
    for name in ("kill_after", "repeats", "threads"):
        if getattr(args, name) is not None:
            cfg = replace(cfg, **{name: getattr(args, name)})
    if not 1 <= cfg.kill_after < cfg.steps:
        ap.error(f"--kill-after must be between 1 and {cfg.steps - 1}")
    args.steps = cfg.steps
    args.cfg = cfg
    return args, cfg


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m acp.demo``; returns the exit status."""
    args, cfg = _args(argv)
    if args.role == "train":
        return _child_train(args, cfg)
    if args.role == "restore":
        return _child_restore(args, cfg)
    base = args.workdir
    args.workdir = tempfile.mkdtemp(prefix="acp-demo-", dir=base)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    args.shm_dir = tempfile.mkdtemp(prefix="acp-demo-", dir=shm) if shm else None
    args.root = os.path.join(args.workdir, "ckpt")
    args.torch_file = os.path.join(args.workdir, "state.pt")
    args.job = f"acp-demo-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        return _parent(args, cfg)
    finally:
        if args.shm_dir:
            shutil.rmtree(args.shm_dir, ignore_errors=True)
        if args.keep:
            print(f"kept {args.workdir}")
        else:
            shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
