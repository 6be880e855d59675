"""The step-time overhead of saving every step, against not saving, in the same run.

One process trains goodput.py's model (an MLP with AdamW: 114 MB of state by default) and
times each step (the training step plus the ``save()`` call) in each mode:

- ``none``: no save;
- ``snapshot``: ``save(step, state, persist=False)`` every step: a RAM snapshot only (the
  copy into the ring, then the background hash that makes it loadable);
- ``coalesce``: ``save(step, state)`` every step with the default policy: every step a
  snapshot, the newest persisted whenever the previous persist has finished;
- ``every`` (not run unless named): every step persisted;
- ``memcpy`` (not run unless named): the floor of any RAM snapshot, measured beside the
  modes above: every tensor of the state copied each step into one preallocated, prefaulted
  buffer with libc memcpy on as many threads as acp's default ``copy_threads`` (the machine's
  cores), nothing else (no ring, no sums, no Python beyond the walk). ``memcpy:overlap=1``
  overlaps it as ``overlap=1`` does a save: the copy runs on its threads while the next step's
  forward and backward run, and that step's optimizer step waits for it. ``threads=N`` sets
  the copy's threads.

A mode may carry ``Checkpointer`` keywords, to compare settings in the same run:
``snapshot:background_nice=19``, ``coalesce:copy_threads=1,ring_slots=4``; other persist
policies are ``coalesce`` with theirs: ``coalesce:persist_every=50``,
``coalesce:persist_interval=30``. Each mode's row gives the bytes its policy wrote to storage
per hour of training at its step rate (``stats()["persist"]["bytes_written"]`` over the timed
blocks, their persists waited for, against the sum of their step times). With
``overlap=1`` (``snapshot:overlap=1``: overlapped saves) the mode's checkpointer is hooked to
the optimizer (``staged_before``), so each step's optimizer step waits for the copy of the
save before it, and that wait is in the step's time; the report gives its median.

What saving every step costs has a floor that no engine goes below: the state's bytes read
and written once per step, on the same cores and the same memory bus as training. With the
small model (114 MB every ~60 ms) that floor is a large share of a step; name ``memcpy`` (and
``memcpy:overlap=1``) among the modes to measure it in the same run, and read each mode's
overhead against it.

The modes alternate within each round (the order rotates from round to round), each mode
running ``--steps`` timed steps; between two modes the engine is left to finish its work
(``Checkpointer.wait``) outside the timing, so no mode pays for another's flush. The
overhead of a mode is its median (and mean) step time over ``none``'s, from all rounds.
The load average before and after is recorded: on a shared machine, read the ratios.

    python acp-bench/peers/overhead.py --rounds 20 --steps 10 --out acp-bench/results/overhead
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from baselines import Buffer, copy_ranges
from compare_harness import tensors_of
from goodput_worker import REALISTIC_MODEL, Model, Trainer

MODES = ("none", "snapshot", "coalesce", "every", "memcpy")
FLOOR_KEYWORDS = ("overlap", "threads")
DEFAULT_MODES = ("none", "snapshot", "coalesce")
ALL = "ALL"
ENDED = "ended threads"


def _base(mode: str) -> str:
    return mode.split(":", 1)[0]


def _keywords(mode: str) -> dict[str, Any]:
    """The ``Checkpointer`` keywords after ``mode``'s colon (integers as such)."""
    if ":" not in mode:
        return {}
    out: dict[str, Any] = {}
    for item in mode.split(":", 1)[1].split(","):
        key, _, value = item.partition("=")
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out


def _mode(text: str) -> str:
    """An argparse type: a mode, with optional keywords."""
    if _base(text) not in MODES:
        raise argparse.ArgumentTypeError(f"{text!r}: a mode is one of {', '.join(MODES)}")
    if _base(text) == "none" and ":" in text:
        raise argparse.ArgumentTypeError(f"{text!r}: none takes no keywords")
    for item in text.split(":", 1)[1].split(",") if ":" in text else []:
        if "=" not in item:
            raise argparse.ArgumentTypeError(f"{text!r}: {item!r} is not KEY=VALUE")
    if _base(text) == "memcpy":
        unknown = sorted(set(_keywords(text)) - set(FLOOR_KEYWORDS))
        if unknown:
            raise argparse.ArgumentTypeError(
                f"{text!r}: memcpy takes {', '.join(FLOOR_KEYWORDS)}, not {', '.join(unknown)}"
            )
    return text


