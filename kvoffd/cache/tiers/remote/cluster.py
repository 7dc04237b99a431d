"""Where each key lives and the threads that talk to it.

* A :class:`Lane` is one thread with one connection to one shard; work for a shard is queued on its
  lanes (each shard has ``read_lanes`` for probes and fetches and ``write_lanes`` for publishing, so a
  slow SET never delays a fetch on the critical path). Only the lane's thread touches its connection.
* A :class:`Shard` is one primary: its address, its lanes, its :class:`Breaker`.
* :class:`Cluster` keeps the slot map (``CLUSTER SLOTS`` from any shard or seed), refreshes it when a
  reply says MOVED or a shard it never saw appears, and falls back to one plain server when the server
  says cluster support is disabled (every slot is that server's).

TLS (``rediss://``): one :class:`Tls` (context and checked name) for the whole cluster, made before the
first connection and handed to every shard this map ever names (seeds, ``CLUSTER SLOTS`` rows, MOVED and
ASK targets), so that every lane, every slot-map read and every reconnect uses the same one.

Nothing here runs on the event loop; the caller is a tier's worker thread, and every call takes a
deadline.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvoffd.cache.tiers.remote.address import Address
from kvoffd.cache.tiers.remote.breaker import Breaker
from kvoffd.cache.tiers.remote.resp import Broken, Connection, RespError
from kvoffd.cache.tiers.remote.slots import SLOTS
from kvoffd.cache.tiers.remote.tls import Tls

log = logging.getLogger(__name__)

Addr = tuple[str, int]


class Lane:
    """One thread and one connection to a shard."""

    def __init__(self, shard: Shard, name: str):
        self.shard = shard
        self.conn = shard.new_connection()
        self._ex = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        self.queued = 0  # tasks queued or running (read under the GIL: a hint for choosing a lane)

    def submit(self, fn: Callable[[Lane], Any]) -> concurrent.futures.Future:
        self.queued += 1

        def run():
            try:
                return fn(self)
            finally:
                self.queued -= 1
        return self._ex.submit(run)

    def ready(self, deadline: float) -> Connection:
        """The connection, connected (and authenticated); Broken or RespError (AUTH) otherwise."""
        if not self.conn.connected:
            self.conn.connect(min(deadline, time.monotonic() + self.shard.connect_timeout))
        return self.conn

    def abort(self) -> None:
        self.conn.abort()

    def close(self) -> None:
        self._ex.shutdown(wait=True, cancel_futures=True)
        self.conn.close()


class Shard:
    def __init__(self, addr: Addr, address: Address, tls: Tls | None, read_lanes: int,
                 write_lanes: int, connect_timeout: float, breaker: Breaker):
        self.addr = addr
        self._address = address
        self._tls = tls
        self.connect_timeout = connect_timeout
        self.breaker = breaker
        name = f"kvoffd-remote-{addr[1]}"
        self.read_lanes = [Lane(self, f"{name}-r{i}") for i in range(read_lanes)]
        self.write_lanes = [Lane(self, f"{name}-w{i}") for i in range(write_lanes)]

    def new_connection(self) -> Connection:
        a = self._address
        return Connection(self.addr[0], self.addr[1], self._tls, a.user, a.password)

    def lane(self, write: bool) -> Lane:
        lanes = self.write_lanes if write else self.read_lanes
        return min(lanes, key=lambda ln: ln.queued)

    def lanes(self) -> list[Lane]:
        return self.read_lanes + self.write_lanes

    def close(self) -> None:
        for ln in self.lanes():
            ln.close()


class Cluster:
    """The slot map and the shards. Thread-safe: lanes and callers read the map under its lock."""

    def __init__(self, address: Address, read_lanes: int = 1, write_lanes: int = 1,
                 connect_timeout: float = 0.5, breaker_max_cooldown: float = 0.5,
                 on_error: Callable[[str, Addr, str], None] | None = None, tls: Tls | None = None):
        if tls is not None and not address.tls:
            raise ValueError("TLS settings with a redis:// address (rediss:// for TLS)")
        self.address = address
        #: rediss:// is always TLS: without settings, the system's CAs and each shard's own host name
        self.tls = (tls or Tls.system()) if address.tls else None
        self._read_lanes, self._write_lanes = read_lanes, write_lanes
        self._connect_timeout = connect_timeout
        self._max_cool = breaker_max_cooldown
        self._on_error = on_error or (lambda kind, addr, text: None)
        self._lock = threading.Lock()
        self._shards: dict[Addr, Shard] = {}
        self._slots: list[Shard | None] = [None] * SLOTS
        self.plain = False  # one server, not a cluster
        self._refreshed = 0.0
        self._refresh_lock = threading.Lock()
        self.refreshes = 0

    def shard(self, addr: Addr) -> Shard:
        with self._lock:
            s = self._shards.get(addr)
            if s is None:
                s = Shard(addr, self.address, self.tls, self._read_lanes, self._write_lanes,
                          self._connect_timeout, Breaker(max_cooldown=self._max_cool))
                self._shards[addr] = s
            return s

    def shards(self) -> list[Shard]:
        with self._lock:
            return list(self._shards.values())

    def owner(self, slot: int) -> Shard | None:
        return self._slots[slot]

    def refresh(self, deadline: float, min_interval: float = 0.1) -> bool:
        """Read the slot map from a shard or seed; at most once per ``min_interval`` (concurrent callers
        share one refresh). True when a map was read."""
        with self._refresh_lock:
            now = time.monotonic()
            if now - self._refreshed < min_interval:
                return True
            known = [s.addr for s in self.shards()]
            tried = set()
            for addr in known + list(self.address.seeds):
                if addr in tried:
                    continue
                tried.add(addr)
                sh = self._shards.get(addr)
                if sh is not None and not sh.breaker.allow():
                    continue
                if self._refresh_from(addr, deadline):
                    if sh is not None:
                        sh.breaker.success()
                    self._refreshed = time.monotonic()
                    self.refreshes += 1
                    return True
                if sh is not None:
                    sh.breaker.failure()
            return False

    def _refresh_from(self, addr: Addr, deadline: float) -> bool:
        a = self.address
        c = Connection(addr[0], addr[1], self.tls, a.user, a.password)
        try:
            c.connect(min(deadline, time.monotonic() + self._connect_timeout))
            r = c.call(min(deadline, time.monotonic() + 2 * self._connect_timeout), "CLUSTER", "SLOTS")
        except RespError as e:
            self._on_error("auth", addr, e.text)
            return False
        except Broken as e:
            self._on_error("connect", addr, str(e))
            return False
        finally:
            c.close()
        if isinstance(r, RespError):
            if "cluster support disabled" in r.text.lower() or r.kind == "ERR" and "cluster" in r.text.lower():
                sh = self.shard(addr)
                with self._lock:
                    self.plain = True
                    self._slots = [sh] * SLOTS
                return True
            self._on_error(r.kind.lower(), addr, r.text)
            return False
        slots: list[Shard | None] = [None] * SLOTS
        for row in r or []:
            lo, hi, primary = int(row[0]), int(row[1]), row[2]
            host = primary[0].decode() if primary[0] else addr[0]
            if host in ("", "?"):
                host = addr[0]
            sh = self.shard((host, int(primary[1])))
            for s in range(lo, hi + 1):
                slots[s] = sh
        with self._lock:
            self.plain = False
            self._slots = slots
        return True

    def moved(self, slot: int, addr: Addr) -> Shard:
        """A MOVED reply: the slot is ``addr``'s now (the map is refreshed whole by the caller)."""
        sh = self.shard(addr)
        with self._lock:
            self._slots[slot] = sh
        return sh

    def close(self) -> None:
        for s in self.shards():
            s.close()


def parse_redirect(e: RespError) -> tuple[int, Addr] | None:
    """``MOVED 3999 127.0.0.1:6381`` / ``ASK ...`` -> (slot, address)."""
    parts = e.text.split()
    if len(parts) < 3:
        return None
    host, _, port = parts[2].rpartition(":")
    try:
        return int(parts[1]), (host, int(port))
    except ValueError:
        return None
