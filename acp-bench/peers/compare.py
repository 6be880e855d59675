#!/usr/bin/env python3
"""acp side by side with the tools a user would pick instead, in one process, on the same data.

    python acp-bench/peers/compare.py                       # 0.25 GiB, 3 repeats, a few minutes
    python acp-bench/peers/compare.py --size-gib 1 4 --repeats 3 --json out.json

State: a transformer-like model's fp32 parameters plus Adam's state for each (exp_avg,
exp_avg_sq and a 0-dim step), laid out as ``model.state_dict()`` and ``opt.state_dict()``
produce them (integer keys, param_groups). ``--size-gib`` is the size of that whole state
(parameters are a third of it). Every tool saves and loads this same state, each to its own
file or directory under ``--dir`` (one file system), in this process.

Measured (median of ``--repeats``, with min and max; seconds):

- baselines: memcpy of the same bytes into preallocated, prefaulted memory: libc ``memcpy``
  (``ctypes.memmove``) on 1 thread and on every CPU, torch ``copy_`` and numpy ``copyto``;
- acp: ``ckpt.save`` stall (returns once the bytes are in the RAM ring) and total (until
  committed on storage), in steady state (each ring slot used once before; the first save
  into each slot, which creates it, is its own row); ``ckpt.load(into=state)`` from RAM
  and from storage;
- ``torch.save`` + fsync; ``torch.load(weights_only=True)`` + copy into the state's tensors;
- safetensors ``save_file`` + fsync; ``load_file`` + copy into the state's tensors;
- torch.distributed.checkpoint: ``dcp.save``; ``dcp.async_save`` blocking part (until it
  returns) and total (until its future completes); ``dcp.load`` (in place);
- acp through DCP (``acp.dcp.StorageWriter``/``StorageReader``): the same three DCP calls;
- MindSpore ``save_checkpoint`` (``.ckpt`` and safetensors; + fsync, and ``async_save=True``
  blocking and total) and ``load_checkpoint`` + ``load_param_into_net`` on Parameters holding
  the same bytes.

Every load ends with every byte in the state's own tensors (the state is zeroed before each
load, outside the timing, and checked after). Caches: before each measured run the page cache
is emptied (``echo 3 > /proc/sys/vm/drop_caches``, or ``posix_fadvise(DONTNEED)`` on our files
when that is refused, which the output says) unless the row says ``warm`` (the files were read
once just before). acp's RAM ring is shared memory: dropping caches does not touch it.

Output: a Markdown table per size with GB/s and the ratio to the fastest memcpy, a table of
acp against each peer (peer time / acp time: above 1, acp is faster), and ``--json`` with
every run, and one verdict line per issue-16 target the run measures (verified restore from
RAM, stall, save until committed, cold restore: each met or MISSED by the median of per-pair
ratios, each acp run having been paired with its floor run right before it: a memcpy on every
core, plus fio's write for a save until committed, fio's read for a cold load; the ratio of two
blocks' medians is given beside it); ``--out DIR`` writes both (``compare.md``,
``compare.json``). More peers plug in with ``--plugin file.py``, whose ``register(compare)``
returns a list of ``compare.Group``; see ``Group``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")  # DCP warns on every no_dist call
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baselines  # noqa: E402
from baselines import MiB, drop_caches, fsync_path  # noqa: E402
from compare_harness import (  # noqa: E402
    Ctx,
    Group,
    Row,
    copy_tree,
    flatten,
    make_state,
    nbytes,
    rm,
)
from compare_report import md_tables  # noqa: E402

# ----------------------------------------------------------------------------- baselines


def run_baselines(ctx: Ctx) -> None:
    srcs = [t.reshape(-1) for t in ctx.tensors if t.numel()]
    dsts = [torch.empty_like(s) for s in srcs]
    for d in dsts:
        d.fill_(1)  # prefault
    ptrs = [(d.data_ptr(), s.data_ptr(), nbytes(s)) for d, s in zip(dsts, srcs)]
    threads = os.cpu_count() or 1

    def memmove(part: list[tuple[int, int, int]]) -> None:
        for d, s, n in part:
            ctypes.memmove(d, s, n)  # ctypes releases the GIL around the call

    def memmove_threads() -> None:
        # Split by bytes, not by count: a few tensors hold most of the bytes.
        parts: list[list[tuple[int, int, int]]] = [[] for _ in range(threads)]
        loads = [0] * threads
        for p in sorted(ptrs, key=lambda x: -x[2]):
            i = loads.index(min(loads))
            parts[i].append(p)
            loads[i] += p[2]
        ts = [threading.Thread(target=memmove, args=(part,)) for part in parts[1:]]
        for t in ts:
            t.start()
        memmove(parts[0])
        for t in ts:
            t.join()

    def torch_copy() -> None:
        for d, s in zip(dsts, srcs):
            d.copy_(s)

    np_srcs = [s.numpy().view(np.uint8) for s in srcs]
    np_dsts = [d.numpy().view(np.uint8) for d in dsts]

    def numpy_copy() -> None:
        for d, s in zip(np_dsts, np_srcs):
            np.copyto(d, s)

    ctx.measure(
        "baseline",
        "memcpy, 1 thread (libc via ctypes.memmove)",
        "copy",
        lambda: memmove(ptrs),
        cache=None,
    )
    ctx.measure(
        "baseline",
        f"memcpy, {threads} threads (libc via ctypes.memmove)",
        "copy",
        memmove_threads,
        cache=None,
    )
    ctx.measure(
        "baseline",
        f"torch copy_ ({torch.get_num_threads()} torch threads)",
        "copy",
        torch_copy,
        cache=None,
    )
    ctx.measure("baseline", "numpy copyto", "copy", numpy_copy, cache=None)

    # The disk: a file of the state's size written and read sequentially
    # with O_DIRECT (fio io_uring when installed), on the same file system.
    path = os.path.join(ctx.dir, "raw.bin")
    tools: list[str] = []

    def write() -> dict[str, float]:
        r = baselines.direct_write(path, ctx.bytes)
        tools.append(r.tool)
        return {"time": r.secs}

    def read() -> dict[str, float]:
        r = baselines.direct_read(path, ctx.bytes)  # drops the page cache itself
        tools.append(r.tool)
        return {"time": r.secs}

    for row in ctx.measure(
        "baseline", "O_DIRECT write + fsync (raw)", "write", write, cache=None
    ).values():
        row.note = tools[-1] if tools else ""
    for row in ctx.measure(
        "baseline", "O_DIRECT read, cold (raw)", "read", read, cache=None
    ).values():
        row.note = tools[-1] if tools else ""

    # The same floors again, one at a time, for the tools to pair each of
    # their runs with (the file stays until the case's directory goes).
    def timed(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def read_floor() -> float:
        if not os.path.exists(path):
            baselines.direct_write(path, ctx.bytes)
        return baselines.direct_read(path, ctx.bytes).secs

    def copy_floor(keep: tuple[Any, ...] = (srcs, dsts)) -> float:
        # ``ptrs`` are raw addresses into these tensors: ``keep`` holds them
        # for as long as the floor lives (after this function returns).
        return timed(memmove_threads)

    ctx.floors["copy"] = copy_floor
    ctx.floors["write"] = lambda: baselines.direct_write(path, ctx.bytes).secs
    ctx.floors["read"] = read_floor


# ----------------------------------------------------------------------------- acp


RING_SLOTS = 2


def _acp_checkpointer(ctx: Ctx, root: str, shm: str | None) -> Any:
    import acp

    slot = ctx.bytes + 64 * MiB
    return acp.Checkpointer(
        root,
        job=f"compare-{os.getpid()}-{os.path.basename(root)}",
        ring_slots=RING_SLOTS,
        ring_bytes=2 * slot,
        keep_last=2,
        shm_dir=shm,
        # The same state is saved step after step: write each step whole,
        # as the peers do (incremental steps would leave out every chunk).
        incremental=False,
    )


def _shm_dir() -> str | None:
    return (
        tempfile.mkdtemp(prefix="acp-compare-", dir="/dev/shm")
        if os.path.isdir("/dev/shm")
        else None
    )


Pair = Callable[[], dict[str, float]]
"""``Ctx.measure``'s ``pair``: runs the floors and returns their seconds by row key."""