class Floor:
    """The ``memcpy`` mode: a save that is nothing but a copy of every tensor of the state into
    one preallocated buffer, on ``threads`` threads; with ``overlap`` the copy runs in the
    background and ``staged`` (hooked before the optimizer step) waits for it. It has the
    methods of ``Checkpointer`` that ``Tally.block`` calls."""

    def __init__(self, nbytes: int, *, overlap: bool, threads: int) -> None:
        self.buf = Buffer(nbytes)
        self.overlap, self.threads = overlap, threads
        self._copy: threading.Thread | None = None

    def save(self, step: int, state: Any, persist: bool | None = None) -> None:
        del step, persist
        self.staged()  # one copy at a time, as a ring slot is written once
        ranges, at = [], 0
        for t in tensors_of(state):
            n = t.numel() * t.element_size()
            if at + n > self.buf.size:
                raise SystemExit(f"memcpy: the state outgrew its {self.buf.size}-byte buffer")
            ranges.append((self.buf.addr + at, t.data_ptr(), n))
            at += n + (-n % 64)
        if not self.overlap:
            copy_ranges(ranges, self.threads)
            return
        self._copy = threading.Thread(
            target=copy_ranges, args=(ranges, self.threads), name="floor-copy", daemon=True
        )
        self._copy.start()

    def reserve(self, state: Any) -> None:
        del state  # the buffer is prefaulted when it is made

    def staged_before(self, optimizer: Any) -> Any:
        return optimizer.register_step_pre_hook(lambda *_: self.staged())

    def staged(self) -> None:
        if self._copy is not None:
            self._copy.join()
            self._copy = None

    def wait(self) -> None:
        self.staged()

    def close(self) -> None:
        self.staged()
        self.buf.close()


def _order(modes: list[str], round_: int) -> list[str]:
    k = round_ % len(modes)
    return modes[k:] + modes[:k]


