"""Liveness from the kernel: a pidfd per client process, read by the loop, fired when it exits.

Instant where the daemon can see the client's pid and its start time matches (pid reuse, other pid
namespaces make that fail; heartbeats alone then tell liveness, kvoffd/server/sessions.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

from kvoffd.server import procfs

log = logging.getLogger(__name__)


def open_pidfd(pid: int, start_ticks: int) -> int:
    """A pidfd for the client's process, only when it is provably that process (pid reuse, other pid
    namespaces). -1 otherwise: heartbeats alone then tell liveness."""
    if pid <= 0 or start_ticks <= 0 or not hasattr(os, "pidfd_open"):
        return -1
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return -1
    if procfs.start_ticks(pid) != start_ticks:
        os.close(fd)
        return -1
    return fd


class PidWatcher:
    """One pidfd per client process, shared by all its connections (a process that opens and closes
    connections in a loop must not cost the daemon a descriptor each). ``on_exit(ident)`` runs on the
    loop for every connection of a process that exited."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_exit: Callable[[bytes], None]) -> None:
        self._loop = loop
        self._on_exit = on_exit
        self._by_pid: dict[tuple[int, int], tuple[int, set[bytes]]] = {}  # (pid, ticks) -> (fd, idents)
        self._of: dict[bytes, tuple[int, int]] = {}

    def watch(self, ident: bytes, pid: int, start_ticks: int) -> bool:
        key = (pid, start_ticks)
        ent = self._by_pid.get(key)
        if ent is None:
            fd = open_pidfd(pid, start_ticks)
            if fd < 0:
                return False
            ent = self._by_pid[key] = (fd, set())
            self._loop.add_reader(fd, self._fired, key)
        ent[1].add(ident)
        self._of[ident] = key
        return True

    def unwatch(self, ident: bytes) -> None:
        key = self._of.pop(ident, None)
        if key is None:
            return
        idents = self._by_pid[key][1]
        idents.discard(ident)
        if not idents:
            self._close(key)

    def _close(self, key: tuple[int, int]) -> None:
        fd, idents = self._by_pid.pop(key)
        for ident in idents:
            self._of.pop(ident, None)
        try:
            self._loop.remove_reader(fd)
        except RuntimeError:  # the loop is closing
            pass
        os.close(fd)

    def _fired(self, key: tuple[int, int]) -> None:
        idents = list(self._by_pid[key][1])
        self._close(key)
        log.debug("client pid %d exited (%d connections)", key[0], len(idents))  # engines leaving log at INFO
        for ident in idents:
            self._on_exit(ident)

    def close(self) -> None:
        for key in list(self._by_pid):
            self._close(key)
