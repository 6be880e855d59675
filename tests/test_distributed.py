"""Several ranks: replicas written once, every rank loading the same step,
resharding through DCP, and waits that name the ranks that did not answer.

The torchrun tests start real process groups (gloo, CPU) on this machine
with the scripts in ``tests/dist/``, each run on a fresh rendezvous port
(``--standalone``); the others run ranks as engines in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import acp
from acp import _acp
from acp.distributed import Coordinator, assign

from .conftest import SMALL_RING, flip_in_slot, save_raw, two_ranks

DIST = Path(__file__).parent / "dist"


def torchrun(
    nproc: int, script: str, *args: object, shm: Path, **env: str
) -> subprocess.CompletedProcess[str]:
    """Runs ``tests/dist/<script>`` on ``nproc`` ranks under torchrun."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--standalone",  # a free rendezvous port of its own
        str(DIST / script),
        *map(str, args),
    ]
    full_env = {**os.environ, "ACP_SHM": str(shm), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(
        cmd, env=full_env, capture_output=True, text=True, timeout=240, check=False
    )


def result(out: Path, name: str) -> Any:
    return json.loads((out / f"{name}.json").read_text())


def committed(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*"))


# --------------------------------------------------------------------------- torchrun


def test_ddp_rank_killed_in_its_copy_resumes_on_a_replaced_node(
    tmp_path: Path, shm_dir: Path
) -> None:
    """Rank 1 dies (SIGKILL) in the middle of copying step 4 into its ring:
    step 4 is never committed. Restarted, rank 1 on a new node (an empty
    shared-memory directory): both ranks resume from step 3, rank 1 from
    storage, rank 0 from RAM (its own file and rank 1's, still resident on
    its node), with identical state, and train on exactly as before."""
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    run = torchrun(2, "ddp_resume.py", root, out, "train", 6, 4, "stall", shm=shm_dir)
    assert run.returncode != 0, run.stderr[-3000:]
    assert "SIGKILL" in run.stderr
    assert committed(root) == [1, 2, 3]
    trained = result(out, "digests-train")

    new_node = shm_dir / "replaced"
    new_node.mkdir()
    run = torchrun(2, "ddp_resume.py", root, out, "resume", 2, shm=shm_dir, ACP_SHM_1=str(new_node))
    assert run.returncode == 0, run.stderr[-3000:]
    r0, r1 = result(out, "resume-rank0"), result(out, "resume-rank1")
    assert r0["step"] == r1["step"] == 3
    assert r0["digest"] == r1["digest"] == trained["3"]
    assert r0["ranks"] == {"0": "ram", "1": "ram"}  # rank 1's file from its old slot
    assert r1["ranks"] == {"1": "storage", "0": "storage"}
    # The resumed run reproduces the lost step, and commits on.
    assert result(out, "digests-resume")["4"] == trained["4"]
    assert result(out, "final-rank1")["steps"] == [1, 2, 3, 4, 5]


def test_ddp_rank_killed_after_its_copy_commits_the_step_on_restart(
    tmp_path: Path, shm_dir: Path
) -> None:
    """Rank 1 dies right after step 4 is in its ring (rank 0's too), most
    often before the commit (its flush races with the kill). Restarted on
    the same node, the ranks find that every one holds step 4, commit it
    from RAM if it was not, and resume from it."""
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    run = torchrun(2, "ddp_resume.py", root, out, "train", 6, 4, "sealed", shm=shm_dir)
    assert run.returncode != 0, run.stderr[-3000:]
    assert committed(root)[:3] == [1, 2, 3]
    assert committed(root)[3:] in ([], [4])
    trained = result(out, "digests-train")

    run = torchrun(2, "ddp_resume.py", root, out, "resume", 1, shm=shm_dir)
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1):
        r = result(out, f"resume-rank{rank}")
        assert r["step"] == 4
        assert r["digest"] == trained["4"]
        assert r.get("rejected") is None, r
        assert r["ranks"][str(rank)] == "ram", (r["ranks"], r.get("rejected"))
        assert r["steps"] == [1, 2, 3, 4]
    assert result(out, "final-rank0")["steps"] == [1, 2, 3, 4, 5]


def test_fsdp_saved_by_four_ranks_loads_into_two(tmp_path: Path, shm_dir: Path) -> None:
    """FSDP2 model and Adam state (DTensor shards) saved by 4 ranks through
    acp's DCP writer (step 5 with dcp.save, step 6 with dcp.async_save and
    acp's stager), loaded by 2 ranks through acp's reader: every full tensor
    and value comes back exactly, each rank reading the other ranks' files
    from their slots on this node."""
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    run = torchrun(4, "reshard.py", root, out, "save", shm=shm_dir)
    assert run.returncode == 0, run.stderr[-3000:]
    assert committed(root) == [5, 6]
    index = json.loads((root / "step-000000000005/model.safetensors.index.json").read_text())
    assert index["metadata"]["acp"]["world_size"] == 4
    # A Checkpointer.save of the same DTensors is refused, naming DCP.
    direct = result(out, "save-rank0")["direct"]
    assert "tensor subclass `torch.distributed.tensor.DTensor`" in direct, direct
    assert "acp.dcp.StorageWriter" in direct, direct

    run = torchrun(2, "reshard.py", root, out, "load", shm=shm_dir)
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1):
        r = result(out, f"load-rank{rank}")
        for step in ("5", "6"):
            assert r[step]["mismatched"] == [], (rank, step)
            assert r[step]["epoch"] == int(step)
            assert r[step]["source"] == "ram"
        assert len(r["5"]["ranks"]) >= 2  # shards of two old ranks at least


