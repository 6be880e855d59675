"""The benchmark scripts in acp-bench/peers run end to end and write what they promise.
No timing is asserted: only that every figure is there and positive."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

PEERS = Path(__file__).resolve().parents[1] / "acp-bench" / "peers"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def baselines():
    sys.path.insert(0, str(PEERS))
    try:
        import baselines

        yield baselines
    finally:
        sys.path.remove(str(PEERS))


def test_scaling_quick(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, str(PEERS / "scaling.py"), "--quick", "--out", str(out)]
    cmd += ["--dir", str(tmp_path)]
    env = {**os.environ, "PYTHONWARNINGS": ""}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    got = json.loads((out / "scaling.json").read_text())
    args = got["args"]
    assert got["machine"]["cpus"] >= 1
    assert got["machine"]["torch"]
    assert got["machine"]["acp"]

    sizes = got["size"]
    assert sizes["skipped"] == []
    assert [r["size_gib"] for r in sizes["rows"]] == args["sizes"]
    for row in sizes["rows"]:
        assert row["tensors"] == sizes["rows"][0]["tensors"]  # only the bytes change
        for key in ("one", "all"):
            assert row["memcpy"][key]["median"] > 0
        assert row["fio_write"]["secs"]["median"] > 0
        assert row["fio_write"]["bytes"] >= row["bytes"]
        acp = row["acp"]
        for key in ("stall", "flush", "total", "copy", "flatten", "commit", "flush_gb_per_sec"):
            assert acp[key]["median"] > 0, key
            assert len(acp[key]["runs"]) == args["repeats"]
        assert len(acp["first_saves"]) == acp["ring_slots"]
        assert row["ratios"]["stall_over_memcpy"] > 0
        assert row["ratios"]["flush_over_fio"] > 0

    counts = got["tensors"]
    assert counts["skipped"] == []
    assert [r["tensors"] for r in counts["rows"]] == sorted(args["counts"])
    for row in counts["rows"]:
        assert row["bytes"] == counts["rows"][0]["bytes"]  # a fixed total
        assert row["acp"]["stall"]["median"] > 0
        assert row["acp"]["flush"]["median"] > 0
    per_tensor = counts["per_tensor"]
    assert per_tensor["base_tensors"] == min(args["counts"])
    assert set(per_tensor["by_count"]) == {str(n) for n in args["counts"]} - {
        str(min(args["counts"]))
    }
    for figures in per_tensor["by_count"].values():
        assert math.isfinite(figures["stall_us"])
        assert math.isfinite(figures["flush_us"])

    md = (out / "scaling.md").read_text()
    assert "## Cost vs state size" in md
    assert "Per-tensor stall overhead" in md
    for name in ("scaling_size.png", "scaling_tensors.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC, name
        assert len(data) > 10_000, name
    # The scratch directory is removed at the end.
    assert [p.name for p in tmp_path.iterdir()] == ["out"]

    # The report is written again from the JSON alone.
    again = tmp_path / "again"
    cmd = [sys.executable, str(PEERS / "scaling.py"), "--from-json", str(out / "scaling.json")]
    proc = subprocess.run(
        [*cmd, "--out", str(again)], check=False, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (again / "scaling.md").read_text() == md
    assert sorted(p.name for p in again.iterdir()) == [
        "scaling.md",
        "scaling_size.png",
        "scaling_tensors.png",
    ]


def test_split_ranges_shares_bytes_evenly(baselines) -> None:
    ranges = [(1 << 20, 0, 10_000), (2 << 20, 100_000, 50), (3 << 20, 200_000, 3_000)]
    parts = baselines.split_ranges(ranges, 3)
    assert len(parts) == 3
    assert sum(n for p in parts for _, _, n in p) == 13_050
    sizes = [sum(n for _, _, n in p) for p in parts]
    assert max(sizes) - min(sizes) <= 128
    # Every byte is copied once, to the same offset in dst as in src.
    for p in parts:
        for d, s, _ in p:
            assert any(d - rd == s - rs for rd, rs, _ in ranges)


def test_memcpy_copies(baselines) -> None:
    with baselines.Buffer(3 << 20, random=True) as src, baselines.Buffer(3 << 20) as dst:
        secs = baselines.copy_ranges([(dst.addr, src.addr, 3 << 20)], threads=2)
        assert secs > 0
        assert bytes(src._mm) == bytes(dst._mm)
    assert all(s > 0 for s in baselines.memcpy(1 << 20, threads=2, repeats=2))


@pytest.mark.parametrize("fio", ["fio", "no-such-fio"])
def test_direct_write_and_read(baselines, tmp_path: Path, fio: str) -> None:
    if fio == "fio" and baselines.fio_version() is None:
        pytest.skip("fio is not installed")
    path = str(tmp_path / "direct.bin")
    n = 5 * (1 << 20) + 12_288  # not a multiple of fio's block: a tail job
    w = baselines.direct_write(path, n, fio=fio)
    assert os.path.getsize(path) == n
    assert (w.op, w.bytes) == ("write", n)
    assert w.secs > 0
    assert w.gb_per_sec > 0
    r = baselines.direct_read(path, fio=fio)
    assert (r.op, r.bytes) == ("read", n)
    assert r.cache.startswith(("cold", "warm"))
    if fio == "fio":
        assert r.tool.startswith("fio-")
    else:
        assert "fio not found" in w.tool
        assert "fio not found" in r.tool


def test_drop_caches_says_how(baselines, tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x" * 8192)
    assert baselines.drop_caches([str(tmp_path)]) in (
        "cold",
        "cold (fadvise)",
        "warm (could not drop caches)",
    )


def test_replica_bench_tiny(tmp_path: Path) -> None:
    out = tmp_path / "replica.json"
    cmd = [sys.executable, str(PEERS / "replica_bench.py"), "--mib", "1", "--saves", "1"]
    cmd += ["--restores", "1", "--dir", str(tmp_path), "--json", str(out)]
    env = {**os.environ, "PYTHONWARNINGS": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(out.read_text())
    assert got["bytes_per_rank"] == 1 << 20
    assert got["sources"] == ["ram", "ram", "peer", "peer"]
    for key in ("replicas", "none"):
        assert got["stall_ms"][key] > 0
    for key in (
        "replicate_gb_per_sec",
        "raw_gloo_gb_per_sec",
        "replicate_over_raw",
        "raw_beside_flush_gb_per_sec",
        "raw_beside_snapshot_gb_per_sec",
        "replicate_over_raw_beside_flush",
    ):
        assert got[key] > 0, key
    for key in ("peer", "storage", "storage_throttled"):
        assert got["restore_node_b_secs"][key] > 0, key
    assert "restore node B from peer RAM" in proc.stdout
    assert not list(tmp_path.glob("acp-replica-bench-*"))


def run_json_line(script: str, tmp_path: Path, *args: str) -> dict[str, Any]:
    """Runs a bench script that prints one JSON line of figures, with its
    root under ``tmp_path``; checks it removed that root."""
    cmd = [sys.executable, str(PEERS / script), *args, "--dir", str(tmp_path)]
    env = {**os.environ, "PYTHONWARNINGS": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not list(tmp_path.iterdir())  # its root is removed
    got: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return got


def test_big_state_tiny(tmp_path: Path) -> None:
    got = run_json_line("big_state.py", tmp_path, "--gib", "0.01", "--saves", "2")
    assert [s["step"] for s in got["saves"]] == [1, 2]
    assert all(s["committed_s"] >= s["stall_s"] > 0 for s in got["saves"])
    assert (got["load_source"], got["load_right"]) == ("ram", True)


def test_snapshot_restore_tiny(tmp_path: Path) -> None:
    got = run_json_line("snapshot_restore.py", tmp_path, "--mib", "4", "--saves", "3")
    assert got["mib"] == 4
    for key in ("background_ms", "restore_ms", "memcpy_ms", "restore_over_memcpy"):
        assert got[key] > 0, key


def test_rank_file_load_tiny(tmp_path: Path) -> None:
    got = run_json_line("rank_file_load.py", tmp_path, "--mib", "4", "--repeats", "2")
    assert got["mib"] == 4
    for key in ("fresh_ms", "into_ms", "memcpy_fresh_ms", "memcpy_warm_ms"):
        assert got[key] > 0, key
    # The data-parallel restore ran (the script checks its bytes and sources).
    assert got["replicated_into_ms"] > 0
    assert got["replicated_into_over_memcpy_warm"] > 0
    assert got["replicated_fresh_over_memcpy_fresh"] > 0


def test_fresh_load_tiny(tmp_path: Path) -> None:
    got = run_json_line("fresh_load.py", tmp_path, "--mib", "4", "--tensors", "8", "--repeats", "2")
    assert (got["mib"], got["tensors"]) == (4, 8)
    for key in ("fresh_ms", "memcpy_new_ms", "into_ms", "memcpy_warm_ms"):
        assert got[key] > 0, key
    assert got["fresh_over_memcpy_new"] > 0
    assert got["into_over_memcpy_warm"] > 0


def test_warm_storage_load_tiny(tmp_path: Path) -> None:
    got = run_json_line(
        "warm_storage_load.py", tmp_path, "--mib", "4", "--tensors", "8", "--repeats", "2"
    )
    assert (got["mib"], got["tensors"]) == (4, 8)
    for key in ("memcpy_ms", "zstd_ms", "plain_ms", "zstd_over_memcpy", "plain_over_memcpy"):
        assert got[key] > 0, key


@pytest.mark.parametrize("fresh", [False, True])
def test_restart_from_storage_on_a_new_ring(tmp_path: Path, fresh: bool) -> None:
    """restart.py --storage: the restart opens a new, empty ring (a replaced node) and
    restores the newest of two steps (each save's state changed) from storage, twice,
    counting each load's page faults, and times the raw read of its file; into its
    tensors, or with --fresh as a fresh state (each checked against the saved one)."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(PEERS / "restart.py"), "--mib", "8", "--rounds", "1"]
    cmd += ["--saves", "2", "--gap", "0", "--storage", "--dir", str(tmp_path), "--out", str(out)]
    cmd += ["--fresh"] if fresh else []
    env = {**os.environ, "PYTHONWARNINGS": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads((out / "restart.json").read_text())
    (round_,) = got["rounds"]
    restart = round_["restart"]
    assert restart["source"] == "storage"
    for key in ("load", "load_again", "raw_read"):
        assert restart[key] > 0, key
    assert restart["load_faults"] >= 0
    assert restart["load_again_faults"] >= 0
    md = (out / "restart.md").read_text()
    assert "load_again" in md
    assert "load / raw read, per round" in md
    (verdict,) = [line for line in md.splitlines() if line.startswith("- 4c.")]
    assert "target <= 1.2x" in verdict
    assert "**met**" in verdict or "**MISSED**" in verdict
    assert not list(tmp_path.glob("acp-restart-*"))  # its roots are removed


@pytest.mark.parametrize("keep", [True, False], ids=["keep_restored", "off"])
def test_restart_after_a_crash_right_after_a_new_nodes_restore(tmp_path: Path, keep: bool) -> None:
    """restart.py --storage --crash-after-restore: the replaced node restores from storage,
    waits until idle and dies before any save; a third process restores from RAM when the
    step was kept resident again (keep_restored, the default), else from storage."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(PEERS / "restart.py"), "--mib", "8", "--rounds", "1"]
    cmd += ["--saves", "1", "--gap", "0", "--storage", "--crash-after-restore"]
    cmd += ["--dir", str(tmp_path), "--out", str(out)]
    cmd += [] if keep else ["--no-keep-restored"]
    env = {**os.environ, "PYTHONWARNINGS": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (round_,) = json.loads((out / "restart.json").read_text())["rounds"]
    node, again = round_["restart"], round_["again"]
    assert node["source"] == "storage"
    assert node["resident"] is keep
    assert node["idle_after"] >= 0
    assert again["source"] == ("ram" if keep else "storage")
    assert again["load"] > 0
    assert len(again["stalls"]) == 1
    md = (out / "restart.md").read_text()
    assert f"| replaced node | step resident when idle | {int(keep)} of 1 rounds |" in md
    assert "the next restore took" in md
    assert not list(tmp_path.glob("acp-restart-*"))


def test_overhead_quick(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, str(PEERS / "overhead.py"), "--quick", "--out", str(out)]
    modes = ["none", "snapshot", "coalesce", "every", "memcpy", "memcpy:overlap=1"]
    cmd += ["--dir", str(tmp_path), "--modes", *modes]
    env = {**os.environ, "PYTHONWARNINGS": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads((out / "overhead.json").read_text())
    args = got["args"]
    assert [r["mode"] for r in got["rows"]] == modes
    assert got["state_bytes"] > 0
    assert len(got["load_before"]) == len(got["load_after"]) == 3
    for row in got["rows"]:
        assert row["steps"] == args["rounds"] * args["steps"]
        for key in ("median_s", "mean_s", "p90_s"):
            assert row[key] > 0, key
        assert math.isfinite(row["overhead_median_pct"])
        assert math.isfinite(row["overhead_mean_pct"])
        assert math.isfinite(row["overhead_paired_pct"])
    saving = {r["mode"]: r for r in got["rows"] if r["mode"] != "none"}
    assert all(r["stall_median_s"] > 0 for r in saving.values())
    assert saving["snapshot"]["persisted_steps"] == 0  # persist=False writes nothing
    # Timed saves committed, counted from their stats (not the steps retention kept).
    timed = args["rounds"] * args["steps"]
    assert 0 < saving["coalesce"]["persisted_steps"] <= timed
    assert saving["every"]["persisted_steps"] == timed
    # Bytes written per hour: none for snapshots, a full state per step for `every`.
    assert saving["snapshot"]["storage_bytes"] == 0
    assert saving["every"]["storage_bytes"] >= timed * got["state_bytes"]
    assert 0 < saving["coalesce"]["storage_bytes"] <= saving["every"]["storage_bytes"] * 2
    assert saving["every"]["storage_bytes_per_hour"] > 0
    # The floor copies and writes nothing else; its stall is its save call.
    for floor in ("memcpy", "memcpy:overlap=1"):
        assert saving[floor]["persisted_steps"] == 0
        assert saving[floor]["overlapped_saves"] == 0
    assert (out / "overhead.md").read_text() in proc.stdout
    assert not list(tmp_path.glob("acp-overhead-*"))  # its roots are removed


@pytest.mark.parametrize("overlap", [False, True])
def test_overhead_floor_copies_every_tensor_of_the_state(baselines: Any, overlap: bool) -> None:
    """overhead.py's memcpy floor copies each tensor's bytes, in walk order, into its
    buffer (64-byte aligned), and an overlapped copy is done once staged() returns."""
    import ctypes

    import overhead
    import torch

    state = {
        "model": {"w": torch.arange(10, dtype=torch.float32), "b": torch.ones(3)},
        "optim": {"state": {0: {"step": torch.tensor(5.0)}}, "groups": [{"lr": 0.1}]},
        "step": 7,
    }
    floor = overhead.Floor(1 << 12, overlap=overlap, threads=2)
    try:
        floor.save(7, state)
        floor.staged()
        at = 0
        for t in (state["model"]["w"], state["model"]["b"], state["optim"]["state"][0]["step"]):
            n = t.numel() * t.element_size()
            got = ctypes.string_at(floor.buf.addr + at, n)
            assert got == t.numpy().tobytes()
            at += n + (-n % 64)
        with pytest.raises(SystemExit, match="outgrew"):
            floor.save(8, {"big": torch.zeros(1 << 11)})
    finally:
        floor.close()


def test_overhead_refuses_unknown_floor_keywords(baselines: Any) -> None:
    import argparse

    import overhead

    assert overhead._mode("memcpy:overlap=1,threads=1") == "memcpy:overlap=1,threads=1"
    with pytest.raises(argparse.ArgumentTypeError, match="not ring_slots"):
        overhead._mode("memcpy:ring_slots=3")


def test_compare_pairs_acp_with_its_floors(tmp_path: Path) -> None:
    """compare.py runs each of acp's saves and loads right after the floor it is
    judged against, and judges each issue-16 target by the per-pair ratios."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(PEERS / "compare.py"), "--size-gib", "0.01", "--repeats", "3"]
    cmd += ["--extra-small", "10", "--ops", "baseline,acp", "--dir", str(tmp_path)]
    cmd += ["--out", str(out)]
    env = {**os.environ, "PYTHONWARNINGS": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (case,) = json.loads((out / "compare.json").read_text())["cases"].values()
    rows = {r["op"]: r for r in case["rows"]}
    for op in (
        "ckpt.save [stall]",
        "ckpt.save [total]",
        "ckpt.load(into=state) from RAM",
        "ckpt.load(into=state) from storage, cold",
    ):
        assert len(rows[op]["runs"]) == 3, op
        assert len(rows[op]["paired"]) == 3, op
        assert all(p > 0 for p in rows[op]["paired"]), op
    # A warm load has no floor to pair with.
    assert rows["ckpt.load(into=state) from storage, warm"]["paired"] == []
    # Each storage load's engine time and page faults are noted, in run order.
    for cache in ("cold", "warm"):
        note = rows[f"ckpt.load(into=state) from storage, {cache}"]["note"]
        assert note.count(" faults") == 3, note
    # The floor of a save until committed holds the copy and the write: it is
    # longer than the copy that the stall is paired with.
    for total, stall in zip(
        rows["ckpt.save [total]"]["paired"], rows["ckpt.save [stall]"]["paired"]
    ):
        assert total > stall
    md = (out / "compare.md").read_text()
    verdicts = [line for line in md.splitlines() if line.startswith("- ") and "target <=" in line]
    assert len(verdicts) == 4
    assert all("median of 3 per-pair ratios" in line for line in verdicts)
    floors = ("x a memcpy on every core", "x the raw O_DIRECT read + a memcpy on every core")
    assert all(any(f in line for f in floors) for line in verdicts)
    assert not list(tmp_path.glob("acp-compare-*"))


def test_per_tensor_prints_its_verdict() -> None:
    """per_tensor.py (run by `make bench-compare`) ends with issue 16's per-tensor
    verdict line, from rounds each paired with their own memcpy."""
    cmd = [sys.executable, str(PEERS / "per_tensor.py"), "--count", "2000", "--rounds", "4"]
    env = {**os.environ, "PYTHONWARNINGS": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("- 2b. per-tensor cost at 2,000 tensors: "), last
    assert "median of 2 rounds each paired with its memcpy" in last
    assert last.endswith(("**met**", "**MISSED**"))
