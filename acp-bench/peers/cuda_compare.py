#!/usr/bin/env python3
"""acp's CUDA path side by side with the tools a GPU user would pick instead, in one process.

    python acp-bench/peers/cuda_compare.py                      # 1 GiB, 5 repeats
    python acp-bench/peers/cuda_compare.py --size-gib 1 4 --out results/cuda

State: a transformer-like model's fp32 parameters plus Adam's ``exp_avg`` and ``exp_avg_sq``
for each, every tensor on the GPU (``--size-gib`` is the whole state). Every tool saves this
same state from the GPU and restores it into the same GPU tensors (zeroed before each load,
outside the timing, and compared with a reference copy on the GPU after).

Measured (median of ``--repeats``, with min and max; seconds):

- floors: one batched device-to-host copy of every tensor into preallocated pinned host
  memory (``torch._foreach_copy_``, non-blocking, then synchronised): the least a save can
  stall for; the same into preallocated pageable memory; the host-to-device copy back from
  pinned memory (the least a restore from RAM can cost); a 2-thread host memcpy of the same
  bytes (``baselines.memcpy``);
- acp: ``ckpt.save`` stall (returns once the bytes are in the RAM ring) and total (until
  committed on storage), in steady state (the first save into each slot, which creates and
  pins it, is its own row); ``ckpt.load(into=state)`` from RAM and from storage;
- ``torch.save`` + fsync and ``torch.load(map_location="cuda", weights_only=True)`` + copy;
- safetensors ``save_file`` + fsync and ``load_file(device="cuda")`` + copy;
- ``dcp.async_save``: blocking part and total, with torch's default stager and with acp's
  ``Stager`` + ``StorageWriter``.

Loads from storage start with the page cache dropped (or our files' pages advised away).
Output: a Markdown table per size (``--out DIR`` writes ``cuda_compare.md`` and ``.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

warnings.filterwarnings("ignore")  # DCP warns on every no_dist call
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baselines  # noqa: E402
from baselines import drop_caches, fsync_path  # noqa: E402
from states import fill, transformer_layer  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
RING_SLOTS = 2

Runs = dict[str, list[float]]


def make_state(size_gib: float) -> dict[str, Any]:
    """Model and Adam state on the GPU, ``size_gib`` in all (parameters are a third)."""
    h = 1024
    per_layer = sum(4 * _numel(s) for _, s in transformer_layer(h))
    layers = max(1, round(size_gib * GiB / 3 / per_layer))
    model: dict[str, torch.Tensor] = {}
    for i in range(layers):
        for name, shape in transformer_layer(h):
            model[f"layers.{i}.{name}"] = torch.empty(shape, dtype=torch.float32)
    fill(list(model.values()))
    model = {k: v.cuda() for k, v in model.items()}
    optim: dict[int, dict[str, Any]] = {}
    for i, p in enumerate(model.values()):
        optim[i] = {
            "step": torch.tensor(10.0),
            "exp_avg": (p * 0.5).contiguous(),
            "exp_avg_sq": (p * p).contiguous(),
        }
    torch.cuda.synchronize()
    return {
        "model": model,
        "optim": {"state": optim, "param_groups": [{"lr": 1e-3, "params": list(optim)}]},
    }


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def all_tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in all_tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in all_tensors(v)]
    return []


def cuda_tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in all_tensors(obj) if t.is_cuda]


class Bench:
    def __init__(self, size_gib: float, repeats: int, work: str) -> None:
        self.state = make_state(size_gib)
        self.tensors = cuda_tensors(self.state)
        self.bytes = sum(t.nbytes for t in self.tensors)
        self.reference = [t.clone() for t in self.tensors]
        self.repeats = repeats
        self.work = work
        self.rows: list[dict[str, Any]] = []

    def zero(self) -> None:
        for t in self.tensors:
            t.zero_()
        torch.cuda.synchronize()

    def check(self, what: str) -> None:
        torch.cuda.synchronize()
        for t, r in zip(self.tensors, self.reference):  # bytes: the fill makes NaNs
            if not torch.equal(t.view(torch.uint8), r.view(torch.uint8)):
                raise SystemExit(f"{what}: restored bytes differ from the saved ones")

    def row(self, tool: str, op: str, runs: list[float], note: str = "") -> None:
        self.rows.append({"tool": tool, "op": op, "runs": runs, "note": note})

    def measure(
        self,
        tool: str,
        op: str,
        fn: Callable[[], Any],
        *,
        before: Callable[[], None] | None = None,
        after: Callable[[], None] | None = None,
        note: str = "",
    ) -> None:
        runs: Runs = {}
        for _ in range(self.repeats):
            if before:
                before()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            parts = fn()
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            for k, v in (parts if isinstance(parts, dict) else {"": elapsed}).items():
                runs.setdefault(k, []).append(v)
            if after:
                after()
        for k, v in runs.items():
            self.row(tool, f"{op} [{k}]" if k else op, v, note)


# ----------------------------------------------------------------------------- floors


def run_floors(b: Bench) -> None:
    pinned = [torch.empty_like(t, device="cpu").pin_memory() for t in b.tensors]
    pageable = [torch.empty_like(t, device="cpu") for t in b.tensors]
    for p in pageable:
        p.view(torch.uint8).reshape(-1).fill_(1)  # prefault

    def d2h(dst: list[torch.Tensor]) -> None:
        torch._foreach_copy_(dst, b.tensors, non_blocking=True)

    b.measure("floor", "device-to-host into pinned memory", lambda: d2h(pinned))
    b.measure("floor", "device-to-host into pageable memory", lambda: d2h(pageable))
    b.measure(
        "floor",
        "host-to-device from pinned memory",
        lambda: torch._foreach_copy_(b.tensors, pinned, non_blocking=True),
        before=b.zero,
        after=lambda: b.check("host-to-device floor"),
    )
    b.row("floor", "host memcpy, 2 threads", baselines.memcpy(b.bytes, 2, b.repeats))


# ----------------------------------------------------------------------------- acp


def _checkpointer(b: Bench, root: str) -> tuple[str, Any]:
    """A checkpointer on ``root`` whose ring (in a private shm directory,
    returned for removal) holds two images of the state."""
    import acp

    shm = tempfile.mkdtemp(prefix="acp-cuda-", dir="/dev/shm")
    ckpt = acp.Checkpointer(
        root,
        job=f"cuda-{os.getpid()}-{os.path.basename(root)}",
        ring_slots=RING_SLOTS,
        ring_bytes=RING_SLOTS * (b.bytes + 64 * MiB),
        keep_last=2,
        shm_dir=shm,
        # The same state is saved step after step: write each step whole,
        # as the peers do (incremental steps would leave out every chunk).
        incremental=False,
    )
    return shm, ckpt


def run_acp(b: Bench) -> None:
    root = os.path.join(b.work, "acp")
    shm, ckpt = _checkpointer(b, root)
    steps = iter(range(1, 1 << 30))
    saves: list[Any] = []
    loads: list[Any] = []

    def save() -> dict[str, float]:
        t0 = time.perf_counter()
        h = ckpt.save(next(steps), b.state)
        stall = time.perf_counter() - t0
        saves.append(h.wait())
        return {"stall": stall, "total": time.perf_counter() - t0}

    def load(storage_only: bool) -> dict[str, float]:
        t0 = time.perf_counter()
        loads.append(ckpt.load(into=b.state, storage_only=storage_only))
        torch.cuda.synchronize()
        return {"": time.perf_counter() - t0}

    def note(stats: list[Any], fields: tuple[str, ...]) -> str:
        parts = [f"{f} {statistics.median(getattr(s, f) or 0.0 for s in stats) * 1e3:.1f} ms"
                 for f in fields]  # fmt: skip
        return ", ".join(parts)

    try:
        t0 = time.perf_counter()
        ready = ckpt.reserve(b.state)
        b.row("acp", "ckpt.reserve(state), once before training", [time.perf_counter() - t0],
              f"creates {ready} ring slots' memory")  # fmt: skip
        for i in range(RING_SLOTS):
            first = save()
            b.row("acp", f"ckpt.save, first into slot {i + 1} [stall]", [first["stall"]],
                  "pins the slot for CUDA copies: once per slot per process")  # fmt: skip
        saves.clear()
        b.measure("acp", "ckpt.save", save)
        b.rows[-2]["note"] = "medians: " + note(saves, ("flatten_secs", "copy_secs"))
        b.rows[-1]["note"] = "medians: " + note(saves, ("flush_secs", "commit_secs"))
        b.measure(
            "acp",
            "ckpt.load(into=state) from RAM",
            lambda: load(False),
            before=b.zero,
            after=lambda: b.check("acp RAM"),
        )
        b.rows[-1]["note"] = f"source {loads[-1].source}; medians: " + note(
            loads, ("engine_secs", "copy_secs")
        )
        loads.clear()
        b.measure(
            "acp",
            "ckpt.load(into=state) from storage, cold",
            lambda: load(True),
            before=lambda: (b.zero(), drop_caches([root])),
            after=lambda: b.check("acp storage"),
        )
        b.rows[-1]["note"] = f"source {loads[-1].source}; medians: " + note(
            loads, ("engine_secs", "copy_secs")
        )
    finally:
        ckpt.close()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def _copy_into(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for d, s in zip(all_tensors(dst), all_tensors(src)):
        if d.is_cuda:
            d.copy_(s)


# ----------------------------------------------------------------------------- peers


def run_torch(b: Bench) -> None:
    path = os.path.join(b.work, "state.pt")

    def save() -> None:
        torch.save(b.state, path)
        fsync_path(path)

    b.measure("torch", "torch.save + fsync", save)
    b.measure(
        "torch",
        "torch.load(map_location=cuda) + copy, cold",
        lambda: _copy_into(b.state, torch.load(path, map_location="cuda", weights_only=True)),
        before=lambda: (b.zero(), drop_caches([path])),
        after=lambda: b.check("torch.load"),
    )
    os.unlink(path)


def run_safetensors(b: Bench) -> None:
    from safetensors.torch import load_file, save_file

    path = os.path.join(b.work, "state.safetensors")
    flat = {f"t{i}": t for i, t in enumerate(b.tensors)}

    def save() -> None:
        save_file(flat, path)
        fsync_path(path)

    def load() -> None:
        got = load_file(path, device="cuda")
        for i, t in enumerate(b.tensors):
            t.copy_(got[f"t{i}"])

    b.measure("safetensors", "save_file + fsync", save)
    b.measure(
        "safetensors",
        "load_file(device=cuda) + copy, cold",
        load,
        before=lambda: (b.zero(), drop_caches([path])),
        after=lambda: b.check("safetensors"),
    )
    os.unlink(path)


def _dcp_async(state: dict[str, Any], **kw: Any) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    fut = dcp.async_save(state, no_dist=True, **kw)
    t1 = time.perf_counter()
    done = getattr(fut, "upload_completion", fut)
    done.result()
    return {"blocking": t1 - t0, "total": time.perf_counter() - t0}


def run_dcp(b: Bench) -> None:
    import acp
    import acp.dcp

    path = os.path.join(b.work, "state.dcp")
    b.measure(
        "dcp",
        "dcp.async_save, default stager",
        lambda: _dcp_async(b.state, checkpoint_id=path),
        before=lambda: shutil.rmtree(path, ignore_errors=True),
    )
    shutil.rmtree(path, ignore_errors=True)

    root = os.path.join(b.work, "acp-dcp")
    shm, ckpt = _checkpointer(b, root)
    writer = acp.dcp.StorageWriter(ckpt)
    steps = iter(range(1, 1 << 30))

    def async_save() -> dict[str, float]:
        writer.reset(next(steps))
        return _dcp_async(b.state, storage_writer=writer, async_stager=acp.dcp.Stager(writer))

    try:
        for _ in range(RING_SLOTS):  # create and pin the slots outside the timing
            async_save()
        b.measure("acp+dcp", "dcp.async_save, acp Stager + StorageWriter", async_save)
    finally:
        ckpt.close()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


# ----------------------------------------------------------------------------- report


def table(b: Bench, size_gib: float) -> str:
    floors = {r["op"]: statistics.median(r["runs"]) for r in b.rows if r["tool"] == "floor"}
    d2h = floors.get("device-to-host into pinned memory")
    h2d = floors.get("host-to-device from pinned memory")
    lines = [
        f"### {size_gib:g} GiB state ({b.bytes / 1e9:.2f} GB in {len(b.tensors)} CUDA tensors), "
        f"{torch.cuda.get_device_name()}",
        "",
        "| tool | operation | median s | min | max | GB/s | x floor | note |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in b.rows:
        med = statistics.median(r["runs"])
        floor = h2d if "load" in r["op"] else d2h
        ratio = f"{med / floor:.2f}" if floor and r["tool"] != "floor" else ""
        lines.append(
            f"| {r['tool']} | {r['op']} | {med:.4f} | {min(r['runs']):.4f} | "
            f"{max(r['runs']):.4f} | {b.bytes / med / 1e9:.2f} | {ratio} | {r['note']} |"
        )
    lines.append("")
    lines.append(
        "x floor: saves against the pinned device-to-host copy, loads against the pinned "
        "host-to-device copy, both measured in this run."
    )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, nargs="+", default=[1.0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a new one in /tmp)")
    ap.add_argument("--out", default=None, help="write cuda_compare.md and .json here")
    ap.add_argument(
        "--only", nargs="+", default=["floors", "acp", "torch", "safetensors", "dcp"],
        help="which groups to run",
    )  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    runs = {"floors": run_floors, "acp": run_acp, "torch": run_torch,
            "safetensors": run_safetensors, "dcp": run_dcp}  # fmt: skip
    work = tempfile.mkdtemp(prefix="acp-cuda-", dir=args.dir)
    machine = baselines.machine(work)
    md: list[str] = []
    everything: list[dict[str, Any]] = []
    try:
        for size in args.size_gib:
            b = Bench(size, args.repeats, work)
            for name in args.only:
                print(f"{size:g} GiB: {name}", file=sys.stderr, flush=True)
                runs[name](b)
            md.append(table(b, size))
            print(md[-1], flush=True)
            everything.append({"size_gib": size, "bytes": b.bytes, "rows": b.rows})
            del b
            torch.cuda.empty_cache()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cuda_compare.md"), "w") as f:
            f.write("\n\n".join(md) + "\n")
        with open(os.path.join(args.out, "cuda_compare.json"), "w") as f:
            json.dump({"machine": machine, "runs": everything}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
