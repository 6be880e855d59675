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
from scaling_report import dur, markdown, plots
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
