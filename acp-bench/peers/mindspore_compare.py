#!/usr/bin/env python3
"""acp vs MindSpore's own checkpointing, on the same parameters, in one run.

    python acp-bench/peers/mindspore_compare.py                 # 0.25 GiB, 3 repeats
    python acp-bench/peers/mindspore_compare.py --size-gib 1    # the README figure
    python acp-bench/peers/mindspore_compare.py --json out.json

Needs MindSpore (2.10 CPU wheel) and the acp wheel in the same environment
(``make build-dev``). The state is a dict of ``mindspore.Parameter`` (fp32,
a transformer-like mix of large matrices and ~500 small vectors) held by a
``Cell``, so both sides load "into the network".

Rows (median of ``--repeats``; GB = 1e9 bytes; "x acp" divides by the acp
row it competes with):

- ``acp save: stall`` — ``acp.mindspore.save`` returning (the copy into the
  ring; steady state, after one warm-up save);
- ``acp save: until committed`` — stall + flush (O_DIRECT) + fsync + commit;
- ``acp restore from RAM into the net`` — ``acp.mindspore.load_into_net``
  from the resident slot, in place, blake3-verified (the default), then the
  same with ``verify="storage_only"`` (RAM loads not verified);
- ``acp restore from RAM, fresh Parameters`` — ``acp.mindspore.load_params``;
- ``acp restore from storage into the net`` — ``storage_only=True``;
- ``mindspore.save_checkpoint`` (``.ckpt`` and ``safetensors``): synchronous
  (as returned, and + fsync, which MindSpore never does), and
  ``async_save=True``: blocking (what training waits for) and total;
- ``mindspore.load_checkpoint + load_param_into_net`` for both formats (the
  file is in the page cache: the best case for MindSpore): as returned, then
  after reading one byte of every page, then after writing one too.
  MindSpore's safetensors loader maps the file, so its data is read on
  first use and copied on first write; the first optimizer step writes
  every parameter, so the last row is the one compared with acp (whose
  restore leaves every byte in the parameters' own memory);
- ``raw memcpy`` into a pre-faulted buffer: the floor for any stall.

Importable: ``run(size_gib, repeats, workdir)`` returns the result
(``{"info", "rows"}``) and ``markdown(result)`` the table, so a combined
comparison script can call them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

GiB = 1 << 30
MiB = 1 << 20


def _shapes(size_gib: float, small: int = 500) -> dict[str, tuple[int, ...]]:
    """Parameter shapes totalling about ``size_gib`` of fp32: layers of
    four big matrices (attention, MLP) and biases, small vectors, and an
    embedding taking up the rest."""
    target = int(size_gib * GiB) // 4  # elements
    h = 1024 if size_gib < 0.5 else 2048
    shapes: dict[str, tuple[int, ...]] = {}
    per_layer = 12 * h * h + 9 * h
    layers = max(1, int(target * 0.85) // per_layer)
    for i in range(layers):
        p = f"layers.{i}."
        shapes[p + "attn.qkv.weight"] = (3 * h, h)
        shapes[p + "attn.qkv.bias"] = (3 * h,)
        shapes[p + "attn.proj.weight"] = (h, h)
        shapes[p + "attn.proj.bias"] = (h,)
        shapes[p + "mlp.up.weight"] = (4 * h, h)
        shapes[p + "mlp.up.bias"] = (4 * h,)
        shapes[p + "mlp.down.weight"] = (h, 4 * h)
        shapes[p + "mlp.down.bias"] = (h,)
    for j in range(small):
        shapes[f"norms.{j}.gamma"] = (256,)
    used = sum(int(np.prod(s)) for s in shapes.values())
    shapes["embed.weight"] = (max(1, (target - used) // h), h)
    return shapes


def _params(size_gib: float) -> dict[str, Any]:
    from mindspore import Parameter, Tensor

    rng = np.random.default_rng(0)
    pattern = rng.standard_normal(16 * MiB // 4).astype(np.float32)
    out = {}
    for name, shape in _shapes(size_gib).items():
        a = np.empty(shape, np.float32).reshape(-1)
        for off in range(0, a.size, pattern.size):
            n = min(pattern.size, a.size - off)
            a[off : off + n] = pattern[:n]
        out[name] = Parameter(Tensor.from_numpy(a.reshape(shape)), name=name)
    return out


def _holder(params: dict[str, Any]) -> Any:
    """A Cell whose parameters are ``params`` (names kept)."""
    from mindspore import ParameterTuple, nn

    class Holder(nn.Cell):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.all = ParameterTuple(list(params.values()))

    return Holder()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rm(path: Path) -> None:
    if path.exists():
        path.chmod(0o600)  # MindSpore leaves its checkpoints read-only
        path.unlink()


def _touch(cell: Any, *, write: bool) -> int:
    """Reads (or writes) one byte of every 4 KiB page of the cell's
    parameters. MindSpore's safetensors loader maps the file: its pages are
    read on first use and copied on first write (the first optimizer step
    writes every parameter)."""
    total = 0
    for p in cell.get_parameters():
        a = p.asnumpy().reshape(-1).view(np.uint8)
        if write:
            a[::4096] ^= 0  # a store that leaves the value as it was
        else:
            total += int(a[::4096].sum())
    return total


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


class _Rows:
    def __init__(self, nbytes: int, log: Callable[[str], None]) -> None:
        self.nbytes = nbytes
        self.log = log
        self.rows: list[dict[str, Any]] = []

    def add(self, op: str, runs: list[float], versus: float | None = None) -> float:
        m = _median(runs)
        row = {"op": op, "median_s": m, "runs_s": runs, "GBps": self.nbytes / m / 1e9}
        if versus is not None:
            row["x_acp"] = m / versus if versus > 0 else float("nan")
        self.rows.append(row)
        self.log(f"  {op:66s} {m:8.4f} s  {self.nbytes / m / 1e9:7.2f} GB/s")
        return m


def _bench_memcpy(params: dict[str, Any], rows: _Rows, repeats: int) -> None:
    """The floor of any stall: one copy into a pre-faulted buffer."""
    dst = np.empty(rows.nbytes, np.uint8)
    dst[:] = 1
    srcs = [p.asnumpy().reshape(-1).view(np.uint8) for p in params.values()]
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        off = 0
        for s in srcs:
            np.copyto(dst[off : off + s.size], s)
            off += s.size
        times.append(time.perf_counter() - t)
    rows.add("raw memcpy into a pre-faulted buffer", times)


def _timed(repeats: int, fn: Callable[[], object]) -> list[float]:
    times = []
    for _ in range(repeats):
        gc.collect()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def _bench_acp(
    params: dict[str, Any], holder: Any, rows: _Rows, *, repeats: int, base: Path, verify: bool
) -> tuple[float, float]:
    """acp's rows; returns its stall and its restore from RAM."""
    root = base / "acp"
    shutil.rmtree(root, ignore_errors=True)
    # Resident slots outlive the checkpointer (that is the point): a private
    # directory for them, removed at the end.
    shm = Path(tempfile.mkdtemp(prefix="acp-ms-bench-", dir=_shm_base(base)))
    try:
        return _bench_acp_in(
            params, holder, rows, repeats=repeats, root=root, shm=shm, verify=verify
        )
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def _shm_base(base: Path) -> str:
    return "/dev/shm" if Path("/dev/shm").is_dir() else str(base)


