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
import socket
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
    """Runs jobs, one at a time (a job: one worker, or one per rank), each run in its own
    checkpoint directory, shared-memory directory (one per node) and acp job; ``close`` kills
    the running workers and removes them all."""

    def __init__(self, a: argparse.Namespace, model: Model) -> None:
        self.a, self.model = a, model
        if a.workdir is not None:
            os.makedirs(a.workdir, exist_ok=True)
        self.base = tempfile.mkdtemp(prefix="acp-goodput-", dir=a.workdir)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.dirs: list[str] = [self.base]

    # ---- one worker process

    def _spawn(self, mode: Mode, paths: dict[str, str], t0: float, probe: bool) -> Job:
        """Starts the mode's ranks: one worker, or (``mode.world`` 2) rank 0 on node "a" and
        rank 1 on node "b", each with its node's shared-memory directory."""
        port = _free_port() if mode.world > 1 else 0
        pipes = []
        for rank in range(mode.world):
            r, w = os.pipe()
            shm = paths["shm"] if rank == 0 else paths["shm_b"]
            cmd = [
                sys.executable, WORKER, f"--kind={mode.kind}",
                f"--fd={w}", f"--every={mode.every}", f"--root={paths['root']}",
                f"--job={paths['job']}", f"--shm-dir={shm}",
                f"--acp-on-full={mode.on_full}", f"--acp-persist={mode.persist}",
                *self.model.flags(),
            ]  # fmt: skip
            if mode.world > 1:
                cmd += [f"--world={mode.world}", f"--rank={rank}", f"--port={port}",
                        f"--node={'ab'[rank]}", f"--replicas={mode.replicas}"]  # fmt: skip
            if probe:
                cmd.append("--probe")
            with open(_log(paths, rank), "ab") as log:
                proc = subprocess.Popen(
                    cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                    pass_fds=(w,), start_new_session=True,
                )  # fmt: skip
            self.procs.append(proc)
            os.close(w)
            pipes.append(Pipe(r, proc, t0, rank if mode.world > 1 else None))
        return Job(pipes)

    def _kill(self) -> None:
        """SIGKILLs the workers' process groups and reaps them."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
        self.procs = []

    @staticmethod
    def _lose_node_b(paths: dict[str, str]) -> None:
        """Node B is replaced: its shared-memory directory starts empty."""
        shutil.rmtree(paths["shm_b"], ignore_errors=True)
        os.mkdir(paths["shm_b"], 0o700)

    def close(self) -> None:
        self._kill()
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)

    # ---- one run

    def run(self, mode: Mode, rnd: int, budget: float, kills: list[float]) -> Run:
        """Runs ``mode`` for ``budget`` seconds, SIGKILLing and restarting its worker at each
        of ``kills``; then (with kills) probes what a restart would restore. A job of two ranks
        loses node B at each kill (and at the end, before the probe): both ranks are killed
        and node B's shared-memory directory is emptied."""
        tag = f"{mode.name}-{rnd}-{'faults' if kills else 'clean'}"
        shm_base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        paths = {
            "root": os.path.join(self.base, tag, "ckpt"),
            "shm": tempfile.mkdtemp(prefix="acp-goodput-", dir=shm_base),
            "job": f"goodput-{os.getpid()}-{tag}-{os.urandom(3).hex()}",
            "log": os.path.join(self.base, f"{tag}.log"),
        }
        self.dirs.append(paths["shm"])
        if mode.world > 1:
            paths["shm_b"] = tempfile.mkdtemp(prefix="acp-goodput-b-", dir=shm_base)
            self.dirs.append(paths["shm_b"])
        os.makedirs(os.path.dirname(paths["root"]))
        run = Run(mode.name, mode.kind, rnd, bool(kills), budget, list(kills), world=mode.world)
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
            if kills and mode.world > 1:
                self._lose_node_b(paths)
            pipe.finish(stamp=end)  # what it wrote before the kill
            run.events += [{**e, "inc": inc} for e in pipe.events]
            if exited:  # a training worker never exits on its own
                run.errors.append(
                    f"a worker exited ({pipe.exits()}) at {time.monotonic() - t0:.1f} s; "
                    f"its log:\n{_tails(paths, mode.world)}"
                )
                break
        run.wall = time.monotonic() - t0
        if kills and not run.errors:
            run.probe = self._probe(mode, paths)
        run.loadavg.append(os.getloadavg()[0])
        shutil.rmtree(os.path.dirname(paths["root"]), ignore_errors=True)
        shutil.rmtree(paths["shm"], ignore_errors=True)
        if "shm_b" in paths:
            shutil.rmtree(paths["shm_b"], ignore_errors=True)
        return run

    def _probe(self, mode: Mode, paths: dict[str, str]) -> dict[str, Any]:
        """What a restart after the budget restores (rank 0's; with several ranks, every
        rank's under ``ranks`` and their sources joined by ``+``)."""
        t0 = time.monotonic()
        job = self._spawn(mode, paths, t0, probe=True)
        exited = job.read_until(t0 + STARTUP_TIMEOUT, until_exit=True)
        self._kill()
        job.finish(stamp=time.monotonic() - t0)
        per_rank: dict[int, dict[str, Any]] = {}
        for ev in job.events:
            if ev["ev"] in ("restored", "fresh"):
                per_rank[ev.get("rank", 0)] = {"step": 0, **ev}
        out: dict[str, Any] = {"rc": job.returncode(), "step": 0, **per_rank.get(0, {})}
        if mode.world > 1:
            out["ranks"] = [per_rank.get(r, {"step": 0, "rank": r}) for r in range(mode.world)]
            out["source"] = "+".join(p.get("source", "none") for p in out["ranks"])
        if not exited or job.returncode() != 0:
            out["error"] = f"probe exited ({job.exits()}); its log:\n{_tails(paths, mode.world)}"
        return out