def test_a_hanging_rank_is_named_in_the_timeouts(tmp_path: Path, shm_dir: Path) -> None:
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    run = torchrun(2, "hang.py", root, out, shm=shm_dir)
    assert run.returncode == 0, run.stderr[-3000:]
    errors = result(out, "hang-rank0")
    assert "ranks [1] did not report" in errors["save"]
    assert "ranks [1] did not answer" in errors["load"]
    assert errors["steps"] == []


# --------------------------------------------------------------------------- in process


def test_a_step_rank_0_refuses_fails_on_every_rank_at_once(tmp_path: Path, shm_dir: Path) -> None:
    """Two ranks' engines save a tensor of the same name (the engine API
    lets a caller name tensors; `Checkpointer` never does this): rank 0
    refuses the step, and rank 1, waiting for the commit, fails with rank
    0's reason rather than at its commit timeout (a minute here). The
    previous step stays committed and loadable."""
    engines = two_ranks(_acp.Engine, tmp_path / "ckpt", shm_dir, job="refused", commit_timeout=60)
    try:
        for h in save_raw(engines, 1, ["t0", "t1"]):
            h.wait()
        errors = []
        for h in save_raw(engines, 2, ["t", "t"]):
            with pytest.raises(acp.InvalidInput) as e:
                h.wait()
            errors.append(str(e.value))
        assert "saved by two ranks" in errors[0]
        assert "rank 0 did not commit it" in errors[1]
        assert "saved by two ranks" in errors[1]
        for e in engines:
            assert e.steps() == [1]
        assert engines[1].load(1, storage_only=True).step == 1
        # Nothing of step 2's attempt is left in the root.
        left = [p.name for p in (tmp_path / "ckpt").iterdir() if "000000000002" in p.name]
        assert left == []
    finally:
        for e in engines:
            e.close()


def test_assign_balances_bytes_deterministically() -> None:
    sizes = [("a", 100), ("b", 60), ("c", 50), ("d", 40), ("e", 10), ("z", 0)]
    owners = assign(sizes, [0, 1])
    assert owners == assign(list(reversed(sizes)), [1, 0])  # order does not matter
    per_rank = [sum(n for name, n in sizes if owners[name] == r) for r in (0, 1)]
    assert per_rank == [140, 120]  # greedy: a | b c, then d to the lighter, e
    assert (owners["a"], owners["b"]) == (0, 1)
    assert set(assign(sizes, [3, 5, 7]).values()) == {3, 5, 7}
    with pytest.raises(acp.InvalidInput):
        assign(sizes, [])


