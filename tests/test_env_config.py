"""``ACP_*`` environment variables of the ``Checkpointer``: the persist
policy (``ACP_PERSIST_EVERY``, ``ACP_PERSIST_INTERVAL``,
``ACP_PERSIST_POLICY``), ``ACP_RELEASE_ON_CLOSE``, ``ACP_REPLICAS``,
``ACP_REPLICA_TIMEOUT``, ``ACP_RING_BYTES`` and ``ACP_SHM_DIR``.
Keywords win over variables; a bad value is a ``ConfigError`` naming its
variable."""

from __future__ import annotations

from pathlib import Path

import pytest

import acp
from tests.conftest import MakeCkpt, slot_dir

VARIABLES = (
    "ACP_PERSIST_EVERY",
    "ACP_PERSIST_INTERVAL",
    "ACP_PERSIST_POLICY",
    "ACP_RELEASE_ON_CLOSE",
    "ACP_REPLICAS",
    "ACP_REPLICA_TIMEOUT",
    "ACP_RING_BYTES",
    "ACP_SHM_DIR",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees only the variables it sets."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _state(step: int) -> dict[str, object]:
    import numpy as np

    return {"w": np.full(1000, step, dtype=np.float32), "step": step}


def _outcomes(ckpt: acp.Checkpointer, steps: range) -> list[str | None]:
    return [ckpt.save(s, _state(s)).wait().outcome for s in steps]


def _ring_files(shm_dir: Path) -> list[str]:
    d = slot_dir(shm_dir)
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def test_persist_every_from_the_environment(
    make_ckpt: MakeCkpt, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACP_PERSIST_EVERY", "2")
    ckpt = make_ckpt(ring_slots=3)
    assert _outcomes(ckpt, range(1, 5)) == ["resident", "persisted", "resident", "persisted"]
    assert ckpt.steps() == [2, 4]


def test_persist_interval_from_the_environment(
    make_ckpt: MakeCkpt, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An hour: the first save persists, the next ones fall inside the interval.
    monkeypatch.setenv("ACP_PERSIST_INTERVAL", "3600")
    monkeypatch.setenv("ACP_PERSIST_POLICY", "interval")
    ckpt = make_ckpt(ring_slots=3)
    assert _outcomes(ckpt, range(1, 4)) == ["persisted", "resident", "resident"]
    assert ckpt.steps() == [1]


def test_persist_policy_from_the_environment(
    make_ckpt: MakeCkpt, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACP_PERSIST_POLICY", "coalesce")
    ckpt = make_ckpt(ring_slots=3)
    assert _outcomes(ckpt, range(1, 2)) == ["persisted"]  # nothing was in flight
    # The engine refuses coalescing with several ranks: the error says
    # where the policy came from.
    with pytest.raises(acp.ConfigError, match=r"persist_policy.*ACP_PERSIST_POLICY"):
        make_ckpt(world_size=2, rank=0)


def test_a_persist_keyword_overrides_every_persist_variable(
    make_ckpt: MakeCkpt, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACP_PERSIST_INTERVAL", "3600")
    monkeypatch.setenv("ACP_PERSIST_EVERY", "not read")
    ckpt = make_ckpt(ring_slots=3, persist_every=1)
    assert _outcomes(ckpt, range(1, 4)) == ["persisted"] * 3


def test_release_on_close_from_the_environment(
    make_ckpt: MakeCkpt, shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACP_RELEASE_ON_CLOSE", "true")
    kept = make_ckpt(release_on_close=False)
    kept.save(1, _state(1)).wait()
    kept.close()
    left = _ring_files(shm_dir)
    assert left  # the keyword won: the ring stays
    released = make_ckpt(job="released", root=tmp_path / "other")
    released.save(1, _state(1)).wait()
    assert len(_ring_files(shm_dir)) > len(left)
    released.close()
    assert _ring_files(shm_dir) == left  # the variable: its ring is gone


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("ACP_PERSIST_EVERY", "two"),
        ("ACP_PERSIST_EVERY", "0"),
        ("ACP_PERSIST_INTERVAL", "soon"),
        ("ACP_PERSIST_INTERVAL", "0"),
        ("ACP_PERSIST_INTERVAL", "-5"),
        ("ACP_PERSIST_INTERVAL", "nan"),
        ("ACP_PERSIST_POLICY", "sometimes"),
        ("ACP_RELEASE_ON_CLOSE", "maybe"),
        ("ACP_REPLICAS", "many"),
        ("ACP_REPLICAS", "-1"),
        ("ACP_REPLICA_TIMEOUT", "0"),
        ("ACP_REPLICA_TIMEOUT", "later"),
    ],
)
def test_a_bad_value_names_its_variable(
    make_ckpt: MakeCkpt, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(acp.ConfigError, match=rf"{name}='{value}'"):
        make_ckpt()


def test_two_policies_from_the_environment_are_refused(
    make_ckpt: MakeCkpt, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACP_PERSIST_EVERY", "2")
    monkeypatch.setenv("ACP_PERSIST_POLICY", "coalesce")
    with pytest.raises(acp.ConfigError, match=r"ACP_PERSIST_EVERY.*ACP_PERSIST_POLICY"):
        make_ckpt()


def test_replica_timeout_from_the_environment_unless_given(monkeypatch: pytest.MonkeyPatch) -> None:
    from acp._env import settings

    keywords = {
        "replicas": None,
        "release_on_close": None,
        "persist_every": None,
        "persist_interval": None,
        "persist_policy": None,
    }
    assert settings(replica_timeout=None, **keywords).replica_timeout is None
    monkeypatch.setenv("ACP_REPLICA_TIMEOUT", "7.5")
    assert settings(replica_timeout=None, **keywords).replica_timeout == 7.5
    assert settings(replica_timeout=2.0, **keywords).replica_timeout == 2.0


def test_shm_dir_from_the_environment_unless_given(
    make_ckpt: MakeCkpt, shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACP_SHM_DIR", str(shm_dir))
    ckpt = make_ckpt(shm_dir=None)
    ckpt.save(1, _state(1)).wait()
    assert _ring_files(shm_dir)  # the variable's directory holds the ring
    ckpt.close()
    other = tmp_path / "other-shm"
    other.mkdir()
    given = make_ckpt(job="given", root=tmp_path / "given", shm_dir=other)
    given.save(1, _state(1)).wait()
    assert _ring_files(other)  # the keyword won
    given.close()


def test_ring_bytes_from_the_environment_unless_given(
    make_ckpt: MakeCkpt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import numpy as np

    monkeypatch.setenv("ACP_RING_BYTES", str(4 << 20))
    big = {"w": np.zeros(3 << 20, dtype=np.uint8)}
    small_ring = make_ckpt(ring_bytes=None)
    with pytest.raises(acp.AcpError, match="ring_bytes \\(now 4194304"):
        small_ring.save(1, big)
    given = make_ckpt(job="given", root=tmp_path / "given", ring_bytes=16 << 20)
    given.save(1, big).wait()  # the keyword won


@pytest.mark.parametrize("value", ["lots", "1000"])
def test_a_bad_ring_bytes_names_its_variable(
    make_ckpt: MakeCkpt, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("ACP_RING_BYTES", value)
    with pytest.raises(acp.ConfigError, match=rf"ACP_RING_BYTES='{value}'"):
        make_ckpt(ring_bytes=None)
