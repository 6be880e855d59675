"""compare.py's Markdown report: each row against its physical floor, and acp
against each peer."""

from __future__ import annotations

from compare_harness import Ctx, Row

# ----------------------------------------------------------------------------- report


def _find(ctx: Ctx, op_start: str, kind: str | None = None) -> Row | None:
    for r in ctx.rows:
        if r.op.startswith(op_start) and not r.error and (kind is None or r.kind == kind):
            return r
    return None


def _floors(ctx: Ctx) -> dict[str, Row]:
    """The physical floors measured in this run, by row kind: the fastest
    memcpy (``copy``), the raw O_DIRECT write (``write``) and read (``read``)."""
    ok = [x for x in ctx.rows if not x.error and x.runs]
    floors = {x.kind: x for x in ok if x.kind in ("write", "read")}
    copies = [x for x in ok if x.kind == "copy"]
    if copies:
        floors["copy"] = min(copies, key=lambda x: x.median)
    return floors


def _floor_of(floors: dict[str, Row], r: Row) -> Row | None:
    """A row's floor: memcpy for copies, stalls and loads from memory (RAM,
    page cache); the raw O_DIRECT write for saves to storage; the raw
    O_DIRECT read for cold loads."""
    if r.kind in ("copy", "stall") or (r.kind == "load" and not r.cache.startswith("cold")):
        return floors.get("copy")
    return floors.get({"save": "write", "load": "read"}.get(r.kind, r.kind))


