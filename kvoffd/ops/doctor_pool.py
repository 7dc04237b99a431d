"""`kvoffd doctor`'s check of the pool file (the warm restart): where the pool will live, whether that is
memory, whether this user may keep it there, whether there is room for it, and what it holds now.

Kept apart from kvoffd/ops/doctor_host.py (the host checks) so that the warm-restart rules
live next to each other: the daemon itself falls back to private memory, with one ERROR, in every
case reported here as WARN, so nothing here is a FAIL. A start that will be cold (a file it will not
adopt, a running daemon whose pool is in private memory) is a WARN with the reason, never a PASS: the
upgrade runbook (docs/operations.md) restarts on this line. The file and the settings are the running
daemon's, or the unit's (kvoffd/ops/doctor_settings.py), and the line says where each came from.
"""

from __future__ import annotations

import os
import pwd
import time
from typing import Any

from kvoffd.pool.format import (
    HEADER_BYTES,
    RANDOM_PART,
    Header,
    PoolLayout,
    allocated_bytes,
    default_pool_path,
    exact_size,
    fs_type,
    pool_geometry,
    segments_mismatch,
    shm_pool_places,
)
from kvoffd.units import format_size

PASS, WARN = "pass", "warn"
SYSTEMD_ENV_FILE = "/etc/kvoffd/kvoffd.env"  # where deploy/systemd installs the unit's environment
_FIX_ROOM = ("enlarge the filesystem (mount -o remount,size=... /dev/shm; docker: shm_size; Kubernetes: the "
             "volume's sizeLimit) or lower --pool-size")


def _thp_shmem() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            text = f.read()
    except OSError:
        return "unknown"
    return text[text.find("[") + 1:text.find("]")] if "[" in text else text.strip()


def _holds(path: str, layout: PoolLayout) -> tuple[str, str]:
    """What the existing file holds, in words, and why the next start will not adopt it ("": it will)."""
    try:
        with open(path, "rb") as f:
            head = Header.unpack(f.read(HEADER_BYTES))
        st = os.stat(path)
    except OSError as e:
        return f"; it cannot be read ({e.strerror})", f"it cannot be read ({e.strerror})"
    if head is None:
        return "; it holds no kvoffd pool header: the next start is cold", "it holds no kvoffd pool header"
    why = head.mismatch(layout, st.st_size) or segments_mismatch(path, st.st_ino, layout)
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(head.updated))
    if why:
        return f"; it holds a pool written until {when} that the next start will not adopt ({why})", why
    return f"; it holds a pool written until {when}, adopted at the next start", ""


def check_pool_file(ctx: Any) -> tuple[str, str, str]:
    """(status, detail, fix) for the pool file the daemon would use: the running daemon's own file when
    one answers (``ctx.daemon``), checked against the settings the next start will use. Everything
    that makes that start cold is a WARN with its reason: a file it will not adopt, a running daemon
    whose pool is in private memory, no room for the file."""
    status, detail, fix = _check_file(ctx)
    v = ctx.daemon
    if v is not None and not v.pool_path and ctx.pool_path != "none":
        status = WARN
        detail = (f"{v.who} keeps its pool in private memory, not in a pool file: what it holds is lost when it "
                  f"stops; the next start would use " + detail)
        fix = ("the daemon's log at its start says why it could not use its pool file (no room in /dev/shm, a file "
               "or directory another user made or can write), unless it was started with --pool-path none; once "
               "fixed, a start makes the file (cold once)" + (f"; then: {fix}" if fix else ""))
    notes = []
    if ctx.overruled:
        notes.append("not used here: " + ", ".join(ctx.overruled))
    implicit = [k for k in ("pool_size", "pool_path") if not _explicit(ctx, k)]
    if v is None and ctx.daemon_error and implicit:  # a daemon may be there: these may not be its settings
        status = WARN
        owner = _socket_owner(ctx.address)
        detail = (f"the daemon at {ctx.address} could not be asked for its pool ({ctx.daemon_error}), so this "
                  f"may not be its pool: " + detail)
        fix = ((f"run the doctor as the daemon's user (sudo -u {owner} kvoffd doctor ...), " if owner else "")
               + "or give its settings: --env-file (the unit's environment file), --pool-size, --pool-path"
               + (f"; then: {fix}" if fix else ""))
    if v is None and ctx.pool_size_source == "the default":
        notes.append(f"no daemon answers at {ctx.address} to say its pool size, so it is the default (give "
                     "--env-file with the daemon's environment file, --pool-size, or its KVOFFD_* variables)")
        if os.path.exists(SYSTEMD_ENV_FILE) and not ctx.env_file:  # a unit is installed: these are not its settings
            status = WARN
            fix = (f"check what the unit's daemon uses: kvoffd doctor --env-file {SYSTEMD_ENV_FILE}"
                   + (f"; then: {fix}" if fix else ""))
    if notes:
        detail += "; " + "; ".join(notes)
    return status, detail, fix


