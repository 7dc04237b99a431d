"""The daemon's pool and its keeper: a pool in its file with the ``FileKeeper`` that keeps the file's
records true (kvoffd/cache/restart/filekeeper.py), or a pool in private memory with ``Volatile``, its
stand-in, so that the server calls one ``Keeper`` without a branch. "Keeper" is the one name of that
role (STATS calls its section ``persistence``: the wire's word, kept).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence

from kvoffd.cache.identity import EventIdentity
from kvoffd.cache.index import Entry, Index
from kvoffd.cache.restart.filekeeper import FileKeeper
from kvoffd.pool.allocator import Pool, Provisioned
from kvoffd.pool.file import PoolFile, PoolFileError, open_pool_file
from kvoffd.pool.format import PoolLayout, pool_geometry
from kvoffd.pool.place import ensure_default_pool_path
from kvoffd.pool.reap import remove_place_if_empty
from kvoffd.pool.shards import bind_shards, plan_shards
from kvoffd.pool.topology import Topology
from kvoffd.units import format_size
from kvoffd_client.paths import default_address

log = logging.getLogger(__name__)


class Volatile:
    """The pool in private memory (``--pool-path none``, or no room for a file): nothing survives the
    process, and the daemon calls this instead of a ``FileKeeper`` without a branch."""

    def __init__(self) -> None:
        self.unverified: set[Entry] = set()

    def adopt(self) -> None:
        pass

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        pass

    def must_check(self, entries: Sequence[Entry]) -> bool:
        return False

    def adopt_asked(self, namespace: str, keys: bytes) -> bool:
        return False

    def corrupt(self, entries: Sequence[Entry]) -> list[int]:
        return []

    @staticmethod
    def intact(data: memoryview, want: int) -> bool:
        return False  # never asked: nothing is adopted (``must_check`` is False)

    def checked(self, entries: Sequence[Entry]) -> None:
        pass

    def touched(self, entries: Sequence[Entry]) -> None:
        pass

    on_adopted = None  # (a pool in private memory adopts nothing)

    def take_adopted(self) -> tuple[list[Entry], dict[str, EventIdentity]]:
        return [], {}

    def note_identity(self, namespace: str, ident: EventIdentity | None) -> None:
        pass

    async def close(self) -> None:
        pass

    def stats(self) -> dict:
        return {"path": "", "adopted_blocks": 0}


#: what the server holds: the pool file's keeper, or its stand-in for a pool in private memory
Keeper = FileKeeper | Volatile


def open_pool(size: int, path: str, address: str, cold: bool,
              topology: Topology | None = None) -> tuple[Pool, PoolFile | None]:
    """The daemon's pool: in its file (``path``; "" for the default, a private directory in /dev/shm
    (kvoffd/pool/place.py); "none" for private memory). A file that cannot be used gives one
    ERROR and private memory: the daemon works, its cache just does not survive it. ``topology``: the host's NUMA
    nodes, which split the pool into shards placed on them (kvoffd/pool/shards.py; None: one shard),
    their policy set here, before the pool file's data is allocated or any page is touched."""
    chunk, num_chunks = pool_geometry(size)
    shards = plan_shards(topology, num_chunks)
    if path == "none":
        return _placed(Pool(size, chunk, shards=shards)), None
    explicit = bool(path)
    path = path or ensure_default_pool_path(address)
    layout = PoolLayout.of(size, chunk)
    try:
        pf, why = open_pool_file(path, layout, cold)
    except PoolFileError as e:
        remove_place_if_empty(os.path.dirname(path))  # a default directory this start made for nothing
        log.error("%s; the pool is kept in private memory: its blocks are lost at every restart", e)
        return _placed(Pool(size, chunk, shards=shards)), None
    if why == "--cold":
        log.info("pool file %s: starting cold (--cold)", path)
    elif why:
        log.warning("pool file %s not adopted: %s; starting cold", path, why)
    log.info("pool file %s: %s of memory (/dev/shm is RAM), kept when the daemon stops so that the next start "
             "adopts its blocks; '%s' gives it back once the daemon is stopped", path, format_size(layout.total_bytes),
             purge_command(address, path if explicit else ""))
    pool = Pool(size, chunk, mapping=pf.data, shards=shards)
    pool.provisioned = Provisioned(pf.allocated, size)
    return _placed(pool), pf


def purge_command(address: str, pool_path: str = "") -> str:
    """The ``kvoffd purge`` line that removes the pool of the daemon at ``address`` (at ``pool_path``
    when that was given rather than the default place)."""
    cmd = "kvoffd purge"
    if address != default_address():
        cmd += f" --address {address}"
    return cmd + (f" --pool-path {pool_path}" if pool_path else "")


def abandon_pool(pf: PoolFile | None) -> None:
    """The start failed before serving: the pool's files go unless they hold a previous daemon's blocks
    (PoolFile.discard), and a default directory left empty goes too."""
    if pf is None:
        return
    pf.discard()
    if pf.previous is None:
        remove_place_if_empty(os.path.dirname(pf.path))


def _placed(pool: Pool) -> Pool:
    """The pool with each shard's range set to prefer its node (one shard: nothing set)."""
    pool.shards = bind_shards(pool.shards, pool.base_address, pool.chunk_bytes)
    return pool


def keeper(pf: PoolFile | None, pool: Pool, index: Index) -> Keeper:
    """The pool file's keeper, having adopted the previous daemon's blocks and joined the index's
    observers (a ``Volatile`` for a pool in private memory)."""
    if pf is None:
        return Volatile()
    p = FileKeeper(pf, pool, index)
    p.adopt()
    index.observers.append(p)
    return p