class Pipe:
    """The event pipe of one worker; events are stamped with the supervisor's clock (seconds
    since ``t0``) when they are read, and with the worker's ``rank`` in a job of several."""

    def __init__(
        self, fd: int, proc: subprocess.Popen[bytes], t0: float, rank: int | None = None
    ) -> None:
        self.fd, self.proc, self.t0, self.rank = fd, proc, t0, rank
        os.set_blocking(fd, False)
        self.buf = b""
        self.eof = False
        self.events: list[dict[str, Any]] = []

    def drain(self, stamp: float | None = None) -> bool:
        """Reads what is there; False at end of file."""
        while True:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return True
            if not chunk:
                self.eof = True
                return False
            self.buf += chunk
            *lines, self.buf = self.buf.split(b"\n")
            t = time.monotonic() - self.t0 if stamp is None else stamp
            tag = {} if self.rank is None else {"rank": self.rank}
            self.events += [{"t": t, **tag, **json.loads(line)} for line in lines]


class Job:
    """The pipes of a job's workers (one per rank), read together."""

    def __init__(self, pipes: list[Pipe]) -> None:
        self.pipes = pipes
        self.sel = selectors.DefaultSelector()
        for p in pipes:
            self.sel.register(p.fd, selectors.EVENT_READ, p)
        self.events: list[dict[str, Any]] = []

    def _merge(self) -> None:
        self.events = sorted((e for p in self.pipes for e in p.events), key=lambda e: e["t"])

    def read_until(
        self, deadline: float, stop_at: str | None = None, until_exit: bool = False
    ) -> bool:
        """Reads events until ``deadline`` (monotonic), or until an event of kind ``stop_at``
        arrives; True if a worker closed its end (exited) before (with ``until_exit``: once
        every worker has)."""
        try:
            while (left := deadline - time.monotonic()) > 0:
                for key, _ in self.sel.select(timeout=left):
                    p: Pipe = key.data
                    n = len(p.events)
                    if not p.drain():
                        self.sel.unregister(p.fd)
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            p.proc.wait(timeout=10)
                        if not until_exit or all(q.eof for q in self.pipes):
                            return True
                    if any(e["ev"] == stop_at for e in p.events[n:]):
                        return False
            for p in self.pipes:
                if not p.eof:
                    p.drain()
            return False
        finally:
            self._merge()

    def finish(self, stamp: float) -> None:
        """After the workers are dead: reads the events they wrote before, stamped ``stamp``."""
        for p in self.pipes:
            if not p.eof:
                p.drain(stamp)
            os.close(p.fd)
        self.sel.close()
        self._merge()

    def returncode(self) -> int | None:
        """The first non-zero exit status of the workers, else 0 (None: one still runs)."""
        codes = [p.proc.returncode for p in self.pipes]
        return next((c for c in codes if c != 0), 0)

    def exits(self) -> str:
        return ", ".join(f"pid {p.proc.pid}: {p.proc.returncode}" for p in self.pipes)


