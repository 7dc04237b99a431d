"""The pool's memory when it has no file (``--pool-path none``, or no room for one): a private
anonymous mapping, reserved whole (it costs nothing until touched), with the kernel's refusal told in
one line that names the pool size and the node's memory."""

from __future__ import annotations

import errno
import mmap

from kvoffd.units import format_size


def _mem_line() -> str:
    """``23.4 GiB, 21.0 GiB available`` from /proc/meminfo (what an operator compares a pool with)."""
    info: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "MemAvailable"):
                    info[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return "unknown"
    total = format_size(info["MemTotal"]) if "MemTotal" in info else "unknown"
    return f"{total}, {format_size(info['MemAvailable'])} available" if "MemAvailable" in info else total


MAP_NORESERVE = 0x4000  # Linux; the mmap module has no name for it before Python 3.13


def reserve_private(nbytes: int, noreserve: bool = False) -> mmap.mmap:
    """The pool's address space. The kernel's refusal (overcommit, RLIMIT_AS, a cgroup) becomes one
    line naming the pool and the memory, not a bare "Cannot allocate memory". ``noreserve``: a range
    the pool file's segments are mapped over at once, so it must not be charged as private memory."""
    try:
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (MAP_NORESERVE if noreserve else 0))
    except OSError as e:
        if e.errno != errno.ENOMEM:
            raise
        raise MemoryError(f"cannot reserve a pool of {format_size(nbytes)}: the kernel refused the memory "
                          f"(RAM {_mem_line()}); choose a smaller --pool-size (kvoffd doctor --pool-size "
                          "SIZE checks one)") from None
