"""goodput.py's output: the machine, goodput.md's table and sentences, and
goodput.png."""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from typing import Any

from goodput_analysis import DURABLE, PROTECTED


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


def fmt(x: float | None, spec: str, scale: float = 1.0, unit: str = "") -> str:
    return "n/a" if x is None else f"{x * scale:{spec}}{unit}"


def markdown(doc: dict[str, Any]) -> str:
    c, m = doc["config"], doc["machine"]
    md = c["model"]
    rates = "; ".join(" and ".join(fmt(x, ".2f") for x in r["bare_rates"]) for r in doc["rounds"])
    kills = sum(len(r["kills"]) for r in doc["rounds"])
    budget = sum(r["budget"] for r in doc["rounds"])
    budgets = " and ".join(f"{r['budget']:g}" for r in doc["rounds"])
    nodes = c.get("world", 1) > 1
    job = (
        f"A data-parallel job of {c['world']} ranks on {c['world']} simulated nodes (rank 0 on "
        "node A, rank 1 on node B: each its own `ACP_NODE_ID` and shared-memory directory; "
        "gloo, one all-reduce of the gradients per step, every rank its own checkpoint "
        "file), each rank training"
        if nodes
        else "A worker training"
    )
    fault = (
        f"lost node B {kills} times (both ranks SIGKILLed, node B's shared memory emptied, "
        "the job restarted)"
        if nodes
        else f"SIGKILLed {kills} times"
    )
    lines = [
        f"# Goodput under {'node losses' if nodes else 'faults'}",
        "",
        f"`{' '.join(doc['command'])}`",
        "",
        f"{job} an MLP ({md['d_in']}-{md['hidden']}x{md['layers']}-{md['classes']}, batch "
        f"{md['batch']}, AdamW, {md['threads']} torch thread(s)) with "
        f"{doc['state_bytes'] / 1e6:.0f} MB of state{' per rank' if nodes else ''}, trained for "
        f"{budget:g} s per mode ({len(doc['rounds'])} round(s) of {budgets} s); the supervisor "
        f"{fault}, at the "
        f"same moments in every mode ({c['schedule']}). The bare loop (no checkpoints, no "
        f"faults) ran {rates} steps/s (at the start and the end of each round). "
        f"{m['cpus']} CPUs ({m['cpu']}), {m['mem_bytes'] / 2**30:.0f} GiB, shared with other "
        f"work (load average {m['loadavg_start'][0]:.1f} at the start, "
        f"{m['loadavg_end'][0]:.1f} at the end); torch {m['torch']}, acp {m['acp']}; "
        f"the whole run took {doc['wall_secs']:.0f} s.",
        "",
        "| mode | useful steps | useful steps/h | goodput (of bare) | faults "
        "| time lost per fault, median / mean | steps lost per fault, median "
        "| kill to restored, median | checkpoint overhead | save stall, median | checks |"
        + (" restored from, rank 0 / rank 1 | protected steps lost (faults) |" if nodes else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|" + ("---|---:|" if nodes else ""),
    ]
    for s in doc["summary"]:
        lines.append(
            f"| {s['label']} | {s['useful_steps']} | {s['useful_steps_per_hour']:,.0f} | "
            f"{fmt(s['goodput'], '.1f', 100, ' %')} | {s['faults']} | "
            f"{fmt(s['lost_secs_median'], '.2f', 1, ' s')} / "
            f"{fmt(s['lost_secs_mean'], '.2f', 1, ' s')} | "
            f"{fmt(s['steps_lost_median'], '.1f')} | "
            f"{fmt(s['restart_secs_median'], '.2f', 1, ' s')} | "
            f"{fmt(s['overhead'], '.1f', 100, ' %')} | "
            f"{fmt(s['stall_secs_median'], '.1f', 1e3, ' ms')} | {s['checks']} |"
            + (
                f" {_by_rank(s)} | {s['protected_steps_lost']} ({s['protected_lost_faults']}) |"
                if nodes
                else ""
            )
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
        "wait for the previous save to finish). "
        + (
            "A node loss: every rank's time and figures are the slowest rank's; a step is "
            "protected once every rank's image of it is in the other node's RAM (acp "
            "replicas) or committed to storage, and no restart may restore an older step. "
            "Node A's rank restores from its own RAM when its slot survived; node B's from "
            "node A's replica (`peer`) or storage. Every node is on this one machine: "
            "storage files stay in the page cache, and the replicas travel over loopback."
            if nodes
            else "Every restart runs on the same node: the peers' files are in the page cache, "
            "acp's newest step in its shared-memory ring."
        ),
        "",
    ]
    return "\n".join(lines)


def _by_rank(s: dict[str, Any]) -> str:
    """Where each rank's restores came from, e.g. ``ram / peer``."""
    return " / ".join(", ".join(x) or "none" for x in s.get("sources_by_rank", []))


def _sentence(s: dict[str, Any]) -> str:
    text = (
        f"**{s['label']}**: {s['useful_steps']} useful steps "
        f"({s['useful_steps_per_hour']:,.0f}/h, {fmt(s['goodput'], '.0f', 100, ' %')} of the "
        f"bare loop's rate); {s['faults']} faults, {s['resumed']} resumed from a checkpoint; "
        f"per fault a median {fmt(s['lost_secs_median'], '.2f')} s lost (mean "
        f"{fmt(s['lost_secs_mean'], '.2f')} s): {fmt(s['restart_secs_median'], '.2f')} s from "
        f"the kill to a restored state (Python up and torch imported after "
        f"{fmt(s['import_secs_median'], '.2f')} s; then model and AdamW built in "
        f"{fmt(s['build_secs_median'], '.2f')} s, checkpointer opened in "
        f"{fmt(s['open_secs_median'], '.3f')} s, state restored in "
        f"{fmt(s['restore_secs_median'], '.3f')} s), then "
        f"{fmt(s['steps_lost_median'], '.1f')} steps to recompute"
    )
    if s.get("world", 1) > 1 and s["restore_sources"]:
        text += f"; restored from {_by_rank(s)} (rank 0 / rank 1)"
        if s["protected_lost_faults"]:
            text += (
                f"; {s['protected_lost_faults']} of {s['faults']} restarts restored a step older "
                f"than the newest protected one ({s['protected_steps_lost']} steps in all)"
            )
    elif s["restore_sources"]:
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
            # A step is useful once it survives the fault: for node losses, protected.
            nodes = run.get("world", 1) > 1
            durable = PROTECTED[run["kind"]] if nodes else (DURABLE[run["kind"]],)
            pts = [(0.0, 0)]
            for e in run["events"]:
                if e["ev"] in durable or e["ev"] == "restored":
                    pts.append((e["t"], max(pts[-1][1], e["step"])))
            pts.append((budget, run["probe"]["step"] if run["probe"] else pts[-1][1]))
            c = color[run["mode"]]
            ax.step(*zip(*pts), where="post", lw=1.6, color=c, label=label[run["mode"]])
            trained = [
                (e["t"], e["step"])
                for e in run["events"]
                if e["ev"] == "step" and e.get("rank", 0) == 0
            ]
            if trained:
                ax.plot(*zip(*trained), ".", ms=1, color=c, alpha=0.3)
        ax.set_xlim(0, budget)
        ax.set_ylim(bottom=0)
        ax.set_ylabel("useful step (dots: step trained)")
        what = "node-loss" if doc["config"].get("world", 1) > 1 else "SIGKILL"
        ax.set_title(f"Round {r + 1}: progress under the same {what} schedule", fontsize=10)
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
