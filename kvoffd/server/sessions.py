"""Who is connected: client connections, the engine workers they registered, leases, liveness.

A connection is a ZeroMQ routing id that said HELLO. An engine belongs to the connection that
registered it; only that connection may submit jobs for it. Liveness comes from two sources: a pidfd
on the client's process (instant, when the daemon can see that pid and its start time matches) and
heartbeats (any message; clients ping every few seconds) for everything else.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvoffd import procfs
from kvoffd.cache.index import Entry, Table
from kvoffd.transfer.base import MappedMemory, TransferBackend

log = logging.getLogger(__name__)

MAX_JOBS_PER_CONN = 4096
MAX_LEASES_PER_CONN = 8192
MAX_ENGINES_PER_CONN = 64
# Memory bounds (docs/security.md, "Bounds per client"): what a client can make the daemon hold.
MAX_LEASED_KEYS_PER_CONN = 1 << 20  # entries (per rank) held by one connection's leases: ~8 MiB
MAX_LEASED_KEYS = 1 << 23  # ...and by all leases: ~64 MiB
MAX_EXPLAIN_KEYS = 4096  # an EXPLAIN reply is ~100 bytes per key
TRACKED_REPLY_BYTES = 4096  # replies this big are counted until libzmq has sent them
MAX_UNREAD_REPLY_BYTES_PER_PEER = 16 << 20  # big replies queued to a peer that is not reading
MAX_UNREAD_REPLY_BYTES = 256 << 20  # ...to all peers
# Copy descriptors: one run per block and segment. A per-layer layout has 2 x num_layers segments
# (160 for 80 layers; hybrid models a few hundred; split heads 2 x layers x kv heads, 1,280 for 80
# layers of 8), so these are far above any real model. What a job costs is bounded by its runs.
MAX_SEGMENTS = 4096  # segments per block (REGISTER layout)
MAX_RUNS_PER_JOB = 1 << 24  # blocks x segments per STORE/LOAD: above 160 segments x 65,536 keys


@dataclass
class Conn:
    ident: bytes
    pid: int
    client: str
    connected_at: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.monotonic)
    engines: set[str] = field(default_factory=set)
    jobs: set[int] = field(default_factory=set)  # client job ids in flight
    leases: set[int] = field(default_factory=set)
    registering: int = 0  # REGISTERs being mapped: counted against the engine bound (pipelined ones too)
    leased_keys: int = 0  # entries its leases pin (bounded: MAX_LEASED_KEYS_PER_CONN)
    watched: bool = False  # registered with the PidWatcher
    active: bool = False  # sent anything after HELLO: a connection that never did is evicted first


@dataclass
class Engine:
    engine_id: str
    conn: Conn
    namespace: str
    rank: int
    world_size: int
    mapped: MappedMemory
    backend: TransferBackend
    table: Table
    registered_at: float = field(default_factory=time.time)
    closing: bool = False  # unregistered; detach once its jobs are done

    def describe(self) -> dict:
        return {"engine_id": self.engine_id, "namespace": self.namespace, "rank": self.rank,
                "world_size": self.world_size, "pid": self.conn.pid, "client": self.conn.client,
                "backend": self.backend.name, "slot_bytes": self.mapped.slot_bytes,
                "num_blocks": self.mapped.num_blocks, "registered_s": round(time.time() - self.registered_at, 3),
                "last_seen_s": round(time.monotonic() - self.conn.last_seen, 3),
                "in_flight": self.mapped.in_flight}


@dataclass
class Lease:
    lease_id: int
    owner: bytes
    expires: float  # monotonic
    by_rank: dict[int, list[Entry]]
    namespace: str


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
