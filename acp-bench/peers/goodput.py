#!/usr/bin/env python3
"""Goodput under faults: a training job SIGKILLed at random moments, with acp and with its peers.

    python acp-bench/peers/goodput.py --quick              # a smoke run, about a minute
    python acp-bench/peers/goodput.py --budget 120 --mtbf 15 --every 5 20

For each mode a supervisor runs a worker process (``goodput_worker.py``: an MLP trained with
AdamW on a deterministic data stream, 114 MB of state by default), SIGKILLs its process group
at moments drawn from a seeded exponential distribution (mean ``--mtbf`` seconds), restarts it
at once, and stops it after the budget. Every mode gets the same kill moments, as offsets from
the start of its run (with rounds: one draw over the whole budget, cut into the rounds). Modes:

- ``acp``: ``acp.Checkpointer.save`` every step (``acp-N``: every N steps); a restart
  restores the newest step acp has with ``ckpt.load``, from the shared-memory ring when the
  killed worker's slot survived;
- ``torch-N``: ``torch.save`` of model and optimizer every N steps, atomically (temp file,
  fsync, rename, fsync of the directory); a restart loads it with ``torch.load(weights_only=True)``;
- ``dcp-N``: ``torch.distributed.checkpoint.async_save(..., no_dist=True)`` every N steps into a
  temp directory, renamed to ``step-N`` once its future completed (one save in flight: the next
  one waits for it); a restart loads the newest complete directory with ``dcp.load``.

N comes from ``--every`` and acp's interval from ``--acp-every`` (several values give several
modes). The machine is shared and its load drifts, so the measurement runs in ``--rounds``
rounds (the budget split evenly): each round runs the bare loop (no checkpoints, no faults:
the pure step rate), then every mode, in an order rotated from round to round, under that
round's kill schedule, then the bare loop again. Each mode's figures are relative to the mean
of the two bare-loop rates of its round.

Useful steps: after the budget the last worker is killed like the others, and a probe process
restores what a restart would get; its step is the run's useful steps, so recomputed steps
count once. Time lost per fault: from the kill until a restarted worker reports the step the
job had reached before it (restart, imports, restore and recompute), on the supervisor's clock.
Checkpoint overhead: the step rate while training (from each worker's restore to its last
step, summed over workers) against the bare loop's; ``--clean S`` adds a fault-free run of S
seconds per mode and round and takes the overhead from those instead.

Correctness: every worker reports a checksum of the model and optimizer state after every step
(a blake2b digest of every 97th element of every tensor). A restored state's checksum must
equal the one reported when that step was trained, every recomputed step's must equal its first
computation's, and every step's must equal the bare loop's; a restore older than the newest
checkpoint reported complete before the kill is an error too. Any of these fails the mode and
the exit status is 1.

Output (``--out``, default ``acp-bench/results/goodput/``): ``goodput.json`` (every run, fault and
event), ``goodput.md`` (a table and a sentence per mode) and ``goodput.png`` (useful step against
wall time, kills marked).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import selectors
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from goodput_worker import QUICK_MODEL, STRIDE, Model

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "goodput_worker.py")
DEFAULT_OUT = os.path.join(os.path.dirname(HERE), "results", "goodput")
STDERR_TAIL = 4000
"""Characters of a failed worker's log that go into the error."""
STARTUP_TIMEOUT = 300.0
"""Seconds a worker may take to restore (a probe) or to train its first step (a fault-free
run, whose budget counts from there)."""
MAX_FAILURES = 50
"""Failed checks kept per mode in the JSON (the count is kept too)."""
DURABLE = {"acp": "saved", "torch": "durable", "dcp": "durable"}
"""The event after which a mode's step survives a SIGKILL of the worker (for acp: the save
returned, the step is in the shared-memory ring)."""


# ============================================================================ the supervisor


@dataclass
class Mode:
    name: str
    kind: str
    every: int
    label: str
    on_full: str = "wait"
    """acp's ``on_full``."""


@dataclass
class Run:
    """One mode in one round; times in seconds from the run's start, on the supervisor's
    clock. ``events`` are the workers' (``inc``: which worker, 0 the first)."""

    mode: str
    kind: str
    round: int
    faulted: bool
    budget: float
    kills: list[float]
    events: list[dict[str, Any]] = field(default_factory=list)
    spawns: list[float] = field(default_factory=list)
    probe: dict[str, Any] | None = None
    errors: list[str] = field(default_factory=list)
    loadavg: list[float] = field(default_factory=list)
    wall: float = 0.0


