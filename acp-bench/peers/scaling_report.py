"""scaling.py's report: scaling.md's tables and the two PNG plots, from the
figures ``scaling.py`` measured (or its ``scaling.json``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from baselines import GiB, MiB


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