def _bench_acp_in(
    params: dict[str, Any],
    holder: Any,
    rows: _Rows,
    *,
    repeats: int,
    root: Path,
    shm: Path,
    verify: bool,
) -> tuple[float, float]:
    import acp
    import acp.mindspore as am

    slots = 2
    opts: dict[str, Any] = {
        "job": f"bench-ms-{uuid.uuid4().hex[:8]}",
        "shm_dir": shm,
        "ring_bytes": slots * (rows.nbytes + 64 * MiB),
        "ring_slots": slots,
        "keep_last": 2,
        # The same parameters every step: written whole, as the peers do.
        "incremental": False,
    }

    def into_net(ckpt: acp.Checkpointer, **kw: Any) -> None:
        report = am.load_into_net(ckpt, holder, **kw)
        assert (report.param_not_load, report.ckpt_not_load) == ([], [])
        assert report.stats is not None
        assert report.stats.source == ("storage" if kw.get("storage_only") else "ram")

    with acp.Checkpointer(root, **opts, verify=None if verify else "storage_only") as ckpt:
        for step in range(slots):  # warm-up: every slot is faulted in once
            am.save(ckpt, step, params=params).wait()
        stalls, totals = [], []
        for step in range(slots, slots + repeats):
            t = time.perf_counter()
            h = am.save(ckpt, step, params=params)
            stalls.append(time.perf_counter() - t)
            h.wait()
            totals.append(time.perf_counter() - t)
        stall = rows.add("acp save: stall (copy into the ring)", stalls)
        rows.rows[-1]["x_acp"] = 1.0
        rows.add("acp save: until committed (flush, fsync, commit)", totals)
        check = "blake3-verified" if verify else "verify=storage_only"
        restore = rows.add(
            f"acp restore from RAM into the net, in place ({check})",
            _timed(repeats, lambda: into_net(ckpt)),
        )
        rows.rows[-1]["x_acp"] = 1.0
        rows.add(
            "acp restore from RAM, fresh Parameters", _timed(repeats, lambda: am.load_params(ckpt))
        )
        rows.add(
            "acp restore from storage into the net",
            _timed(repeats, lambda: into_net(ckpt, storage_only=True)),
        )
        check_params = am.load_params(ckpt)
        for k in [*list(params)[:3], *list(params)[-3:]]:
            assert np.array_equal(check_params[k].asnumpy(), params[k].asnumpy()), k
        del check_params, h
    gc.collect()  # a save handle or a loaded checkpoint keeps the ring mapped
    if verify:  # the same resident checkpoint, reopened without verifying RAM loads
        with acp.Checkpointer(root, **opts, verify="storage_only") as ckpt:
            rows.add(
                "acp restore from RAM into the net, in place (verify=storage_only)",
                _timed(repeats, lambda: into_net(ckpt)),
            )
    gc.collect()
    return stall, restore