class Supervisor:
    """Runs workers, one at a time, each run in its own checkpoint directory, shared-memory
    directory and acp job; ``close`` kills the running worker and removes them all."""

    def __init__(self, a: argparse.Namespace, model: Model) -> None:
        self.a, self.model = a, model
        if a.workdir is not None:
            os.makedirs(a.workdir, exist_ok=True)
        self.base = tempfile.mkdtemp(prefix="acp-goodput-", dir=a.workdir)
        self.proc: subprocess.Popen[bytes] | None = None
        self.dirs: list[str] = [self.base]

    # ---- one worker process

    def _spawn(self, mode: Mode, paths: dict[str, str], t0: float, probe: bool) -> Pipe:
        r, w = os.pipe()
        cmd = [
            sys.executable, WORKER, f"--kind={mode.kind}",
            f"--fd={w}", f"--every={mode.every}", f"--root={paths['root']}",
            f"--job={paths['job']}", f"--shm-dir={paths['shm']}",
            f"--acp-on-full={mode.on_full}", *self.model.flags(),
        ]  # fmt: skip
        if probe:
            cmd.append("--probe")
        with open(paths["log"], "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                pass_fds=(w,), start_new_session=True,
            )  # fmt: skip
        os.close(w)
        return Pipe(r, self.proc, t0)

    def _kill(self) -> None:
        """SIGKILLs the worker's process group and reaps it."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self._kill()
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)

    # ---- one run

    def run(self, mode: Mode, rnd: int, budget: float, kills: list[float]) -> Run:
        """Runs ``mode`` for ``budget`` seconds, SIGKILLing and restarting its worker at each
        of ``kills``; then (with kills) probes what a restart would restore."""
        tag = f"{mode.name}-{rnd}-{'faults' if kills else 'clean'}"
        shm_base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        paths = {
            "root": os.path.join(self.base, tag, "ckpt"),
            "shm": tempfile.mkdtemp(prefix="acp-goodput-", dir=shm_base),
            "job": f"goodput-{os.getpid()}-{tag}-{os.urandom(3).hex()}",
            "log": os.path.join(self.base, f"{tag}.log"),
        }
        self.dirs.append(paths["shm"])
        os.makedirs(os.path.dirname(paths["root"]))
        run = Run(mode.name, mode.kind, rnd, bool(kills), budget, list(kills))
        run.loadavg.append(os.getloadavg()[0])
        t0 = time.monotonic()
        for inc, until in enumerate([*run.kills, budget]):
            end, exited = until, False
            run.spawns.append(time.monotonic() - t0)
            pipe = self._spawn(mode, paths, t0, probe=False)
            if not kills:  # fault-free: the budget counts from the first step
                exited = pipe.read_until(t0 + STARTUP_TIMEOUT, stop_at="step")
                first = next((e["t"] for e in pipe.events if e["ev"] == "step"), None)
                if first is None and not exited:
                    run.errors.append(f"no step in {STARTUP_TIMEOUT:g} s")
                end = (first or 0.0) + budget
            exited = exited or pipe.read_until(t0 + end)
            self._kill()
            pipe.finish(stamp=end)  # what it wrote before the kill
            run.events += [{**e, "inc": inc} for e in pipe.events]
            if exited:  # a training worker never exits on its own
                run.errors.append(
                    f"worker {pipe.proc.pid} exited with {pipe.proc.returncode} at "
                    f"{time.monotonic() - t0:.1f} s; its log:\n{_tail(paths['log'])}"
                )
                break
        run.wall = time.monotonic() - t0
        if kills and not run.errors:
            run.probe = self._probe(mode, paths)
        run.loadavg.append(os.getloadavg()[0])
        shutil.rmtree(os.path.dirname(paths["root"]), ignore_errors=True)
        shutil.rmtree(paths["shm"], ignore_errors=True)
        return run

    def _probe(self, mode: Mode, paths: dict[str, str]) -> dict[str, Any]:
        """What a restart after the budget restores."""
        t0 = time.monotonic()
        pipe = self._spawn(mode, paths, t0, probe=True)
        exited = pipe.read_until(t0 + STARTUP_TIMEOUT)
        self._kill()
        pipe.finish(stamp=time.monotonic() - t0)
        out: dict[str, Any] = {"rc": pipe.proc.returncode, "step": 0}
        for ev in pipe.events:
            if ev["ev"] in ("restored", "fresh"):
                out.update(ev)
        if not exited or pipe.proc.returncode != 0:
            out["error"] = (
                f"probe exited with {pipe.proc.returncode}; its log:\n{_tail(paths['log'])}"
            )
        return out


class Pipe:
    """The event pipe of one worker; events are stamped with the supervisor's clock (seconds
    since ``t0``) when they are read."""

    def __init__(self, fd: int, proc: subprocess.Popen[bytes], t0: float) -> None:
        self.fd, self.proc, self.t0 = fd, proc, t0
        os.set_blocking(fd, False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(fd, selectors.EVENT_READ)
        self.buf = b""
        self.events: list[dict[str, Any]] = []

    def _drain(self, stamp: float | None = None) -> bool:
        """Reads what is there; False at end of file."""
        while True:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return True
            if not chunk:
                return False
            self.buf += chunk
            *lines, self.buf = self.buf.split(b"\n")
            t = time.monotonic() - self.t0 if stamp is None else stamp
            self.events += [{"t": t, **json.loads(line)} for line in lines]

    def read_until(self, deadline: float, stop_at: str | None = None) -> bool:
        """Reads events until ``deadline`` (monotonic), or until an event of kind
        ``stop_at`` arrives; True if the worker closed its end (exited) before."""
        while (left := deadline - time.monotonic()) > 0:
            self.sel.select(timeout=left)
            n = len(self.events)
            if not self._drain():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=10)
                return True
            if any(e["ev"] == stop_at for e in self.events[n:]):
                return False
        self._drain()
        return False

    def finish(self, stamp: float) -> None:
        """After the worker is dead: reads the events it wrote before, stamped ``stamp``."""
        self._drain(stamp)
        self.sel.close()
        os.close(self.fd)


def _tail(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-STDERR_TAIL:]
    except OSError:
        return ""


# ============================================================================ analysis


def kill_schedule(budget: float, mtbf: float, seed: int, min_gap: float) -> list[float]:
    """Kill moments (seconds from the start) with exponential gaps of mean ``mtbf``, each at
    least ``min_gap``, before ``budget``."""
    rng = random.Random(seed)
    out: list[float] = []
    t = 0.0
    while True:
        t += max(min_gap, rng.expovariate(1.0 / mtbf))
        if t >= budget:
            return out
        out.append(round(t, 3))


def training(run: Run) -> tuple[int, float]:
    """Steps trained and seconds spent training: from each worker's restore (or fresh start)
    to its last step, summed over the run's workers. Checkpoint stalls are inside."""
    steps, secs = 0, 0.0
    for inc in sorted({e["inc"] for e in run.events}):
        evs = [e for e in run.events if e["inc"] == inc]
        ready = next((e["t"] for e in evs if e["ev"] in ("restored", "fresh")), None)
        done = [e["t"] for e in evs if e["ev"] == "step"]
        if ready is not None and done:
            steps += len(done)
            secs += done[-1] - ready
    return steps, secs


