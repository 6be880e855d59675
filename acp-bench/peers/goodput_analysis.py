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
PROTECTED = {"acp": ("replicated", "committed"), "torch": ("durable",)}
"""The events after which a rank's image of a step survives the loss of its node (for acp:
in the other node's RAM, or committed to storage); a step is protected once every rank's
image is."""


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
    world: int = 1
    """Ranks of the job: 1, or 2 on two simulated nodes (``--faults node-loss``)."""
    replicas: int = 0
    """acp's peer replicas (``replicas=``), with two ranks."""


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
    world: int = 1
    """Ranks of the job; with 2 every event carries its ``rank`` and every kill is the loss
    of node B (both ranks killed, node B's shared memory emptied)."""


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
        evs = [e for e in run.events if e["inc"] == inc and e.get("rank", 0) == 0]
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
    if run.world > 1:
        return check_job(run, ref_ck)
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


def check_job(run: Run, ref_ck: dict[int, str]) -> list[str]:
    """The checks of a run of several ranks under node losses: every step's checksum equals
    its first computation's and the bare loop's on every rank (the ranks are data parallel:
    identical states); at each restart every rank restores the same step, its checksum the
    one that rank trained, and no older than the newest step protected before the kill
    (every rank's image replicated to the other node or committed; torch: every rank's file
    durable). The probe likewise."""
    where = f"round {run.round + 1}{'' if run.faulted else ', fault-free'}"
    bad = [f"{where}: {e}" for e in run.errors]
    seen: dict[int, str] = {}
    protected: list[set[int]] = [set() for _ in range(run.world)]
    kinds = PROTECTED.get(run.kind, ())

    def fail(text: str) -> None:
        bad.append(f"{where}: {text}")

    def safe() -> int:
        """The newest step every rank's image of which is protected."""
        return max(set.intersection(*protected), default=0)

    def restarted(job: str, evs: list[dict[str, Any]]) -> None:
        steps = {e.get("rank", 0): e.get("step", 0) for e in evs}
        if len(steps) != run.world:
            fail(f"{job}: only ranks {sorted(steps)} restored")
        if len(set(steps.values())) > 1:
            fail(f"{job}: the ranks restored different steps: {steps}")
        for e in evs:
            got, r = e.get("step", 0), e.get("rank", 0)
            if got < safe():
                fail(
                    f"{job}: rank {r} restored step {got}, but step {safe()} was "
                    "protected on every rank before the node loss"
                )
            if e["ev"] == "restored" and seen.get(got, e["ck"]) != e["ck"]:
                fail(f"{job}: rank {r} restored step {got}: checksum {e['ck']}, trained "
                     f"{seen[got]}")  # fmt: skip
        for p in protected:  # what the restart restored is the job's new floor
            p.intersection_update(range(min(steps.values(), default=0) + 1))
            p.add(min(steps.values(), default=0))

    starts: dict[int, list[dict[str, Any]]] = {}
    for e in run.events:
        r = e.get("rank", 0)
        if e["ev"] == "step":
            s, ck = e["step"], e["ck"]
            if seen.setdefault(s, ck) != ck:
                fail(f"rank {r}: step {s} at {e['t']:.2f} s: checksum {ck}, first {seen[s]}")
            if ref_ck.get(s, ck) != ck:
                fail(f"rank {r}: step {s}: checksum {ck}, the bare loop's {ref_ck[s]}")
        elif e["ev"] in kinds:
            protected[r].add(e["step"])
        elif e["ev"] == "error":
            fail(f"rank {r}: save of step {e['step']} failed: {e['error']}")
        elif e["ev"] in ("restored", "fresh"):
            starts.setdefault(e["inc"], []).append(e)
            if len(starts[e["inc"]]) == run.world:
                restarted(f"job {e['inc']}", starts[e["inc"]])
    for inc, evs in starts.items():
        if len(evs) < run.world:
            restarted(f"job {inc}", evs)
    p = run.probe
    if p is not None:
        if p.get("error"):
            fail(p["error"])
        restarted("the probe", [{"ev": "fresh", **x} for x in p.get("ranks", [])])
    return bad


