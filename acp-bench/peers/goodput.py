#!/usr/bin/env python3
"""Goodput under faults: a training job SIGKILLed at random moments, with acp and with its peers.

    python acp-bench/peers/goodput.py --quick              # a smoke run, about a minute
    python acp-bench/peers/goodput.py --budget 120 --mtbf 15 --every 5 20
    python acp-bench/peers/goodput.py --regime realistic   # 1 GiB of state, 1 s steps

Two regimes set the defaults. ``small`` (the default): 114 MB of state, a step of a few tens
of milliseconds, a kill every 15 s on average; there about 2.2 s of every fault is the restart
itself (Python, torch import, model build), the same for every mode, so no mode can win by much.
``realistic``: about 1 GiB of state (``REALISTIC_MODEL``), a step of a second or two of compute,
a kill every 60 s on average, 20 minutes per mode in 2 rounds, the peers every 20 and 50 steps,
and acp snapshotting every step with the coalescing persist and with a persist every 50 steps
(``--acp-persist coalesce every:50``). Any flag given on the command line wins over the
regime's default (``--hidden``, ``--layers``, ``--batch`` size the model and the step).

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
import itertools
import json
import os
import selectors
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

from goodput_analysis import Mode, Run, check, kill_schedule, step_rate, summarize
from goodput_report import fmt, machine, markdown, plot
from goodput_worker import QUICK_MODEL, REALISTIC_MODEL, STRIDE, Model

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "goodput_worker.py")
DEFAULT_OUT = os.path.join(os.path.dirname(HERE), "results", "goodput")
STDERR_TAIL = 4000
"""Characters of a failed worker's log that go into the error."""
STARTUP_TIMEOUT = 300.0
"""Seconds a worker may take to restore (a probe) or to train its first step (a fault-free
run, whose budget counts from there)."""


# ============================================================================ the supervisor


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
            f"--acp-on-full={mode.on_full}", f"--acp-persist={mode.persist}",
            *self.model.flags(),
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


# ============================================================================ main


def modes(a: argparse.Namespace) -> list[Mode]:
    out = []
    for kind in a.modes:
        if kind == "acp":
            for n, on_full, persist in itertools.product(a.acp_every, a.acp_on_full, a.acp_persist):
                label = f"acp, save every {'step' if n == 1 else f'{n} steps'}"
                name = "acp" if n == 1 else f"acp-{n}"
                if on_full != "wait":
                    label += f" (on_full={on_full})"
                    name += f"-{on_full}"
                if persist != "all":
                    label += f", persist {persist.replace(':', ' ')}"
                    name += f"-persist-{persist.replace(':', '')}"
                out.append(Mode(name, "acp", n, label, on_full, persist))
        else:
            for n in a.every:
                call = "torch.save" if kind == "torch" else "dcp.async_save"
                out.append(Mode(f"{kind}-{n}", kind, n, f"{call} every {n} steps"))
    return out


def _persist(text: str) -> str:
    if text in ("all", "coalesce") or (text.startswith("every:") and text[6:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: give all, coalesce or every:N")


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
    ap.add_argument("--acp-persist", nargs="+", type=_persist,
                    help="acp's persist policies: all (every save written to storage), "
                    "coalesce, every:N; several give several acp modes (default: all; "
                    "realistic regime: coalesce every:50)")  # fmt: skip
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
    ap.add_argument("--regime", choices=["small", "realistic"], default="small",
                    help="the defaults: small (114 MB, a kill every 15 s) or realistic "
                    "(1 GiB, 1 s steps, a kill every 60 s)")  # fmt: skip
    a = ap.parse_args(argv)
    quick = {"budget": 0.0, "rounds": 1, "mtbf": 0.0, "min_gap": 0.0, "bare": 2.0,
             "clean": 0.0, "every": [5], "acp_persist": ["all"]}  # fmt: skip
    full = {"budget": 120.0, "rounds": 2, "mtbf": 15.0, "min_gap": 0.0, "bare": 20.0,
            "clean": 0.0, "every": [10], "acp_persist": ["all"]}  # fmt: skip
    realistic = {"budget": 1200.0, "rounds": 2, "mtbf": 60.0, "min_gap": 0.0, "bare": 60.0,
                 "clean": 0.0, "every": [20, 50],
                 "acp_persist": ["coalesce", "every:50"]}  # fmt: skip
    if a.quick and a.regime != "small":
        ap.error("--quick is a smoke run of the small regime")
    defaults = quick if a.quick else realistic if a.regime == "realistic" else full
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    model = QUICK_MODEL if a.quick else REALISTIC_MODEL if a.regime == "realistic" else Model()
    for k, v in asdict(model).items():
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
            "bare_rates": [step_rate(bare)],
            "bare_first_step_secs": startup,
            "bare": [asdict(bare)],
        }
        doc["rounds"].append(rnd)
        _say(f"  {fmt(step_rate(bare), '.2f')} steps/s after {startup:.1f} s of start-up; each "
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
            rnd["bare_rates"].append(step_rate(bare))
            rnd["bare"].append(asdict(bare))
            _say(f"  the bare loop again: {fmt(step_rate(bare), '.2f')} steps/s")
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
            "regime": a.regime,
            "budget": a.budget, "rounds": a.rounds, "mtbf": a.mtbf, "seed": a.seed,
            "min_gap": a.min_gap, "kills": a.kills, "bare": a.bare, "clean": a.clean,
            "every": a.every, "acp_every": a.acp_every, "acp_on_full": a.acp_on_full,
            "acp_persist": a.acp_persist,
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
