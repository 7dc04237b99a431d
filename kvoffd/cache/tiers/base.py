"""The interface of a tier below the DRAM pool (the disk, kvoffd/cache/tiers/disk.py; any other medium implements the same calls).

A tier keeps immutable, content-addressed blocks: the same (table, key) always means the same bytes, so
there is no update and no invalidation, only write (spill), read (promote), presence and removal. What
makes it small enough for a remote store is that every call is *batched* and *asynchronous*:

* ``contains`` answers from memory on the loop thread (the LOOKUP is answered before anything else
  runs): a local tier reads its own index; a remote tier keeps a local presence table of what it wrote
  (the same :class:`kvoffd.cache.tiers.diskindex.DiskIndex`) and treats a stale "yes" as a failed read.
* ``read`` and ``write`` take a whole batch and return an ``asyncio.Future`` resolved *on the loop*
  (the tier's own threads or event loop call ``loop.call_soon_threadsafe``); the work itself happens
  off the loop. A read fills the caller's buffers (pool slots) and says, per block, whether the bytes
  are the ones written: a tier verifies its checksum before it says yes, so a torn or stale block is a
  miss and never a wrong byte. A tier must not touch a destination buffer after it resolved the future
  (no late writes into a slot the pool may have handed on).
* Errors never raise into the caller: an I/O error, a timeout or a dead shard is a failed block
  (counted in the tier's stats), and the block is recomputed upstream.

``kvoffd/cache/tiers/manager.py`` (``Tiers``) is the only caller: it mirrors the index through the
index's observer seam and is what the server calls; adding a tier means implementing this protocol and
listing it in ``Tiers`` — no server change.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class TableRef:
    """Which blocks a key names: one (namespace, rank) of one layout. Two engines share blocks only if
    all of it agrees (the layout fingerprint keeps a restarted daemon from serving another model's
    bytes under the same key)."""

    namespace: str
    rank: int
    world_size: int
    layout: tuple[int, ...]

    @property
    def slot_bytes(self) -> int:
        return sum(self.layout)


class SpillResult(enum.Enum):
    """What happened to one spilled block (counted per tier)."""

    WRITTEN = "written"
    PRESENT = "present"  # already held (same key, same bytes): nothing written
    FULL = "full"  # no room (every slot busy, or the file system said ENOSPC/EFBIG)
    BUSY = "busy"  # the tier's write queue is full: dropped rather than delay promotions
    ERROR = "error"  # an I/O error
    CORRUPT = "corrupt"  # a block adopted at a warm restart whose bytes failed their checksum: never spilled


@dataclass
class TierStats:
    """One tier's figures: ``kvoffctl status`` prints them, the metrics collector exports them."""

    name: str
    capacity_bytes: int = 0
    resident_bytes: int = 0
    resident_blocks: int = 0
    hits: int = 0  # blocks a LOOKUP found here (after the DRAM hits)
    promotions: int = 0  # blocks read back into the pool, verified
    promotion_failures: int = 0  # reads that failed (I/O error, short read, checksum): misses
    spills: int = 0  # blocks written
    spills_dropped: dict[str, int] = field(default_factory=dict)  # by SpillResult value (full, busy, error)
    evictions: int = 0  # blocks dropped to make room for newer ones
    admissions_refused: int = 0  # blocks its admission rule turned away (the disk tier keeps every spill)
    io_errors: int = 0  # failed system calls (read or write)
    checksum_failures: int = 0  # blocks whose bytes did not match their checksum on read
    read_bytes: int = 0
    write_bytes: int = 0
    index_bytes: int = 0  # memory of the tier's index
    # The spill path's own figures (kvoffd/cache/tiers/manager.py fills them; 0 for a tier on its own):
    staged_hits: int = 0  # promotions served from a spill still in flight (its pool slot), no read
    spill_copies: int = 0  # evicted blocks copied out on the loop (a STORE larger than the reserve kept ahead)
    promotions_no_room: int = 0  # blocks a LOOKUP answered as hits that were then not promoted (no slot, a false probe)
    spill_deferred_bytes: int = 0  # pool bytes held out of the pool now until their spill has read them
    spills_in_flight: int = 0  # blocks whose spill write has not landed yet (a lagging disk: it grows)
    notes: dict[str, str] = field(default_factory=dict)  # e.g. direct_io: "off (tmpfs)"

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["spills_dropped"] = dict(self.spills_dropped)
        d["notes"] = dict(self.notes)
        return d


