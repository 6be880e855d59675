#!/usr/bin/env python3
"""How acp's save cost scales: with the bytes of the state, and with its number of tensors.

    python acp-bench/peers/scaling.py                # 0.25..8 GiB, 10..100,000 tensors, 3 runs
    python acp-bench/peers/scaling.py --quick --out /tmp/scaling      # smoke: well under a minute
    python acp-bench/peers/scaling.py --sizes 1 4 --counts 10 1000 100000 --repeats 5

Cost vs state size (``--sizes``, GiB; above 8 only with ``--large``): a transformer-like fp32
state dict (24 layers, a token embedding, a final norm: 291 tensors at every size, only their
shapes grow). Per size, in the same run:

- memcpy of the state's tensors into one preallocated, prefaulted buffer, on 1 thread and on
  every CPU (``baselines.copy_ranges``);
- fio: a sequential O_DIRECT write of a fresh file of the same size, fsync included
  (``baselines.direct_write``);
- acp: ``Checkpointer.save(step, state)``: the stall (until it returns) in steady state (the
  first save into each ring slot creates the slot's memory: reported apart), the flush (from
  ``handle.wait()``'s stats, with copy, walk and commit times, throughput, I/O engine), and
  the time from the call until committed.

Ratios: stall / fastest memcpy, and acp's flush throughput / fio's write throughput.

Cost vs tensor count (``--counts``) at a fixed total (``--count-total-mib``, default 256 MiB):
the stall and flush per count, and the overhead per tensor, (stall(n) - stall(n0)) / (n - n0)
in microseconds, n0 being the smallest count (10).

A size that does not fit in memory (state + memcpy target or acp's RAM ring + headroom, against
MemAvailable) is skipped with its reason; when a ring of two slots does not fit but one does,
the size runs with ``ring_slots=1`` and says so. Each acp run has a fresh root under ``--dir``
and its own shared-memory directory in /dev/shm, both removed after ``close()``.

Output in ``--out``: scaling.json (every run and the machine), scaling.md (tables),
scaling_size.png and scaling_tensors.png. Medians of ``--repeats`` with min and max;
GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baselines
from baselines import GiB, MiB, summary
from states import fill, transformer_layer

import acp

LAYERS = 24
DEFAULT_SIZES = [0.25, 0.5, 1, 2, 4, 8]
DEFAULT_COUNTS = [10, 100, 1_000, 10_000, 100_000]
QUICK_SIZES = [0.03125, 0.0625]
QUICK_COUNTS = [10, 1_000]
QUICK_COUNT_TOTAL_MIB = 32
MAX_SIZE_GIB = 8
RING_SLOTS = 2
KEEP_LAST = 2
OUT_DEFAULT = Path(__file__).resolve().parents[1] / "results" / "scaling"
KINDS = [
    "attn.q_proj.weight",
    "attn.k_proj.weight",
    "attn.v_proj.weight",
    "attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
]


# ----------------------------------------------------------------------------- states


def model_state(nbytes: int) -> dict[str, torch.Tensor]:
    """A transformer-like fp32 ``state_dict`` of ``nbytes`` (less under 4 * hidden bytes):
    ``LAYERS`` layers (12 tensors each), a token embedding and a final norm. The hidden size
    grows with ``nbytes``; the tensor count does not."""
    floats = nbytes // 4
    h = max(64, int(math.sqrt(0.85 * floats / (12 * LAYERS))) // 64 * 64)
    per_layer = 12 * h * h + 13 * h
    vocab = (floats - LAYERS * per_layer - 2 * h) // h
    if vocab < 1:
        raise ValueError(f"{nbytes} bytes is too small for {LAYERS} layers of width {h}")
    state = {"embed_tokens.weight": torch.empty(vocab, h)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        for name, shape in transformer_layer(h):
            state[p + name] = torch.empty(shape)
    state["norm.weight"] = torch.empty(h)
    state["norm.bias"] = torch.empty(h)
    fill(list(state.values()))
    return state


def count_state(count: int, nbytes: int) -> dict[str, torch.Tensor]:
    """``count`` fp32 tensors of ``nbytes`` in all (sizes differ by at most one element),
    each with its own storage and random bytes, named like a model's parameters."""
    floats = nbytes // 4
    base, extra = divmod(floats, count)
    if base < 1:
        raise ValueError(f"{nbytes} bytes cannot hold {count} fp32 tensors")
    g = torch.Generator().manual_seed(1)
    pool = torch.randint(0, 256, (floats * 4,), dtype=torch.uint8, generator=g)
    state: dict[str, torch.Tensor] = {}
    off = 0
    for i in range(count):
        n = (base + (i < extra)) * 4
        name = f"model.layers.{i // len(KINDS)}.{KINDS[i % len(KINDS)]}"
        state[name] = pool[off : off + n].view(torch.float32).clone()
        off += n
    return state


