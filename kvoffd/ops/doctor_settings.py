"""Which settings ``kvoffd doctor`` checks against, and where each one came from.

A doctor that checks what its own shell says instead of what the daemon uses gives a PASS about the
wrong pool: run without the systemd unit's ``KVOFFD_*`` environment it would take the default pool
size, find the running daemon's file "will not adopt" and describe a file that is not on disk. So
each setting is taken, in this order, from: the doctor's own flag; the unit's
``EnvironmentFile`` given with ``--env-file`` (what the *next* start of the unit will use, edited for
an upgrade or not); the running daemon, asked over its socket (STATS: its pool's size and file);
this shell's ``KVOFFD_*``; the daemon's default. The address comes before the daemon (it is how the
daemon is found), so it is the flag, the env file, ``$KVOFFD_ADDRESS`` or the default. Every figure
the pool-file check prints says its source, and a ``KVOFFD_*`` of this shell that is overruled is
named, never silently ignored.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvoffd.config import ConfigError, default_pool_size, parse_size
from kvoffd.pool.format import exact_size
from kvoffd_client.paths import default_address

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MAX_ENV_FILE = 1 << 20  # an environment file is a few lines; a larger one is not one


@dataclass(frozen=True)
class DaemonView:
    """What the running daemon says of itself (STATS): its pool's size and file ("" = private memory)."""

    pid: int
    version: str
    pool_bytes: int
    pool_path: str
    engines: int

    @property
    def who(self) -> str:
        return f"the running daemon (pid {self.pid})"


@dataclass
class Settings:
    """The values checked and, for each, where it came from (``sources``); ``overruled``: this shell's
    ``KVOFFD_*`` variables that a flag, the env file or the daemon overrode, as text."""

    address: str
    pool_size: int
    pool_path: str
    numa_map: str
    sysfs_root: str
    sources: dict[str, str] = field(default_factory=dict)
    overruled: list[str] = field(default_factory=list)


def read_env_file(path: str) -> dict[str, str]:
    """The variables of a systemd ``EnvironmentFile``: ``KEY=VALUE`` lines, ``#`` and ``;`` comments,
    a value in single or double quotes unquoted. A line systemd would not take either is a ConfigError
    naming it (the doctor must not guess what the daemon was given)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_ENV_FILE + 1)
    except OSError as e:
        raise ConfigError(f"--env-file {path}: {e.strerror}") from None
    if len(raw) > _MAX_ENV_FILE:
        raise ConfigError(f"--env-file {path}: more than {_MAX_ENV_FILE} bytes; not an environment file")
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise ConfigError(f"--env-file {path}: not UTF-8 text") from None
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        key, eq, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not _KEY.fullmatch(key):
            raise ConfigError(f"--env-file {path}, line {n}: not KEY=VALUE: {line[:80]!r}")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
            if line.rstrip()[-1] == '"':
                value = value.replace('\\"', '"').replace("\\\\", "\\")
        out[key] = value
    return out


def resolve(args: Any, env_file: Mapping[str, str], environ: Mapping[str, str], env_file_name: str,
            ask: Callable[[str], tuple[DaemonView | None, str]]) -> tuple[Settings, DaemonView | None, str]:
    """The settings to check (see the module docstring), the running daemon's view (None: none
    answered) and why it did not answer ("" when it did, or when no socket is there to ask).
    ``args``: the doctor's parsed flags; ``ask(address)``: (DaemonView or None, why not)."""
    src: dict[str, str] = {}
    overruled: list[str] = []

    def pick(name: str, flag: str | None, daemon_value: str | None, daemon_src: str = "",
             norm: Callable[[str], object] = str) -> str | None:
        var = "KVOFFD_" + name.upper()
        mine = environ.get(var)
        for value, where in ((flag, "--" + name.replace("_", "-")), (env_file.get(var), env_file_name),
                             (daemon_value, daemon_src), (mine, f"${var}")):
            if value:
                src[name] = where
                if mine and where != f"${var}" and _norm(norm, mine) != _norm(norm, value):
                    overruled.append(f"${var}={mine} here (overruled by {where})")
                return value
        src[name] = "the default"
        return None

    address = pick("address", args.address, None) or default_address()
    view, why = ask(address)
    who = view.who if view is not None else ""
    size = pick("pool_size", args.pool_size, str(view.pool_bytes) if view and view.pool_bytes else None, who,
                parse_size)
    try:
        pool_size = parse_size(size) if size else default_pool_size()
    except ConfigError as e:
        raise ConfigError(f"the pool size of {src['pool_size']}: {e}") from None
    path = pick("pool_path", args.pool_path, view.pool_path if view else None, who) or ""
    if view is not None and view.pool_bytes and src["pool_size"] != who and pool_size != view.pool_bytes:
        overruled.append(f"the pool size of {who}, {exact_size(view.pool_bytes)} (overruled by {src['pool_size']})")
    if view is not None and view.pool_path and src["pool_path"] != who and path != view.pool_path:
        overruled.append(f"the pool file of {who}, {view.pool_path} (overruled by {src['pool_path']})")
    numa = pick("numa_map", args.numa_map, None) or "auto"
    sysfs = pick("sysfs_root", args.sysfs_root, None) or "/sys"
    return Settings(address, pool_size, path, numa, sysfs, src, overruled), view, why


def _norm(norm: Callable[[str], object], text: str) -> object:
    try:
        return norm(text)
    except ConfigError:
        return text


def daemon_view(address: str, timeout_s: float = 1.0) -> tuple[DaemonView | None, str]:
    """Ask the daemon at ``address`` (STATS) what pool it serves: (its view, "") or (None, why not;
    "" when no socket is there: nothing is running, nothing to say)."""
    if address.startswith("ipc://") and not os.path.exists(address[len("ipc://"):]):
        return None, ""
    try:
        from kvoffd.ops import ctl
    except ImportError as e:
        return None, f"cannot load the client library to ask the daemon ({e})"
    try:
        client = ctl.connect(address, timeout_s)
    except ctl.Unreachable as e:
        return None, str(e)
    try:
        st = client.stats(detail=False)
    except Exception as e:  # a daemon that answers HELLO but not STATS: say so, never a traceback
        return None, f"kvoffd at {address} did not answer STATS: {e}"
    finally:
        client.close()
    d, pool, kept = st.get("daemon") or {}, st.get("pool") or {}, st.get("persistence") or {}
    engines = st.get("engines", [])
    return DaemonView(pid=int(d.get("pid") or 0), version=str(d.get("version", "?")),
                      pool_bytes=int(pool.get("total_bytes") or 0), pool_path=str(kept.get("path") or ""),
                      engines=len(engines) if isinstance(engines, list) else int(engines or 0)), ""
