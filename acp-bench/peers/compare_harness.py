"""compare.py's harness: the state every tool saves and loads, cache handling,
and the measuring context (``Ctx``) with its rows (``Row``) and tool groups
(``Group``), which plugins of ``compare.py --plugin`` use too."""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from baselines import GiB, MiB, drop_caches, files_under
from states import fill, transformer_layer

PAGE = 4096


# ----------------------------------------------------------------------------- the state


def make_state(size_gib: float, extra_small: int) -> dict[str, Any]:
    """``{"model": params, "optim": Adam state_dict}`` of about ``size_gib`` GiB in all."""
    target = int(size_gib * GiB) // 3  # params; Adam adds two tensors of the same size
    h = 512 if target < 256 * MiB else 1024 if target < 2 * GiB else 2048
    g = torch.Generator().manual_seed(0)
    small = [int(x) * 256 for x in torch.randint(1, 65, (extra_small,), generator=g)]
    small_bytes = sum(s * 4 for s in small)
    per_layer = (12 * h * h + 13 * h) * 4
    layers = max(1, int((target - small_bytes) * 0.9) // per_layer)
    vocab = max(1, (target - small_bytes - layers * per_layer) // (h * 4))
    params: dict[str, torch.Tensor] = {"embed.weight": torch.empty(vocab, h)}
    for i in range(layers):
        p = f"layers.{i}."
        for name, shape in transformer_layer(h):
            params[p + name] = torch.empty(shape)
    for j, s in enumerate(small):
        params[f"adapters.{j}.scale"] = torch.empty(s)
    names = list(params)
    optim = {
        "state": {
            i: {
                "step": torch.tensor(100.0),
                "exp_avg": torch.empty_like(params[n]),
                "exp_avg_sq": torch.empty_like(params[n]),
            }
            for i, n in enumerate(names)
        },
        "param_groups": [
            {
                "lr": 1e-3,
                "betas": (0.9, 0.999),
                "eps": 1e-8,
                "weight_decay": 0.0,
                "amsgrad": False,
                "maximize": False,
                "foreach": None,
                "capturable": False,
                "differentiable": False,
                "fused": None,
                "decoupled_weight_decay": False,
                "params": list(range(len(names))),
            }
        ],
    }
    state = {"model": params, "optim": optim}
    fill(tensors_of(state))
    return state


def tensors_of(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_of(v)]
    return []


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def flatten(obj: Any, prefix: str = "") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Named tensors and the JSON-able rest, for safetensors (which holds only tensors)."""
    flat: dict[str, torch.Tensor] = {}
    rest: dict[str, Any] = {}
    if isinstance(obj, torch.Tensor):
        flat[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            f, r = flatten(v, f"{prefix}.{k}" if prefix else str(k))
            flat.update(f)
            rest.update(r)
    else:
        rest[prefix] = obj
    return flat, rest


def fingerprint(tensors: list[torch.Tensor]) -> int:
    """A cheap checksum over a sample of every tensor's bytes."""
    total = 0
    for t in tensors:
        u = t.reshape(-1).view(torch.uint8)
        if u.numel():
            total += int(u[:: PAGE + 1].sum()) + int(u[-1]) * 7 + u.numel()
    return total


def copy_tree(dst: Any, src: Any) -> None:
    """Copies the tensors of ``src`` into the same places of ``dst``."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, dict):
        for k, v in dst.items():
            copy_tree(v, src[k])
    elif isinstance(dst, (list, tuple)):
        for d, s in zip(dst, src):
            copy_tree(d, s)


# ----------------------------------------------------------------------------- caches, files


def warm(paths: list[str]) -> str:
    buf = bytearray(16 * MiB)
    for p in files_under(paths):
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return "warm"


def rm(p: str) -> None:
    if os.path.isdir(p):
        shutil.rmtree(p)
    elif os.path.exists(p):
        os.unlink(p)


# ----------------------------------------------------------------------------- measuring


@dataclass
class Row:
    group: str
    op: str
    kind: str  # "copy", "save", "stall", "load"
    runs: list[float] = field(default_factory=list)
    cache: str = ""
    note: str = ""
    error: str = ""
    # The baseline run right before each of ``runs`` (``Ctx.measure``'s
    # ``pair``), in the same order: ratios per pair steady a verdict on a
    # machine whose speed moves between minutes.
    paired: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    def paired_ratio(self) -> float | None:
        """The median of ``run / baseline`` over the pairs; None without pairs."""
        if not self.paired or len(self.paired) != len(self.runs):
            return None
        return statistics.median(r / p for r, p in zip(self.runs, self.paired) if p > 0)


@dataclass
class Group:
    """One tool. ``run(ctx)`` measures its operations with ``ctx.measure``."""

    name: str
    run: Callable[[Ctx], None]


class Ctx:
    def __init__(self, state: dict[str, Any], workdir: str, repeats: int) -> None:
        self.state = state
        self.tensors = tensors_of(state)
        self.bytes = sum(nbytes(t) for t in self.tensors)
        self.dir = workdir
        self.repeats = repeats
        self.rows: list[Row] = []
        self.expected = fingerprint(self.tensors)
        self.cache_modes: set[str] = set()
        # The physical floors, each a callable that runs one and returns its
        # seconds ("copy", "write", "read"), set by compare.py's baselines:
        # a tool pairs its runs with them (``measure``'s ``pair``).
        self.floors: dict[str, Callable[[], float]] = {}

    def zero(self) -> None:
        for t in self.tensors:
            t.zero_()

    def check(self, what: str) -> None:
        if fingerprint(self.tensors) != self.expected:
            raise AssertionError(f"{what}: the state's bytes differ after the load")

    def measure(
        self,
        group: str,
        op: str,
        kind: str,
        fn: Callable[[], Any],
        *,
        before: Callable[[], Any] | None = None,
        cache: str | None = "cold",
        paths: Callable[[], list[str]] | None = None,
        after: Callable[[], Any] | None = None,
        note: str = "",
        pair: Callable[[], dict[str, float]] | None = None,
    ) -> dict[str, Row]:
        """Runs ``fn`` ``repeats`` times. ``fn`` may return ``{"blocking": s, "total": s}``
        (async saves): each key becomes its own row. ``pair``, when given, runs right
        before each run (before ``before`` and the cache handling) and returns the
        baseline's seconds for some of those keys (``"time"`` for a plain ``fn``): they
        go to the rows' ``paired``. Errors are reported, not raised."""
        rows: dict[str, Row] = {}
        for _ in range(self.repeats):
            base = pair() if pair is not None else {}
            if before is not None:
                before()
            mode = ""
            if cache == "cold":
                mode = drop_caches(paths() if paths else [self.dir])
            elif cache == "warm":
                mode = warm(paths() if paths else [])
            self.cache_modes.add(mode)
            gc.collect()
            try:
                t0 = time.perf_counter()
                out = fn()
                dt = time.perf_counter() - t0
                if after is not None:
                    after()
            except Exception as e:  # report and go on: one tool failing must not stop the rest
                msg = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"  {group} {op}: FAILED {msg}", flush=True)
                row = Row(group, op, kind, cache=mode, error=msg)
                self.rows.append(row)
                return {"time": row}
            parts = out if isinstance(out, dict) else {"time": dt}
            for key, secs in parts.items():
                if key not in rows:
                    label = op if key == "time" else f"{op} [{key}]"
                    k = "stall" if key in ("blocking", "stall") else kind
                    rows[key] = Row(
                        group, label, k, cache=mode if kind == "load" else "", note=note
                    )
                rows[key].runs.append(secs)
                if key in base:
                    rows[key].paired.append(base[key])
        for row in rows.values():
            self.rows.append(row)
            print(
                f"  {row.op:58s} {row.median:8.4f} s  {self.bytes / row.median / 1e9:6.2f} GB/s"
                f"  {row.cache}",
                flush=True,
            )
        return rows

    def measure_loads(
        self,
        group: str,
        op: str,
        fn: Callable[[], Any],
        path: str,
        what: str,
        *,
        zero: Callable[[], Any] | None = None,
        check: Callable[[], Any] | None = None,
        pair_cold: Callable[[], dict[str, float]] | None = None,
    ) -> list[dict[str, Row]]:
        """A load of ``path``, cold then warm: into a zeroed state (``zero``,
        by default the state's tensors), its bytes checked after
        (``check``, by default against the state's fingerprint); each cold
        run paired with ``pair_cold`` (``measure``'s ``pair``)."""
        return [
            self.measure(
                group,
                f"{op}, {cache}",
                "load",
                fn,
                before=zero or self.zero,
                cache=cache,
                paths=lambda: [path],
                after=check or (lambda: self.check(what)),
                pair=pair_cold if cache == "cold" else None,
            )
            for cache in ("cold", "warm")
        ]
