"""``ACP_*`` environment variables of the ``Checkpointer``: one per keyword
(``acp._env.VARIABLES``), each read, each losing to its keyword, each
refusing a bad value with a ``ConfigError`` naming the variable, the value
and what is accepted; and the signature, the table and
``docs/configuration.md`` kept in step."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import acp
from acp import _acp, _env
from tests.conftest import MakeCkpt, slot_dir

VARIABLES = tuple(v.name for v in _env.VARIABLES)
DOCS = Path(__file__).parents[1] / "docs" / "configuration.md"


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


def test_replica_timeout_from_the_environment_unless_given() -> None:
    env = {"ACP_REPLICA_TIMEOUT": "7.5"}
    assert _env.fill({"replica_timeout": None}, {})[0] == {"replica_timeout": None}
    assert _env.fill({"replica_timeout": None}, env)[0] == {"replica_timeout": 7.5}
    assert _env.fill({"replica_timeout": 2.0}, env)[0] == {"replica_timeout": 2.0}


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


# --- every variable ---------------------------------------------------------

# A value of each variable and what it reads as.
READS: dict[str, tuple[str, object]] = {
    "ACP_JOB": ("run42", "run42"),
    "ACP_RING_BYTES": ("16GiB", 16 << 30),
    "ACP_RING_SLOTS": ("3", 3),
    "ACP_SHM_DIR": ("/mnt/shm", "/mnt/shm"),
    "ACP_KEEP_LAST": ("3", 3),
    "ACP_KEEP_EVERY": ("1000", 1000),
    "ACP_ON_FULL": ("skip", "skip"),
    "ACP_FULL_TIMEOUT": ("2.5", 2.5),
    "ACP_COPY_THREADS": ("4", 4),
    "ACP_IO": ("psync", "psync"),
    "ACP_DIRECT_IO": ("off", "off"),
    "ACP_VERIFY": ("storage_only", "storage_only"),
    "ACP_MLOCK": ("off", False),
    "ACP_CHUNK_BYTES": ("8MiB", 8 << 20),
    "ACP_QUEUE_DEPTH": ("16", 16),
    "ACP_PERSIST_ON_OPEN": ("no", False),
    "ACP_STALL_TIMEOUT": ("900", 900.0),
    "ACP_COMMIT_TIMEOUT": ("1800", 1800.0),
    "ACP_RELEASE_ON_CLOSE": ("yes", True),
    "ACP_KEEP_RESTORED": ("0", False),
    "ACP_SHM_TTL": ("0", 0.0),
    "ACP_PERSIST_EVERY": ("50", 50),
    "ACP_PERSIST_INTERVAL": ("300", 300.0),
    "ACP_PERSIST_POLICY": ("coalesce", "coalesce"),
    "ACP_BACKGROUND_NICE": ("19", 19),
    "ACP_REPLICAS": ("1", 1),
    "ACP_REPLICA_TIMEOUT": ("120", 120.0),
    "ACP_COMPRESS": ("zstd", "zstd"),
    "ACP_COMPRESS_LEVEL": ("3", 3),
    "ACP_INCREMENTAL": ("0", False),
    "ACP_OVERLAP": ("1", True),
}

# A value of each variable that is refused, and a word of what is accepted.
REFUSED: dict[str, tuple[str, str]] = {
    "ACP_JOB": ("j" * 129, "1 to 128 bytes"),
    "ACP_RING_BYTES": ("4GB", "KiB, MiB, GiB or TiB"),
    "ACP_RING_SLOTS": ("0", "at least 1"),
    "ACP_KEEP_LAST": ("0", "at least 1"),
    "ACP_KEEP_EVERY": ("every", "an integer"),
    "ACP_ON_FULL": ("block", "wait, skip"),
    "ACP_FULL_TIMEOUT": ("-1", "more than 0"),
    "ACP_COPY_THREADS": ("300", "from 1 to 256"),
    "ACP_IO": ("aio", "auto, uring, psync"),
    "ACP_DIRECT_IO": ("maybe", "auto, on, off"),
    "ACP_VERIFY": ("never", "always, storage_only"),
    "ACP_MLOCK": ("2", "true"),
    "ACP_CHUNK_BYTES": ("5000", "a multiple of 4096"),
    "ACP_QUEUE_DEPTH": ("2000", "from 1 to 1024"),
    "ACP_PERSIST_ON_OPEN": ("sure", "false"),
    "ACP_STALL_TIMEOUT": ("inf", "more than 0"),
    "ACP_COMMIT_TIMEOUT": ("10m", "a number of seconds"),
    "ACP_RELEASE_ON_CLOSE": ("maybe", "yes"),
    "ACP_KEEP_RESTORED": ("sometimes", "false"),
    "ACP_SHM_TTL": ("-1", "0 or more"),
    "ACP_PERSIST_EVERY": ("0", "at least 1"),
    "ACP_PERSIST_INTERVAL": ("0", "more than 0"),
    "ACP_PERSIST_POLICY": ("sometimes", "every, interval, coalesce"),
    "ACP_BACKGROUND_NICE": ("20", "from 0 to 19"),
    "ACP_REPLICAS": ("-1", "at least 0"),
    "ACP_REPLICA_TIMEOUT": ("nan", "more than 0"),
    "ACP_COMPRESS": ("lz4", "none, zstd, auto"),
    "ACP_COMPRESS_LEVEL": ("22", "from 1 to 19"),
    "ACP_INCREMENTAL": ("maybe", "true"),
    "ACP_OVERLAP": ("later", "true"),
}


def test_every_variable_has_a_read_and_a_refusal_case() -> None:
    assert set(READS) == set(VARIABLES)
    assert set(REFUSED) == set(VARIABLES) - {"ACP_SHM_DIR"}  # any path reads


@pytest.mark.parametrize("var", _env.VARIABLES, ids=lambda v: v.name)
def test_each_variable_is_read_unless_its_keyword_is_given(var: _env.Var) -> None:
    raw, value = READS[var.name]
    env = {var.name: raw}
    assert _env.fill({}, env)[0] == {var.keyword: value}
    assert _env.fill({var.keyword: None}, env)[0] == {var.keyword: value}
    given = object()
    assert _env.fill({var.keyword: given}, env)[0] == {var.keyword: given}
    assert _env.fill({}, {var.name: "  "})[0] == {}  # empty: not given


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_value_names_variable_value_and_what_is_accepted(name: str) -> None:
    value, accepted = REFUSED[name]
    with pytest.raises(acp.ConfigError) as e:
        _env.fill({}, {name: value})
    assert f"{name}={value!r}" in str(e.value)
    assert accepted in str(e.value)


class _Opened(Exception):
    """Raised by a stand-in for the engine, with the keywords it was given."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        self.kwargs = kwargs