class _Store:
    """An in-memory store with torch.distributed.Store's set/get/check/add."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def set(self, key: str, value: str) -> None:
        with self.lock:
            self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        with self.lock:
            return self.data[key]

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            return all(k in self.data for k in keys)

    def add(self, key: str, amount: int) -> int:
        with self.lock:
            value = int(self.data.get(key, b"0")) + amount
            self.data[key] = str(value).encode()
            return value

    def delete_key(self, key: str) -> bool:
        with self.lock:
            return self.data.pop(key, None) is not None


def test_coordinator_gathers_and_names_the_silent_ranks() -> None:
    store = _Store()
    coords = [Coordinator(store, "job", r, 3, timeout=5) for r in range(3)]
    got: dict[int, list[str]] = {}

    def run(r: int) -> None:
        for i in range(4):
            got[r] = coords[r].gather(f"round {i}", f"{r}:{i}")

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {r: ["0:3", "1:3", "2:3"] for r in range(3)}
    assert len(store.data) < 20  # old rounds' keys are deleted

    lonely = [Coordinator(store, "other", r, 3, timeout=0.3) for r in range(3)]
    started = time.monotonic()
    with pytest.raises(acp.AcpTimeout, match=r"ready: ranks \[1, 2\] did not answer"):
        lonely[0].gather("ready", "x")
    assert time.monotonic() - started < 3


def test_replicated_state_is_written_once_and_loaded_whole(tmp_path: Path, shm_dir: Path) -> None:
    """Two ranks (engines in this process) save the same model replicated:
    the two files share its bytes; each rank loads all of it, reading the
    other's file from its slot, or from storage when told to."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))
    state = {"model": model.state_dict(), "step": 7}
    ckpts = two_ranks(acp.Checkpointer, tmp_path / "ckpt", shm_dir, job="rep", commit_timeout=60)
    try:
        handles = [
            c.save(
                1, {**state, "mine": torch.full((3,), float(c.rank))}, replicated=["model", "step"]
            )
            for c in ckpts
        ]
        stats = [h.wait() for h in handles]
        model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        assert sum(s.tensor_bytes for s in stats) == model_bytes + 2 * 12
        assert all(s.tensor_bytes < model_bytes for s in stats)  # shared out
        for c in ckpts:
            got = c.load()
            assert got["step"] == 7
            assert torch.equal(got["mine"], torch.full((3,), float(c.rank)))
            for k, v in model.state_dict().items():
                assert torch.equal(got["model"][k], v), k
            assert c.last_load is not None
            assert c.last_load.ranks == {c.rank: "ram", 1 - c.rank: "ram"}
            c.load(storage_only=True)
            assert c.last_load.source == "storage"
            into = {"model": torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))}
            target = {"model": into["model"].state_dict()}
            c.load(into=target)
            assert torch.equal(into["model"][0].weight, model[0].weight)
        index = json.loads(
            (tmp_path / "ckpt/step-000000000001/model.safetensors.index.json").read_text()
        )
        assert index["weight_map"]["model.0.weight"].startswith("rank-")
        assert index["weight_map"]["rank1.mine"] == "rank-00001.safetensors"
    finally:
        for c in ckpts:
            c.close()