def nbytes_of(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# ----------------------------------------------------------------------------- measuring


def measure_memcpy(state: dict[str, torch.Tensor], repeats: int) -> dict[str, Any]:
    """memcpy of every tensor into one prefaulted buffer, packed like a ring slot."""
    total = nbytes_of(state)
    threads = baselines.cpus()
    with baselines.Buffer(total) as dst:
        ranges, off = [], 0
        for t in state.values():
            n = t.numel() * t.element_size()
            ranges.append((dst.addr + off, t.data_ptr(), n))
            off += n
        one = [baselines.copy_ranges(ranges, 1) for _ in range(repeats)]
        many = [baselines.copy_ranges(ranges, threads) for _ in range(repeats)]
    return {"threads": threads, "one": summary(one), "all": summary(many)}


def measure_fio(nbytes: int, workdir: str, repeats: int, a: argparse.Namespace) -> dict[str, Any]:
    path = os.path.join(workdir, "fio-write.bin")
    try:
        runs = [
            baselines.direct_write(path, nbytes, bs=a.bs, iodepth=a.iodepth) for _ in range(repeats)
        ]
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return {
        "tool": runs[0].tool,
        "bytes": runs[0].bytes,
        "secs": summary([r.secs for r in runs]),
        "gb_per_sec": summary([r.gb_per_sec for r in runs]),
    }


def slot_bytes(nbytes: int, tensors: int) -> int:
    """A ring slot that holds the state's image: its bytes, a header and some slack."""
    need = nbytes + 64 * MiB + 1024 * tensors
    return -(-need // (2 * MiB)) * (2 * MiB)


def _one_save(ckpt: acp.Checkpointer, step: int, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    gc.collect()
    t0 = time.perf_counter()
    handle = ckpt.save(step, state)
    stall = time.perf_counter() - t0
    s = handle.wait()
    total = time.perf_counter() - t0
    return {
        "step": step,
        "stall": stall,
        "total": total,
        "flatten": s.flatten_secs,
        "copy": s.copy_secs,
        # begin_save (the engine plans the image, takes a slot), finish, bookkeeping
        "other": stall - s.flatten_secs - s.copy_secs,
        "slot_wait": s.slot_wait_secs,
        "flush": s.flush_secs,
        "commit": s.commit_secs,
        "engine_total": s.total_secs,
        "flush_gb_per_sec": (s.flush_bytes_per_sec or 0.0) / 1e9,
        "file_bytes": s.bytes,
        "io": s.io,
        "direct": s.direct,
    }


def measure_acp(
    state: dict[str, torch.Tensor], workdir: str, label: str, slots: int, repeats: int
) -> dict[str, Any]:
    """``slots`` saves that create the ring's slots, then ``repeats`` steady-state saves; each
    waited for. A fresh root and shared-memory directory, removed afterwards."""
    slot = slot_bytes(nbytes_of(state), len(state))
    root = os.path.join(workdir, f"acp-{label}")
    shm = tempfile.mkdtemp(
        prefix="acp-scaling-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    ckpt = acp.Checkpointer(
        root,
        job=f"scaling-{os.getpid()}-{label}",
        ring_slots=slots,
        ring_bytes=slots * slot,
        keep_last=KEEP_LAST,
        shm_dir=shm,
    )
    try:
        first = [_one_save(ckpt, step, state) for step in range(1, slots + 1)]
        runs = [_one_save(ckpt, slots + 1 + i, state) for i in range(repeats)]
    finally:
        ckpt.close()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    keys = ["stall", "total", "flatten", "copy", "other", "slot_wait", "flush", "commit"]
    keys += ["engine_total", "flush_gb_per_sec"]
    out: dict[str, Any] = {"ring_slots": slots, "ring_bytes": slots * slot}
    out |= {k: summary([r[k] for r in runs]) for k in keys if None not in [r[k] for r in runs]}
    out |= {
        "io": runs[-1]["io"],
        "direct": runs[-1]["direct"],
        "file_bytes": runs[-1]["file_bytes"],
    }
    out |= {"first_saves": first, "runs": runs}
    return out


# ----------------------------------------------------------------------------- fitting


def plan_slots(nbytes: int, tensors: int, workdir: str, headroom: int) -> tuple[int, str]:
    """The ring slots a state fits with (2, else 1), or 0, with the reason."""
    avail = baselines.mem_available()
    shm_free = _free("/dev/shm")
    disk_free = _free(workdir)
    slot = slot_bytes(nbytes, tensors)
    disk_need = (KEEP_LAST + 1) * nbytes + GiB
    if disk_free is not None and disk_free < disk_need:
        return 0, (
            f"skipped: {workdir} has {disk_free / GiB:.1f} GiB free, "
            f"{disk_need / GiB:.1f} GiB needed ({KEEP_LAST + 1} checkpoint files)"
        )
    for slots in (RING_SLOTS, 1):
        # The memcpy target is freed before the ring is made: the peak is the larger one.
        mem_need = nbytes + max(nbytes, slots * slot) + 64 * MiB + headroom
        shm_ok = shm_free is None or shm_free >= slots * slot
        if mem_need <= avail and shm_ok:
            why = "" if slots == RING_SLOTS else f"{RING_SLOTS} slots do not fit in memory"
            return slots, why
    return 0, (
        f"skipped: needs {mem_need / GiB:.1f} GiB (the state, a ring of one slot or the memcpy "
        f"target, {headroom / GiB:.1f} GiB headroom); MemAvailable is {avail / GiB:.1f} GiB"
        + (f", /dev/shm has {shm_free / GiB:.1f} GiB free" if shm_free is not None else "")
    )


def _free(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


# ----------------------------------------------------------------------------- the two axes


class Skip(Exception):
    """A case that does not fit in memory now; the message says why."""


def _check_room(need: int, what: str, headroom: int) -> None:
    avail = baselines.mem_available()
    if need + headroom > avail:
        raise Skip(
            f"skipped before {what}: it needs {need / GiB:.1f} GiB + {headroom / GiB:.1f} GiB "
            f"headroom; MemAvailable is {avail / GiB:.1f} GiB now"
        )


def measure_case(
    state: dict[str, torch.Tensor],
    row: dict[str, Any],
    *,
    slots: int,
    workdir: str,
    a: argparse.Namespace,
    label: str,
    fio: dict[str, Any] | None = None,
) -> None:
    """memcpy, fio (unless given) and acp on one state, into ``row``. Memory is checked again
    before each allocation (other processes come and go); raises ``Skip`` when it is short."""
    headroom = int(a.headroom_gib * GiB)
    _check_room(row["bytes"], "the memcpy", headroom)
    row["memcpy"] = measure_memcpy(state, a.repeats)
    row["fio_write"] = fio or measure_fio(row["bytes"], workdir, a.repeats, a)
    slot = slot_bytes(row["bytes"], len(state))
    if slots > 1 and slots * slot + headroom > baselines.mem_available():
        slots = 1
        row["note"] = f"{RING_SLOTS} slots do not fit in memory"
    _check_room(slots * slot, "acp's ring", headroom)
    row["acp"] = measure_acp(state, workdir, label, slots, a.repeats)
    row["ratios"] = ratios(row)


def run_sizes(a: argparse.Namespace, workdir: str) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for size in a.sizes:
        nbytes = int(size * GiB)
        if size > MAX_SIZE_GIB and not a.large:
            reason = f"skipped: above {MAX_SIZE_GIB} GiB (pass --large)"
            print(f"\n## {size:g} GiB: {reason}", flush=True)
            skipped.append({"size_gib": size, "reason": reason})
            continue
        slots, why = plan_slots(nbytes, LAYERS * 12 + 3, workdir, int(a.headroom_gib * GiB))
        if not slots:
            print(f"\n## {size:g} GiB: {why}", flush=True)
            skipped.append({"size_gib": size, "reason": why})
            continue
        t0 = time.perf_counter()
        state = model_state(nbytes)
        row: dict[str, Any] = {
            "size_gib": size,
            "bytes": nbytes_of(state),
            "tensors": len(state),
            "hidden": state["norm.weight"].numel(),
            "note": why,
        }
        print(
            f"\n## {size:g} GiB: {row['tensors']} tensors, {row['bytes'] / 1e9:.3f} GB, hidden "
            f"{row['hidden']} (built in {time.perf_counter() - t0:.1f} s)"
            + (f"; {why}" if why else ""),
            flush=True,
        )
        try:
            measure_case(state, row, slots=slots, workdir=workdir, a=a, label=f"size{size:g}")
        except Skip as e:
            print(f"  {e}", flush=True)
            skipped.append({"size_gib": size, "reason": str(e)})
            continue
        finally:
            del state
            gc.collect()
        print_row(row)
        rows.append(row)
    return {"rows": rows, "skipped": skipped}


def run_counts(a: argparse.Namespace, workdir: str) -> dict[str, Any]:
    total = int(a.count_total_mib * MiB)
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    fio = None
    for count in sorted(a.counts):
        slots, why = plan_slots(total, count, workdir, int(a.headroom_gib * GiB))
        if not slots:
            print(f"\n## {count:,} tensors: {why}", flush=True)
            skipped.append({"tensors": count, "reason": why})
            continue
        t0 = time.perf_counter()
        state = count_state(count, total)
        row: dict[str, Any] = {"tensors": count, "bytes": nbytes_of(state), "note": why}
        print(
            f"\n## {count:,} tensors of {row['bytes'] / count / 1e3:,.1f} kB, "
            f"{row['bytes'] / 1e9:.3f} GB in all (built in {time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
        try:
            measure_case(
                state, row, slots=slots, workdir=workdir, a=a, label=f"count{count}", fio=fio
            )
        except Skip as e:
            print(f"  {e}", flush=True)
            skipped.append({"tensors": count, "reason": str(e)})
            continue
        finally:
            del state
            gc.collect()
        fio = row["fio_write"]
        print_row(row)
        rows.append(row)
    per_tensor = per_tensor_overhead(rows)
    for n, v in per_tensor.get("by_count", {}).items():
        print(
            f"per-tensor overhead at {int(n):,} tensors: stall {v['stall_us']:.2f} us, "
            f"flush {v['flush_us']:.2f} us (over {per_tensor['base_tensors']} tensors)"
        )
    return {"total_bytes": total, "rows": rows, "skipped": skipped, "per_tensor": per_tensor}


def ratios(row: dict[str, Any]) -> dict[str, Any]:
    mc = row["memcpy"]
    fastest = min(mc["one"]["median"], mc["all"]["median"])
    stall = row["acp"]["stall"]["median"]
    return {
        "fastest_memcpy_secs": fastest,
        "stall_over_memcpy": stall / fastest,
        "flush_over_fio": row["acp"]["flush_gb_per_sec"]["median"]
        / row["fio_write"]["gb_per_sec"]["median"],
        "total_over_memcpy_plus_fio": row["acp"]["total"]["median"]
        / (fastest + row["fio_write"]["secs"]["median"]),
    }


def per_tensor_overhead(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """(x(n) - x(n0)) / (n - n0) in microseconds for the stall, its parts and the flush, n0
    being the smallest count measured, from the medians; for the stall also its bounds from
    the extremes, (min(n) - max(n0)) / (n - n0) and (max(n) - min(n0)) / (n - n0), which show
    how much of it is run-to-run noise (most, where n - n0 is small)."""
    if len(rows) < 2:
        return {}
    base = rows[0]
    by_count = {}
    for row in rows[1:]:
        dn = (row["tensors"] - base["tensors"]) / 1e6
        now, then = row["acp"], base["acp"]
        figures = {
            f"{k}_us": (now[k]["median"] - then[k]["median"]) / dn
            for k in ("stall", "flatten", "copy", "other", "flush", "total")
        }
        figures["stall_us_low"] = (now["stall"]["min"] - then["stall"]["max"]) / dn
        figures["stall_us_high"] = (now["stall"]["max"] - then["stall"]["min"]) / dn
        by_count[str(row["tensors"])] = figures
    return {"base_tensors": base["tensors"], "by_count": by_count}


def print_row(row: dict[str, Any]) -> None:
    mc, fio, ac, r = row["memcpy"], row["fio_write"], row["acp"], row["ratios"]
    print(
        f"  memcpy 1 thread {dur(mc['one']['median'])}, {mc['threads']} threads "
        f"{dur(mc['all']['median'])}; fio O_DIRECT write {dur(fio['secs']['median'])} "
        f"({fio['gb_per_sec']['median']:.2f} GB/s)\n"
        f"  acp: first save into each slot: stall "
        + ", ".join(dur(f["stall"]) for f in ac["first_saves"])
        + f"; steady stall {dur(ac['stall']['median'])} ({r['stall_over_memcpy']:.2f}x memcpy), "
        f"flush {dur(ac['flush']['median'])} ({ac['flush_gb_per_sec']['median']:.2f} GB/s, "
        f"{r['flush_over_fio']:.2f}x fio, io={ac['io']}, O_DIRECT={ac['direct']}), "
        f"to committed {dur(ac['total']['median'])}",
        flush=True,
    )


# ----------------------------------------------------------------------------- report


def dur(s: float) -> str:
    """Seconds, as ms below 1 s; three significant digits."""
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def cell(sm: dict[str, Any]) -> str:
    """The median, and min-max in the same unit when there are several runs."""
    if len(sm["runs"]) < 2:
        return dur(sm["median"])
    scale, unit = (1e3, "ms") if sm["median"] < 1 else (1.0, "s")
    lo, hi = sm["min"] * scale, sm["max"] * scale
    return f"{sm['median'] * scale:.3g} {unit} ({lo:.3g}-{hi:.3g})"


def machine_line(m: dict[str, Any]) -> str:
    mount = m["dir_mount"]
    return (
        f"{m['cpus']} CPUs ({m['cpu_model']}), {m['mem_total'] / GiB:.1f} GiB RAM, "
        f"Linux {m['kernel']}, {mount['fs']} on {mount['device']}"
    )


def markdown(out: dict[str, Any]) -> str:
    m = out["machine"]
    lines = [
        "# acp: save cost vs state size and tensor count",
        "",
        f"Machine: {machine_line(m)}; {m['fio']}; torch {m['torch']}, acp {m['acp']}. "
        f"Load average (1 min) at the start {m['load_average'][0]:.2f}"
        + (f", at the end {m['load_average_end'][0]:.2f}" if m.get("load_average_end") else "")
        + f" (other processes share the {m['cpus']} CPUs).",
        "",
        f"Command: `{out['command']}`; whole run {out['wall_secs']:.0f} s. Cells are medians "
        f"of {out['args']['repeats']} runs (min-max); GB = 1e9 bytes. Stall: "
        "`Checkpointer.save` until it returns, in steady state (the first save into each ring "
        "slot creates the slot, acp's `slot_wait_secs`, and has its own column). Flush: "
        "writing the file (acp's `flush_secs`). To committed: from the call until "
        "`handle.wait()` returns. fio: a fresh fallocated file of the same size, written with "
        "O_DIRECT, fsync included.",
    ]
    sizes = out.get("size")
    if sizes is not None:
        lines += size_table(sizes)
    counts = out.get("tensors")
    if counts is not None:
        lines += count_table(counts)
    return "\n".join(lines) + "\n"


def size_table(sizes: dict[str, Any]) -> list[str]:
    rows = sizes["rows"]
    skipped = [f"\n{s['size_gib']:g} GiB: {s['reason']}" for s in sizes["skipped"]]
    if not rows:
        return ["", "## Cost vs state size", *skipped]
    threads = rows[0]["memcpy"]["threads"]
    tensors = sorted({r["tensors"] for r in rows})
    lines = [
        "",
        "## Cost vs state size",
        "",
        f"A transformer-like fp32 state dict of {', '.join(map(str, tensors))} tensors at "
        "every size (only the shapes grow).",
        "",
        f"| state | GB | memcpy 1 thread | memcpy {threads} threads | fio O_DIRECT write | "
        "acp stall | stall / memcpy | acp flush | flush GB/s | fio GB/s | flush / fio | "
        "acp to committed | first save into a slot (of which creating it) | ring slots |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ac, fio, ra = r["acp"], r["fio_write"], r["ratios"]
        first = ", ".join(
            f"{dur(f['stall'])} (slot {dur(f['slot_wait'])})" for f in ac["first_saves"]
        )
        lines.append(
            f"| {r['size_gib']:g} GiB | {r['bytes'] / 1e9:.3f} | {cell(r['memcpy']['one'])} | "
            f"{cell(r['memcpy']['all'])} | {cell(fio['secs'])} | {cell(ac['stall'])} | "
            f"**{ra['stall_over_memcpy']:.2f}** | {cell(ac['flush'])} | "
            f"{ac['flush_gb_per_sec']['median']:.2f} | {fio['gb_per_sec']['median']:.2f} | "
            f"**{ra['flush_over_fio']:.2f}** | {cell(ac['total'])} | {first} | "
            f"{ac['ring_slots']}{' (' + r['note'] + ')' if r['note'] else ''} |"
        )
    lines += [
        "",
        "Inside the stall (medians): "
        + "; ".join(
            f"{r['size_gib']:g} GiB: walking the state {dur(r['acp']['flatten']['median'])}, "
            f"copy {dur(r['acp']['copy']['median'])}, other {dur(r['acp']['other']['median'])}"
            for r in rows
        )
        + f". acp's I/O: io={rows[-1]['acp']['io']}, O_DIRECT={rows[-1]['acp']['direct']}.",
    ]
    return lines + skipped


def count_table(counts: dict[str, Any]) -> list[str]:
    rows = counts["rows"]
    title = f"## Cost vs tensor count ({counts['total_bytes'] / MiB:g} MiB in all)"
    skipped = [f"\n{s['tensors']:,} tensors: {s['reason']}" for s in counts["skipped"]]
    if not rows:
        return ["", title, *skipped]
    pt = counts["per_tensor"].get("by_count", {})
    base = counts["per_tensor"].get("base_tensors")
    lines = [
        "",
        title,
        "",
        "fp32 tensors of equal size, each with its own storage. The stall's parts (medians): "
        "walking the state (flatten, in Python), copy (into the ring slot), other (the rest: "
        "`begin_save`, where the engine plans the image and takes a slot, `finish`, "
        f"bookkeeping). Per-tensor overhead: (x(n) - x({base})) / (n - {base}). memcpy here is "
        "a Python loop of one `ctypes.memmove` per tensor, so it carries a Python call per "
        "tensor too.",
        "",
        "| tensors | kB each | acp stall | walking | copy | other | stall / memcpy | "
        "per-tensor stall µs | acp flush | per-tensor flush µs | flush / fio | "
        "acp to committed | memcpy 1 thread |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ac, ra = r["acp"], r["ratios"]
        p = pt.get(str(r["tensors"]))
        stall_us = (
            f"**{p['stall_us']:.2f}** ({p['stall_us_low']:.3g} to {p['stall_us_high']:.3g})"
            if p
            else "-"
        )
        flush_us = f"{p['flush_us']:.2f}" if p else "-"
        lines.append(
            f"| {r['tensors']:,} | {r['bytes'] / r['tensors'] / 1e3:,.1f} | "
            f"{cell(ac['stall'])} | {dur(ac['flatten']['median'])} | "
            f"{dur(ac['copy']['median'])} | {dur(ac['other']['median'])} | "
            f"{ra['stall_over_memcpy']:.2f} | "
            f"{stall_us} | {cell(ac['flush'])} | {flush_us} | {ra['flush_over_fio']:.2f} | "
            f"{cell(ac['total'])} | {cell(r['memcpy']['one'])} |"
        )
    fio = rows[0]["fio_write"]
    lines += [
        "",
        f"fio O_DIRECT write of the same bytes: {cell(fio['secs'])}, "
        f"{fio['gb_per_sec']['median']:.2f} GB/s.",
    ]
    if pt:
        top = max(pt, key=int)
        lines += [
            "",
            f"Per-tensor stall overhead at {int(top):,} tensors: **{pt[top]['stall_us']:.2f} µs** "
            f"(walking the state {pt[top]['flatten_us']:.2f} µs, copy {pt[top]['copy_us']:.2f} "
            f"µs, other {pt[top]['other_us']:.2f} µs); the target is at most 2 µs.",
        ]
    return lines + skipped


def plots(out: dict[str, Any], outdir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    where = machine_line(out["machine"])
    rows = out.get("size", {}).get("rows", [])
    if rows:
        fig = plot_sizes(plt, rows, where)
        fig.savefig(outdir / "scaling_size.png", dpi=110)
        plt.close(fig)
        made.append("scaling_size.png")
    counts = out.get("tensors")
    if counts and counts["rows"]:
        fig = plot_counts(plt, counts, where)
        fig.savefig(outdir / "scaling_tensors.png", dpi=110)
        plt.close(fig)
        made.append("scaling_tensors.png")
    return made


def _series(rows: list[dict[str, Any]], get: Any) -> tuple[list[float], list[float], list[Any]]:
    med = [get(r)["median"] for r in rows]
    lo = [m - get(r)["min"] for m, r in zip(med, rows)]
    hi = [get(r)["max"] - m for m, r in zip(med, rows)]
    return med, lo, [lo, hi]


def plot_sizes(plt: Any, rows: list[dict[str, Any]], where: str) -> Any:
    gb = [r["bytes"] / 1e9 for r in rows]
    threads = rows[0]["memcpy"]["threads"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5.2))
    lines = [
        ("acp save stall", lambda r: r["acp"]["stall"], "C0", "o", "-"),
        ("acp flush", lambda r: r["acp"]["flush"], "C1", "s", "-"),
        ("acp save to committed", lambda r: r["acp"]["total"], "C3", "^", "-"),
        ("memcpy, 1 thread", lambda r: r["memcpy"]["one"], "0.45", "", "--"),
        (f"memcpy, {threads} threads", lambda r: r["memcpy"]["all"], "0.2", "", ":"),
        ("fio O_DIRECT write (fsync incl.)", lambda r: r["fio_write"]["secs"], "C2", "", "--"),
    ]
    for label, get, color, marker, style in lines:
        med, _, err = _series(rows, get)
        ax.errorbar(
            gb,
            med,
            yerr=err,
            label=label,
            color=color,
            marker=marker or None,
            linestyle=style,
            capsize=3,
        )
        bx.plot(
            gb,
            [g / m for g, m in zip(gb, med)],
            label=label,
            color=color,
            marker=marker or None,
            linestyle=style,
        )
    ax.set(xscale="log", yscale="log", xlabel="state size (GB, log)", ylabel="seconds (log)")
    ax.set_title("time vs bytes (median, bars: min-max)")
    bx.set(xscale="log", xlabel="state size (GB, log)", ylabel="GB/s (bytes / median time)")
    bx.set_title("throughput vs bytes: flat = cost linear in bytes")
    bx.set_ylim(bottom=0)
    for x in (ax, bx):
        x.grid(True, which="both", alpha=0.3)
        x.set_xticks(gb, [f"{g:.3g}" for g in gb])
        x.minorticks_off()
    ax.legend(fontsize=8)
    bx.legend(fontsize=8)
    tensors = rows[0]["tensors"]
    fig.suptitle(f"acp save cost vs state size ({tensors} fp32 tensors at every size)\n{where}")
    fig.tight_layout()
    return fig


def plot_counts(plt: Any, counts: dict[str, Any], where: str) -> Any:
    rows = counts["rows"]
    n = [r["tensors"] for r in rows]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5.2))
    for label, get, color, marker, style in (
        ("acp save stall", lambda r: r["acp"]["stall"], "C0", "o", "-"),
        ("  of which: walking the state", lambda r: r["acp"]["flatten"], "C0", "x", ":"),
        ("  of which: copy", lambda r: r["acp"]["copy"], "C9", "x", ":"),
        ("  of which: other (begin_save, finish)", lambda r: r["acp"]["other"], "C4", "x", ":"),
        ("acp flush", lambda r: r["acp"]["flush"], "C1", "s", "-"),
        ("memcpy loop, 1 thread", lambda r: r["memcpy"]["one"], "0.45", "", "--"),
    ):
        med, _, err = _series(rows, get)
        ax.errorbar(
            n,
            [m * 1e3 for m in med],
            yerr=[[e * 1e3 for e in x] for x in err],
            label=label,
            color=color,
            marker=marker or None,
            linestyle=style,
            capsize=3,
        )
    ax.set(xscale="log", yscale="log", xlabel="tensors (log)", ylabel="milliseconds (log)")
    ax.set_title(f"time vs tensor count, {counts['total_bytes'] / MiB:g} MiB in all")
    ax.legend(fontsize=8)
    if counts["per_tensor"]:
        _per_tensor_panel(bx, counts["per_tensor"])
    for x in (ax, bx):
        x.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"acp save cost vs tensor count at a fixed total size\n{where}")
    fig.tight_layout()
    return fig


def _per_tensor_panel(bx: Any, pt: dict[str, Any]) -> None:
    """Overhead per tensor vs count. The y range fits the counts at least 1,000 above the
    base, where the noise of two stalls divided by n - n0 is small; the others are written at
    the edge when they fall outside."""
    n0 = pt["base_tensors"]
    xs = [int(k) for k in pt["by_count"]]
    figs = [pt["by_count"][str(x)] for x in xs]
    stall = [f["stall_us"] for f in figs]
    err = [[y - f["stall_us_low"] for y, f in zip(stall, figs)]]
    err.append([f["stall_us_high"] - y for y, f in zip(stall, figs)])
    bx.errorbar(xs, stall, yerr=err, label="save stall (bars: from min and max)", color="C0",
                marker="o", capsize=3)  # fmt: skip
    for key, label, color in (
        ("flatten_us", "  of which: walking the state", "C0"),
        ("other_us", "  of which: other (begin_save, finish)", "C4"),
    ):
        bx.plot(xs, [f[key] for f in figs], label=label, color=color, marker="x", linestyle=":")
    bx.axhline(2.0, color="C3", linestyle="--", label="target: 2 µs per tensor (stall)")
    wide = [f for x, f in zip(xs, figs) if x - n0 >= 990] or figs
    lo = min(0.0, *(f["stall_us_low"] for f in wide))
    hi = max(2.5, *(f["stall_us_high"] for f in wide))
    lo, hi = lo - 0.1 * (hi - lo), hi + 0.2 * (hi - lo)
    bx.set_ylim(lo, hi)
    for x, y in zip(xs, stall):
        inside = lo <= y <= hi
        bx.annotate(
            f"{y:.1f} µs" if inside else f"{y:.0f} µs (off scale)",
            (x, min(max(y, lo), hi)),
            textcoords="offset points",
            xytext=(0, 7 if inside or y < lo else -12),
            ha="center",
            fontsize=8,
            color="C0",
        )
    bx.set(xscale="log", xlabel="tensors (log)", ylabel="µs per extra tensor")
    bx.set_title(f"stall overhead per tensor: (t(n) - t({n0})) / (n - {n0})")
    bx.legend(fontsize=8)


# ----------------------------------------------------------------------------- main


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", type=float, nargs="+", default=None, help="state sizes, GiB")
    ap.add_argument("--large", action="store_true", help=f"allow sizes above {MAX_SIZE_GIB} GiB")
    ap.add_argument("--counts", type=int, nargs="+", default=None, help="tensor counts")
    ap.add_argument("--count-total-mib", type=float, default=None, help="default 256")
    ap.add_argument("--repeats", type=int, default=None, help="default 3")
    ap.add_argument("--axes", default="size,tensors", help="size, tensors or both (default)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a new one in /tmp)")
    ap.add_argument("--out", default=str(OUT_DEFAULT), help="output directory")
    ap.add_argument("--headroom-gib", type=float, default=2.0, help="memory kept free")
    ap.add_argument("--bs", default=baselines.FIO_BS, help="fio block size")
    ap.add_argument("--iodepth", type=int, default=baselines.FIO_IODEPTH, help="fio depth")
    ap.add_argument("--quick", action="store_true", help="a smoke run: two small sizes, 1 run")
    ap.add_argument(
        "--from-json",
        default=None,
        metavar="PATH",
        help="measure nothing: write scaling.md and the PNGs again from this scaling.json",
    )
    a = ap.parse_args(argv)
    if a.sizes is None:
        a.sizes = QUICK_SIZES if a.quick else DEFAULT_SIZES
    if a.counts is None:
        a.counts = QUICK_COUNTS if a.quick else DEFAULT_COUNTS
    if a.count_total_mib is None:
        a.count_total_mib = QUICK_COUNT_TOTAL_MIB if a.quick else 256
    if a.repeats is None:
        a.repeats = 1 if a.quick else 3
    axes = set(a.axes.split(","))
    if not axes or axes - {"size", "tensors"}:
        ap.error(f"--axes: {a.axes!r}: a comma list of size, tensors")
    a.axes = axes
    return a


def write_report(out: dict[str, Any], outdir: Path) -> list[str]:
    """scaling.md and the PNGs; returns the names written."""
    (outdir / "scaling.md").write_text(markdown(out))
    return ["scaling.md", *plots(out, outdir)]


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    started = time.perf_counter()
    outdir = Path(a.out)
    outdir.mkdir(parents=True, exist_ok=True)
    if a.from_json:
        names = write_report(json.loads(Path(a.from_json).read_text()), outdir)
        print(f"wrote {outdir}: {', '.join(names)}")
        return 0
    workdir = tempfile.mkdtemp(prefix="acp-scaling-", dir=a.dir)
    env = baselines.machine(workdir)
    env |= {
        "torch": torch.__version__,
        "acp": acp.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    print("# scaling", json.dumps(env), flush=True)
    out: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]) if argv is None else " ".join(argv),
        "machine": env,
        "args": {k: sorted(v) if isinstance(v, set) else v for k, v in vars(a).items()},
    }
    try:
        if "size" in a.axes:
            out["size"] = run_sizes(a, workdir)
        if "tensors" in a.axes:
            out["tensors"] = run_counts(a, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out["machine"]["load_average_end"] = list(os.getloadavg())
    out["wall_secs"] = time.perf_counter() - started
    (outdir / "scaling.json").write_text(json.dumps(out, indent=1) + "\n")
    names = ", ".join(["scaling.json", *write_report(out, outdir)])
    print(f"\nwrote {outdir}: {names}; {out['wall_secs']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