def _threads_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of this process's live threads, summed by
    thread name (``python``, ``acp-flush-r0``, ...), and of the whole process
    (``ALL``: also the threads that ended, e.g. a save's ``acp-copy`` threads)."""
    tick = os.sysconf("SC_CLK_TCK")
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    out: dict[str, float] = {ALL: (int(fields[11]) + int(fields[12])) / tick}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _faults() -> int:
    """Minor page faults of the whole process so far."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7])


def _written(ckpt: Any) -> int:
    """Bytes ``ckpt`` (a Checkpointer) has written to storage so far; 0 for none or the floor."""
    if ckpt is None or isinstance(ckpt, Floor):
        return 0
    return int(ckpt.stats()["persist"]["bytes_written"])


def _pct(x: float, base: float) -> float:
    return 100.0 * (x / base - 1.0)


class Tally:
    """One mode's figures over its timed blocks: step times, the save call
    and its stall, and where the time goes (CPU seconds per thread name and
    minor page faults, over the steps and the wait after them)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.block_medians: list[float] = []
        """Each timed block's median step time, in round order."""
        self.stalls: list[float] = []
        self.saves: list[float] = []
        self.waits: list[float] = []
        """Overlapped saves: how long the optimizer step waited for each copy."""
        self.persisted = 0
        """Timed saves committed in storage (the others stayed in RAM or were
        superseded)."""
        self.cpu: dict[str, float] = {}
        self.faults = 0
        self.written = 0
        """Bytes the checkpointer wrote to storage for the timed blocks
        (``stats()["persist"]["bytes_written"]``, their persists waited
        for)."""

    def block(self, tr: Trainer, ckpt: Any, mode: str, steps: int, timed: bool) -> None:
        """Runs ``steps`` steps of ``mode``, then waits for ``ckpt``'s
        background work (untimed), so that the next mode starts clean."""
        cpu0, faults0 = _threads_cpu(), _faults()
        written0 = _written(ckpt)
        first = len(self.times)
        handles = []
        for _ in range(steps):
            t0 = time.perf_counter()
            tr.train_step()
            ts = time.perf_counter()
            if ckpt is not None:
                persist = False if _base(mode) == "snapshot" else None
                h = ckpt.save(tr.step, tr.state(), persist=persist)
            t1 = time.perf_counter()
            if timed:
                self.times.append(t1 - t0)
                if ckpt is not None:
                    self.saves.append(t1 - ts)
                    if h is not None:  # the memcpy floor has no handle
                        handles.append(h)
        if ckpt is not None:
            ckpt.wait()
        for h in handles:  # sealed by now
            self.stalls.append(h.stats.stall_secs)
            self.persisted += bool(h.stats.persisted)
            if h.stats.overlap_wait_secs is not None:
                self.waits.append(h.stats.overlap_wait_secs)
        if timed:
            self.block_medians.append(statistics.median(self.times[first:]))
            spent = {n: s - cpu0.get(n, 0.0) for n, s in _threads_cpu().items()}
            spent[ENDED] = spent[ALL] - sum(v for n, v in spent.items() if n != ALL)
            del spent[ALL]
            for name, secs in spent.items():
                self.cpu[name] = self.cpu.get(name, 0.0) + secs
            self.faults += _faults() - faults0
            self.written += _written(ckpt) - written0

    def row(self, mode: str) -> dict[str, Any]:
        t = self.times
        return {
            "mode": mode,
            "steps": len(t),
            "median_s": statistics.median(t),
            "mean_s": statistics.fmean(t),
            "p90_s": statistics.quantiles(t, n=10)[-1] if len(t) >= 2 else t[0],
            # The floor's stall is its save call: the copy, or (overlapped) its start.
            "stall_median_s": statistics.median(self.stalls or self.saves or [0.0]),
            "overlap_wait_median_s": statistics.median(self.waits) if self.waits else None,
            "overlapped_saves": len(self.waits),
            "save_call_median_s": statistics.median(self.saves) if self.saves else 0.0,
            "cpu_per_step_s": {k: v / len(t) for k, v in sorted(self.cpu.items()) if v > 0},
            "minor_faults_per_step": self.faults / len(t),
            "persisted_steps": self.persisted,
            "storage_bytes": self.written,
            # What the policy writes per hour of training at this step rate.
            "storage_bytes_per_hour": self.written / sum(t) * 3600,
        }


def _open(acp: Any, work: Path, mode: str, state_bytes: int) -> Any:
    slot = state_bytes + (4 << 20)
    if _base(mode) == "memcpy":
        kw = _keywords(mode)
        threads = int(kw.get("threads", os.cpu_count() or 1))
        return Floor(slot, overlap=bool(kw.get("overlap")), threads=threads)
    kwargs: dict[str, Any] = {"persist_every": 1} if _base(mode) == "every" else {}
    kwargs.update(ring_slots=3, ring_bytes=3 * slot, keep_last=2, release_on_close=True)
    kwargs.update(_keywords(mode))
    name = f"{os.getpid()}-{len(list(work.iterdir()))}"
    return acp.Checkpointer(work / name, job=f"overhead-{name}", **kwargs)


def run(a: argparse.Namespace) -> dict[str, Any]:
    import acp

    m = Model(d_in=a.d_in, hidden=a.hidden, layers=a.layers, batch=a.batch, threads=a.threads)
    tr = Trainer(m)
    tr.init_opt_state()
    state_bytes = tr.state_bytes()
    work = Path(tempfile.mkdtemp(prefix="acp-overhead-", dir=a.dir))
    if len(set(a.modes)) != len(a.modes):
        raise SystemExit(f"--modes: a mode is named twice: {a.modes}")
    ckpts = {mode: _open(acp, work, mode, state_bytes) for mode in a.modes if mode != "none"}
    tallies = {mode: Tally() for mode in a.modes}
    load_before = os.getloadavg()
    started = time.time()
    try:
        for mode, ckpt in ckpts.items():
            ckpt.reserve(tr.state())
            if _keywords(mode).get("overlap"):
                ckpt.staged_before(tr.opt)
        for round_ in range(-1, a.rounds):  # round -1 warms every mode up, untimed
            for mode in _order(list(a.modes), max(round_, 0)):
                steps = a.warmup if round_ < 0 else a.steps
                tallies[mode].block(tr, ckpts.get(mode), mode, steps, timed=round_ >= 0)
    finally:
        for ckpt in ckpts.values():
            ckpt.close()
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    rows = [tallies[mode].row(mode) for mode in a.modes]
    base = next((r for r in rows if r["mode"] == "none"), None)
    for row in rows:
        if base is not None:
            row["overhead_median_pct"] = _pct(row["median_s"], base["median_s"])
            row["overhead_mean_pct"] = _pct(row["mean_s"], base["mean_s"])
            # Paired: each round's block against none's block of the same
            # round, which cancels the drift of a shared machine's load.
            pairs = zip(tallies[row["mode"]].block_medians, tallies["none"].block_medians)
            row["overhead_paired_pct"] = statistics.median(_pct(x, b) for x, b in pairs)
    return {
        "args": {k: v for k, v in vars(a).items() if k not in ("out", "dir")},
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "acp": acp.__version__,
        },
        "state_bytes": state_bytes,
        "load_before": load_before,
        "load_after": load_after,
        "secs": time.time() - started,
        "rows": rows,
    }