def faults(run: Run) -> list[dict[str, Any]]:
    """Per kill: see ``faults_one`` (one worker) and ``faults_job`` (several ranks)."""
    return faults_job(run) if run.world > 1 else faults_one(run)


def faults_job(run: Run) -> list[dict[str, Any]]:
    """Per node loss, as ``faults_one`` with the job's ranks taken together: the step the
    job had reached (the least of the ranks' newest steps), the time lost until every
    restarted rank reports it again, start-up figures of the slowest rank, and where each
    rank restored from (``sources``, by rank; ``source``: them joined by ``+``)."""
    ranks = range(run.world)
    kinds = PROTECTED.get(run.kind, ())
    out = []
    for i, tk in enumerate(run.kills):
        last = i + 1 == len(run.kills)
        end = run.budget if last else run.kills[i + 1]
        by_rank = [[e for e in run.events if e.get("rank", 0) == r] for r in ranks]
        reached = min(
            max([e["step"] for e in evs if e["ev"] in ("step", "restored") and e["t"] <= tk],
                default=0)
            for evs in by_rank
        )  # fmt: skip
        backs = [
            next((e["t"] for e in evs if e["inc"] == i + 1 and e["ev"] in ("step", "restored")
                  and e["step"] >= reached), None)
            for evs in by_rank
        ]  # fmt: skip
        back = None if None in backs else max(b for b in backs if b is not None)
        # The newest step every rank's image of which was protected before the kill (at
        # least what this job restored: that survived the previous loss).
        prot = [
            {e["step"] for e in x if e["inc"] == i and e["ev"] in kinds and e["t"] <= tk}
            for x in by_rank
        ]
        floor = min(
            [e.get("step", 0) for x in by_rank for e in x
             if e["inc"] == i and e["ev"] in ("restored", "fresh")],
            default=0,
        )  # fmt: skip
        f: dict[str, Any] = {"round": run.round, "t": tk, "reached": reached}
        f["protected"] = max(set.intersection(*prot) | {floor})
        f["censored"] = None if back is not None else "budget" if last else "kill"
        f["lost_secs"] = (back if back is not None else end) - tk
        evs = [{e["ev"]: e for e in reversed(x) if e["inc"] == i + 1} for x in by_rank]

        for name, kind, key, since in [
            ("import_secs", "imported", "t", tk),
            ("opened_secs", "opened", "t", tk),
            ("build_secs", "opened", "build_secs", 0.0),
            ("open_secs", "opened", "open_secs", 0.0),
        ]:
            xs = [ev[kind][key] - since for ev in evs if kind in ev]
            if len(xs) == run.world:  # the slowest rank's
                f[name] = max(xs)
        starts = [ev.get("restored", ev.get("fresh")) for ev in evs]
        if all(x is not None for x in starts):
            got = [x for x in starts if x is not None]
            f["restored"] = min(x.get("step", 0) for x in got)
            f["steps_lost"] = reached - f["restored"]
            f["restart_secs"] = max(x["t"] for x in got) - tk
            f["restore_secs"] = max(x.get("secs", 0.0) for x in got)
            f["sources"] = [x.get("source", "none") for x in got]
            f["source"] = "+".join(f["sources"])
            f["protected_lost"] = max(0, f["protected"] - f["restored"])
        out.append(f)
    return out


def faults_one(run: Run) -> list[dict[str, Any]]:
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
        "world": runs[0].world if runs else 1,
        "protected_lost_faults": sum(1 for f in restarted if f.get("protected_lost")),
        "protected_steps_lost": sum(f.get("protected_lost", 0) for f in restarted),
        "sources_by_rank": [
            sorted({f["sources"][r] for f in resumed if "sources" in f})
            for r in range(runs[0].world if runs else 1)
        ],
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
