"""How much memory a pool can really have: the cgroup's limit and what the host has available.

Physical RAM is the wrong yardstick on a shared or containerised host: a 20 GiB pool on a machine
with 6 GiB available starts, then the kernel reclaims or kills. A pool's pages live in
shared memory, which Linux charges to the memory cgroup of whoever first touches them, so a pool
larger than the daemon's cgroup limit can never be filled without the OOM killer. MemAvailable is a
softer bound: a pool file the daemon is about to adopt already holds its pages (counted in Shmem,
not in MemAvailable), so only a pool larger than both together is surely short.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: cgroup v2 and v1 write "no limit" as these.
_UNLIMITED = {"max", ""}
_V1_UNLIMITED_FROM = 1 << 60


@dataclass(frozen=True)
class MemoryView:
    """The host's and the cgroup's figures, in bytes (None: not known here)."""

    available: int | None  # MemAvailable
    shmem: int | None  # Shmem: tmpfs and /dev/shm pages, an adopted pool file's among them
    cgroup_limit: int | None  # the daemon's memory cgroup limit (v2 memory.max, v1 limit_in_bytes)
    cgroup_path: str = ""


def read_memory_view(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> MemoryView:
    info = _meminfo(os.path.join(proc, "meminfo"))
    limit, where = _cgroup_limit(os.path.join(proc, "self", "cgroup"), cgroup_root)
    return MemoryView(info.get("MemAvailable"), info.get("Shmem"), limit, where)


def pool_memory_problem(pool_size: int, view: MemoryView) -> tuple[str, str]:
    """(refusal, warning) for a pool of ``pool_size`` bytes; empty strings where there is none."""
    from kvoffd.units import format_size

    if view.cgroup_limit is not None and pool_size > view.cgroup_limit:
        return (f"--pool-size {format_size(pool_size)} is larger than this daemon's memory cgroup limit "
                f"({format_size(view.cgroup_limit)}, {view.cgroup_path}): the pool's pages are charged to "
                "that cgroup and the OOM killer would end the daemon before it is full; choose a smaller "
                "pool or raise the limit (a container's memory limit, systemd's MemoryMax=)"), ""
    if view.available is not None and pool_size > view.available + (view.shmem or 0):
        return "", (f"--pool-size {format_size(pool_size)} is more than this host has available "
                    f"({format_size(view.available)} available, {format_size(view.shmem or 0)} in shared "
                    "memory an adopted pool may already hold): filling it will make the kernel reclaim "
                    "the engines' memory or swap; choose a smaller pool")
    return "", ""


def _meminfo(path: str) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[name] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _cgroup_limit(self_cgroup: str, root: str) -> tuple[int | None, str]:
    """The tightest memory limit on the path from this process's cgroup up to the root."""
    try:
        with open(self_cgroup) as f:
            lines = [ln.rstrip("\n").split(":", 2) for ln in f]
    except OSError:
        return None, ""
    for _hid, controllers, rel in (ln for ln in lines if len(ln) == 3):
        if controllers == "":  # v2 (unified)
            found = _tightest(os.path.join(root, rel.lstrip("/")), root, "memory.max")
        elif "memory" in controllers.split(","):  # v1
            found = _tightest(os.path.join(root, "memory", rel.lstrip("/")), os.path.join(root, "memory"),
                              "memory.limit_in_bytes")
        else:
            continue
        if found[0] is not None:
            return found
    return None, ""


def _tightest(leaf: str, top: str, name: str) -> tuple[int | None, str]:
    best: tuple[int | None, str] = (None, "")
    d = os.path.normpath(leaf)
    top = os.path.normpath(top)
    while True:
        try:
            with open(os.path.join(d, name)) as f:
                text = f.read().strip()
        except OSError:
            text = ""
        limit = int(text) if text not in _UNLIMITED and text.isdigit() else None
        if limit is not None and limit < _V1_UNLIMITED_FROM and (best[0] is None or limit < best[0]):
            best = (limit, os.path.join(d, name))
        if d == top or len(d) <= len(top):
            return best
        d = os.path.dirname(d)