def _free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a job's gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _log(paths: dict[str, str], rank: int) -> str:
    return paths["log"] if rank == 0 else paths["log"].replace(".log", f"-rank{rank}.log")


def _tails(paths: dict[str, str], world: int) -> str:
    return "\n".join(_tail(_log(paths, r)) for r in range(world))


def _tail(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-STDERR_TAIL:]
    except OSError:
        return ""


# ============================================================================ main


def world(a: argparse.Namespace) -> int:
    """Ranks of every job: 2 (on two simulated nodes) under node losses, else 1."""
    return 2 if a.faults == "node-loss" else 1


def modes(a: argparse.Namespace) -> list[Mode]:
    out = []
    n_ranks = world(a)
    for kind in a.modes:
        if kind == "acp":
            for n, on_full, persist, replicas in itertools.product(
                a.acp_every, a.acp_on_full, a.acp_persist, a.acp_replicas if n_ranks > 1 else [0]
            ):
                label = f"acp, save every {'step' if n == 1 else f'{n} steps'}"
                name = "acp" if n == 1 else f"acp-{n}"
                if n_ranks > 1:
                    label += f", replicas={replicas}" if replicas else ", storage only"
                    name += f"-replicas{replicas}" if replicas else "-storage"
                if on_full != "wait":
                    label += f" (on_full={on_full})"
                    name += f"-{on_full}"
                if persist != "all":
                    label += f", persist {persist.replace(':', ' ')}"
                    name += f"-persist-{persist.replace(':', '')}"
                out.append(Mode(name, "acp", n, label, on_full, persist, n_ranks, replicas))
        else:
            for n in a.every:
                call = "torch.save" if kind == "torch" else "dcp.async_save"
                label = f"{call} every {n} steps" + (", each rank its file" if n_ranks > 1 else "")
                out.append(Mode(f"{kind}-{n}", kind, n, label, world=n_ranks))
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
                    help="the modes (default: acp torch dcp; node-loss: acp torch)")  # fmt: skip
    ap.add_argument("--faults", choices=["process", "node-loss"], default="process",
                    help="process: SIGKILL of the worker; node-loss: a job of 2 ranks on 2 "
                    "simulated nodes, both killed and node B's shared memory emptied")  # fmt: skip
    ap.add_argument("--acp-replicas", type=int, nargs="+", default=[1, 0],
                    help="node-loss: acp's peer replicas, one mode each (default: 1 0, "
                    "0: storage only)")  # fmt: skip
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
    if a.faults == "node-loss":
        if a.regime != "small":
            ap.error("--faults node-loss runs the small regime (and --quick)")
        if a.modes and "dcp" in a.modes:
            ap.error("--faults node-loss: the modes are acp and torch")
        # Steps protected by a persist only every 50 saves against every save replicated.
        persist = "every:10" if a.quick else "every:50"
        defaults = {**defaults, "modes": ["acp", "torch"], "acp_persist": [persist],
                    "rounds": 1}  # fmt: skip
    else:
        defaults = {**defaults, "modes": ["acp", "torch", "dcp"]}
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
        bare = sup.run(Mode("bare", "bare", 1, "bare loop", world=world(a)), r, a.bare, [])
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
            bare = sup.run(Mode("bare", "bare", 1, "bare loop", world=world(a)), r, a.bare, [])
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
            "acp_persist": a.acp_persist, "faults": a.faults, "world": world(a),
            "acp_replicas": a.acp_replicas,
            "model": asdict(model), "checksum_stride": STRIDE, "schedule": describe(a),
            # Checkpointer settings the workers inherit (ACP_OVERLAP=1, ...).
            "acp_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("ACP_")},
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