def _rate(run: Run) -> float | None:
    steps, secs = training(run)
    return steps / secs if secs > 0 else None


def check(run: Run, ref_ck: dict[int, str]) -> list[str]:
    """The correctness checks of one run; returns the failures."""
    where = f"round {run.round + 1}{'' if run.faulted else ', fault-free'}"
    bad = [f"{where}: {e}" for e in run.errors]
    seen: dict[int, str] = {}
    last_durable = 0
    durable_ev = DURABLE.get(run.kind)

    def fail(text: str) -> None:
        bad.append(f"{where}: {text}")

    for e in run.events:
        if e["ev"] == "step":
            s, ck = e["step"], e["ck"]
            if seen.setdefault(s, ck) != ck:
                fail(f"step {s} recomputed at {e['t']:.2f} s: checksum {ck}, first {seen[s]}")
            if ref_ck.get(s, ck) != ck:
                fail(f"step {s}: checksum {ck}, the bare loop's {ref_ck[s]}")
        elif e["ev"] == durable_ev:
            last_durable = max(last_durable, e["step"])
        elif e["ev"] == "error":
            fail(f"save of step {e['step']} failed: {e['error']}")
        elif e["ev"] in ("restored", "fresh"):
            got = e.get("step", 0)
            if got < last_durable:
                fail(
                    f"worker {e['inc']} restored step {got} at {e['t']:.2f} s, but step "
                    f"{last_durable} was reported saved before the kill"
                )
            if e["ev"] == "restored" and seen.get(got, e["ck"]) != e["ck"]:
                fail(f"restored step {got}: checksum {e['ck']}, trained {seen[got]}")
            last_durable = got
    p = run.probe
    if p is not None:
        if p.get("error"):
            fail(p["error"])
        if p["step"] < last_durable:
            fail(f"the probe restored step {p['step']}, but step {last_durable} was saved")
        if seen.get(p["step"], p.get("ck")) != p.get("ck"):
            fail(f"the probe's step {p['step']}: checksum {p['ck']}, trained {seen[p['step']]}")
    return bad


