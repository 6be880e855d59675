#!/usr/bin/env python3
"""acp with several ranks against ``dcp.async_save``, on one machine.

    python acp-bench/peers/dist_bench.py                       # 2 and 4 ranks, 128 MiB state
    python acp-bench/peers/dist_bench.py --ranks 2 4 --mib 256 --saves 5 --json out.json

Each rank count runs under torchrun (gloo, CPU). Every rank holds the same
data-parallel state (``--mib`` MiB of fp32 tensors of mixed sizes, identical
on every rank, as DDP keeps it) and saves it ``--saves`` times with each
method, after ``--warmup`` unmeasured saves (the first saves into acp's ring
slots create them; DCP's first async_save sets up its stager and threads):

- ``acp replicated``: ``ckpt.save(step, state, replicated=True)``: each tensor
  is written by one rank (greedy balance by bytes);
- ``acp per rank``: ``ckpt.save(step, state)``: every rank writes its copy;
- ``dcp.async_save``: DCP's ``FileSystemWriter`` with its default stager (its
  planner deduplicates replicated tensors across ranks);
- ``acp via dcp``: ``dcp.async_save`` with ``acp.dcp.StorageWriter`` and
  ``acp.dcp.Stager`` (the stager copies the whole local state: no dedup).

``--policy`` measures the persist policy instead: each rank saves
``--policy-saves`` steps back to back, one per ``--step-ms`` of simulated
compute, once with the default policy (several ranks coalescing together:
rank 0 decides, every rank holds each save until it knows) and once with
``persist_every=1``; the table gives the saves per persist, the median
stall, the wall time until every step chosen is committed (``close``) and
the bytes written.

Measured per save and rank: the **stall** (until ``save``/``async_save``
returns, i.e. what training waits for) and **save → commit** (from the call
to its completion: acp's handle, DCP's future; with several ranks that is
when the step is committed for every rank). Ranks start each save together
(a barrier) and the next save starts once every rank's is done. **Written**
is the bytes of one step on storage (all ranks' files). Both tools fsync.
Output: a Markdown table (medians over saves; stall: the median rank and
the slowest rank), and ``--json`` with every measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")

METHODS = ["acp replicated", "acp per rank", "dcp.async_save", "acp via dcp"]


def make_state(mib: int) -> dict[str, Any]:
    """``mib`` MiB of fp32 in tensors of mixed sizes (3:1), with their
    biases, identical on every rank."""
    import torch

    gen = torch.Generator().manual_seed(0)
    unit = (mib << 20) // 4 // 32  # elements: 8 big (3 units) + 8 small (1 unit)
    state: dict[str, Any] = {}
    for i in range(8):
        state[f"layer{i}.w1"] = torch.randn(3 * unit, generator=gen)
        state[f"layer{i}.w2"] = torch.randn(unit, generator=gen)
        state[f"layer{i}.b"] = torch.randn(256, generator=gen)
    return {"model": state, "step": 0}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(args: argparse.Namespace, save: Any, written: Any) -> list[dict[str, Any]]:
    """``--warmup`` then ``--saves`` saves: ``save(step)`` starts one and
    returns what waits for its completion; ``written(step)`` (rank 0) is
    the bytes it left on storage."""
    import torch.distributed as dist

    runs = []
    for i in range(args.warmup + args.saves):
        step = i + 1
        dist.barrier()
        t0 = time.perf_counter()
        done = save(step)
        stall = time.perf_counter() - t0
        done()
        total = time.perf_counter() - t0
        dist.barrier()
        nbytes = written(step) if dist.get_rank() == 0 else None
        if i >= args.warmup:
            runs.append({"stall": stall, "commit": total, "written": nbytes})
    return runs


def bench_acp(args: argparse.Namespace, state: Any, ring: int) -> dict[str, Any]:
    import acp

    out = {}
    for method, replicated in (("acp replicated", True), ("acp per rank", False)):
        root = Path(args.dir) / method.replace(" ", "-")
        ckpt = acp.Checkpointer(
            root, job=str(root), shm_dir=args.shm, ring_bytes=ring, mlock=False, keep_last=1
        )

        def save(step: int, ckpt: Any = ckpt, replicated: bool = replicated) -> Any:
            return ckpt.save(step, state, replicated=replicated).wait

        def written(step: int, root: Path = root) -> int:
            return dir_bytes(root / f"step-{step:012d}")

        out[method] = measure(args, save, written)
        ckpt.close()
    return out


def bench_dcp(args: argparse.Namespace, state: Any, ring: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    import acp
    import acp.dcp

    out = {}
    # DCP's own async_save: FileSystemWriter and its default stager.
    base = Path(args.dir) / "dcp"

    def dcp_save(step: int) -> Any:
        return dcp.async_save(state, checkpoint_id=str(base / f"{step}")).result

    def dcp_written(step: int) -> int:
        nbytes = dir_bytes(base / f"{step}")
        shutil.rmtree(base / f"{step - 1}", ignore_errors=True)
        return nbytes

    out["dcp.async_save"] = measure(args, dcp_save, dcp_written)

    # acp through DCP.
    root = Path(args.dir) / "acp-dcp"
    ckpt = acp.Checkpointer(root, job=str(root), shm_dir=args.shm, ring_bytes=ring, mlock=False)
    writer = acp.dcp.StorageWriter(ckpt)
    stager = acp.dcp.Stager(writer)

    def acp_dcp_save(step: int) -> Any:
        writer.reset(step)
        fut = dcp.async_save(state, checkpoint_id=step, storage_writer=writer, async_stager=stager)
        return fut.result

    def acp_dcp_written(step: int) -> int:
        nbytes = dir_bytes(root / f"step-{step:012d}")
        ckpt.retain(1)
        return nbytes

    out["acp via dcp"] = measure(args, acp_dcp_save, acp_dcp_written)
    ckpt.close()
    return out


POLICIES = {"coalesce (agreed)": {}, "every save": {"persist_every": 1}}


def bench_policy(args: argparse.Namespace, state: Any, ring: int) -> dict[str, Any]:
    """Each policy: ``--policy-saves`` saves, one per ``--step-ms`` of
    simulated compute (ranks in step by a barrier, as collectives keep
    them), then ``close`` (which commits the newest step)."""
    import torch.distributed as dist

    import acp

    out = {}
    for name, kwargs in POLICIES.items():
        root = Path(args.dir) / name.split()[0]
        ckpt = acp.Checkpointer(
            root,
            job=str(root),
            shm_dir=args.shm,
            ring_bytes=ring,
            ring_slots=3,
            mlock=False,
            **kwargs,
        )
        stalls = []
        dist.barrier()
        t0 = time.perf_counter()
        for step in range(1, args.policy_saves + 1):
            dist.barrier()
            time.sleep(args.step_ms / 1e3)  # the training step's compute
            t = time.perf_counter()
            ckpt.save(step, state)
            stalls.append(time.perf_counter() - t)
        ckpt.close()
        dist.barrier()
        wall = time.perf_counter() - t0
        out[name] = {
            "saves": args.policy_saves,
            # Committed by the policy, and the newest by close.
            "persisted": len(list(root.glob("step-*"))),
            "stall": statistics.median(stalls),
            "wall": wall,
            "written": dir_bytes(root),
        }
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
    return out


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state = make_state(args.mib)
    state_bytes = sum(t.numel() * 4 for t in state["model"].values())
    ring = 3 * (state_bytes + (16 << 20))
    if args.policy:
        runs = bench_policy(args, state, ring)
    else:
        runs = {**bench_acp(args, state, ring), **bench_dcp(args, state, ring)}
    out = {"rank": rank, "world": world, "state_bytes": state_bytes, "runs": runs}
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> dict[int, list[dict[str, Any]]]:
    results: dict[int, list[dict[str, Any]]] = {}
    for n in args.ranks:
        work = Path(tempfile.mkdtemp(prefix=f"acp-dist-bench-{n}-", dir=args.dir))
        shm = Path(tempfile.mkdtemp(prefix="acp-dist-bench-", dir="/dev/shm"))
        out = work / "results"
        out.mkdir()
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={n}",
            "--standalone",
            __file__,
            "--worker",
            "--dir",
            str(work),
            "--shm",
            str(shm),
            "--out",
            str(out),
            "--mib",
            str(args.mib),
            "--saves",
            str(args.saves),
            "--warmup",
            str(args.warmup),
            "--policy-saves",
            str(args.policy_saves),
            "--step-ms",
            str(args.step_ms),
            *(["--policy"] if args.policy else []),
        ]
        started = time.perf_counter()
        proc = subprocess.run(
            cmd,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-5000:])
            raise SystemExit(f"{n} ranks: torchrun failed ({proc.returncode})")
        results[n] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]
        print(f"# {n} ranks: {time.perf_counter() - started:.0f} s", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return results


def table(results: dict[int, list[dict[str, Any]]], mib: int) -> str:
    lines = [
        f"State: {mib} MiB per rank (identical on every rank, as data parallel keeps it). "
        "Medians over saves; stall: median rank / slowest rank.",
        "",
        "| ranks | method | stall per rank (ms) | save → commit (s) | written per step (MiB) |",
        "|---:|---|---:|---:|---:|",
    ]
    for n, ranks in results.items():
        for method in METHODS:
            per_rank_stall = [
                statistics.median(x["stall"] for x in r["runs"][method]) for r in ranks
            ]
            commit = statistics.median(
                max(r["runs"][method][i]["commit"] for r in ranks)
                for i in range(len(ranks[0]["runs"][method]))
            )
            written = statistics.median(x["written"] for x in ranks[0]["runs"][method])
            lines.append(
                f"| {n} | {method} | {statistics.median(per_rank_stall) * 1e3:.1f} / "
                f"{max(per_rank_stall) * 1e3:.1f} | {commit:.2f} | {written / 2**20:.0f} |"
            )
    return "\n".join(lines)


def policy_table(results: dict[int, list[dict[str, Any]]], mib: int, step_ms: float) -> str:
    lines = [
        f"State: {mib} MiB per rank; one save per {step_ms:.0f} ms of compute. "
        "Stall: median over saves, slowest rank; written: every rank's files.",
        "",
        "| ranks | policy | saves | persisted | saves per persist | stall (ms) "
        "| wall (s) | written (MiB) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n, ranks in results.items():
        for name in POLICIES:
            rows = [r["runs"][name] for r in ranks]
            r0 = rows[0]
            persisted = max(r0["persisted"], 1)
            lines.append(
                f"| {n} | {name} | {r0['saves']} | {r0['persisted']} | "
                f"{r0['saves'] / persisted:.1f} | {max(r['stall'] for r in rows) * 1e3:.1f} | "
                f"{max(r['wall'] for r in rows):.1f} | {r0['written'] / 2**20:.0f} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--mib", type=int, default=128, help="state size per rank (MiB)")
    p.add_argument("--saves", type=int, default=5, help="measured saves per method")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured saves first")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--json", default=None, help="write every measurement here")
    p.add_argument("--policy", action="store_true", help="measure the persist policy instead")
    p.add_argument("--policy-saves", type=int, default=40, help="saves per policy (--policy)")
    p.add_argument("--step-ms", type=float, default=50.0, help="compute per step (--policy)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shm", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    results = run(args)
    if args.policy:
        print(policy_table(results, args.mib, args.step_ms))
    else:
        print(table(results, args.mib))
    if args.json:
        Path(args.json).write_text(json.dumps({"mib": args.mib, "results": results}, indent=1))


if __name__ == "__main__":
    main()
