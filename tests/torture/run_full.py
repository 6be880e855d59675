"""Runs the torture suite at its full trial counts and prints the figures
that RELIABILITY.md quotes, so they stay true: each suite's trials and
failures, the single-scenario fault tests passed and failed, and the wall
time. ``make torture-full`` runs it (after building the wheel).

    python tests/torture/run_full.py            # full counts (ACP_TORTURE_FULL=1)
    python tests/torture/run_full.py --ci       # the CI counts
    python tests/torture/run_full.py --fuzz     # and `make fuzz-smoke`

Exits non-zero when any trial or test failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUST_SUITES = [
    "torture_sigkill",
    "torture_corrupt",
    "torture_faults",
    "torture_hostile",
    "torture_perms",
    "torture_neighbours",
    "failed_slots",
    "crash_consistency",
]
WHERE = {
    "sigkill": "acp-core/tests/torture_sigkill.rs",
    "corrupt": "acp-core/tests/torture_corrupt.rs",
    "io-error-every-op": "acp-core/tests/torture_faults.rs",
    "io-error-every-op-two-ranks": "acp-core/tests/torture_faults.rs",
    "io-error-every-op-load": "acp-core/tests/torture_faults.rs",
    "hostile": "acp-core/tests/torture_hostile.rs",
    "fifo": "acp-core/tests/torture_hostile.rs",
    "claimed size": "acp-core/tests/torture_hostile.rs",
    "permissions": "acp-core/tests/torture_perms.rs",
    "sigterm-dying-checkpoint": "tests/torture/test_sigterm_torture.py",
}


def run(cmd: list[str], env: dict[str, str], what: str) -> tuple[int, str, float]:
    print(f"== {what}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    secs = time.monotonic() - t0
    out = p.stdout + p.stderr
    if p.returncode != 0:
        print(out[-4000:], file=sys.stderr)
    return p.returncode, out, secs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ci", action="store_true", help="the CI trial counts")
    ap.add_argument("--fuzz", action="store_true", help="also run `make fuzz-smoke`")
    args = ap.parse_args()

    report = Path(tempfile.mkstemp(prefix="acp-torture-", suffix=".jsonl")[1])
    env = {**os.environ, "ACP_TORTURE_REPORT": str(report)}
    if args.ci:
        env.pop("ACP_TORTURE_FULL", None)
    else:
        env["ACP_TORTURE_FULL"] = "1"
    env.setdefault("ACP_CRASH_TRIALS", "8" if args.ci else "100")

    ok = True
    fuzz_line = ""
    timings: list[tuple[str, float]] = []
    cargo = ["cargo", "test", "-p", "acp-core"]
    for suite in RUST_SUITES:
        cargo += ["--test", suite]
    code, _, secs = run(cargo, env, "Rust torture suites")
    ok &= code == 0
    timings.append(("Rust (cargo test, debug build)", secs))

    python = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/torture"]
    code, out, secs = run(python, env, "Python torture suites")
    ok &= code == 0
    timings.append(("Python (pytest tests/torture)", secs))
    summary = re.findall(r"(\d+) (passed|failed|skipped|error)", out)
    scenarios = {kind: int(n) for n, kind in summary}

    if args.fuzz:
        code, out, secs = run(["make", "fuzz-smoke"], env, "fuzz smoke")
        ok &= code == 0
        timings.append(("make fuzz-smoke", secs))
        runs = [int(n) for n in re.findall(r"stat::number_of_executed_units: (\d+)", out)]
        fuzz_line = (
            f"fuzz smoke: {len(runs)} targets, {sum(runs):,} executions, crashed: {code != 0}"
        )

    records = [json.loads(line) for line in report.read_text().splitlines() if line.strip()]
    report.unlink()
    counts = "CI" if args.ci else "full"
    print(f"\n| suite ({counts} counts) | test | trials | failures |")
    print("|---|---|---:|---:|")
    for r in records:
        where = WHERE.get(r["suite"], "?")
        print(f"| {r['suite']} | `{where}` | {r['trials']:,} | {r['failures']} |")
        ok &= r["failures"] == 0
        for f in r.get("first_failures", []):
            print(f"|  | failure: {f} | | |")
    for r in records:
        if r.get("notes"):
            print(f"\n{r['suite']}: {r['notes']}")
    print(
        f"\nPython fault scenarios (tests/torture): {scenarios.get('passed', 0)} passed, "
        f"{scenarios.get('failed', 0) + scenarios.get('error', 0)} failed, "
        f"{scenarios.get('skipped', 0)} skipped (the suites above included)"
    )
    if fuzz_line:
        print(fuzz_line)
    for what, secs in timings:
        print(f"{what}: {secs:.0f} s")
    print("result:", "no failures" if ok else "FAILURES")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
