"""``ACP_*`` environment variables: every setting of a ``Checkpointer`` a
launcher can give per node or per job without changing the training script.

Each keyword ``k`` of ``Checkpointer`` has the variable ``ACP_<K>``
(:data:`VARIABLES`), except the few listed with a reason in
:data:`NO_VARIABLE`. An explicit keyword argument always wins over its
variable; an unset or empty variable means "not given". A value that cannot
be read raises ``acp.ConfigError`` naming the variable, the value and what
is accepted: never a silent default. ``docs/configuration.md`` has one row
per variable, and a test checks the signature, this table and that page
against each other.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar, cast

from acp._acp import ConfigError

P = ParamSpec("P")
R = TypeVar("R")

PERSIST_EVERY = "ACP_PERSIST_EVERY"
PERSIST_INTERVAL = "ACP_PERSIST_INTERVAL"
PERSIST_POLICY = "ACP_PERSIST_POLICY"
RELEASE_ON_CLOSE = "ACP_RELEASE_ON_CLOSE"
REPLICAS = "ACP_REPLICAS"
REPLICA_TIMEOUT = "ACP_REPLICA_TIMEOUT"
RING_BYTES = "ACP_RING_BYTES"
SHM_DIR = "ACP_SHM_DIR"
COMPRESS = "ACP_COMPRESS"
COMPRESS_LEVEL = "ACP_COMPRESS_LEVEL"
COMPRESS_MODES = ("none", "zstd", "auto")

POLICIES = ("every", "interval", "coalesce")
PERSIST_KEYWORDS = ("persist_every", "persist_interval", "persist_policy")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_UNITS = {"": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def _get(name: str, environ: Mapping[str, str]) -> str | None:
    value = environ.get(name, "").strip()
    return value or None


def _bad(name: str, value: str, what: str) -> ConfigError:
    return ConfigError(f"{name}={value!r}: {what}")


# --- parsers: (variable, raw value) -> value, or ConfigError naming both ---

Parser = Callable[[str, str], Any]


def _integer(minimum: int, maximum: int | None = None) -> Parser:
    accepted = (
        f"an integer from {minimum} to {maximum}"
        if maximum is not None
        else f"an integer, at least {minimum}"
    )

    def parse(name: str, value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise _bad(name, value, f"not an integer (accepted: {accepted})") from None
        if n < minimum or (maximum is not None and n > maximum):
            raise _bad(name, value, f"out of range (accepted: {accepted})")
        return n

    return parse


def _bytes(minimum: int, multiple: int = 1, maximum: int | None = None) -> Parser:
    accepted = f"bytes, at least {minimum}"
    if maximum is not None:
        accepted += f", at most {maximum}"
    if multiple > 1:
        accepted += f", a multiple of {multiple}"
    accepted += "; an integer with an optional KiB, MiB, GiB or TiB suffix"

    def parse(name: str, value: str) -> int:
        m = re.fullmatch(r"(\d+)\s*([A-Za-z]*)", value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise _bad(name, value, f"not a size (accepted: {accepted})")
        n = int(m.group(1)) * _UNITS[m.group(2).lower()]
        if n < minimum or n % multiple or (maximum is not None and n > maximum):
            raise _bad(name, value, f"out of range (accepted: {accepted})")
        return n

    return parse


def _seconds(*, zero: bool = False) -> Parser:
    accepted = "a number of seconds, " + ("0 or more" if zero else "more than 0")

    def parse(name: str, value: str) -> float:
        try:
            secs = float(value)
        except ValueError:
            raise _bad(name, value, f"not a number (accepted: {accepted})") from None
        if not math.isfinite(secs) or secs < 0 or (secs == 0 and not zero):
            raise _bad(name, value, f"out of range (accepted: {accepted})")
        return secs

    return parse


def _flag(name: str, value: str) -> bool:
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise _bad(name, value, f"not a flag (accepted: {', '.join(_TRUE + _FALSE)})")


def _choice(*choices: str) -> Parser:
    def parse(name: str, value: str) -> str:
        if value not in choices:
            raise _bad(name, value, f"not one of {', '.join(choices)}")
        return value

    return parse


def _text(max_bytes: int) -> Parser:
    def parse(name: str, value: str) -> str:
        if len(value.encode()) > max_bytes:
            raise _bad(name, value, f"too long (accepted: 1 to {max_bytes} bytes)")
        return value

    return parse


def _path(name: str, value: str) -> str:
    return value


@dataclass(frozen=True)
class Var:
    """One variable: the keyword it stands for and how its value is read."""

    keyword: str
    parse: Parser = field(repr=False)

    @property
    def name(self) -> str:
        return "ACP_" + self.keyword.upper()

    def read(self, environ: Mapping[str, str] = os.environ) -> Any:
        """The value the variable holds, None when unset or empty."""
        value = _get(self.name, environ)
        return None if value is None else self.parse(self.name, value)


VARIABLES: tuple[Var, ...] = (
    Var("job", _text(128)),
    Var("ring_bytes", _bytes(1 << 20)),
    Var("ring_slots", _integer(1)),
    Var("shm_dir", _path),
    Var("keep_last", _integer(1)),
    Var("keep_every", _integer(1)),
    Var("on_full", _choice("wait", "skip")),
    Var("full_timeout", _seconds()),
    Var("copy_threads", _integer(1, 256)),
    Var("io", _choice("auto", "uring", "psync")),
    Var("direct_io", _choice("auto", "on", "off")),
    Var("verify", _choice("always", "storage_only")),
    Var("mlock", _flag),
    Var("chunk_bytes", _bytes(4096, 4096, 1 << 30)),
    Var("queue_depth", _integer(1, 1024)),
    Var("persist_on_open", _flag),
    Var("stall_timeout", _seconds()),
    Var("commit_timeout", _seconds()),
    Var("release_on_close", _flag),
    Var("keep_restored", _flag),
    Var("shm_ttl", _seconds(zero=True)),
    Var("persist_every", _integer(1)),
    Var("persist_interval", _seconds()),
    Var("persist_policy", _choice(*POLICIES)),
    Var("background_nice", _integer(0, 19)),
    Var("replicas", _integer(0)),
    Var("replica_timeout", _seconds()),
    Var("compress", _choice(*COMPRESS_MODES)),
    Var("compress_level", _integer(1, 19)),
    Var("incremental", _flag),
    Var("overlap", _flag),
)
"""Every ``Checkpointer`` keyword a variable can give, named ``ACP_<KEYWORD>``."""

BY_KEYWORD: dict[str, Var] = {v.keyword: v for v in VARIABLES}

CHECKPOINTER_ONLY = frozenset({"replicas", "replica_timeout", "overlap"})
"""The variables' keywords that a ``Checkpointer`` acts on itself and a bare
engine (``acp.dcp`` opened on a root path) has none of."""

NO_VARIABLE: dict[str, str] = {
    "root": "required: the training script names its checkpoint directory",
    "rank": "torch.distributed, else the launcher's RANK or RANK_ID",
    "world_size": "torch.distributed, else the launcher's WORLD_SIZE or RANK_SIZE",
    "replica_group": "the model's data-parallel layout, which the training script knows",
    "store": "an object (torch.distributed's store by default)",
    "faults": "a fault injector object, for tests",
}
"""The keywords with no variable, and where their value comes from."""


def _read_persist(environ: Mapping[str, str]) -> dict[str, Any]:
    """The persist policy the ``ACP_PERSIST_*`` variables give.

    They describe one policy, as the keywords do: ``EVERY`` (with no policy
    or ``every``), ``INTERVAL`` (with no policy or ``interval``), or the
    policy ``coalesce`` (or ``every``) alone.

    Raises:
        ConfigError: a value that cannot be read, or variables that name
            two policies; the message names the variables.
    """
    got = {k: BY_KEYWORD[k].read(environ) for k in PERSIST_KEYWORDS}
    every, interval, policy = (got[k] for k in PERSIST_KEYWORDS)
    fits = {
        None: True,
        "every": interval is None,
        "interval": every is None and interval is not None,
        "coalesce": every is None and interval is None,
    }[policy]
    if not fits or (every is not None and interval is not None):
        shown = ", ".join(
            f"{BY_KEYWORD[k].name}={environ.get(BY_KEYWORD[k].name, '').strip()!r}"
            for k, v in got.items()
            if v is not None
        )
        raise ConfigError(
            f"{shown}: give one policy: {PERSIST_EVERY}, {PERSIST_INTERVAL} or "
            f"{PERSIST_POLICY}=coalesce"
        )
    return {k: v for k, v in got.items() if v is not None}


def fill(
    keywords: Mapping[str, Any], environ: Mapping[str, str] = os.environ
) -> tuple[dict[str, Any], dict[str, str]]:
    """``keywords`` with each one that is missing or None taken from its
    variable when that is set; and the variables used, by keyword, as
    ``NAME='value'``.

    The persist policy is one setting: a keyword for any part of it
    (``persist_every``, ``persist_interval``, ``persist_policy``) ignores
    every ``ACP_PERSIST_*``.

    Raises:
        ConfigError: a variable that cannot be read, naming it, its value
            and what is accepted.
    """
    out = dict(keywords)
    used: dict[str, str] = {}
    for var in VARIABLES:
        if var.keyword in PERSIST_KEYWORDS or out.get(var.keyword) is not None:
            continue
        value = var.read(environ)
        if value is not None:
            out[var.keyword] = value
            used[var.keyword] = f"{var.name}={_get(var.name, environ)!r}"
    if all(out.get(k) is None for k in PERSIST_KEYWORDS):
        for k, v in _read_persist(environ).items():
            out[k] = v
            used[k] = f"{BY_KEYWORD[k].name}={_get(BY_KEYWORD[k].name, environ)!r}"
    return out, used


def _naming_sources(e: ConfigError, used: Mapping[str, str]) -> ConfigError | None:
    """``e`` again, naming the variables behind the settings it is about
    (a refusal the engine made, e.g. ``coalesce`` with several ranks);
    None when no variable is concerned."""
    message = str(e)
    named = [
        source
        for keyword, source in used.items()
        if keyword in message
        or (keyword in PERSIST_KEYWORDS and any(k in message for k in PERSIST_KEYWORDS))
    ]
    if not named:
        return None
    return ConfigError(f"{message} (from {', '.join(named)})")


def from_environment(init: Callable[P, R]) -> Callable[P, R]:
    """Decorates ``Checkpointer.__init__``: each keyword left out or None
    comes from its ``ACP_*`` variable (:func:`fill`), and a ``ConfigError``
    about a setting that a variable gave names the variable."""

    @functools.wraps(init)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        filled, used = fill(kwargs)
        call = cast("Callable[..., R]", init)
        try:
            return call(*args, **filled)
        except ConfigError as e:
            again = _naming_sources(e, used) if used else None
            if again is None:
                raise
            raise again from e

    return wrapper
