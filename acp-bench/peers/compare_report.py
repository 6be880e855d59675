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
    lines += ["", _peer_table(ctx)]
    return "\n".join(lines)


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