def test_replicated_load_into_checks_the_other_ranks_chunks_on_their_way_in(
    tmp_path: Path, shm_dir: Path
) -> None:
    """``load(into=)`` of a replicated state: the tensors the other rank
    wrote come from its slot straight into this rank's tensors, each chunk
    checked on the way (over several chunks and copy threads); a byte
    changed in that slot sends those tensors to storage, and the restore
    is still exact."""
    torch.manual_seed(1)
    state = {f"t{i}": torch.randn(400_000 + 1000 * i) for i in range(6)}
    ckpts = two_ranks(
        acp.Checkpointer,
        tmp_path / "ckpt",
        shm_dir,
        job="rep-into",
        commit_timeout=60,
        chunk_bytes=256 << 10,
        copy_threads=3,
    )
    try:
        for h in [c.save(1, state, replicated=True) for c in ckpts]:
            h.wait()
        index = json.loads(
            (tmp_path / "ckpt/step-000000000001/model.safetensors.index.json").read_text()
        )
        by_rank = {
            r: [k for k, f in index["weight_map"].items() if f == f"rank-{r:05d}.safetensors"]
            for r in (0, 1)
        }
        assert by_rank[0]  # shared out
        assert by_rank[1]
        c = ckpts[1]
        # A fresh load: rank 0's tensors are views of the memory they were
        # copied into (handed over, not copied again), writable, and
        # nobody else's: writing them changes no later load.
        fresh = c.load(1)
        assert all(torch.equal(fresh[k], v) for k, v in state.items())
        # Views (over memory torch cannot resize) where rank 0 wrote them;
        # copies out of this rank's own ring slot.
        for r in (0, 1):
            for name in by_rank[r]:
                views = not fresh[name.split(".")[-1]].untyped_storage().resizable()
                assert views == (r == 0), name
        for t in fresh.values():
            t.add_(1.0)
        del fresh
        again = c.load(1)
        assert all(torch.equal(again[k], v) for k, v in state.items())
        del again
        into = {k: torch.zeros_like(v) for k, v in state.items()}
        c.load(1, into=into)
        assert all(torch.equal(into[k], v) for k, v in state.items())
        assert c.last_load is not None
        assert c.last_load.ranks == {0: "ram", 1: "ram"}
        # The engine's side: rank 0's tensors planned from its slot, read
        # by the first copy_into into the memory given, and not kept.
        engine = c._engine
        part = engine.load(step=1, rank=0, tensors=by_rank[0], defer=True)
        assert part.pending
        assert part.source == "ram"
        names = [e[0] for e in part.entries()]
        dst = torch.zeros_like(state[names[0]])
        part.copy_into([(0, dst.data_ptr(), dst.numel() * dst.element_size())])
        assert torch.equal(dst, state[names[0]])
        assert part.report()["source"] == "ram"
        with pytest.raises(acp.InvalidInput, match=f"tensor `{names[0]}` was read straight"):
            part.buffer(0)
        if len(names) > 1:  # the others are kept, and checked too
            kept = torch.frombuffer(bytearray(part.buffer(1)), dtype=torch.float32)
            assert torch.equal(kept, state[names[1]])
        del part
        # A byte of one of rank 0's tensors changed in rank 0's slot.
        name = by_rank[0][0]
        needle = state[name.split(".")[-1]][1000:1100].numpy().tobytes()
        flip_in_slot(shm_dir, needle)  # only rank 0's slot holds it
        into = {k: torch.zeros_like(v) for k, v in state.items()}
        c.load(1, into=into)
        assert all(torch.equal(into[k], v) for k, v in state.items())
        assert c.last_load.ranks == {0: "storage", 1: "ram"}
    finally:
        for c in ckpts:
            c.close()