def faults(run: Run) -> list[dict[str, Any]]:
    """Per kill: the step the job had reached (its high-water mark), what the restart
    restored, and the time lost: until a restarted worker reports that step again. A fault
    whose job is killed again before that is ``censored="kill"`` and counts until that kill
    (the next fault's time starts there: together they partition the time spent below the
    high-water mark); one still short of it when the budget ends is ``censored="budget"``
    and left out of the time figures."""
    progress = [
        (e["t"], e["inc"], e["step"]) for e in run.events if e["ev"] in ("step", "restored")
    ]
    out = []
    for i, tk in enumerate(run.kills):
        last = i + 1 == len(run.kills)
        end = run.budget if last else run.kills[i + 1]
        reached = max([s for t, _, s in progress if t <= tk], default=0)
        back = next((t for t, inc, s in progress if inc == i + 1 and s >= reached), None)
        f: dict[str, Any] = {"round": run.round, "t": tk, "reached": reached}
        f["censored"] = None if back is not None else "budget" if last else "kill"
        f["lost_secs"] = (back if back is not None else end) - tk
        ev = {e["ev"]: e for e in reversed(run.events) if e["inc"] == i + 1}
        if "imported" in ev:
            f["import_secs"] = ev["imported"]["t"] - tk
        if "opened" in ev:
            f["opened_secs"] = ev["opened"]["t"] - tk
            f["build_secs"] = ev["opened"]["build_secs"]
            f["open_secs"] = ev["opened"]["open_secs"]
        restarted = ev.get("restored", ev.get("fresh"))
        if restarted is not None:
            f["restored"] = restarted.get("step", 0)
            f["steps_lost"] = reached - f["restored"]
            f["restart_secs"] = restarted["t"] - tk
            f["restore_secs"] = restarted.get("secs", 0.0)
            f["source"] = restarted.get("source", "none")
        out.append(f)
    return out


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def summarize(
    mode: Mode, runs: list[Run], cleans: list[Run], bare: list[float | None], bad: list[str]
) -> dict[str, Any]:
    """The figures of one mode over its rounds; ``bare``: the bare loop's step rate by round."""
    every = [f for run in runs for f in faults(run)]
    timed = [f for f in every if f["censored"] != "budget"]
    restarted = [f for f in every if "restored" in f]
    resumed = [f for f in restarted if f["restored"] > 0]
    budget = sum(run.budget for run in runs)
    useful = sum(run.probe["step"] if run.probe else 0 for run in runs)
    ideal = sum((bare[run.round] or 0.0) * run.budget for run in runs)
    src = cleans or runs
    steps = sum(training(run)[0] for run in src)
    bare_steps = sum(training(run)[1] * (bare[run.round] or 0.0) for run in src)
    return {
        "mode": mode.name,
        "label": mode.label,
        "useful_steps": useful,
        "budget_secs": budget,
        "useful_steps_per_hour": useful / budget * 3600,
        "goodput": useful / ideal if ideal else None,
        "by_round": [
            {
                "round": run.round,
                "useful_steps": run.probe["step"] if run.probe else 0,
                "goodput": (run.probe["step"] if run.probe else 0)
                / ((bare[run.round] or 0.0) * run.budget or 1.0),
            }
            for run in runs
        ],
        "faults": len(every),
        "faults_timed": len(timed),
        "killed_before_back": sum(1 for f in timed if f["censored"]),
        "resumed": len(resumed),
        "lost_secs_median": _med([f["lost_secs"] for f in timed]),
        "lost_secs_mean": _mean([f["lost_secs"] for f in timed]),
        "restart_secs_median": _med([f["restart_secs"] for f in restarted]),
        "import_secs_median": _med([f["import_secs"] for f in every if "import_secs" in f]),
        "opened_secs_median": _med([f["opened_secs"] for f in every if "opened_secs" in f]),
        "build_secs_median": _med([f["build_secs"] for f in every if "build_secs" in f]),
        "open_secs_median": _med([f["open_secs"] for f in every if "open_secs" in f]),
        "restore_secs_median": _med([f["restore_secs"] for f in resumed]),
        "steps_lost_median": _med([f["steps_lost"] for f in restarted]),
        "steps_lost_mean": _mean([f["steps_lost"] for f in restarted]),
        "restore_sources": sorted({f["source"] for f in resumed}),
        "ram_restores": sum(1 for f in resumed if f["source"] == "ram"),
        "final_sources": [(run.probe or {}).get("source", "none") for run in runs],
        "training_steps_per_sec": steps / sum(training(run)[1] for run in src) if steps else None,
        "overhead": 1 - steps / bare_steps if bare_steps else None,
        "overhead_from": "fault-free runs" if cleans else "training time of the faulted runs",
        "stall_secs_median": _med([e["stall"] for run in src for e in run.events if "stall" in e]),
        "checks": "ok" if not bad else "FAILED",
        "failures": bad[:MAX_FAILURES],
        "failures_total": len(bad),
        "fault_list": every,
    }