def md_tables(case: str, ctx: Ctx) -> str:
    floors = _floors(ctx)
    ref = floors.get("copy")
    lines = [
        f"\n### {case}: {len(ctx.tensors):,} tensors, {ctx.bytes / 1e9:.3f} GB\n",
        "Medians of the runs, with min and max (seconds). `x floor`: median / the median of "
        f"the row's physical floor: the fastest memcpy (`{ref.op if ref else 'none'}`) for "
        "stalls and loads from memory, the raw O_DIRECT write for saves to storage, the raw "
        "O_DIRECT read for cold loads (below 1: faster than that floor, e.g. a save that "
        "does not fsync).\n",
        "| tool | operation | median s | min s | max s | GB/s | x floor | floor | note |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in ctx.rows:
        if r.error:
            lines.append(f"| {r.group} | {r.op} | FAILED | | | | | | {r.error[:100]} |")
            continue
        base = _floor_of(floors, r)
        ratio = f"{r.median / base.median:.2f}" if base and base is not r else "-"
        floor = {"copy": "memcpy", "write": "O_DIRECT write", "read": "O_DIRECT read"}
        floor_name = floor.get(base.kind, "") if base and base is not r else ""
        note = ", ".join(x for x in (r.cache, r.note) if x)
        lines.append(
            f"| {r.group} | {r.op} | {r.median:.4f} | {min(r.runs):.4f} | {max(r.runs):.4f} | "
            f"{ctx.bytes / r.median / 1e9:.2f} | {ratio} | {floor_name} | {note} |"
        )
    lines += ["", _peer_table(ctx), "", *verdicts(ctx)]
    return "\n".join(lines)


def _ratio_line(
    name: str, target: float, num: Row | None, den: float | None, what: str, *, pair: str
) -> str:
    """``num`` against ``den`` (the block's median of ``what``), or, when its runs
    were paired, against ``pair``: what ran right before each of them."""
    if num is None or den is None:
        return f"- {name}: not measured in this run ({what})"
    block = num.median / den
    paired = num.paired_ratio()
    if paired is None:
        return (
            f"- {name}: {block:.2f}x {what} (target <= {target}x; ratio of the two "
            f"medians): **{'met' if block <= target else 'MISSED'}**"
        )
    return (
        f"- {name}: {paired:.2f}x {pair} (target <= {target}x; median of "
        f"{len(num.paired)} per-pair ratios, each run right after its floor; "
        f"{block:.2f}x {what} by the medians of the two blocks): "
        f"**{'met' if paired <= target else 'MISSED'}**"
    )


def verdicts(ctx: Ctx) -> list[str]:
    """One line per issue-16 target that this run measures, each the median of
    the per-pair ratios where acp's runs were paired with their baseline
    (``Row.paired``), else the ratio of two medians of this run, and the
    target's verdict."""
    floors = _floors(ctx)
    copy, write, read = (floors.get(k) for k in ("copy", "write", "read"))
    ram = _find(ctx, "ckpt.load(into=state) from RAM")
    cold = _find(ctx, "ckpt.load(into=state) from storage, cold")
    warm_st = next(
        (r for r in ctx.rows if r.op.startswith("safetensors load_file") and r.cache == "warm"),
        None,
    )
    cold_torch = next(
        (r for r in ctx.rows if r.op.startswith("torch.load") and r.cache.startswith("cold")),
        None,
    )
    out = ["Issue 16's targets in this run (same-run ratios):", ""]
    out.append(
        _ratio_line(
            "1. verified restore from RAM",
            1.3,
            ram,
            copy.median if copy else None,
            "the fastest memcpy",
            pair="a memcpy on every core",
        )
    )
    if ram and warm_st:
        faster = ram.median < warm_st.median
        out.append(
            f"- 1b. against safetensors `load_file` + copy from a warm page cache: acp "
            f"{ram.median:.4f} s, safetensors {warm_st.median:.4f} s: "
            f"**{'met' if faster else 'MISSED'}** (target: acp faster)"
        )
    out.append(
        _ratio_line(
            "2. save stall",
            1.2,
            _find(ctx, "ckpt.save [stall]"),
            copy.median if copy else None,
            "the fastest memcpy",
            pair="a memcpy on every core",
        )
    )
    out.append(
        _ratio_line(
            "3. save until committed",
            1.1,
            _find(ctx, "ckpt.save [total]"),
            copy.median + write.median if copy and write else None,
            "memcpy + the raw O_DIRECT write and fsync",
            pair="a memcpy on every core + the raw O_DIRECT write and fsync",
        )
    )
    out.append(
        _ratio_line(
            "4. cold restore from storage",
            1.2,
            cold,
            read.median + copy.median if read and copy else None,
            "the raw O_DIRECT read + a memcpy of the same bytes (the scatter)",
            pair="the raw O_DIRECT read + a memcpy on every core of the same bytes (the scatter)",
        )
    )
    if cold and cold_torch:
        faster = cold.median < cold_torch.median
        out.append(
            f"- 4b. against `torch.load` + copy, cold: acp {cold.median:.4f} s, "
            f"torch.load {cold_torch.median:.4f} s: "
            f"**{'met' if faster else 'MISSED'}** (target: acp faster)"
        )
    return out


def _peer_table(ctx: Ctx) -> str:
    """acp against each peer: peer median / acp median (above 1: acp is faster)."""
    acp_rows = {
        "save stall": _find(ctx, "ckpt.save [stall]"),
        "save, to committed": _find(ctx, "ckpt.save [total]"),
        "load from RAM": _find(ctx, "ckpt.load(into=state) from RAM"),
        "load from storage, cold": _find(ctx, "ckpt.load(into=state) from storage, cold"),
    }
    peers = {
        "torch.save / torch.load": {
            "save stall": "torch.save + fsync",
            "save, to committed": "torch.save + fsync",
            "load from RAM": "torch.load(weights_only) + copy into state, warm",
            "load from storage, cold": "torch.load(weights_only) + copy into state, cold",
        },
        "safetensors": {
            "save stall": "safetensors save_file + fsync",
            "save, to committed": "safetensors save_file + fsync",
            "load from RAM": "safetensors load_file + copy into state, warm",
            "load from storage, cold": "safetensors load_file + copy into state, cold",
        },
        "dcp.save / dcp.load": {
            "save stall": "dcp.save",
            "save, to committed": "dcp.save",
            "load from RAM": "dcp.load (in place), warm",
            "load from storage, cold": "dcp.load (in place), cold",
        },
        "dcp.async_save": {
            "save stall": "dcp.async_save [blocking]",
            "save, to committed": "dcp.async_save [total]",
        },
        "MindSpore .ckpt": {
            "save stall": "save_checkpoint(ckpt) + fsync",
            "save, to committed": "save_checkpoint(ckpt) + fsync",
            "load from RAM": "load_checkpoint(ckpt) + load_param_into_net + write every page, warm",
            "load from storage, cold": (
                "load_checkpoint(ckpt) + load_param_into_net + write every page, cold"
            ),
        },
        "MindSpore async .ckpt": {
            "save stall": "save_checkpoint(ckpt, async_save=True) [blocking]",
            "save, to committed": "save_checkpoint(ckpt, async_save=True) [total]",
        },
    }
    head = "| acp | acp s | " + " | ".join(peers) + " |"
    lines = [
        "acp against each peer: peer median / acp median (above 1: acp is faster). Peers' "
        'loads "from RAM" are from a warm page cache.\n',
        head,
        "|---|---:|" + "---:|" * len(peers),
    ]
    for metric, row in acp_rows.items():
        if row is None:
            continue
        cells = []
        for ops in peers.values():
            op = ops.get(metric)
            peer = None
            if op is not None:
                peer = next((r for r in ctx.rows if r.op == op and not r.error), None)
            cells.append(f"{peer.median / row.median:.1f}x" if peer else "-")
        lines.append(f"| {metric} | {row.median:.4f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