def _bench_mindspore(
    params: dict[str, Any],
    holder: Any,
    rows: _Rows,
    *,
    repeats: int,
    base: Path,
    acp_stall: float,
    acp_restore: float,
) -> None:
    import mindspore as ms
    import mindspore.train.serialization as ser

    for fmt in ("ckpt", "safetensors"):
        path = base / f"ms.{fmt}"
        sync, sync_fsync = [], []
        for _ in range(repeats):
            _rm(path)
            t = time.perf_counter()
            ms.save_checkpoint(params, str(path), format=fmt)
            t1 = time.perf_counter()
            _fsync(path)
            sync.append(t1 - t)
            sync_fsync.append(time.perf_counter() - t)
        rows.add(f"mindspore.save_checkpoint({fmt}): as returned", sync, acp_stall)
        rows.add(f"mindspore.save_checkpoint({fmt}) + fsync", sync_fsync)
        blocking, total = [], []
        for _ in range(repeats):
            _rm(path)
            gc.collect()
            t = time.perf_counter()
            ms.save_checkpoint(params, str(path), async_save=True, format=fmt)
            blocking.append(time.perf_counter() - t)
            ser._wait_async_thread_save_ckpt()
            _fsync(path)
            total.append(time.perf_counter() - t)
        rows.add(
            f"mindspore.save_checkpoint({fmt}, async_save=True): blocking", blocking, acp_stall
        )
        rows.add(f"mindspore.save_checkpoint({fmt}, async_save=True): + write + fsync", total)
        loads, read, written = [], [], []
        for _ in range(repeats):
            gc.collect()
            t = time.perf_counter()
            loaded = ms.load_checkpoint(str(path), format=fmt)
            not_loaded = ms.load_param_into_net(holder, loaded)
            loads.append(time.perf_counter() - t)
            _touch(holder, write=False)
            read.append(time.perf_counter() - t)
            _touch(holder, write=True)
            written.append(time.perf_counter() - t)
            assert not_loaded == ([], [])
            del loaded
        what = f"mindspore.load_checkpoint({fmt}) + load_param_into_net"
        rows.add(what, loads)
        rows.add(f"{what} + read every page", read)
        rows.add(f"{what} + read and write every page", written, acp_restore)
        _rm(path)


def run(
    size_gib: float = 0.25,
    repeats: int = 3,
    workdir: str | os.PathLike[str] | None = None,
    *,
    verify: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measures everything once on the same parameters; see the module doc."""
    import mindspore as ms

    import acp

    ms.set_device("CPU")
    base = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="acp-ms-"))
    base.mkdir(parents=True, exist_ok=True)
    params = _params(size_gib)
    nbytes = sum(int(p.nbytes) for p in params.values())
    holder = _holder(params)
    info = {
        "mindspore": ms.__version__,
        "acp": acp.__version__,
        "python": sys.version.split()[0],
        "parameters": len(params),
        "bytes": nbytes,
        "repeats": repeats,
        "workdir": str(base),
        "note": "no drop_caches: MindSpore loads read from the page cache",
    }
    log(f"# {len(params)} parameters, {nbytes / 1e9:.3f} GB, {repeats} repeats, in {base}")
    rows = _Rows(nbytes, log)
    _bench_memcpy(params, rows, repeats)
    stall, restore = _bench_acp(params, holder, rows, repeats=repeats, base=base, verify=verify)
    _bench_mindspore(
        params, holder, rows, repeats=repeats, base=base, acp_stall=stall, acp_restore=restore
    )
    return {"info": info, "rows": rows.rows}


def markdown(result: dict[str, Any]) -> str:
    info = result["info"]
    lines = [
        f"{info['parameters']} MindSpore parameters, {info['bytes'] / 1e9:.3f} GB fp32, "
        f"MindSpore {info['mindspore']}, acp {info['acp']}, median of {info['repeats']}.",
        "",
        "| operation | median s | GB/s | x acp |",
        "|---|---:|---:|---:|",
    ]
    for r in result["rows"]:
        ratio = f"{r['x_acp']:.1f}" if "x_acp" in r else ""
        lines.append(f"| {r['op']} | {r['median_s']:.4f} | {r['GBps']:.2f} | {ratio} |")
    lines.append("")
    lines.append(
        "x acp: MindSpore's saves divided by acp's stall, its loads (read and write every page) "
        "by acp's verified restore from RAM."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=0.25)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="work directory (default: a new temp dir)")
    ap.add_argument("--json", default=None, help="also write the result here")
    ap.add_argument(
        "--no-verify",
        action="store_true",
        help="acp loads from RAM skip blake3 (verify=storage_only)",
    )
    a = ap.parse_args(argv)
    result = run(a.size_gib, a.repeats, a.dir, verify=not a.no_verify)
    print()
    print(markdown(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    if a.dir is None:
        shutil.rmtree(result["info"]["workdir"], ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
