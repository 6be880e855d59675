"""Compressed size of a real trained model that a package ships (issue 17).

The model is Resemblyzer's speaker encoder (PyPI ``resemblyzer`` 0.1.4,
installed by ``make venv`` with ``--no-deps``): its wheel carries
``resemblyzer/pretrained.pt``, a torch checkpoint of a 3-layer LSTM trained
for 1.56 M steps, with the model's fp32 weights and its Adam state
(``exp_avg``, ``exp_avg_sq``) at that step. The file is found without
importing the package and read with ``torch.load(weights_only=True)``: no
pickled code runs, nothing is downloaded.

Each state is saved through ``acp.Checkpointer(compress="zstd")`` and the
figures are the engine's own (``SaveStats.bytes`` staged against
``SaveStats.stored_bytes`` written, the data file with its header and frame
table); every state is loaded back from storage and compared bit for bit:

- ``weights fp32``: the model's weights as shipped;
- ``weights bf16``: the same cast to bf16 (how mixed precision holds a model);
- ``adam fp32``: the optimizer's ``exp_avg`` and ``exp_avg_sq``;
- ``all fp32``: weights and Adam state together (the whole training state).

Targets: at most 0.75 of the bytes for a bf16 model state, 0.85 for fp32
Adam state.

    .venv/bin/python acp-bench/peers/real_model.py [--json out.json] [--level 1]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import uuid
from pathlib import Path

import torch

import acp

TARGETS = {"weights bf16": 0.75, "adam fp32": 0.85}
INSTALL = "pip install --no-deps resemblyzer==0.1.4"


def pretrained_path() -> Path:
    """``resemblyzer/pretrained.pt`` of the installed package, found without
    importing it (its ``__init__`` imports librosa and webrtcvad)."""
    spec = importlib.util.find_spec("resemblyzer")
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"resemblyzer is not installed: `make venv` installs it ({INSTALL})")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "pretrained.pt"
        if path.is_file():
            return path
    sys.exit("resemblyzer is installed but has no pretrained.pt")


def states() -> dict[str, dict[str, torch.Tensor]]:
    """The four states of the module docs, as flat name → tensor maps."""
    ckpt = torch.load(pretrained_path(), weights_only=True, map_location="cpu")
    weights = {k: v.contiguous() for k, v in ckpt["model_state"].items()}
    adam: dict[str, torch.Tensor] = {}
    for pid, per in ckpt["optimizer_state"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            adam[f"{pid}.{key}"] = per[key].contiguous()
    return {
        "weights fp32": weights,
        "weights bf16": {k: v.to(torch.bfloat16) for k, v in weights.items()},
        "adam fp32": adam,
        "all fp32": {
            **{f"model.{k}": v for k, v in weights.items()},
            **{f"adam.{k}": v for k, v in adam.items()},
        },
    }


def measure(root: Path, shm: Path, state: dict[str, torch.Tensor], level: int) -> dict[str, float]:
    """Saves ``state`` compressed, loads it back from storage, checks it bit for bit."""
    ckpt = acp.Checkpointer(
        root,
        job=f"real-{uuid.uuid4().hex[:12]}",
        shm_dir=shm,
        mlock=False,
        compress="zstd",
        compress_level=level,
    )
    try:
        s = ckpt.save(1, state).wait()
        out = ckpt.load(1, storage_only=True)
    finally:
        ckpt.close()
    for name, want in state.items():
        got = out[name]
        if got.dtype != want.dtype or not torch.equal(
            got.view(torch.uint8), want.view(torch.uint8)
        ):
            sys.exit(f"{name}: not bit-exact after the compressed round trip")
    assert s.bytes is not None
    assert s.stored_bytes is not None
    tensor_bytes = sum(t.numel() * t.element_size() for t in state.values())
    return {
        "tensors": len(state),
        "tensor_bytes": tensor_bytes,
        "staged_bytes": s.bytes,
        "stored_bytes": s.stored_bytes,
        "ratio": s.stored_bytes / s.bytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--level", type=int, default=1, help="compress_level (default 1)")
    ap.add_argument(
        "--dir", type=Path, default=None, help="where to write the checkpoints (a temporary folder)"
    )
    args = ap.parse_args()
    rows = {}
    with (
        tempfile.TemporaryDirectory(dir=args.dir) as tmp,
        tempfile.TemporaryDirectory(dir="/dev/shm") as shm,
    ):
        for i, (name, state) in enumerate(states().items()):
            rows[name] = measure(Path(tmp) / f"c{i}", Path(shm), state, args.level)
    print(
        f"resemblyzer 0.1.4 pretrained.pt, compress=zstd level {args.level}, bit-exact round trips"
    )
    print(f"{'state':<14} {'tensors':>7} {'staged':>12} {'stored':>12} {'ratio':>7}  target")
    for name, r in rows.items():
        target = TARGETS.get(name)
        verdict = ""
        if target is not None:
            verdict = f"at most {target}: {'met' if r['ratio'] <= target else 'MISSED'}"
        sizes = f"{r['tensors']:>7} {r['staged_bytes']:>12} {r['stored_bytes']:>12}"
        print(f"{name:<14} {sizes} {r['ratio']:>7.3f}  {verdict}")
    if args.json:
        args.json.write_text(
            json.dumps({"model": "resemblyzer-0.1.4", "level": args.level, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