def report(got: dict[str, Any]) -> str:
    lines = [
        f"state {got['state_bytes'] / 1e6:.0f} MB, {got['args']['rounds']} rounds x "
        f"{got['args']['steps']} steps per mode; load average "
        f"{got['load_before'][0]:.2f} before, {got['load_after'][0]:.2f} after",
        "",
        "| mode | step median | overhead (median) | overhead (paired by round) "
        "| step mean | overhead (mean) | step p90 | save stall median | timed saves persisted "
        "| written to storage per hour |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in got["rows"]:
        med, paired, mean = (
            "—" if r.get(k) is None else f"{r[k]:+.1f} %"
            for k in ("overhead_median_pct", "overhead_paired_pct", "overhead_mean_pct")
        )
        lines.append(
            f"| {r['mode']} | {r['median_s'] * 1e3:.1f} ms | {med} | {paired} | "
            f"{r['mean_s'] * 1e3:.1f} ms | {mean} | {r['p90_s'] * 1e3:.1f} ms | "
            f"{r['stall_median_s'] * 1e3:.1f} ms | {r['persisted_steps']} | "
            f"{r['storage_bytes_per_hour'] / 1e9:,.1f} GB |"
        )
    lines += ["", "CPU per step, by thread (ms), and minor page faults per step:", ""]
    for r in got["rows"]:
        threads = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["cpu_per_step_s"].items())
        wait = r.get("overlap_wait_median_s")
        overlapped = (
            ""
            if wait is None
            else f"; {r['overlapped_saves']} saves overlapped, the optimizer step waited "
            f"{wait * 1e3:.1f} ms (median) for their copies"
        )
        lines.append(
            f"- {r['mode']}: {threads}; save() call median "
            f"{r['save_call_median_s'] * 1e3:.1f} ms; {r['minor_faults_per_step']:.0f} faults"
            f"{overlapped}"
        )
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    d = Model()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--modes", nargs="+", type=_mode, default=list(DEFAULT_MODES), metavar="MODE[:K=V,...]"
    )
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode per round")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per mode first")
    p.add_argument("--d-in", type=int, default=d.d_in)
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads")
    p.add_argument(
        "--realistic", action="store_true", help="goodput.py's realistic model (about 1 GiB)"
    )
    p.add_argument("--quick", action="store_true", help="a tiny run (for the tests)")
    p.add_argument("--dir", default=None, help="where the checkpoint roots go (a temp dir)")
    p.add_argument("--out", default="acp-bench/results/overhead")
    a = p.parse_args(argv)
    if a.realistic:
        r = REALISTIC_MODEL
        a.d_in, a.hidden, a.layers, a.batch = r.d_in, r.hidden, r.layers, r.batch
    if a.quick:
        a.d_in, a.hidden, a.layers, a.batch = 32, 64, 2, 4
        a.rounds, a.steps, a.warmup = 2, 3, 1
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    got = run(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(got, indent=2) + "\n")
    text = report(got)
    (out / "overhead.md").write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