def test_a_rank_that_wrote_none_of_a_replicated_state_restores_it(
    tmp_path: Path, shm_dir: Path
) -> None:
    """One tensor shared out over two ranks: rank 0 writes it, rank 1's file
    holds no tensor. Rank 1 restores it fresh and into its own tensor,
    from rank 0's slot and from storage."""
    w = torch.arange(1000.0)
    ckpts = two_ranks(
        acp.Checkpointer, tmp_path / "ckpt", shm_dir, job="rep-none", commit_timeout=60
    )
    try:
        for h in [c.save(1, {"w": w}, replicated=True) for c in ckpts]:
            h.wait()
        index = json.loads(
            (tmp_path / "ckpt/step-000000000001/model.safetensors.index.json").read_text()
        )
        assert set(index["weight_map"].values()) == {"rank-00000.safetensors"}
        c = ckpts[1]
        for storage_only in (False, True):
            assert torch.equal(c.load(1, storage_only=storage_only)["w"], w)
            into = {"w": torch.zeros(1000)}
            c.load(1, into=into, storage_only=storage_only)
            assert torch.equal(into["w"], w)
            assert c.last_load is not None
            want = "storage" if storage_only else "ram"
            assert c.last_load.ranks == {0: want, 1: want}
    finally:
        for c in ckpts:
            c.close()


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "into"])
def test_a_rank_holding_only_values_has_its_slot_checked_before_they_are_used(
    tmp_path: Path, shm_dir: Path, fresh: bool
) -> None:
    """Rank 1 of a replicated state writes no tensor, only the values. Its
    slot's copy of them changed in RAM: the restore reads (and checks)
    rank 1's file all the same, before it uses a value of it, and takes
    the step from storage instead."""
    w = torch.arange(1000.0)
    ckpts = two_ranks(
        acp.Checkpointer, tmp_path / "ckpt", shm_dir, job="rep-values", commit_timeout=60
    )
    try:
        for h in [c.save(1, {"w": w, "epoch": 7}, replicated=True) for c in ckpts]:
            h.wait()
        hit = 0
        for f in sorted(p for p in shm_dir.rglob("*-r00001-s*") if p.is_file()):
            b = bytearray(f.read_bytes())
            at = b.find(b"},7]")
            if at >= 0:
                b[at + 2] = ord("8")
                f.write_bytes(bytes(b))
                hit += 1
        assert hit == 1
        c = ckpts[1]
        if fresh:
            out = c.load(1)
        else:
            out = {"w": torch.zeros(1000), "epoch": -1}
            c.load(1, into=out)
        assert out["epoch"] == 7
        assert torch.equal(out["w"], w)
        assert c.last_load is not None
        assert c.last_load.ranks is not None
        assert c.last_load.ranks[1] == "storage"
    finally:
        for c in ckpts:
            c.close()


def test_a_replicated_restore_into_keeps_its_plan(tmp_path: Path, shm_dir: Path) -> None:
    """A data-parallel ``load(into=)`` (this rank's file and the other's)
    keeps its plan as a single file's does: the next load of the same
    structure reuses it, and fills every tensor from the step it loads."""
    ckpts = two_ranks(
        acp.Checkpointer, tmp_path / "ckpt", shm_dir, job="rep-plan", commit_timeout=60
    )
    try:
        first: dict[str, Any] = {f"t{i}": torch.randn(100) for i in range(6)}
        first["epoch"] = 3
        second = {k: v + 1 if isinstance(v, torch.Tensor) else v for k, v in first.items()}
        for step, state in ((1, first), (2, second)):
            for h in [c.save(step, state, replicated=True) for c in ckpts]:
                h.wait()
        c = ckpts[1]
        into: dict[str, Any] = {k: torch.zeros(100) for k in first if k != "epoch"}
        into["epoch"] = -1
        plan = None
        for step, state in ((1, first), (2, second), (1, first)):
            c.load(step, into=into)
            assert c.last_load is not None
            assert c.last_load.ranks == {0: "ram", 1: "ram"}
            assert into["epoch"] == 3
            for k, v in state.items():
                if k != "epoch":
                    assert torch.equal(into[k], v), (step, k)
            plan = plan or c._plans.load
            assert plan is not None
            assert c._plans.load is plan, "the kept plan was not reused"
    finally:
        for c in ckpts:
            c.close()


