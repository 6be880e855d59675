"""Hostile checkpoints seen from Python: nothing a default load reads may run
code, and a crafted value raises ``acp.CheckpointCorrupt`` naming its key,
never a raw Python error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import acp
import acp.dcp
from tests.conftest import MakeCkpt

# DCP warns on every single-process call that it assumes a single process.
dcp_warning = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def plant(path: str) -> str:
    """What the hostile pickle calls when it is unpickled: leaves a marker."""
    Path(path).write_text("code ran on load")
    return "planted"


class Hostile:
    """An object whose pickle calls :func:`plant` when it is unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (plant, (self.marker,))


def hostile_dcp_checkpoint(make_ckpt: MakeCkpt, marker: Path) -> acp.Checkpointer:
    """A step saved by ``dcp.save`` through acp whose ``trap`` value is a
    pickle that runs :func:`plant`; saving it runs nothing."""
    ckpt = make_ckpt()
    state = {"w": torch.ones(3), "trap": Hostile(marker), "epoch": 3}
    dcp.save(state, checkpoint_id=1, storage_writer=acp.dcp.StorageWriter(ckpt), no_dist=True)
    assert not marker.exists()
    return ckpt


@dcp_warning
@pytest.mark.parametrize("storage_only", [False, True], ids=["from-ram", "from-storage"])
def test_dcp_default_load_never_unpickles_code(
    make_ckpt: MakeCkpt, tmp_path: Path, storage_only: bool
) -> None:
    marker = tmp_path / "marker"
    ckpt = hostile_dcp_checkpoint(make_ckpt, marker)
    target = {"w": torch.zeros(3), "trap": None, "epoch": 0}
    reader = acp.dcp.StorageReader(ckpt, storage_only=storage_only)
    with pytest.raises(CheckpointException, match=r"`trap` is a DCP value that torch\.load"):
        dcp.load(target, storage_reader=reader, no_dist=True)
    assert not marker.exists(), "a default load ran code from the checkpoint"
    # load_bytes=False still refuses every byte entry, the harmless one too.
    with pytest.raises(CheckpointException, match="`epoch` is a pickled DCP value"):
        dcp.load(
            {"w": torch.zeros(3), "epoch": 0},
            storage_reader=acp.dcp.StorageReader(ckpt, load_bytes=False),
            no_dist=True,
        )
    assert not marker.exists()


@dcp_warning
def test_dcp_allow_pickle_is_the_explicit_old_path(make_ckpt: MakeCkpt, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    ckpt = hostile_dcp_checkpoint(make_ckpt, marker)
    target: dict[str, Any] = {"w": torch.zeros(3), "trap": None, "epoch": 0}
    reader = acp.dcp.StorageReader(ckpt, allow_pickle=True)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert marker.read_text() == "code ran on load"
    assert target["trap"] == "planted"
    assert target["epoch"] == 3


def blank(value: Any) -> Any:
    """``value``'s dict structure with every leaf None: what DCP loads into
    (it flattens nested dicts into keys)."""
    if isinstance(value, dict):
        return {k: blank(v) for k, v in value.items()}
    return None


@dcp_warning
def test_dcp_plain_values_round_trip_by_default(make_ckpt: MakeCkpt) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    plain = {
        "epoch": 7,
        "loss": 0.125,
        "name": "run1",
        "flags": [True, None, 2, 3.5, "x"],
        "nested": {"a": {"b": [1, 2, (3, 4)]}},
        "on": False,
    }
    state = {"model": model.state_dict(), "optim": opt.state_dict(), **plain}
    ckpt = make_ckpt()
    dcp.save(state, checkpoint_id=1, storage_writer=acp.dcp.StorageWriter(ckpt), no_dist=True)

    model2 = torch.nn.Linear(4, 2)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    model2(torch.randn(3, 4)).sum().backward()
    opt2.step()  # creates the state tensors the load fills in
    target: dict[str, Any] = {
        "model": model2.state_dict(),
        "optim": opt2.state_dict(),
        **{k: blank(v) for k, v in plain.items()},
    }
    dcp.load(target, storage_reader=acp.dcp.StorageReader(ckpt), no_dist=True)
    for k, v in plain.items():
        assert target[k] == v, k
    want_groups = opt.state_dict()["param_groups"]
    assert target["optim"]["param_groups"] == want_groups
    assert target["optim"]["param_groups"][0]["betas"] == (0.9, 0.95)
    for k, t in model.state_dict().items():
        assert torch.equal(target["model"][k], t), k
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(target["optim"]["state"][pid][k], v), (pid, k)