# ============================================================================ output


def machine() -> dict[str, Any]:
    """The machine and versions (torch's without importing it here)."""
    from importlib.metadata import version

    import acp

    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    mem = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        mem = int(next(ln.split()[1] for ln in f if ln.startswith("MemTotal"))) * 1024
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "mem_bytes": mem,
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "torch": version("torch"),
        "acp": acp.__version__,
        "loadavg_start": list(os.getloadavg()),
    }


def _fmt(x: float | None, spec: str, scale: float = 1.0, unit: str = "") -> str:
    return "n/a" if x is None else f"{x * scale:{spec}}{unit}"


def markdown(doc: dict[str, Any]) -> str:
    c, m = doc["config"], doc["machine"]
    md = c["model"]
    rates = "; ".join(" and ".join(_fmt(x, ".2f") for x in r["bare_rates"]) for r in doc["rounds"])
    kills = sum(len(r["kills"]) for r in doc["rounds"])
    budget = sum(r["budget"] for r in doc["rounds"])
    budgets = " and ".join(f"{r['budget']:g}" for r in doc["rounds"])
    lines = [
        "# Goodput under faults",
        "",
        f"`{' '.join(doc['command'])}`",
        "",
        f"An MLP ({md['d_in']}-{md['hidden']}x{md['layers']}-{md['classes']}, batch "
        f"{md['batch']}, AdamW, {md['threads']} torch thread(s)) with "
        f"{doc['state_bytes'] / 1e6:.0f} MB of state, trained for {budget:g} s per mode "
        f"({len(doc['rounds'])} round(s) of {budgets} s) and SIGKILLed {kills} times, at the "
        f"same moments in every mode ({c['schedule']}). The bare loop (no checkpoints, no "
        f"faults) ran {rates} steps/s (at the start and the end of each round). "
        f"{m['cpus']} CPUs ({m['cpu']}), {m['mem_bytes'] / 2**30:.0f} GiB, shared with other "
        f"work (load average {m['loadavg_start'][0]:.1f} at the start, "
        f"{m['loadavg_end'][0]:.1f} at the end); torch {m['torch']}, acp {m['acp']}; "
        f"the whole run took {doc['wall_secs']:.0f} s.",
        "",
        "| mode | useful steps | useful steps/h | goodput (of bare) | faults "
        "| time lost per fault, median / mean | steps lost per fault, median "
        "| kill to restored, median | checkpoint overhead | save stall, median | checks |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in doc["summary"]:
        lines.append(
            f"| {s['label']} | {s['useful_steps']} | {s['useful_steps_per_hour']:,.0f} | "
            f"{_fmt(s['goodput'], '.1f', 100, ' %')} | {s['faults']} | "
            f"{_fmt(s['lost_secs_median'], '.2f', 1, ' s')} / "
            f"{_fmt(s['lost_secs_mean'], '.2f', 1, ' s')} | "
            f"{_fmt(s['steps_lost_median'], '.1f')} | "
            f"{_fmt(s['restart_secs_median'], '.2f', 1, ' s')} | "
            f"{_fmt(s['overhead'], '.1f', 100, ' %')} | "
            f"{_fmt(s['stall_secs_median'], '.1f', 1e3, ' ms')} | {s['checks']} |"
        )
    lines += ["", *[f"- {_sentence(s)}" for s in doc["summary"]], ""]
    overhead = (
        f"Checkpoint overhead: 1 - (the mode's step rate in fault-free runs of {c['clean']:g} s) "
        "/ (the bare loop's in the same round); the save stall is from those runs. "
        if c["clean"] > 0
        else "Checkpoint overhead: 1 - (the mode's step rate while training, from each "
        "worker's restore to its last step, stalls included) / (the bare loop's in the same "
        "round). "
    )
    lines += [
        "Useful steps: the step a restart after the budget restores, summed over the rounds "
        "(recomputed steps count once); goodput: useful steps over what the bare loop's step "
        "rate gives in the same time. Time lost per fault: from the kill until a restarted "
        "worker reports the step the job had reached before it, on the supervisor's clock; a "
        "fault whose job is killed again before getting back counts until that kill, and one "
        "the budget cut short is left out. "
        + overhead
        + "Save stall: how long a checkpoint call held the training loop (for dcp, with the "
        "wait for the previous save to finish). Every restart runs on the same node: the peers' "
        "files are in the page cache, acp's newest step in its shared-memory ring.",
        "",
    ]
    return "\n".join(lines)


def _sentence(s: dict[str, Any]) -> str:
    text = (
        f"**{s['label']}**: {s['useful_steps']} useful steps "
        f"({s['useful_steps_per_hour']:,.0f}/h, {_fmt(s['goodput'], '.0f', 100, ' %')} of the "
        f"bare loop's rate); {s['faults']} faults, {s['resumed']} resumed from a checkpoint; "
        f"per fault a median {_fmt(s['lost_secs_median'], '.2f')} s lost (mean "
        f"{_fmt(s['lost_secs_mean'], '.2f')} s): {_fmt(s['restart_secs_median'], '.2f')} s from "
        f"the kill to a restored state (Python up and torch imported after "
        f"{_fmt(s['import_secs_median'], '.2f')} s; then model and AdamW built in "
        f"{_fmt(s['build_secs_median'], '.2f')} s, checkpointer opened in "
        f"{_fmt(s['open_secs_median'], '.3f')} s, state restored in "
        f"{_fmt(s['restore_secs_median'], '.3f')} s), then "
        f"{_fmt(s['steps_lost_median'], '.1f')} steps to recompute"
    )
    if s["restore_sources"]:
        text += f"; restored from {', '.join(s['restore_sources'])}"
        if "ram" in s["restore_sources"]:
            text += f" ({s['ram_restores']} of {s['resumed']} restores from RAM)"
    if s["overhead"] is not None:
        text += f"; checkpointing costs {s['overhead'] * 100:.1f} % of the bare loop's step rate"
    text += "."
    if s["failures"]:
        text += f" **CHECKS FAILED**: {'; '.join(s['failures'][:3])}"
    return text


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = doc["rounds"]
    fig = plt.figure(figsize=(13, 1.0 + 4.0 * len(rounds)), layout="constrained")
    grid = fig.add_gridspec(len(rounds), 2, width_ratios=[2.3, 1])
    color = {s["mode"]: f"C{i}" for i, s in enumerate(doc["summary"])}
    label = {s["mode"]: s["label"] for s in doc["summary"]}
    for r, rnd in enumerate(rounds):
        ax = fig.add_subplot(grid[r, 0])
        budget = rnd["budget"]
        for i, tk in enumerate(rnd["kills"]):
            ax.axvline(tk, color="0.6", lw=0.8, ls="--", label="SIGKILL" if i == 0 else None)
        if rnd["bare_rate"]:
            t1 = rnd["bare_first_step_secs"]
            ax.plot([t1, budget], [0, rnd["bare_rate"] * (budget - t1)], "k:", lw=1,
                    label="bare loop, no faults")  # fmt: skip
        for run in (x for x in doc["runs"] if x["round"] == r):
            durable = DURABLE[run["kind"]]
            pts = [(0.0, 0)]
            for e in run["events"]:
                if e["ev"] in (durable, "restored"):
                    pts.append((e["t"], max(pts[-1][1], e["step"])))
            pts.append((budget, run["probe"]["step"] if run["probe"] else pts[-1][1]))
            c = color[run["mode"]]
            ax.step(*zip(*pts), where="post", lw=1.6, color=c, label=label[run["mode"]])
            trained = [(e["t"], e["step"]) for e in run["events"] if e["ev"] == "step"]
            if trained:
                ax.plot(*zip(*trained), ".", ms=1, color=c, alpha=0.3)
        ax.set_xlim(0, budget)
        ax.set_ylim(bottom=0)
        ax.set_ylabel("useful step (dots: step trained)")
        ax.set_title(f"Round {r + 1}: progress under the same SIGKILL schedule", fontsize=10)
        if r == 0:
            ax.legend(loc="upper left", fontsize=8)
        if r == len(rounds) - 1:
            ax.set_xlabel("wall time (s)")
    bx = fig.add_subplot(grid[:, 1])
    labels = [s["label"] for s in doc["summary"]]
    values = [(s["goodput"] or 0) * 100 for s in doc["summary"]]
    bars = bx.barh(labels, values, color=[color[s["mode"]] for s in doc["summary"]])
    bx.bar_label(bars, fmt="%.0f %%", fontsize=8)
    bx.invert_yaxis()
    bx.set_xlabel("goodput (% of the bare loop's step rate)")
    bx.set_xlim(0, 110)
    bx.set_title("Goodput over all rounds", fontsize=10)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ============================================================================ main


def modes(a: argparse.Namespace) -> list[Mode]:
    out = []
    for kind in a.modes:
        if kind == "acp":
            for n in a.acp_every:
                for on_full in a.acp_on_full:
                    label = f"acp, save every {'step' if n == 1 else f'{n} steps'}"
                    name = "acp" if n == 1 else f"acp-{n}"
                    if on_full != "wait":
                        label += f" (on_full={on_full})"
                        name += f"-{on_full}"
                    out.append(Mode(name, "acp", n, label, on_full))
        else:
            for n in a.every:
                call = "torch.save" if kind == "torch" else "dcp.async_save"
                out.append(Mode(f"{kind}-{n}", kind, n, f"{call} every {n} steps"))
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--budget", type=float, help="seconds per mode under faults (default 120)")
    ap.add_argument("--rounds", type=int, help="rounds the budget is split into (default 2)")
    ap.add_argument("--mtbf", type=float, help="mean seconds between kills (default 15)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    ap.add_argument("--min-gap", type=float, help="least seconds between kills (default 0)")
    ap.add_argument("--kills", type=float, nargs="*", help="explicit kill offsets, every round")
    ap.add_argument("--bare", type=float, help="seconds of the bare loop per round (default 20)")
    ap.add_argument("--clean", type=float, help="seconds of a fault-free run per mode and round "
                    "(default 0: overhead from the faulted runs)")  # fmt: skip
    ap.add_argument("--every", type=int, nargs="+", help="peers' checkpoint interval(s) (10)")
    ap.add_argument("--acp-every", type=int, nargs="+", default=[1],
                    help="acp's checkpoint interval(s) (1)")  # fmt: skip
    ap.add_argument("--acp-on-full", choices=["wait", "skip"], nargs="+", default=["wait"],
                    help="acp's on_full (what a save does when no ring slot is free); "
                    "both: two acp modes")  # fmt: skip
    ap.add_argument("--modes", nargs="+", choices=["acp", "torch", "dcp"],
                    default=["acp", "torch", "dcp"])  # fmt: skip
    for name, value in asdict(Model()).items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"model: default {value}")
    ap.add_argument("--out", default=DEFAULT_OUT, help="output directory")
    ap.add_argument(
        "--workdir",
        help="where checkpoint directories go, created if missing (default: system temp)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny model, short budget: a smoke run")
    a = ap.parse_args(argv)
    quick = {"budget": 0.0, "rounds": 1, "mtbf": 0.0, "min_gap": 0.0, "bare": 2.0,
             "clean": 0.0, "every": [5]}  # fmt: skip
    full = {"budget": 120.0, "rounds": 2, "mtbf": 15.0, "min_gap": 0.0, "bare": 20.0,
            "clean": 0.0, "every": [10]}  # fmt: skip
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    for k, v in asdict(QUICK_MODEL if a.quick else Model()).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.rounds < 1 or a.bare <= 0 or (a.budget <= 0 and not a.quick):
        ap.error("--rounds, --budget and --bare must be positive")
    return a


def schedule(a: argparse.Namespace, rnd: int, startup: float) -> tuple[list[float], float]:
    """Round ``rnd``'s kill moments and budget per mode. ``--quick`` fits them to the
    machine's speed: one kill at 1.5 times the bare loop's start-up time plus 1.5 s (a
    checkpoint exists by then), and as long again after it, plus 1 s, to restart."""
    if a.quick and a.kills is None:
        kill = round(1.5 * startup + 1.5, 3)
        return [kill], round(2 * kill + 1, 3)
    per_round = a.budget / a.rounds
    if a.kills is not None:
        return sorted(k for k in a.kills if 0 < k < per_round), per_round
    # One process over the whole budget, cut into the rounds: a short round alone would
    # often draw no kill at all.
    start = rnd * per_round
    kills = kill_schedule(a.budget, a.mtbf, a.seed, a.min_gap)
    return [round(k - start, 3) for k in kills if start < k < start + per_round], per_round


def describe(a: argparse.Namespace) -> str:
    """How the kill moments were chosen, in words."""
    if a.kills is not None:
        return f"given: {a.kills} s"
    if a.quick:
        return "--quick: one kill at 1.5 times the bare loop's start-up time, plus 1.5 s"
    gap = f", at least {a.min_gap:g} s" if a.min_gap > 0 else ""
    return (
        f"exponential gaps of mean {a.mtbf:g} s{gap}, seed {a.seed}, drawn over the whole "
        "budget and cut into the rounds"
    )


def measure(a: argparse.Namespace, sup: Supervisor, doc: dict[str, Any]) -> bool:
    """The rounds: the bare loop, then every mode (fault-free first with ``--clean``) under
    the round's kills; fills ``doc``; True if every check held."""
    ms = modes(a)
    runs: dict[str, list[Run]] = {m.name: [] for m in ms}
    cleans: dict[str, list[Run]] = {m.name: [] for m in ms}
    ref_ck: dict[int, str] = {}
    bad_bare: list[str] = []
    for r in range(a.rounds):
        _say(f"round {r + 1}/{a.rounds}: the bare loop, {a.bare:g} s")
        bare = sup.run(Mode("bare", "bare", 1, "bare loop"), r, a.bare, [])
        bad_bare += check(bare, ref_ck)
        ref_ck.update({e["step"]: e["ck"] for e in bare.events if e["ev"] == "step"})
        fresh = next((e for e in bare.events if e["ev"] == "fresh"), {})
        doc["state_bytes"] = fresh.get("state_bytes", 0)
        startup = next((e["t"] for e in bare.events if e["ev"] == "step"), 0.0)
        kills, per_round = schedule(a, r, startup)
        rnd: dict[str, Any] = {
            "budget": per_round,
            "kills": kills,
            "bare_rates": [_rate(bare)],
            "bare_first_step_secs": startup,
            "bare": [asdict(bare)],
        }
        doc["rounds"].append(rnd)
        _say(f"  {_fmt(_rate(bare), '.2f')} steps/s after {startup:.1f} s of start-up; each "
             f"mode: {per_round:g} s, kills at {kills}")  # fmt: skip
        k = r % len(ms)
        for mode in ms[k:] + ms[:k]:
            if a.clean > 0:
                cleans[mode.name].append(sup.run(mode, r, a.clean, []))
            run = sup.run(mode, r, per_round, kills)
            runs[mode.name].append(run)
            restored = [e.get("source") for e in run.events if e["ev"] == "restored"]
            _say(f"  {mode.label}: {run.probe['step'] if run.probe else 0} useful steps; "
                 f"restores from {restored}")  # fmt: skip
        if not a.quick:  # the load drifts: the bare loop again, at the end of the round
            bare = sup.run(Mode("bare", "bare", 1, "bare loop"), r, a.bare, [])
            bad_bare += check(bare, ref_ck)
            rnd["bare_rates"].append(_rate(bare))
            rnd["bare"].append(asdict(bare))
            _say(f"  the bare loop again: {_fmt(_rate(bare), '.2f')} steps/s")
        rates = [x for x in rnd["bare_rates"] if x]
        rnd["bare_rate"] = statistics.fmean(rates) if rates else None
    bare_rates = [rnd["bare_rate"] for rnd in doc["rounds"]]
    ok = not bad_bare
    if bad_bare:
        _say("FAILED: the bare loop:\n    " + "\n    ".join(bad_bare))
    for mode in ms:
        bad = [b for run in runs[mode.name] for b in check(run, ref_ck)]
        bad += [b for run in cleans[mode.name] for b in check(run, ref_ck)]
        doc["summary"].append(summarize(mode, runs[mode.name], cleans[mode.name], bare_rates, bad))
        doc["runs"] += [asdict(run) for run in runs[mode.name]]
        doc["clean_runs"] += [asdict(run) for run in cleans[mode.name]]
        if bad:
            ok = False
            more = f"\n    ... and {len(bad) - 10} more" if len(bad) > 10 else ""
            _say(f"FAILED: {mode.label}:\n    " + "\n    ".join(bad[:10]) + more)
    return ok


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    started = time.monotonic()
    model = Model(**{k: getattr(a, k) for k in asdict(Model())})
    doc: dict[str, Any] = {
        "command": [os.path.basename(sys.argv[0]), *(sys.argv[1:] if argv is None else argv)],
        "config": {
            "budget": a.budget, "rounds": a.rounds, "mtbf": a.mtbf, "seed": a.seed,
            "min_gap": a.min_gap, "kills": a.kills, "bare": a.bare, "clean": a.clean,
            "every": a.every, "acp_every": a.acp_every, "acp_on_full": a.acp_on_full,
            "model": asdict(model), "checksum_stride": STRIDE, "schedule": describe(a),
        },
        "machine": machine(),
        "rounds": [],
        "summary": [],
        "runs": [],
        "clean_runs": [],
    }  # fmt: skip
    sup = Supervisor(a, model)
    prev = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        ok = measure(a, sup, doc)
    finally:
        signal.signal(signal.SIGTERM, prev)
        sup.close()
    doc["wall_secs"] = time.monotonic() - started
    doc["machine"]["loadavg_end"] = list(os.getloadavg())
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "goodput.json"), "w") as f:
        json.dump(doc, f, indent=1)
    md = markdown(doc)
    with open(os.path.join(a.out, "goodput.md"), "w") as f:
        f.write(md)
    plot(doc, os.path.join(a.out, "goodput.png"))
    _say("\n" + md)
    return 0 if ok else 1


def _say(text: str) -> None:
    print(text, flush=True)


if __name__ == "__main__":
    sys.exit(main())
