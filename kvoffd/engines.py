"""Who is connected: client connections, the engine workers they registered, leases, liveness.

A connection is a ZeroMQ routing id that said HELLO. An engine belongs to the connection that
registered it; only that connection may submit jobs for it. Liveness comes from two sources: a pidfd
on the client's process (instant, when the daemon can see that pid and its start time matches) and
heartbeats (any message; clients ping every few seconds) for everything else.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

from kvoffd.index import Entry, Table
from kvoffd.transfer.base import MappedMemory, TransferBackend

log = logging.getLogger(__name__)

MAX_JOBS_PER_CONN = 4096
MAX_LEASES_PER_CONN = 8192
MAX_ENGINES_PER_CONN = 64


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
    pidfd: int = -1


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


def process_start_ticks(pid: int) -> int:
    """Field 22 of /proc/PID/stat (start time in clock ticks since boot); 0 when unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def open_pidfd(pid: int, start_ticks: int) -> int:
    """A pidfd for the client's process, only when it is provably that process (pid reuse, other pid
    namespaces). -1 otherwise: heartbeats alone then tell liveness."""
    if pid <= 0 or start_ticks <= 0 or not hasattr(os, "pidfd_open"):
        return -1
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return -1
    if process_start_ticks(pid) != start_ticks:
        os.close(fd)
        return -1
    return fd
