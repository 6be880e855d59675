"""What the torchrun scripts of tests/test_distributed.py share: the process
group (gloo, CPU), a checkpointer per rank, digests and result files."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import acp


def init() -> tuple[int, int]:
    """Joins the gloo process group torchrun describes; (rank, world size)."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    return dist.get_rank(), dist.get_world_size()


def shm_dir(rank: int) -> str:
    """This rank's shared-memory directory: ``ACP_SHM_<rank>`` (a rank on
    another node, or a replaced one) else ``ACP_SHM`` (this node)."""
    return os.environ.get(f"ACP_SHM_{rank}") or os.environ["ACP_SHM"]


def checkpointer(root: str, job: str, rank: int, **kwargs: Any) -> acp.Checkpointer:
    kwargs.setdefault("ring_bytes", 8 << 20)
    kwargs.setdefault("commit_timeout", 60)
    # These scripts count on every save being committed (the default with
    # several ranks coalesces: tests/test_coalesce_ranks.py).
    kwargs.setdefault("persist_every", 1)
    return acp.Checkpointer(root, job=job, shm_dir=shm_dir(rank), mlock=False, **kwargs)


def digest(*tensors: torch.Tensor) -> str:
    """sha256 over the tensors' bytes, in order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def state_digest(state: Any) -> str:
    """sha256 over every tensor of a nested state, in key order."""
    out: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(state)
    return digest(*out)


def write_result(out: str, name: str, data: Any) -> None:
    """Writes ``data`` as JSON to ``out/name.json`` (temp name, then rename)."""
    path = Path(out) / f"{name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def report_dying_checkpoint(
    ckpt: acp.Checkpointer, out: str, rank: int, timeout: float | None = None
) -> None:
    """Installs acp's SIGTERM handler (dying checkpoint bounded by
    ``timeout``), chaining one that writes its report to
    OUT/dying-RANK.json: it runs after the dying checkpoint, before the
    exit."""
    import signal

    previous = signal.getsignal(signal.SIGTERM)

    def report(signum: int, frame: object) -> None:
        dying = ckpt.last_dying
        assert dying is not None
        Path(out, f"dying-{rank}.json").write_text(json.dumps(dying.as_dict()))
        if callable(previous):
            previous(signum, frame)  # type: ignore[arg-type]

    signal.signal(signal.SIGTERM, report)
    ckpt.install_sigterm_handler(timeout=timeout)
