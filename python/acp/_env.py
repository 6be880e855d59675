"""``ACP_*`` environment variables: settings of a ``Checkpointer`` a job
can give without changing the training script.

An explicit keyword argument always wins over its variable; an unset or
empty variable means "not given". A value that cannot be read raises
``acp.ConfigError`` naming the variable and the value.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

from acp._acp import ConfigError

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
INCREMENTAL = "ACP_INCREMENTAL"

POLICIES = ("every", "interval", "coalesce")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _get(name: str, environ: Mapping[str, str]) -> str | None:
    value = environ.get(name, "").strip()
    return value or None


def _bad(name: str, value: str, what: str) -> ConfigError:
    return ConfigError(f"{name}={value!r}: {what}")


def env_int(name: str, *, minimum: int, environ: Mapping[str, str] = os.environ) -> int | None:
    """The integer ``name`` holds (at least ``minimum``), None when unset."""
    value = _get(name, environ)
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        raise _bad(name, value, "not an integer") from None
    if n < minimum:
        raise _bad(name, value, f"must be at least {minimum}")
    return n


def env_seconds(name: str, *, environ: Mapping[str, str] = os.environ) -> float | None:
    """The positive, finite number of seconds ``name`` holds, None when unset."""
    value = _get(name, environ)
    if value is None:
        return None
    try:
        secs = float(value)
    except ValueError:
        raise _bad(name, value, "not a number of seconds") from None
    if not math.isfinite(secs) or secs <= 0:
        raise _bad(name, value, "must be a positive number of seconds")
    return secs


def env_bool(name: str, *, environ: Mapping[str, str] = os.environ) -> bool | None:
    """``name`` as a flag (1/true/yes/on or 0/false/no/off), None when unset."""
    value = _get(name, environ)
    if value is None:
        return None
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise _bad(name, value, f"not a flag (one of {', '.join(_TRUE + _FALSE)})")


def env_choice(
    name: str, choices: tuple[str, ...], *, environ: Mapping[str, str] = os.environ
) -> str | None:
    """The one of ``choices`` that ``name`` holds, None when unset."""
    value = _get(name, environ)
    if value is None:
        return None
    if value not in choices:
        raise _bad(name, value, f"not one of {', '.join(choices)}")
    return value


def compress_settings(
    compress: str | None,
    compress_level: int | None,
    *,
    environ: Mapping[str, str] = os.environ,
) -> tuple[str | None, int | None]:
    """``compress`` and ``compress_level``, each from ``ACP_COMPRESS`` /
    ``ACP_COMPRESS_LEVEL`` when its keyword is None (None: the engine's
    default, plain files, level 1)."""
    if compress is None:
        compress = env_choice(COMPRESS, COMPRESS_MODES, environ=environ)
    if compress_level is None:
        compress_level = env_int(COMPRESS_LEVEL, minimum=1, environ=environ)
    return compress, compress_level


def incremental_setting(
    incremental: bool | None, *, environ: Mapping[str, str] = os.environ
) -> bool | None:
    """``incremental``, from ``ACP_INCREMENTAL`` when the keyword is None
    (None: the engine's default, on)."""
    if incremental is None:
        incremental = env_bool(INCREMENTAL, environ=environ)
    return incremental


@dataclass
class PersistEnv:
    """The persist policy the ``ACP_PERSIST_*`` variables give."""

    every: int | None = None
    interval: float | None = None
    policy: str | None = None
    names: list[str] = field(default_factory=list)
    """The variables that were set, e.g. for an error message."""


def persist_from_env(environ: Mapping[str, str] = os.environ) -> PersistEnv:
    """Reads ``ACP_PERSIST_EVERY`` (steps), ``ACP_PERSIST_INTERVAL``
    (seconds) and ``ACP_PERSIST_POLICY`` (every, interval, coalesce).

    They describe one policy, as the keywords do: ``EVERY`` (with no policy
    or ``every``), ``INTERVAL`` (with no policy or ``interval``), or the
    policy ``coalesce`` (or ``every``) alone.

    Raises:
        ConfigError: a value that cannot be read, or variables that name
            two policies; the message names the variables.
    """
    env = PersistEnv(
        every=env_int(PERSIST_EVERY, minimum=1, environ=environ),
        interval=env_seconds(PERSIST_INTERVAL, environ=environ),
        policy=env_choice(PERSIST_POLICY, POLICIES, environ=environ),
    )
    env.names = [
        name
        for name, value in (
            (PERSIST_EVERY, env.every),
            (PERSIST_INTERVAL, env.interval),
            (PERSIST_POLICY, env.policy),
        )
        if value is not None
    ]
    fits = {
        None: True,
        "every": env.interval is None,
        "interval": env.every is None and env.interval is not None,
        "coalesce": env.every is None and env.interval is None,
    }[env.policy]
    if not fits or (env.every is not None and env.interval is not None):
        shown = ", ".join(f"{n}={environ.get(n, '').strip()!r}" for n in env.names)
        raise ConfigError(
            f"{shown}: give one policy: {PERSIST_EVERY}, {PERSIST_INTERVAL} or "
            f"{PERSIST_POLICY}=coalesce"
        )
    return env


@dataclass
class Settings:
    """A ``Checkpointer``'s settings that the environment may give: the
    keywords where given, else the variables."""

    replicas: int | None
    replica_timeout: float | None
    release_on_close: bool
    persist: PersistEnv
    """The persist policy; its ``names`` are empty when keywords gave it."""
    ring_bytes: int | None = None
    shm_dir: str | None = None

    @contextmanager
    def naming_persist_vars(self) -> Iterator[None]:
        """Re-raises the engine's refusal of a persist policy that the
        environment gave (e.g. ``coalesce`` with several ranks) naming the
        variables it came from."""
        try:
            yield
        except ConfigError as e:
            names = self.persist.names
            if not names or "persist_policy" not in str(e):
                raise
            raise ConfigError(f"{e} (from {', '.join(names)})") from e


def settings(
    *,
    replicas: int | None,
    replica_timeout: float | None,
    release_on_close: bool | None,
    persist_every: int | None,
    persist_interval: float | None,
    persist_policy: str | None,
    ring_bytes: int | None = None,
    shm_dir: str | None = None,
    environ: Mapping[str, str] = os.environ,
) -> Settings:
    """Fills in from ``ACP_REPLICAS``, ``ACP_REPLICA_TIMEOUT``,
    ``ACP_RELEASE_ON_CLOSE``, ``ACP_RING_BYTES`` (bytes), ``ACP_SHM_DIR``
    (the ring's directory, e.g. a larger tmpfs than a container's
    ``/dev/shm``) and
    ``ACP_PERSIST_*`` what the keywords leave as None. The persist policy is
    one setting: a keyword for any part of it ignores every ``ACP_PERSIST_*``.

    Raises:
        ConfigError: a variable that cannot be read, naming it.
    """
    if replicas is None:
        replicas = env_int(REPLICAS, minimum=0, environ=environ)
    if replica_timeout is None:
        replica_timeout = env_seconds(REPLICA_TIMEOUT, environ=environ)
    if release_on_close is None:
        release_on_close = bool(env_bool(RELEASE_ON_CLOSE, environ=environ))
    if ring_bytes is None:
        ring_bytes = env_int(RING_BYTES, minimum=1 << 20, environ=environ)
    if shm_dir is None:
        shm_dir = _get(SHM_DIR, environ)
    if persist_every is None and persist_interval is None and persist_policy is None:
        persist = persist_from_env(environ)
    else:
        persist = PersistEnv(persist_every, persist_interval, persist_policy)
    return Settings(
        replicas, replica_timeout, release_on_close, persist, ring_bytes=ring_bytes, shm_dir=shm_dir
    )
