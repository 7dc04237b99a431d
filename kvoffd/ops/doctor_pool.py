"""`kvoffd doctor`'s check of the pool file (issue 14): where the pool will live, whether that is
memory, whether this user may keep it there, whether there is room for it, and what it holds now.

Kept apart from kvoffd/ops/doctor_host.py (the host checks) so that the warm-restart rules
live next to each other: the daemon itself falls back to private memory, with one ERROR, in every
case reported here as WARN, so nothing here is a FAIL.
"""

from __future__ import annotations

import os
import time
from typing import Any

from kvoffd.config import format_size
from kvoffd.pool_format import (
    HEADER_BYTES,
    RANDOM_PART,
    Header,
    Layout,
    allocated_bytes,
    default_pool_path,
    exact_size,
    fs_type,
    pool_geometry,
    segments_mismatch,
    shm_pool_places,
)

PASS, WARN = "pass", "warn"
_FIX_ROOM = ("enlarge the filesystem (mount -o remount,size=... /dev/shm; docker: shm_size; Kubernetes: the "
             "volume's sizeLimit) or lower --pool-size")


def _thp_shmem() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            text = f.read()
    except OSError:
        return "unknown"
    return text[text.find("[") + 1:text.find("]")] if "[" in text else text.strip()


def _holds(path: str, layout: Layout) -> str:
    """What the existing file holds, in words."""
    try:
        with open(path, "rb") as f:
            head = Header.unpack(f.read(HEADER_BYTES))
        st = os.stat(path)
    except OSError as e:
        return f"; it cannot be read ({e.strerror})"
    if head is None:
        return "; it holds no kvoffd pool header: the next start is cold"
    why = head.mismatch(layout, st.st_size) or segments_mismatch(path, st.st_ino, layout)
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(head.updated))
    if why:
        return f"; it holds a pool written until {when} that the next start will not adopt ({why})"
    return f"; it holds a pool written until {when}, adopted at the next start"


def check_pool_file(ctx: Any) -> tuple[str, str, str]:
    """(status, detail, fix) for the pool file the daemon would use."""
    path = ctx.pool_path or default_pool_path(ctx.address)
    if path == "none":
        return PASS, "the pool is kept in private memory (--pool-path none): the cache does not survive a restart", ""
    try:
        chunk, _ = pool_geometry(ctx.pool_size)
    except ValueError as e:
        return WARN, str(e), "choose a --pool-size of whole 64 MiB chunks"
    layout = Layout.of(ctx.pool_size, chunk)
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
    extra = ""
    if os.path.exists(path):
        fst = os.stat(path)
        if fst.st_uid != os.getuid() or fst.st_mode & 0o077:
            return (WARN, f"{path} is not a 0600 file of this user (mode {fst.st_mode & 0o777:o}, uid {fst.st_uid}): "
                    "the daemon would not use it", "remove it, or run kvoffd as its owner")
        have = allocated_bytes(path, layout)
        extra = _holds(path, layout)
    free = st.f_bavail * st.f_frsize
    need = max(0, layout.total_bytes - have)
    detail = (f"{path} on {kind}: {format_size(layout.total_bytes)} in {layout.num_segments + 1} files (metadata and "
              f"{exact_size(layout.segment_bytes)} data segments) for a {exact_size(ctx.pool_size)} pool, "
              f"{format_size(free)} free{extra}")
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
    return PASS, detail, ""
