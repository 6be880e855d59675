"""The ``acp`` command line on real checkpoints, intact and broken: every
subcommand, its ``--json`` output, its exit codes, and the README's
examples."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import acp

from .conftest import SMALL_RING, slot_dir
from .helpers import assert_same

REPO = Path(__file__).resolve().parent.parent
SUBCOMMANDS = ["ls", "inspect", "verify", "export", "import", "diff", "gc", "persist", "bench"]


def run(*args: object, check_rc: int | None = 0) -> subprocess.CompletedProcess[str]:
    """Runs ``python -m acp.cli ARGS`` (stdout and stderr are pipes)."""
    proc = subprocess.run(
        [sys.executable, "-m", "acp.cli", *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    if check_rc is not None:
        assert proc.returncode == check_rc, (proc.returncode, proc.stdout, proc.stderr)
    return proc


def run_json(*args: object, check_rc: int = 0) -> Any:
    proc = run(*args, "--json", check_rc=check_rc)
    return json.loads(proc.stdout)


def state(step: int) -> dict[str, Any]:
    return {
        "model": {"w": torch.full((64, 64), float(step)), "b": torch.arange(8)},
        "lr": 0.001 * step,
        "step": step,
        "name": "run1",
    }


class Root:
    """A checkpoint root with steps saved by ``acp.Checkpointer``."""

    def __init__(self, path: Path, shm_dir: Path) -> None:
        self.path = path
        self.shm_dir = shm_dir
        self.job = f"cli-{uuid.uuid4().hex[:12]}"

    def open(self, **kwargs: Any) -> acp.Checkpointer:
        kwargs.setdefault("job", self.job)
        # Small digest chunks, so a changed byte is pinned to one tensor.
        kwargs.setdefault("chunk_bytes", 4096)
        return acp.Checkpointer(
            self.path, shm_dir=self.shm_dir, ring_bytes=SMALL_RING, mlock=False, **kwargs
        )

    def save(self, *steps: int) -> None:
        with self.open() as ckpt:
            for s in steps:
                ckpt.save(s, state(s)).wait()

    def data_file(self, step: int) -> Path:
        return self.path / f"step-{step:012}" / "rank-00000.safetensors"

    def flip(self, step: int, tensor: str = "model.w") -> None:
        """Flips one byte in the middle of ``tensor``'s bytes."""
        info = run_json("inspect", self.path, "--step", step)
        t = next(t for t in info["tensors"] if t["name"] == tensor)
        path = self.data_file(step)
        data = bytearray(path.read_bytes())
        data[t["offset"] + t["bytes"] // 2] ^= 0x10
        path.write_bytes(bytes(data))


@pytest.fixture
def root(tmp_path: Path, shm_dir: Path) -> Root:
    r = Root(tmp_path / "ckpt", shm_dir)
    r.save(100, 200, 300)
    return r


# --- the parser -----------------------------------------------------------


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help(command: str) -> None:
    out = run(command, "--help").stdout
    assert f"usage: acp {command}" in out.lower()
    assert "--json" in out
    assert "exit codes" in out


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    assert run(check_rc=2).returncode == 2
    run("frobnicate", check_rc=2)
    run("verify", check_rc=2)  # ROOT missing
    run("diff", tmp_path, "--step", "1", check_rc=2)  # one step only
    run("gc", tmp_path, check_rc=2)  # nothing to do
    run("bench", "--size", "lots", check_rc=2)
    assert "acp " in run("--version").stdout


def test_python_errors_map_to_the_engine_exit_codes(root: Root, tmp_path: Path) -> None:
    """Conversions run in Python; their exceptions leave with the exit code
    of the engine error of the same kind."""
    out = tmp_path / "x.pt"
    proc = run("export", root.path, out, "--to", "torch", "--rank", 9, check_rc=3)
    assert "rank 9" in proc.stderr
    assert not out.exists()
    proc = run("import", tmp_path / "missing.pt", "--to", tmp_path / "d", "--step", 1, check_rc=3)
    assert "missing.pt" in proc.stderr
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a torch file")
    proc = run("import", bad, "--to", tmp_path / "d", "--step", 1, check_rc=1)
    assert "bad.pt" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_sizes_and_counts_are_checked() -> None:
    run("bench", "--size", "0", check_rc=2)
    run("gc", "r", "--keep", "0", check_rc=2)
    proc = run("gc", "r", "--every", "2", "--pending", check_rc=2)
    assert "--keep" in proc.stderr


# --- ls, inspect ------------------------------------------------------------


def test_ls(root: Root) -> None:
    r = run_json("ls", root.path, "--job", root.job, "--shm-dir", root.shm_dir)
    assert [s["step"] for s in r["steps"]] == [100, 200, 300]
    assert r["latest"] == 300
    newest = r["steps"][-1]
    assert newest["world_size"] == 1
    assert newest["tensors"] == 2
    assert newest["bytes"] == root.data_file(300).stat().st_size
    assert newest["resident_ranks"] == [0]  # the ring keeps the newest step
    assert r["resident_only"] == []
    assert all(not s["locked"] for s in r["slots"])
    text = run("ls", root.path, "--job", root.job, "--shm-dir", root.shm_dir).stdout
    assert re.search(r"300 .* latest", text), text


def test_a_failure_with_json_is_reported_in_json_too(root: Root, tmp_path: Path) -> None:
    """A reader of ``--json`` got nothing on stdout when the command failed
    (the message went to stderr only)."""
    for args, code in (
        (("inspect", root.path, "--step", 999), 3),
        (("export", root.path, tmp_path / "x.pt", "--to", "torch", "--rank", 9), 3),
        (("verify", tmp_path / "nope"), 3),
    ):
        r = run_json(*args, check_rc=code)
        assert r["error"]["exit_code"] == code, r
        assert r["error"]["command"] == args[0], r
        assert r["error"]["message"], r


def test_ls_missing_root_is_not_found(tmp_path: Path) -> None:
    proc = run("ls", tmp_path / "nope", check_rc=3)
    assert "not found" in proc.stderr


def test_inspect(root: Root) -> None:
    r = run_json("inspect", root.path, "--step", 200)
    assert r["step"] == 200
    # A step of plain files stays version 1 (readable by builds before compression).
    assert r["format_version"] == 1 < acp.FORMAT_VERSION
    tensors = {t["name"]: t for t in r["tensors"]}
    assert tensors["model.w"]["dtype"] == "F32"
    assert tensors["model.w"]["shape"] == [64, 64]
    assert tensors["model.w"]["bytes"] == 64 * 64 * 4
    assert tensors["model.b"]["dtype"] == "I64"
    (f,) = r["files"]
    assert f["metadata"]["format"] == "pt"
    assert len(f["root"]) == 64
    assert "acp.codec" in f["values"]
    text = run("inspect", root.path).stdout  # the newest step
    assert "step 300" in text
    assert '"lr": 0.3' in text
    assert "<tensor model.w>" in text
    run("inspect", root.path, "--step", 999, check_rc=3)


# --- verify -------------------------------------------------------------------


def test_verify_intact(root: Root) -> None:
    r = run_json("verify", root.path, "--all")
    assert r["ok"] is True
    assert [s["step"] for s in r["steps"]] == [100, 200, 300]
    proc = run("verify", root.path)
    assert "intact" in proc.stdout
    assert proc.stderr == ""  # no progress bar on a pipe


def test_verify_fails_on_a_flipped_byte_naming_file_and_tensor(root: Root) -> None:
    root.flip(200)
    proc = run("verify", root.path, "--step", 200, check_rc=1)
    assert "rank-00000.safetensors" in proc.stdout
    assert "`model.w`" in proc.stdout
    r = run_json("verify", root.path, "--all", check_rc=1)
    assert r["ok"] is False
    bad = {s["step"]: s for s in r["steps"]}
    assert bad[100]["ok"]
    assert bad[300]["ok"]
    (problem,) = bad[200]["problems"]
    assert problem["file"] == str(root.data_file(200).resolve())
    assert problem["tensors"] == ["model.w"]
    run("verify", root.path, "--step", 300)  # another step is still intact


def test_verify_fails_on_a_truncated_file(root: Root) -> None:
    path = root.data_file(300)
    path.write_bytes(path.read_bytes()[:-10])
    r = run_json("verify", root.path, check_rc=1)
    assert "the index says" in r["steps"][0]["problems"][0]["reason"]


# --- export, import -----------------------------------------------------------


def test_export_safetensors(root: Root, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "m.safetensors"
    r = run_json("export", root.path, out, "--step", 200)
    assert r["tensors"] == 2
    assert out.read_bytes() == root.data_file(200).read_bytes()
    tensors = load_file(out)
    assert torch.equal(tensors["model.w"], state(200)["model"]["w"])
    run("export", root.path, out, check_rc=2)  # exists
    run("export", root.path, out, "--force")


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_export_of_a_corrupt_step_refuses(root: Root, tmp_path: Path, fmt: str) -> None:
    root.flip(200)
    out = tmp_path / "out.bin"
    proc = run("export", root.path, out, "--step", 200, "--to", fmt, check_rc=1)
    assert "model.w" in proc.stderr
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("fmt", ["safetensors", "torch", "mindspore"])
def test_export_never_replaces_a_fifo_or_device(root: Root, tmp_path: Path, fmt: str) -> None:
    """``--force`` replaces a file or a link, never a FIFO or a device: an
    export aimed at ``/dev/null`` made it a regular file."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    proc = run("export", root.path, fifo, "--to", fmt, "--force", check_rc=2)
    assert "not a regular file" in proc.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_export_torch_gives_back_the_saved_state(root: Root, tmp_path: Path) -> None:
    out = tmp_path / "m.pt"
    r = run_json("export", root.path, out, "--to", "torch")
    assert r["step"] == 300
    loaded = torch.load(out, weights_only=True)
    assert_same(state(300), loaded)


def test_import_torch_round_trips(root: Root, tmp_path: Path, shm_dir: Path) -> None:
    src = tmp_path / "in.pt"
    saved = {"fc.weight": torch.randn(4, 3), "fc.bias": torch.zeros(4), "epoch": 7}
    torch.save(saved, src)
    dest = tmp_path / "imported"
    r = run_json("import", src, "--to", dest, "--step", 5, "--shm-dir", shm_dir)
    assert r["tensors"] == 2
    run("verify", dest, "--step", 5)
    with acp.Checkpointer(dest, job="check", shm_dir=shm_dir, ring_bytes=SMALL_RING) as ckpt:
        assert_same(saved, ckpt.load(5))
    run("import", src, "--to", dest, "--step", 5, "--shm-dir", shm_dir, check_rc=2)  # exists
    run("import", src, "--to", dest, "--step", 5, "--shm-dir", shm_dir, "--force")
    assert not [p for p in shm_dir.iterdir() if p.name.startswith("acp-import")]


def test_import_never_unpickles_code(tmp_path: Path, shm_dir: Path) -> None:
    marker = tmp_path / "pwned"
    src = tmp_path / "evil.pt"
    maker = textwrap.dedent(
        f"""
        import os, torch
        class Evil:
            def __reduce__(self):
                return (os.system, ("touch {marker}",))
        torch.save({{"w": torch.zeros(2), "x": Evil()}}, {str(src)!r})
        """
    )
    subprocess.run([sys.executable, "-c", maker], check=True)
    proc = run("import", src, "--to", tmp_path / "dest", "--step", 1, check_rc=1)
    assert "weights_only" in proc.stderr
    assert not marker.exists()


def test_import_refuses_a_tensor_claiming_more_bytes_than_its_file_holds(
    tmp_path: Path, shm_dir: Path
) -> None:
    """A 1.5 KB torch file whose tensor repeats one float over 2^40
    elements (stride 0) made the import size a 4 TiB ring."""
    src = tmp_path / "expanded.pt"
    torch.save({"ok": torch.ones(2), "w": torch.zeros(1).expand(2**20, 2**20)}, src)
    proc = run(
        "import", src, "--to", tmp_path / "dest", "--step", 1, "--shm-dir", shm_dir, check_rc=1
    )
    assert "expanded.pt: tensor `w`" in proc.stderr, proc.stderr
    assert "4398046511104 bytes" in proc.stderr, proc.stderr
    assert not [p for p in shm_dir.iterdir() if p.name.startswith("acp-import")]


@pytest.mark.parametrize("shape", ["cycle", "shared"])
def test_import_refuses_containers_that_never_end(tmp_path: Path, shape: str) -> None:
    """The unpickler's memo makes a list that holds itself (the import's
    walk never ended) or 60 levels of a list held twice (2^60 values).
    Checked where ``acp import`` reads torch files, in this process."""
    from acp.convert import read_torch

    src = tmp_path / f"{shape}.pt"
    node: list[Any] = [torch.ones(2)]
    if shape == "cycle":
        node.append(node)
    else:
        for _ in range(60):
            node = [node, node]
    torch.save({"x": node}, src)
    why = "holds itself" if shape == "cycle" else "more than 50000000 values"
    with pytest.raises(acp.CheckpointCorrupt, match=f"{shape}.pt: `x") as e:
        read_torch([str(src)])
    assert why in str(e.value)


def test_import_takes_containers_the_state_shares(tmp_path: Path, shm_dir: Path) -> None:
    """An optimizer's param groups share their default ``betas`` tuple, and
    the unpickler keeps it shared: the import is not refused for it."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "lr": 1e-4}])
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    groups = state["optim"]["param_groups"]
    assert groups[0]["betas"] is groups[1]["betas"]
    src = tmp_path / "shared.pt"
    torch.save(state, src)
    dest = tmp_path / "dest"
    run("import", src, "--to", dest, "--step", 1, "--shm-dir", shm_dir)
    with acp.Checkpointer(
        dest, shm_dir=shm_dir, ring_bytes=SMALL_RING, release_on_close=True
    ) as ckpt:
        got = ckpt.load(1)
    assert got["optim"]["param_groups"][1]["betas"] == groups[1]["betas"]
    assert torch.equal(got["optim"]["state"][0]["exp_avg"], state["optim"]["state"][0]["exp_avg"])


def test_export_to_a_symlinked_directory_replaces_the_link(root: Root, tmp_path: Path) -> None:
    """``--force`` onto a symlink to a directory replaces the link, as the
    safetensors export does; it never writes into the linked directory."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for to in ("torch", "safetensors"):
        out = tmp_path / f"m-{to}"
        out.symlink_to(elsewhere)
        run("export", root.path, out, "--to", to, "--force")
        assert not out.is_symlink()
        assert out.is_file()
        assert list(elsewhere.iterdir()) == []


def test_import_safetensors(tmp_path: Path, shm_dir: Path) -> None:
    from safetensors.torch import save_file

    tensors = {
        "a": torch.arange(6, dtype=torch.float16).reshape(2, 3),
        "b": torch.ones(3),
        # A rotary `freqs_cis` buffer: complex64 (C64), format version 5.
        "c": torch.polar(torch.ones(4, 2), torch.randn(4, 2)),
    }
    src = tmp_path / "x.safetensors"
    save_file(tensors, src, metadata={"format": "pt"})
    dest = tmp_path / "dest"
    r = run_json("import", src, "--to", dest, "--step", 9, "--shm-dir", shm_dir)
    assert r["tensors"] == 3
    with acp.Checkpointer(dest, job="check2", shm_dir=shm_dir, ring_bytes=SMALL_RING) as ckpt:
        loaded = ckpt.load()
    assert set(loaded) == {"a", "b", "c"}
    for k, v in tensors.items():
        assert torch.equal(loaded[k], v)
    info = run_json("inspect", dest)
    assert info["files"][0]["metadata"]["format"] == "pt"
    # No private ring is left behind.
    assert not [p for p in shm_dir.iterdir() if p.name.startswith("acp-import")]


def test_export_then_import_keeps_the_values(root: Root, tmp_path: Path, shm_dir: Path) -> None:
    out = tmp_path / "m.safetensors"
    run("export", root.path, out, "--step", 100)
    dest = tmp_path / "dest"
    run("import", out, "--to", dest, "--step", 100, "--shm-dir", shm_dir)
    with acp.Checkpointer(dest, job="check3", shm_dir=shm_dir, ring_bytes=SMALL_RING) as ckpt:
        assert_same(state(100), ckpt.load())
    run("import", tmp_path / "missing.safetensors", "--to", dest, "--step", 1, check_rc=3)


# --- diff -----------------------------------------------------------------------


def test_diff_numbers(tmp_path: Path, shm_dir: Path) -> None:
    r = Root(tmp_path / "ckpt", shm_dir)
    base = torch.linspace(-1, 1, 100)
    changed = base.clone()
    changed[3] += 0.25
    changed[7] -= 0.5
    with r.open() as ckpt:
        ckpt.save(1, {"w": base, "h": base.to(torch.bfloat16), "i": torch.arange(4), "lr": 0.1})
        ckpt.save(
            2,
            {
                "w": changed,
                "h": changed.to(torch.bfloat16),
                "i": torch.tensor([0, 1, 5, 3]),
                "lr": 0.2,
                "new": torch.ones(2),
            },
        )
    d = run_json("diff", r.path, "--step", 1, "--step", 2)
    assert d["added"] == ["new"]
    assert d["removed"] == []
    by = {t["name"]: t for t in d["changed"]}
    w = by["w"]
    assert w["changed_elements"] == 2
    assert w["max_abs_diff"] == pytest.approx(0.5, rel=1e-6)
    want = float(torch.linalg.norm((changed - base).double()) / torch.linalg.norm(base.double()))
    assert w["rel_l2"] == pytest.approx(want, rel=1e-6)
    h = by["h"]
    hb, hc = base.to(torch.bfloat16).double(), changed.to(torch.bfloat16).double()
    assert h["max_abs_diff"] == pytest.approx(float((hc - hb).abs().max()), rel=1e-9)
    assert h["rel_l2"] == pytest.approx(float(torch.linalg.norm(hc - hb) / torch.linalg.norm(hb)))
    assert by["i"]["changed_elements"] == 1
    assert by["i"]["max_abs_diff"] is None
    assert by["i"]["differing_bytes"] == 1
    assert [v["path"] for v in d["values"]] == ["lr", "new"]
    text = run("diff", r.path, "--step", 1, "--step", 2).stdout
    assert "+ new" in text
    assert "~ w: 2/100 element(s) changed" in text
    r.flip(2, "w")
    run("diff", r.path, "--step", 1, "--step", 2, check_rc=1)


# --- gc -----------------------------------------------------------------------------


def test_gc_keeps_what_it_should(tmp_path: Path, shm_dir: Path) -> None:
    r = Root(tmp_path / "ckpt", shm_dir)
    r.save(100, 200, 300, 400, 500)
    stale = r.path / ".pending-000000000600-r00000-1-2"
    stale.mkdir()
    (stale / "rank-00000.safetensors").write_bytes(b"partial")
    dry = run_json("gc", r.path, "--keep", 2, "--every", 200, "--dry-run")
    assert dry["removed_steps"] == [100, 300]
    assert (r.path / "step-000000000100").exists()
    g = run_json("gc", r.path, "--keep", 2, "--every", 200, "--pending")
    assert g["removed_steps"] == [100, 300]
    assert g["kept_steps"] == [200, 400, 500]
    assert g["removed_unfinished"] == []  # younger than an hour
    assert stale.exists()
    g = run_json("gc", r.path, "--pending", "--older-than", 0)
    assert g["removed_unfinished"] == [stale.name]
    assert not stale.exists()
    steps = [s["step"] for s in run_json("ls", r.path)["steps"]]
    assert steps == [200, 400, 500]
    run("gc", r.path, "--keep", 0, check_rc=2)
    run("verify", r.path, "--all")


# --- persist --------------------------------------------------------------------------

DEAD_SAVER = textwrap.dedent(
    """
    import os, signal, sys, torch, acp
    root, shm, job = sys.argv[1:4]
    kw = dict(job=job, shm_dir=shm, ring_bytes=32 << 20, mlock=False)
    with acp.Checkpointer(root, **kw) as ckpt:
        ckpt.save(1, {"w": torch.full((100,), 1.0), "step": 1}).wait()
    # The storage dies: every storage operation fails from now on.
    dead = acp._acp.FaultInjector(fail_at=0, sticky=True)
    ckpt = acp.Checkpointer(root, faults=dead, persist_on_open=False, **kw)
    try:
        ckpt.save(2, {"w": torch.full((100,), 2.0), "step": 2}).wait()
    except acp.StorageError:
        pass
    else:
        sys.exit("the save should have failed")
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_persist_commits_what_a_killed_saver_left(tmp_path: Path, shm_dir: Path) -> None:
    root = tmp_path / "ckpt"
    job = f"dead-{uuid.uuid4().hex[:8]}"
    child = subprocess.run(
        [sys.executable, "-c", DEAD_SAVER, str(root), str(shm_dir), job],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    where = ["--job", job, "--shm-dir", shm_dir]
    before = run_json("ls", root, *where)
    assert before["latest"] == 1
    assert [s["step"] for s in before["resident_only"]] == [2]
    assert "acp persist" in run("ls", root, *where).stdout
    p = run_json("persist", root, *where)
    assert p["ranks"][0]["persisted_steps"] == [2]
    assert p["latest"] == 2
    run("verify", root, "--step", 2)
    with acp.Checkpointer(root, shm_dir=shm_dir, job="reader", ring_bytes=SMALL_RING) as ckpt:
        got = ckpt.load(2)
    assert torch.equal(got["w"], torch.full((100,), 2.0))
    again = run("persist", root, *where).stdout
    assert "nothing to persist" in again


def test_persist_refuses_while_the_trainer_lives(root: Root) -> None:
    with root.open() as ckpt:
        ckpt.save(400, state(400)).wait()
        proc = run("persist", root.path, "--job", root.job, "--shm-dir", root.shm_dir, check_rc=5)
        assert "live process" in proc.stderr


def test_persist_with_nothing_resident(root: Root, tmp_path: Path) -> None:
    p = run_json("persist", root.path, "--job", "nobody", "--shm-dir", tmp_path)
    assert p["ranks"] == []


# --- bench ------------------------------------------------------------------------------


def test_bench_small(tmp_path: Path, shm_dir: Path) -> None:
    r = run_json("bench", "--size", "2MiB", "--dir", tmp_path, "--shm-dir", shm_dir)
    names = [row["name"] for row in r["rows"]]
    assert names[0] == "memcpy"
    assert any(n.startswith("flush") for n in names)
    assert all(row["bytes"] >= 2 << 20 for row in r["rows"])
    assert list(tmp_path.iterdir()) == []
    assert list(shm_dir.iterdir()) == []


# --- the README's examples -----------------------------------------------------------------


def bash_blocks(path: Path, section: str) -> Iterator[str]:
    """The ```bash blocks of the Markdown section headed ``section``."""
    text = path.read_text()
    start = text.index(section)
    end = text.find("\n## ", start + len(section))
    yield from re.findall(r"```bash\n(.*?)```", text[start : end if end > 0 else None], re.DOTALL)


def test_readme_examples_run(tmp_path: Path) -> None:
    acp_bin = shutil.which("acp", path=os.path.dirname(sys.executable))
    if acp_bin is None:
        pytest.skip("the acp script is not installed beside this Python")
    blocks = list(bash_blocks(REPO / "README.md", "## The `acp` command line"))
    assert len(blocks) >= 3
    root = tmp_path / "run1"
    r = Root(root, Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path)
    r.save(100, 200, 300)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = dict(os.environ, PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    try:
        for block in blocks:
            script = (
                block.replace("--dir /tmp", "--dir @SCRATCH@")
                .replace("/tmp/", "@SCRATCH@/")
                .replace("/mnt/ckpt/imported", str(tmp_path / "imported"))
                .replace("/mnt/ckpt/run1", str(root))
                .replace("@SCRATCH@", str(scratch))
                .replace("python -c", f"{sys.executable} -c")
            )
            proc = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", script],
                capture_output=True,
                text=True,
                env=env,
                check=False,
                timeout=300,
            )
            assert proc.returncode == 0, (script, proc.stdout, proc.stderr)
    finally:
        # Export and import opened no ring; the trainer's fixture did, under
        # its own job; remove the default-job slots an example could leave.
        for target in (root, tmp_path / "imported"):
            if target.exists():
                for slot in run_json("ls", target)["slots"]:
                    Path(slot["path"]).unlink(missing_ok=True)
        for slot in run_json("ls", root, "--job", r.job, "--shm-dir", r.shm_dir)["slots"]:
            Path(slot["path"]).unlink(missing_ok=True)
        # The per-user slot directory, once empty (another ring may use it).
        with contextlib.suppress(OSError):
            slot_dir(Path(r.shm_dir)).rmdir()


def test_progress_bar_only_on_a_terminal(root: Root) -> None:
    import pty

    master, slave = pty.openpty()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "acp.cli", "verify", str(root.path), "--all"],
            stdout=subprocess.PIPE,
            stderr=slave,
            text=True,
            check=False,
            timeout=120,
        )
        os.close(slave)
        slave = -1
        drawn = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)
    assert proc.returncode == 0
    assert b"verify step" in drawn
    assert b"%" in drawn
    assert "verify step" not in proc.stdout


def test_export_torch_of_a_numpy_state(tmp_path: Path, shm_dir: Path) -> None:
    import numpy as np

    r = Root(tmp_path / "ckpt", shm_dir)
    with r.open() as ckpt:
        ckpt.save(1, {"a": np.arange(6, dtype=np.int32).reshape(2, 3), "s": np.float64(2.5)})
    out = tmp_path / "np.pt"
    run("export", r.path, out, "--to", "torch")
    got = torch.load(out, weights_only=True)
    assert torch.equal(got["a"], torch.arange(6, dtype=torch.int32).reshape(2, 3))
    assert isinstance(got["s"], torch.Tensor)
    assert float(got["s"]) == 2.5