def _ranks_in_threads(fn: Any, world: int) -> list[Any]:
    """Runs ``fn(rank)`` for every rank in its own thread; each result or
    exception, by rank."""
    results: list[Any] = [None] * world

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except Exception as e:
            results[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


def test_ranks_agree_to_fall_back_or_to_fail_together(tmp_path: Path, shm_dir: Path) -> None:
    """Rank 1's file of the newest step is corrupt on storage: with
    ``fallback`` both ranks load the step before; without, both raise,
    rank 0 naming rank 1."""
    store = _Store()

    def open_rank(rank: int) -> acp.Checkpointer:
        return acp.Checkpointer(
            tmp_path / "ckpt",
            job="agree",
            rank=rank,
            world_size=2,
            shm_dir=shm_dir,
            ring_bytes=SMALL_RING,
            mlock=False,
            commit_timeout=30,
            store=store,
        )

    ckpts = _ranks_in_threads(open_rank, 2)
    try:
        for step in (1, 2):
            hs = [c.save(step, {"w": torch.full((1000,), float(step))}) for c in ckpts]
            for h in hs:
                h.wait()
        data = tmp_path / "ckpt/step-000000000002/rank-00001.safetensors"
        raw = bytearray(data.read_bytes())
        raw[-1] ^= 0xFF
        data.write_bytes(bytes(raw))

        got = _ranks_in_threads(lambda r: ckpts[r].load(storage_only=True, fallback=True), 2)
        assert [g["w"][0].item() for g in got] == [1.0, 1.0]

        errors = _ranks_in_threads(lambda r: ckpts[r].load(storage_only=True), 2)
        assert isinstance(errors[1], acp.CheckpointCorrupt), errors
        assert isinstance(errors[0], acp.CheckpointCorrupt), errors
        assert "ranks [1] could not load it" in str(errors[0])

        # Without agreement (a load on one rank only), no store is involved.
        assert ckpts[0].load(agree=False)["w"][0].item() == 2.0
    finally:
        for c in ckpts:
            c.close()


def test_a_rank_missing_at_open_is_named_and_the_ring_released(
    tmp_path: Path, shm_dir: Path
) -> None:
    """Constructing the Checkpointer is collective with a store: a rank that
    never comes is named, and the engine of the one that waited is closed
    (its job can be opened again)."""
    store = _Store()
    kwargs: dict[str, Any] = {
        "job": "alone",
        "rank": 0,
        "world_size": 2,
        "shm_dir": shm_dir,
        "ring_bytes": SMALL_RING,
        "mlock": False,
        "commit_timeout": 0.3,
    }
    with pytest.raises(acp.AcpTimeout, match=r"open: resident steps: ranks \[1\] did not answer"):
        acp.Checkpointer(tmp_path / "ckpt", store=store, **kwargs)
    acp.Checkpointer(tmp_path / "ckpt", **kwargs).close()  # no store: no coordination


def test_hsdp_replica_groups_share_out_their_own_shard(tmp_path: Path, shm_dir: Path) -> None:
    """Four ranks, two shards, each held by a replica group ({0, 2} and
    {1, 3}): each group's shard is written once, shared by its two ranks,
    and every rank loads its group's shard whole."""
    groups = {0: [0, 2], 2: [0, 2], 1: [1, 3], 3: [1, 3]}
    shards = {
        g: {f"w{i}": torch.full((256 * (i + 1),), float(g * 10 + i)) for i in range(4)}
        for g in (0, 1)
    }
    ckpts = [
        acp.Checkpointer(
            tmp_path / "ckpt",
            job="hsdp",
            rank=r,
            world_size=4,
            shm_dir=shm_dir,
            ring_bytes=SMALL_RING,
            mlock=False,
            commit_timeout=60,
            replica_group=groups[r],
        )
        for r in range(4)
    ]
    try:
        handles = [c.save(1, {"shard": shards[c.rank % 2]}, replicated=True) for c in ckpts]
        written = [h.wait().tensor_bytes for h in handles]
        assert sum(written) == 2 * sum(4 * 256 * (i + 1) for i in range(4))
        assert all(w > 0 for w in written)
        index = json.loads(
            (tmp_path / "ckpt/step-000000000001/model.safetensors.index.json").read_text()
        )
        assert sorted(index["weight_map"]) == sorted(
            f"group{g}.shard.w{i}" for g in (0, 1) for i in range(4)
        )
        for c in ckpts:
            got = c.load()
            for k, v in shards[c.rank % 2].items():
                assert torch.equal(got["shard"][k], v), (c.rank, k)
        with pytest.raises(acp.ConfigError, match="replica_group"):
            acp.Checkpointer(tmp_path / "ckpt", rank=0, world_size=4, replica_group=[1, 3])
    finally:
        for c in ckpts:
            c.close()