def _floor_pairs(ctx: Ctx, settle: Callable[[], object]) -> dict[str, Pair | None]:
    """``measure``'s ``pair`` for a save (the copy for its stall, the copy and the
    write for its total), a load from RAM (the copy) and a cold load (the read and
    the copy), from the baselines this run measured; None for each without them.
    Each calls ``settle`` first (the tool's background work from its previous run,
    such as a commit's housekeeping, must not slow its baseline)."""
    copy, write, read = (ctx.floors.get(k) for k in ("copy", "write", "read"))
    if copy is None or write is None or read is None:
        return {"save": None, "ram": None, "cold": None}

    def save() -> dict[str, float]:
        settle()
        c = copy()
        return {"stall": c, "total": c + write()}

    def ram() -> dict[str, float]:
        settle()
        return {"time": copy()}

    def cold() -> dict[str, float]:
        settle()
        return {"time": read() + copy()}

    return {"save": save, "ram": ram, "cold": cold}


def run_acp(ctx: Ctx) -> None:
    root = os.path.join(ctx.dir, "acp")
    shm = _shm_dir()
    ckpt = _acp_checkpointer(ctx, root, shm)
    pairs = _floor_pairs(ctx, ckpt.wait)
    steps = iter(range(1, 1 << 30))
    last: dict[str, Any] = {"saves": [], "loads": [], "faults": []}

    def save() -> dict[str, float]:
        t0 = time.perf_counter()
        h = ckpt.save(next(steps), ctx.state)
        stall = time.perf_counter() - t0
        stats = h.wait()
        total = time.perf_counter() - t0
        last["saves"].append(stats)
        return {"stall": stall, "total": total}

    def load(storage_only: bool) -> None:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        stats = ckpt.load(into=ctx.state, storage_only=storage_only)
        last["faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        last["source"] = stats.source
        last["loads"].append(stats)

    try:
        # A training run saves again and again into the same ring slots,
        # whose memory is created once: by reserve() before training, or
        # else by the first save into each slot. Measure those apart.
        t0 = time.perf_counter()
        ready = ckpt.reserve(ctx.state)
        ctx.rows.append(
            Row("acp", "ckpt.reserve(state), once before training", "setup",
                [time.perf_counter() - t0], note=f"creates {ready} ring slots' memory")
        )  # fmt: skip
        for i in range(RING_SLOTS):
            drop_caches([ctx.dir])
            first = save()
            ctx.rows.append(
                Row("acp", f"ckpt.save, first into reserved slot {i + 1} of {RING_SLOTS} [stall]",
                    "stall", [first["stall"]], note="once per slot per process")
            )  # fmt: skip
        last["saves"] = []
        rows = ctx.measure("acp", "ckpt.save", "save", save, pair=pairs["save"])
        saves = last["saves"]
        if saves and "stall" in rows:
            rows["stall"].note = "medians: " + ", ".join(
                f"{name} {_ms(saves, field)}"
                for name, field in (
                    ("walking the state", "flatten_secs"),
                    ("copy", "copy_secs"),
                    ("slot wait", "slot_wait_secs"),
                )
            )
        if saves and "total" in rows:
            flush = statistics.median(s.flush_bytes_per_sec or 0.0 for s in saves)
            rows["total"].note = (
                f"flush {_ms(saves, 'flush_secs')} ({flush / 1e9:.2f} GB/s, io={saves[-1].io}, "
                f"O_DIRECT={saves[-1].direct}), commit {_ms(saves, 'commit_secs')}"
            )
        last["loads"] = []
        rows = ctx.measure(
            "acp",
            "ckpt.load(into=state) from RAM",
            "load",
            lambda: load(False),
            before=ctx.zero,
            cache=None,
            after=lambda: ctx.check("acp RAM"),
            pair=pairs["ram"],
        )
        _note_source(rows, last, "ram")
        for row in rows.values():
            row.note += (
                f"; find+verify {_ms(last['loads'], 'engine_secs')}, "
                f"copy {_ms(last['loads'], 'copy_secs')}"
            )
        last["loads"], last["faults"] = [], []
        _note_each_load(
            ctx.measure_loads(
                "acp",
                "ckpt.load(into=state) from storage",
                lambda: load(True),
                root,
                "acp storage",
                pair_cold=pairs["cold"],
            ),
            last,
        )
    finally:
        ckpt.close()
        if shm:
            shutil.rmtree(shm, ignore_errors=True)
        rm(root)


def _note_each_load(rows_by_cache: list[dict[str, Row]], last: dict[str, Any]) -> None:
    """Notes the source of ``measure_loads``' storage rows and, in run order (the cold
    loads ran first, then the warm ones), each load's times (the engine's open, then the
    read, check and copy) and minor page faults: a slow run with many faults read into
    memory that was new."""
    done = 0
    for rows in rows_by_cache:
        _note_source(rows, last, "storage")
        n = max((len(row.runs) for row in rows.values()), default=0)
        loads = last["loads"][done : done + n]
        faults = last["faults"][done : done + n]
        done += n
        for row in rows.values():
            row.note += "; per run, open + read and copy: " + ", ".join(
                f"{(s.engine_secs or 0) * 1e3:.0f}+{(s.copy_secs or 0) * 1e3:.0f} ms/{f} faults"
                for s, f in zip(loads, faults, strict=True)
            )


def _ms(stats: list[Any], attr: str) -> str:
    """The median of a stats attribute, in milliseconds."""
    values = [getattr(s, attr) for s in stats if getattr(s, attr) is not None]
    return f"{statistics.median(values) * 1e3:.0f} ms" if values else "-"


def _note_source(rows: dict[str, Row], last: dict[str, Any], want: str) -> None:
    for row in rows.values():
        if last.get("source") != want:
            row.note = f"source={last.get('source')} (expected {want})"
        else:
            row.note = f"source={want}"


# ----------------------------------------------------------------------------- peers


def run_torch(ctx: Ctx) -> None:
    path = os.path.join(ctx.dir, "state.pt")

    def save() -> None:
        torch.save(ctx.state, path)
        fsync_path(path)

    def load() -> None:
        sd = torch.load(path, weights_only=True)
        copy_tree(ctx.state, sd)

    ctx.measure("torch", "torch.save + fsync", "save", save, before=lambda: rm(path))
    ctx.measure_loads(
        "torch", "torch.load(weights_only) + copy into state", load, path, "torch.load"
    )
    rm(path)


def run_safetensors(ctx: Ctx) -> None:
    from safetensors.torch import load_file, save_file

    path = os.path.join(ctx.dir, "state.safetensors")
    flat, rest = flatten(ctx.state)
    meta = {"rest": json.dumps(rest)}

    def save() -> None:
        save_file(flat, path, metadata=meta)
        fsync_path(path)

    def load() -> None:
        got = load_file(path)
        for k, t in flat.items():
            t.copy_(got[k])

    ctx.measure(
        "safetensors", "safetensors save_file + fsync", "save", save, before=lambda: rm(path)
    )
    ctx.measure_loads(
        "safetensors", "safetensors load_file + copy into state", load, path, "safetensors"
    )
    rm(path)


def _dcp_async(state: dict[str, Any], **kw: Any) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    fut = dcp.async_save(state, no_dist=True, **kw)
    t1 = time.perf_counter()
    if hasattr(fut, "upload_completion"):
        fut.upload_completion.result()
    else:
        fut.result()
    return {"blocking": t1 - t0, "total": time.perf_counter() - t0}


def run_dcp(ctx: Ctx) -> None:
    import torch.distributed.checkpoint as dcp

    path = os.path.join(ctx.dir, "state.dcp")
    ctx.measure(
        "dcp",
        "dcp.save",
        "save",
        lambda: dcp.save(ctx.state, checkpoint_id=path, no_dist=True),
        before=lambda: rm(path),
    )
    ctx.measure(
        "dcp",
        "dcp.async_save",
        "save",
        lambda: _dcp_async(ctx.state, checkpoint_id=path),
        before=lambda: rm(path),
    )
    if not os.path.exists(path):
        dcp.save(ctx.state, checkpoint_id=path, no_dist=True)
    ctx.measure_loads(
        "dcp",
        "dcp.load (in place)",
        lambda: dcp.load(ctx.state, checkpoint_id=path, no_dist=True),
        path,
        "dcp.load",
    )
    rm(path)


def run_acp_dcp(ctx: Ctx) -> None:
    import torch.distributed.checkpoint as dcp

    import acp.dcp

    root = os.path.join(ctx.dir, "acp-dcp")
    shm = _shm_dir()
    ckpt = _acp_checkpointer(ctx, root, shm)
    writer = acp.dcp.StorageWriter(ckpt)
    steps = iter(range(1, 1 << 30))
    try:
        for _ in range(RING_SLOTS):  # create the ring's slots outside the timing
            dcp.save(ctx.state, checkpoint_id=next(steps), storage_writer=writer, no_dist=True)
        ctx.measure(
            "acp+dcp",
            "dcp.save, acp StorageWriter",
            "save",
            lambda: dcp.save(
                ctx.state, checkpoint_id=next(steps), storage_writer=writer, no_dist=True
            ),
        )

        def async_save() -> dict[str, float]:
            writer.reset(next(steps))
            return _dcp_async(ctx.state, storage_writer=writer, async_stager=acp.dcp.Stager(writer))

        ctx.measure("acp+dcp", "dcp.async_save, acp Stager + StorageWriter", "save", async_save)
        reader = acp.dcp.StorageReader(ckpt)
        rows = ctx.measure(
            "acp+dcp",
            "dcp.load, acp StorageReader, from RAM",
            "load",
            lambda: dcp.load(ctx.state, storage_reader=reader, no_dist=True),
            before=ctx.zero,
            cache=None,
            after=lambda: ctx.check("acp dcp.load"),
        )
        last = reader.last_load or {}
        _note_source(rows, {"source": last.get("source")}, "ram")
    finally:
        ckpt.close()
        if shm:
            shutil.rmtree(shm, ignore_errors=True)
        rm(root)


def run_mindspore(ctx: Ctx) -> None:
    """MindSpore's ``save_checkpoint``/``load_checkpoint`` on the same bytes.

    The state's tensors become ``mindspore.Parameter`` objects (copies of the
    same bytes, named by their key paths) held by a Cell; loads go through
    ``load_param_into_net`` and end with a store into every page, so every
    byte is in the parameters' memory (MindSpore's safetensors loader maps
    the file and copies pages on first write). acp's own MindSpore path is
    measured by ``mindspore_compare.py``."""
    import mindspore as ms
    from mindspore import Parameter, Tensor
    from mindspore_compare import _holder, _rm, _touch

    flat, _ = flatten(ctx.state)
    originals = {name: t.detach().reshape(-1).view(torch.uint8).numpy() for name, t in flat.items()}
    params = {
        name: Parameter(Tensor.from_numpy(t.detach().numpy().copy()), name=name)
        for name, t in flat.items()
    }
    holder = _holder(params)

    def zero() -> None:
        for p in params.values():
            p.asnumpy().reshape(-1).view(np.uint8)[:] = 0

    def check(what: str) -> None:
        for name, p in holder.parameters_and_names():
            got = p.asnumpy().reshape(-1).view(np.uint8)
            if not np.array_equal(got, originals[p.name]):
                raise AssertionError(f"{what}: parameter {name} differs after the load")

    for fmt in ("ckpt", "safetensors"):
        path = os.path.join(ctx.dir, f"state.{fmt}")

        def save(path: str = path, fmt: str = fmt) -> None:
            ms.save_checkpoint(params, path, format=fmt)
            fsync_path(path)

        def async_save(path: str = path, fmt: str = fmt) -> dict[str, float]:
            import mindspore.train.serialization as ser

            t0 = time.perf_counter()
            ms.save_checkpoint(params, path, async_save=True, format=fmt)
            t1 = time.perf_counter()
            ser._wait_async_thread_save_ckpt()
            fsync_path(path)
            return {"blocking": t1 - t0, "total": time.perf_counter() - t0}

        def load(path: str = path, fmt: str = fmt) -> None:
            loaded = ms.load_checkpoint(path, format=fmt)
            not_loaded = ms.load_param_into_net(holder, loaded)
            if not_loaded != ([], []):
                raise AssertionError(f"load_param_into_net left out {not_loaded}")
            _touch(holder, write=True)

        def remove(path: str = path) -> None:
            _rm(Path(path))  # MindSpore leaves its files read-only

        ctx.measure("mindspore", f"save_checkpoint({fmt}) + fsync", "save", save, before=remove)
        ctx.measure(
            "mindspore", f"save_checkpoint({fmt}, async_save=True)", "save", async_save,
            before=remove,
        )  # fmt: skip
        ctx.measure_loads(
            "mindspore",
            f"load_checkpoint({fmt}) + load_param_into_net + write every page",
            load,
            path,
            f"mindspore {fmt}",
            zero=zero,
            check=lambda fmt=fmt: check(f"mindspore {fmt}"),
        )
        remove()


GROUPS = {
    "acp": Group("acp", run_acp),
    "torch": Group("torch", run_torch),
    "safetensors": Group("safetensors", run_safetensors),
    "dcp": Group("dcp", run_dcp),
    "acp-dcp": Group("acp+dcp", run_acp_dcp),
    "mindspore": Group("mindspore", run_mindspore),
}
DEFAULT_OPS = "baseline,acp,torch,safetensors,dcp,acp-dcp,mindspore"


# ----------------------------------------------------------------------------- main


def _load_plugin(path: str, groups: dict[str, Group], ops: list[str]) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("compare_plugin", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--plugin {path}: not a python file")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for g in mod.register(sys.modules[__name__]):
        groups[g.name] = g
        ops.append(g.name)


def _env(base: str) -> dict[str, Any]:
    import acp

    env = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": np.__version__,
        "acp": acp.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "dir": base,
    }
    try:
        import safetensors

        env["safetensors"] = safetensors.__version__
    except ImportError:
        pass
    return env


def _run_case(
    size: float, a: argparse.Namespace, base: str, ops: list[str], groups: dict[str, Group]
) -> tuple[str, dict[str, Any]]:
    case = f"state{size:g}GiB"
    t0 = time.perf_counter()
    state = make_state(size, a.extra_small)
    wd = os.path.join(base, case)
    os.makedirs(wd)
    ctx = Ctx(state, wd, a.repeats)
    print(
        f"\n## {case}: {len(ctx.tensors)} tensors, {ctx.bytes / 1e9:.3f} GB "
        f"(built in {time.perf_counter() - t0:.1f} s)",
        flush=True,
    )
    if "baseline" in ops:
        run_baselines(ctx)
    for name in ops:
        if name != "baseline":
            groups[name].run(ctx)
            gc.collect()
    ctx.check("end of case")
    record = {
        "bytes": ctx.bytes,
        "tensors": len(ctx.tensors),
        "cache_modes": sorted(m for m in ctx.cache_modes if m),
        "rows": [vars(r) | {"median": r.median if r.runs else None} for r in ctx.rows],
    }
    return md_tables(case, ctx), record


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--size-gib",
        type=float,
        nargs="+",
        default=[0.25],
        help="state sizes (parameters + Adam state), GiB; default 0.25",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--extra-small", type=int, default=500, help="small adapter tensors in the model"
    )
    ap.add_argument("--dir", default=None, help="scratch directory (default: a new one in /tmp)")
    ap.add_argument(
        "--ops", default=DEFAULT_OPS, help=f"comma list of: baseline,{','.join(GROUPS)}"
    )
    ap.add_argument("--json", default=None, help="write every run here")
    ap.add_argument(
        "--out", default=None, help="directory for compare.md and compare.json (made if missing)"
    )
    ap.add_argument("--plugin", default=None, help="python file with register(compare) -> [Group]")
    a = ap.parse_args()
    groups = dict(GROUPS)
    ops = a.ops.split(",")
    if a.plugin:
        _load_plugin(a.plugin, groups, ops)
    unknown = [o for o in ops if o != "baseline" and o not in groups]
    if unknown:
        ap.error(f"unknown --ops {unknown}")
    base = tempfile.mkdtemp(prefix="acp-compare-", dir=a.dir)
    env = _env(base)
    print("# compare", json.dumps(env), flush=True)
    out: dict[str, Any] = {"env": env, "args": vars(a), "cases": {}}
    md = []
    try:
        for size in a.size_gib:
            table, record = _run_case(size, a, base, ops, groups)
            md.append(table)
            out["cases"][f"state{size:g}GiB"] = record
            gc.collect()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report = "\n".join(md)
    print(report)
    outputs = [a.json] if a.json else []
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        outputs.append(os.path.join(a.out, "compare.json"))
        with open(os.path.join(a.out, "compare.md"), "w") as f:
            f.write(f"# compare.py {' '.join(sys.argv[1:])}\n\n")
            f.write("Machine: " + ", ".join(f"{k} {v}" for k, v in env.items()) + "\n")
            f.write(report + "\n")
    for path in outputs:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    sys.stdout.flush()
    os._exit(0)  # DCP's executor threads would otherwise hold the exit


if __name__ == "__main__":
    sys.exit(main())