@pytest.fixture
def engine_keywords(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """Opens a ``Checkpointer`` against a stand-in engine; returns the
    keywords the engine got."""

    def fake(root: str, **kwargs: Any) -> None:
        raise _Opened(kwargs)

    monkeypatch.setattr(_acp, "Engine", fake)

    def open_with(**kwargs: Any) -> dict[str, Any]:
        with pytest.raises(_Opened) as e:
            acp.Checkpointer(tmp_path / "ckpt", **kwargs)
        return e.value.kwargs

    return open_with


# The Checkpointer's own use of these, not the engine's (replicas need
# torch and several ranks: replica.py's tests cover them; ACP_OVERLAP:
# test_overlap.py).
NOT_FOR_THE_ENGINE = {"ACP_REPLICAS", "ACP_REPLICA_TIMEOUT", "ACP_OVERLAP"}


@pytest.mark.parametrize(
    "var", [v for v in _env.VARIABLES if v.name not in NOT_FOR_THE_ENGINE], ids=lambda v: v.name
)
def test_each_variable_reaches_the_engine_and_its_keyword_wins(
    engine_keywords: Any, monkeypatch: pytest.MonkeyPatch, var: _env.Var
) -> None:
    raw, value = READS[var.name]
    monkeypatch.setenv(var.name, raw)
    assert engine_keywords()[var.keyword] == value
    other = {
        "ACP_JOB": "other",
        "ACP_SHM_DIR": "/elsewhere",
        "ACP_ON_FULL": "wait",
        "ACP_IO": "auto",
        "ACP_DIRECT_IO": "on",
        "ACP_VERIFY": "always",
        "ACP_MLOCK": True,
        "ACP_PERSIST_ON_OPEN": True,
        "ACP_RELEASE_ON_CLOSE": False,
        "ACP_KEEP_RESTORED": True,
        "ACP_PERSIST_POLICY": "every",
        "ACP_COMPRESS": "none",
        "ACP_INCREMENTAL": True,
    }.get(var.name, 7)
    assert engine_keywords(**{var.keyword: other})[var.keyword] == other


def test_an_engine_refusal_of_a_variable_names_it(
    make_ckpt: MakeCkpt, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACP_ON_FULL", "skip")
    monkeypatch.setenv("ACP_FULL_TIMEOUT", "5")
    with pytest.raises(acp.ConfigError, match=r"full_timeout.*ACP_FULL_TIMEOUT='5'"):
        make_ckpt()


def test_keep_last_from_the_environment_retains(
    make_ckpt: MakeCkpt, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACP_KEEP_LAST", "2")
    ckpt = make_ckpt(persist_every=1)
    for s in range(1, 5):
        ckpt.save(s, _state(s)).wait()
    assert ckpt.steps() == [3, 4]


# --- the signature, the table and the docs stay in step ---------------------


def _doc_rows() -> dict[str, tuple[str, str]]:
    """``docs/configuration.md``'s table: variable -> (keyword, example)."""
    rows = {}
    for line in DOCS.read_text().splitlines():
        m = re.fullmatch(r"\| `(ACP_\w+)` \| `(\w+)` \|.*\| `(ACP_\w+)=([^`]*)` \|", line)
        if m:
            assert m.group(3) == m.group(1), line
            rows[m.group(1)] = (m.group(2), m.group(4))
    return rows


def test_every_keyword_has_a_variable_or_a_reason_not_to() -> None:
    params = inspect.signature(acp.Checkpointer.__init__).parameters
    keywords = [p for p in params if p != "self"]
    missing = [k for k in keywords if k not in _env.BY_KEYWORD and k not in _env.NO_VARIABLE]
    assert not missing, (
        f"Checkpointer keywords with no ACP_* variable: {missing}; add a Var to "
        "acp._env.VARIABLES (or a reason to acp._env.NO_VARIABLE) and a row to "
        "docs/configuration.md"
    )
    stale = (set(_env.BY_KEYWORD) | set(_env.NO_VARIABLE)) - set(keywords)
    assert not stale, f"acp._env names keywords Checkpointer does not have: {stale}"
    assert not set(_env.BY_KEYWORD) & set(_env.NO_VARIABLE)
    # A variable's default is the keyword's: None, so an unset variable
    # leaves the engine's default.
    assert all(params[k].default is None for k in _env.BY_KEYWORD)
    assert all(v.name == "ACP_" + v.keyword.upper() for v in _env.VARIABLES)


def test_every_variable_has_a_docs_row_with_an_example_that_reads() -> None:
    rows = _doc_rows()
    assert set(rows) == set(VARIABLES), (
        f"docs/configuration.md lacks {sorted(set(VARIABLES) - set(rows))}, "
        f"has extra {sorted(set(rows) - set(VARIABLES))}"
    )
    for var in _env.VARIABLES:
        keyword, example = rows[var.name]
        assert keyword == var.keyword, var.name
        var.parse(var.name, example)  # the documented example is accepted


def test_the_readme_points_to_the_table() -> None:
    readme = (DOCS.parents[1] / "README.md").read_text()
    assert "docs/configuration.md" in readme


def test_mindspore_opens_its_checkpointer_through_the_same_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from acp.mindspore import export_ckpt

    monkeypatch.setenv("ACP_RING_SLOTS", "none")
    with pytest.raises(acp.ConfigError, match="ACP_RING_SLOTS='none'"):
        export_ckpt(tmp_path / "ckpt", tmp_path / "out.ckpt")
