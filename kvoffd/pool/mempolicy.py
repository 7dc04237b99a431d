"""``mbind(2)`` through ctypes: a range of the pool's mapping gets a NUMA memory policy before its
first page exists, so the kernel allocates its pages on the shard's node whoever touches them (a
pinning thread, ``posix_fallocate`` of the pool file: shmem keeps the policy per file range and its
fallocate honours it, a copy thread).

Why a syscall through ctypes and not libnuma: one call, no new dependency, and glibc exports
``syscall``. Why MPOL_PREFERRED by default and not MPOL_BIND: a node that fills up then lends pages
from the next node instead of failing the fault (a SIGBUS for a pool file, the OOM killer for private
memory); placement is a speed matter, never a correctness one.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import logging
import os
import platform
from dataclasses import dataclass
from typing import Any

from kvoffd import libc

log = logging.getLogger(__name__)

# the mbind syscall number per architecture (asm/unistd.h)
_SYS_MBIND = {"x86_64": 237, "aarch64": 235, "ppc64le": 259, "s390x": 268}
_MAX_NODES = 1024  # bits in the node mask handed over


class Policy(enum.IntEnum):
    """The kernel's MPOL_* values used here."""

    DEFAULT = 0
    PREFERRED = 1
    BIND = 2


@dataclass(frozen=True)
class BindResult:
    """What one ``mbind`` did: ``ok``, or the errno's name and text (EINVAL: the node is not online;
    EPERM: a seccomp profile or cpuset forbids it; ENOSYS: not Linux or an unknown architecture)."""

    ok: bool
    error: str = ""


def _syscall() -> tuple[Any | None, int]:
    return libc.syscall, _SYS_MBIND.get(platform.machine(), -1)


def mbind(address: int, length: int, node: int, policy: Policy = Policy.PREFERRED) -> BindResult:
    """Give ``[address, +length)`` (page-aligned) the policy ``policy`` on ``node``; nothing moves
    (no MPOL_MF_MOVE: pages already there, an adopted pool's, stay where they are)."""
    syscall, nr = _syscall()
    if syscall is None or nr < 0:
        return BindResult(False, "ENOSYS: mbind is not available here")
    if not 0 <= node < _MAX_NODES:
        return BindResult(False, f"EINVAL: node {node} out of range")
    words = _MAX_NODES // (8 * ctypes.sizeof(ctypes.c_ulong))
    mask = (ctypes.c_ulong * words)()
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    mask[node // bits] = 1 << (node % bits)
    r = syscall(ctypes.c_long(nr), ctypes.c_void_p(address), ctypes.c_ulong(length), ctypes.c_int(int(policy)),
                     mask, ctypes.c_ulong(_MAX_NODES + 1), ctypes.c_uint(0))
    if r == 0:
        return BindResult(True)
    e = ctypes.get_errno()
    return BindResult(False, f"{errno.errorcode.get(e, str(e))}: {os.strerror(e)}")