def _explicit(ctx: Any, setting: str) -> bool:
    """Whether the operator named this setting (a flag or the env file), not the daemon or a default."""
    src = ctx.sources.get(setting, "")
    return src.startswith("--") or bool(ctx.env_file and src == ctx.env_file)


def _socket_owner(address: str) -> str:
    """The user owning an ipc:// socket's directory (the daemon's, in every deployment), "" if unknown."""
    if not address.startswith("ipc://"):
        return ""
    try:
        uid = os.stat(os.path.dirname(os.path.abspath(address[len("ipc://"):]))).st_uid
    except OSError:
        return ""
    return "" if uid == os.getuid() else _user(uid)


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"#{uid}"


def _from(source: str) -> str:
    return source if source == "the default" else f"from {source}"


def _check_file(ctx: Any) -> tuple[str, str, str]:
    path = ctx.pool_path or default_pool_path(ctx.address)
    where = ctx.sources.get("pool_path", "")
    if path == "none":
        return PASS, "the pool is kept in private memory (--pool-path none): the cache does not survive a restart", ""
    try:
        chunk, _ = pool_geometry(ctx.pool_size)
    except ValueError as e:
        return WARN, str(e), "choose a --pool-size of whole 64 MiB chunks"
    layout = PoolLayout.of(ctx.pool_size, chunk)
    d = os.path.dirname(path)
    probe = d if os.path.isdir(d) else os.path.dirname(d)
    try:
        kind = fs_type(probe)
        st = os.statvfs(probe)
    except OSError as e:
        return WARN, f"{d} cannot be examined ({e.strerror})", "create it, or choose another --pool-path"
    if kind == "other":
        return (WARN, f"{d} is not memory-backed: the daemon would keep the pool in private memory (a pool file "
                "on disk is never used)", "point --pool-path at /dev/shm or another tmpfs/hugetlbfs mount")
    if not os.access(probe, os.W_OK | os.X_OK):
        return WARN, f"this user cannot create files in {probe}", "choose a --pool-path this user owns"
    have = 0
    extra = refused = ""
    if os.path.exists(path):
        fst = os.stat(path)
        v = ctx.daemon
        if fst.st_uid != os.getuid() and v is not None and path == v.pool_path:
            return (WARN, f"{path}, the pool file of {v.who}, belongs to uid {fst.st_uid}, not to this user: what it "
                    "holds cannot be checked from here", f"run the doctor as the daemon's user (sudo -u "
                    f"{_user(fst.st_uid)} kvoffd doctor ...)")
        if fst.st_uid != os.getuid() or fst.st_mode & 0o077:
            return (WARN, f"{path} is not a 0600 file of this user (mode {fst.st_mode & 0o777:o}, uid {fst.st_uid}): "
                    "the daemon would not use it", "remove it, or run kvoffd as its owner")
        have = allocated_bytes(path, layout)
        extra, refused = _holds(path, layout)
    free = st.f_bavail * st.f_frsize
    need = max(0, layout.total_bytes - have)
    named = f" ({_from(where)})" if where and where != "the default" else ""
    detail = (f"{path}{named} on {kind}: {format_size(layout.total_bytes)} in {layout.num_segments + 1} files "
              f"(metadata and {exact_size(layout.segment_bytes)} data segments) for a {exact_size(ctx.pool_size)} "
              f"pool ({_from(ctx.pool_size_source)}), {format_size(free)} free{extra}")
    if kind == "tmpfs":
        detail += f"; shmem huge pages: {_thp_shmem()}"
    if not ctx.pool_path:
        if RANDOM_PART in path:
            detail += "; its directory is made at the daemon's first start, named at random"
        taken = [f"{p} (uid {uid})" for p, uid in shm_pool_places(ctx.address).foreign]
        if taken:  # the daemon ignores them: a squatter costs nothing, but someone tried
            detail += f"; never used, as others made them or can write them: {', '.join(taken)}"
    if need > free:
        return (WARN, detail + f"; {format_size(need)} more is needed: the daemon would keep the pool in private "
                "memory", _FIX_ROOM)
    if refused.startswith("it cannot be read"):
        return WARN, detail, "run the doctor as the daemon's user (the file is 0600)"
    if refused:
        return (WARN, detail, "the next start with these settings begins cold and makes the file again; to keep "
                "its blocks, start with the settings it was made for (the reason names the one that differs: "
                "--pool-size/KVOFFD_POOL_SIZE for the pool size), or accept one cold start")
    return PASS, detail, ""