@dataclass
class Held:
    """What a tier holds of one namespace: blocks and bytes over its ranks' tables, the world size its
    tables were written with and the ranks that have blocks here (with replicas, a run's first rank)."""

    blocks: int = 0
    bytes: int = 0
    world_size: int = 0
    ranks: set[int] = field(default_factory=set)


class TierEvents(Protocol):
    """Where a tier's changes go when the daemon publishes KV events (kvoffd/events/publisher.py)."""

    def tier_changed(self, medium: str, namespace: str, stored: list[bytes], removed: list[bytes]) -> None: ...

    def reopened(self, tier: Tier) -> None:
        """``tier`` holds blocks from before the restart (``reopened_namespaces``): announce them."""


class Tier(Protocol):
    """A tier of blocks below the pool. All methods are called on the event loop thread and return at
    once; ``read``/``write`` do their work elsewhere.

    KV events: ``medium`` names it on the stream; ``changed`` (set by ``Tiers.publish``, None: off) is
    told each change of what it holds, and ``mark_reopened`` (once, before serving), then
    ``reopened_namespaces``/``take_reopened`` hand out, once, the rank-0 blocks it found at start (see
    kvoffd/cache/tiers/disk.py)."""

    name: str
    medium: str
    changed: Callable[[TableRef, bytes, bytes], None] | None

    def mark_reopened(self) -> None: ...

    def reopened_namespaces(self) -> set[str]: ...

    def take_reopened(self, namespace: str, n: int) -> tuple[bytes, bool]: ...

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start threads/connections; futures are resolved on ``loop``."""

    def contains(self, table: TableRef, keys: bytes, touch: bool = False) -> np.ndarray:
        """A bool per 32-byte key of the binary ``keys``: held here now (vectorised; no I/O).
        ``touch``: the blocks were used above (evicted from the pool again): a hint for the tier's
        replacement policy. A read is a use by itself."""

    def probe(self, table: TableRef, keys: bytes) -> int:
        """How many of the leading 32-byte keys of ``keys`` may be held here: never fewer than are held,
        rarely more (a filter's false positive). What a LOOKUP is answered on, so it must be cheap (no
        I/O, no round trip: a remote tier keeps a local filter of what it wrote, or answers from
        ``contains``); the exact ``contains`` and the ``read`` follow, and a false "yes" costs a miss."""

    def read(self, table: TableRef, keys: bytes, dest: Sequence[memoryview]) -> asyncio.Future:
        """Fill ``dest[i]`` with block ``i``'s bytes; resolves to a bool array (True: verified). Reads
        are served before writes when the tier is busy."""

    def write(self, table: TableRef, keys: bytes, src: Sequence[memoryview],
              sums: Sequence[int] | None = None) -> asyncio.Future:
        """Keep block ``i`` = ``src[i]``; resolves to a list of :class:`SpillResult`, one per block. Best
        effort: dropping is always allowed. ``src`` are usually the evicted blocks' own pool slots, kept
        out of the pool until the future resolves: read them only until then, never write them.
        ``sums``: the blocks' pool checksums (``Entry.checksum``, -1 where none), for a tier whose
        values carry that checksum (the cluster tier); a tier with its own (the disk's crc32) ignores them."""

    def remove(self, table: TableRef, keys: bytes) -> None:
        """Forget these blocks (a read in flight still completes or fails cleanly)."""

    def clear(self, namespace: str) -> int:
        """Forget every block of ``namespace`` ("" = all); returns how many it held (the CLEAR's reply)."""

    def namespace_blocks(self) -> dict[str, Held]:
        """What each namespace has in this tier now (STATS' namespaces): cheap, no I/O, no scan of
        every block (an operator's ``kvoffctl namespaces`` runs on the loop)."""

    def stats(self) -> TierStats: ...

    def close(self) -> None:
        """Finish or drop queued work, make the index durable, release the files."""
