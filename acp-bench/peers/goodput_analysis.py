"""goodput.py's analysis: a mode and a run as the supervisor records them, the kill
schedule, and from a run's events its correctness checks, its faults and the figures of
a mode over its rounds."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from typing import Any

MAX_FAILURES = 50
"""Failed checks kept per mode in the JSON (the count is kept too)."""
DURABLE = {"acp": "saved", "torch": "durable", "dcp": "durable"}
"""The event after which a mode's step survives a SIGKILL of the worker (for acp: the save
returned, the step is in the shared-memory ring)."""


@dataclass
class Mode:
    name: str
    kind: str
    every: int
    label: str
    on_full: str = "wait"
    """acp's ``on_full``."""
    persist: str = "all"
    """acp's persist policy: ``all`` (every save is written to storage), ``coalesce``
    (the newest snapshot whenever the previous persist finished) or ``every:N``."""


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


def step_rate(run: Run) -> float | None:
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
