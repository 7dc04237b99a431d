"""The block pool: one large host allocation carved into fixed-size slots.

One slot holds one block of one rank (every layer, K and V). Engines of different models have
different block sizes, so the pool hands out memory in chunks (64 MiB by default) and each chunk is
cut into slots of one size only (a slab per slot size). A slot is named by its byte offset in the
pool, which is all a transfer backend needs (``base + offset``).

Cost is proportional to the blocks held, never to the pool or chunk size: a chunk is carved lazily
(a bump pointer, plus a free list of the slots given back), so handing out one slot of a fresh chunk
costs the same whatever the slot size. A chunk that holds nothing any more goes back to the free
chunks at once, for any slot size to take.

Sharing between slot sizes (several models on one node): a slot size that needs memory when no chunk
is free may take a whole chunk from another slot size that holds more than its fair share
(``reclaim_victim``). The index empties the chunk (it knows which entries live there and which are
pinned) while the pool keeps it closed to new slots (``begin_drain``); when its last slot is given
back it goes straight to the slot size that asked for it.

The memory is either a region of a shared file mapping that outlives the process (the persistent pool,
kvoffd/pool/file.py: a warm restart adopts its slots with ``adopt_slots``) or an anonymous
private mapping (huge pages where the kernel gives them, ``--pool-path none``). Either costs nothing
until touched, so the daemon is ready at once whatever the pool size.

NUMA shards (kvoffd/pool/shards.py): the chunks are split into contiguous ranges, one per NUMA node
(``shards``; one shard covering every chunk when none are given: the pool as it always was). Each
shard keeps its own free chunks and each slab its own chunks with room per shard; ``alloc`` takes from
the asked-for shard first and, when that one is full, from the others nearest first (``spilled``,
counted), so a store never fails for want of room on its node while another node has some. Eviction
stays global (the index decides what goes); the slots it frees serve whichever shard they are on.

The size asked for is the size served: a pool is a whole number of chunks, or (below one chunk) one
chunk of exactly its size, and any other size is refused with one line (``pool_geometry``, kvoffd/pool/format.py) rather
than silently rounded down (a pool is never smaller than asked). A backend that needs
the memory pinned (CUDA) makes chunks usable as it pins them (``set_usable_bytes``); until then only
usable chunks are handed out.
"""

from __future__ import annotations

import heapq
import logging
import mmap
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from kvoffd.pool.format import DEFAULT_CHUNK, MIN_SLOT_BYTES, pool_geometry
from kvoffd.pool.private import reserve_private
from kvoffd.pool.shards import Shard, single_shard

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_CHUNK", "MIN_SLOT_BYTES", "Pool", "SlabStats", "pool_geometry"]
# A slot size that allocated within this many seconds counts as a user of the pool when fair shares
# are computed; an idle one (its model gone) has no share and is the first to give chunks back.
ACTIVE_S = 60.0


@dataclass
class _Chunk:
    """One chunk's state. ``carved`` slots have been cut from its start (the bump pointer); of those,
    ``free`` were given back and ``live`` are held. ``drain_for`` > 0: the chunk is being emptied for
    that slot size and hands out nothing meanwhile."""

    index: int
    shard: int = 0
    slot_bytes: int = 0  # 0: free
    carved: int = 0
    live: int = 0
    free: list[int] = field(default_factory=list)  # slot offsets given back, LIFO (warm memory first)
    drain_for: int = 0


@dataclass
class _Slab:
    slot_bytes: int
    room: list[dict[int, None]]  # per shard: owned chunks that can hand out a slot (ordered sets)
    chunks: set[int] = field(default_factory=set)  # chunk indices owned
    by_age: dict[int, None] = field(default_factory=dict)  # owned chunks, least recently allocated from first
    used: int = 0  # slots handed out
    demand_at: float = 0.0  # monotonic time of the last allocation asked for


@dataclass(frozen=True)
class SlabStats:
    slot_bytes: int
    chunks: int
    used_slots: int


class Provisioned:
    """How much of the pool's memory exists yet, told to threads: a pool file's data segments are
    allocated in the background (kvoffd/pool/file.py), and the pinning threads
    (kvoffd/transfer/pinning.py) touch a range only once it is allocated, because touching a page
    the filesystem has not allocated allocates it on the spot, contends with the allocating thread and
    raises SIGBUS when the filesystem is full. Private memory is provisioned whole from the start."""

    def __init__(self, nbytes: int, total: int):
        self._cond = threading.Condition()
        self.nbytes = nbytes
        self.total = total
        self.ended_short = False  # the allocation stopped before ``total`` (ENOSPC, daemon stopping)

    def advance(self, nbytes: int) -> None:
        with self._cond:
            self.nbytes = max(self.nbytes, nbytes)
            self._cond.notify_all()

    def end(self) -> None:
        """No more is coming (allocation done, failed or stopped): waiters beyond it give up."""
        with self._cond:
            self.ended_short = self.nbytes < self.total
            self._cond.notify_all()

    def wait_for(self, end: int, cancel: threading.Event) -> bool:
        """Block until the first ``end`` bytes exist (True), or they never will / ``cancel`` is set."""
        with self._cond:
            while self.nbytes < end:
                if self.ended_short or cancel.is_set():
                    return False
                self._cond.wait(0.1)
            return True


class Pool:
    def __init__(self, nbytes: int, chunk_bytes: int = DEFAULT_CHUNK, mapping: mmap.mmap | None = None,
                 offset: int = 0, shards: list[Shard] | None = None):
        """``mapping``: a shared file mapping holding the pool at ``offset`` (the persistent pool);
        None: private anonymous memory reserved here. ``shards``: contiguous chunk ranges covering the
        pool in order (kvoffd/pool/shards.py ``plan_shards``; None: one). ValueError for a size
        ``pool_geometry`` refuses or shards that do not tile the chunks."""
        self.chunk_bytes, self.num_chunks = pool_geometry(nbytes, chunk_bytes)
        self.nbytes = nbytes
        self.persistent = mapping is not None  # touched by reading, never writing (kvoffd/transfer/pinning.py)
        self._map = mapping if mapping is not None else reserve_private(self.nbytes)
        self.buffer = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=offset)
        self.base_address = self.buffer.ctypes.data
        self.shards = shards or single_shard(self.num_chunks)
        ends = [0] + [s.end_chunk for s in self.shards]
        if any(s.index != i or s.first_chunk != ends[i] or s.num_chunks < 1 for i, s in enumerate(self.shards)) \
                or ends[-1] != self.num_chunks:
            raise ValueError(f"shards {[(s.first_chunk, s.num_chunks) for s in self.shards]} do not tile "
                             f"{self.num_chunks} chunks")
        self._chunks = [_Chunk(i, s.index) for s in self.shards for i in range(s.first_chunk, s.end_chunk)]
        self._free: list[list[int]] = [list(range(s.first_chunk, s.end_chunk)) for s in self.shards]  # min-heaps
        # where alloc looks, by asked-for shard (-1: no preference, low chunks first as ever)
        self._order: dict[int, tuple[int, ...]] = {-1: tuple(range(len(self.shards)))}
        for s in self.shards:
            self._order[s.index] = (s.index, *s.near, *(t.index for t in self.shards
                                                       if t.index != s.index and t.index not in s.near))
        self.spilled = [0] * len(self.shards)  # slots handed out on another shard than asked, by asker
        self.chunk_node = np.array([self.shards[c.shard].node for c in self._chunks], dtype=np.int16)  # chunk -> node
        self._usable_chunks = self.num_chunks
        self._pinned_chunks = self._allocated_chunks = self.num_chunks  # usable = the smaller of the two
        self._slabs: dict[int, _Slab] = {}
        self.pinned_bytes = 0
        self.reclaimed_chunks = 0  # chunks handed from one slot size to another by a drain
        self.provisioned = Provisioned(nbytes, nbytes)  # a pool file's keeper lowers it while allocating

    # --- capacity ---------------------------------------------------------------------------------
    def set_usable_bytes(self, nbytes: int) -> None:
        """Only the first ``nbytes`` may be handed out (the rest is still being pinned)."""
        self._pinned_chunks = min(self.num_chunks, nbytes // self.chunk_bytes)
        self._usable_chunks = min(self._pinned_chunks, self._allocated_chunks)

    def set_allocated_bytes(self, nbytes: int) -> None:
        """Only the first ``nbytes`` are backed by the pool file so far (it is allocated in the
        background: kvoffd/pool/file.py); a slot beyond them could SIGBUS on a full filesystem."""
        self._allocated_chunks = min(self.num_chunks, nbytes // self.chunk_bytes)
        self._usable_chunks = min(self._pinned_chunks, self._allocated_chunks)

    @property
    def capacity_bytes(self) -> int:
        return self._usable_chunks * self.chunk_bytes

    @property
    def used_bytes(self) -> int:
        return sum(s.used * s.slot_bytes for s in self._slabs.values())

    @property
    def free_chunk_bytes(self) -> int:
        """The largest allocation of any slot size that can still be made without eviction."""
        return self._free_usable() * self.chunk_bytes

    def _free_usable(self, shard: int = -1) -> int:
        """Free chunks that are usable now (of one shard, or all)."""
        heaps = self._free if shard < 0 else [self._free[shard]]
        if self._usable_chunks == self.num_chunks:
            return sum(map(len, heaps))
        return sum(1 for heap in heaps for c in heap if c < self._usable_chunks)

    def shard_of(self, offset: int) -> int:
        """The shard a slot (byte offset) lies in."""
        return self._chunks[offset // self.chunk_bytes].shard

    def slots_share(self, slot_bytes: int) -> int:
        """How many slots of this size the pool holds for it now: its chunks plus the free usable ones,
        or its fair share of the usable chunks if that is more (a size below its share takes chunks
        from the others as it stores: Reclaimer.reclaim). An eviction policy's capacity."""
        slab = self._slabs.get(slot_bytes)
        mine = len(slab.chunks) if slab is not None else 0
        free = self._free_usable()
        now = time.monotonic()
        active = sum(1 for s in self._slabs.values() if s is slab or now - s.demand_at <= ACTIVE_S)
        fair = self._usable_chunks // (active + (slab is None))
        return (self.chunk_bytes // slot_bytes) * max(mine + free, fair)

    # --- allocation ---------------------------------------------------------------------------------
    def _slab(self, slot_bytes: int) -> _Slab:
        slab = self._slabs.get(slot_bytes)
        if slab is None:
            slab = self._slabs[slot_bytes] = _Slab(slot_bytes, [{} for _ in self.shards])
        return slab

    def alloc(self, slot_bytes: int, n: int, shard: int = -1) -> list[int]:
        """Up to ``n`` free slot offsets of ``slot_bytes``; fewer when the pool is full (caller evicts).
        ``shard``: the shard to place them on (the storing engine's node; -1: none preferred); a full
        shard spills to the others, nearest first, counted in ``spilled``.

        Costs O(n): slots given back are reused first, then fresh ones are cut from the bump pointer
        (consecutive offsets, so neighbours coalesce into one copy run), then a free chunk is taken.
        """
        if slot_bytes > self.chunk_bytes or slot_bytes <= 0:
            return []
        slab = self._slab(slot_bytes)
        slab.demand_at = time.monotonic()
        out: list[int] = []
        per = self.chunk_bytes // slot_bytes
        for s in self._order.get(shard, self._order[-1]):
            room = slab.room[s]
            before = len(out)
            while len(out) < n:
                if room:
                    ch = self._chunks[next(reversed(room))]
                else:
                    ch = self._take_free_chunk(slab, s)
                    if ch is None:
                        break
                self._carve(ch, per, n - len(out), out)
                del slab.by_age[ch.index]
                slab.by_age[ch.index] = None
                if not ch.free and ch.carved == per:
                    del room[ch.index]
            if s != shard and shard >= 0:
                self.spilled[shard] += len(out) - before
            if len(out) >= n:
                break
        slab.used += len(out)
        return out

    def spare_slots(self, slot_bytes: int, upto: int, shard: int = -1) -> int:
        """How many slots of this size ``alloc`` could hand out now without evicting (on one shard,
        or anywhere), counted up to ``upto`` (bounded work: stops there). Changes nothing."""
        slab = self._slabs.get(slot_bytes)
        per = self.chunk_bytes // slot_bytes if 0 < slot_bytes <= self.chunk_bytes else 0
        n = 0
        rooms = () if slab is None else slab.room if shard < 0 else [slab.room[shard]]
        for room in rooms:
            for c in room:
                ch = self._chunks[c]
                n += len(ch.free) + per - ch.carved
                if n >= upto:
                    return upto
        return min(upto, n + self._free_usable(shard) * per)

    def _carve(self, ch: _Chunk, per: int, k: int, out: list[int]) -> None:
        size = ch.slot_bytes
        take = min(k, len(ch.free))
        if take:
            out += ch.free[-take:]
            del ch.free[-take:]
        fresh = min(k - take, per - ch.carved)
        if fresh:
            start = ch.index * self.chunk_bytes + ch.carved * size
            out += range(start, start + fresh * size, size)
            ch.carved += fresh
        ch.live += take + fresh

    def _take_free_chunk(self, slab: _Slab, shard: int) -> _Chunk | None:
        heap = self._free[shard]
        if not heap or heap[0] >= self._usable_chunks:
            return None
        ch = self._chunks[heapq.heappop(heap)]
        self._assign(ch, slab)
        return ch

    def _assign(self, ch: _Chunk, slab: _Slab) -> None:
        """A free chunk joins ``slab``: carved into its slot size from empty."""
        ch.slot_bytes, ch.carved, ch.live, ch.free, ch.drain_for = slab.slot_bytes, 0, 0, [], 0
        slab.chunks.add(ch.index)
        slab.room[ch.shard][ch.index] = None
        slab.by_age[ch.index] = None

    def free(self, slot_bytes: int, offsets: list[int]) -> None:
        """Give slots back. A chunk left holding nothing is released at once (to the slot size it is
        being drained for, or to the free chunks)."""
        if not offsets:
            return
        chunks, cb = self._chunks, self.chunk_bytes
        slab = self._slabs[slot_bytes]
        slab.used -= len(offsets)
        for off in offsets:
            ch = chunks[off // cb]
            ch.free.append(off)
            ch.live -= 1
            if ch.live == 0:
                self._release(ch, slab)
            elif not ch.drain_for and ch.index not in slab.room[ch.shard]:
                slab.room[ch.shard][ch.index] = None

    def _release(self, ch: _Chunk, slab: _Slab) -> None:
        slab.chunks.discard(ch.index)
        slab.room[ch.shard].pop(ch.index, None)
        slab.by_age.pop(ch.index, None)
        target = self._slabs.get(ch.drain_for) if ch.drain_for else None
        if target is not None and target is not slab:
            self._assign(ch, target)
            self.reclaimed_chunks += 1
            return
        ch.slot_bytes, ch.carved, ch.free, ch.drain_for = 0, 0, [], 0
        heapq.heappush(self._free[ch.shard], ch.index)

    # --- sharing between slot sizes -------------------------------------------------------------------
    def reclaim_victim(self, slot_bytes: int) -> int:
        """The slot size that should give a chunk to ``slot_bytes``, or 0 if none should.

        Fair share: the usable chunks split evenly among the slot sizes in use (those that asked for
        slots within ``ACTIVE_S``, and the asker). The asker, below its share, may take a chunk from
        a size above its share that holds at least two chunks more than the asker; after the move
        the giver still holds at least as many as the asker, so a chunk never moves back and forth.
        An idle size (its model gone) has no share and gives its chunks to anyone who asks. The giver
        is the size furthest above its share. With fewer chunks than sizes some sizes get none.
        """
        me = self._slabs.get(slot_bytes)
        if me is None:
            return 0
        now = time.monotonic()
        active = [s for s in self._slabs.values() if s is me or now - s.demand_at <= ACTIVE_S]
        fair = self._usable_chunks / len(active)
        mine = len(me.chunks)
        if mine >= fair:
            return 0
        best, excess = 0, 0.0
        for s in self._slabs.values():
            have = len(s.chunks)
            if s is me or not have:
                continue
            if s in active:
                over = have - fair
                if over <= 0 or have - mine < 2:
                    continue
            else:
                over = float(have)
            if over > excess:
                best, excess = s.slot_bytes, over
        return best

    def oldest_chunks(self, slot_bytes: int, k: int) -> list[int]:
        """Up to ``k`` chunks of this slot size that are not draining, least recently allocated
        from first: their blocks are the oldest, and none of them holds the blocks just stored (a
        chunk refilled from slots LRU eviction gave back holds the newest and the oldest at once)."""
        slab = self._slabs.get(slot_bytes)
        out: list[int] = []
        if slab is None:
            return out
        for c in slab.by_age:
            if not self._chunks[c].drain_for:
                out.append(c)
                if len(out) == k:
                    break
        return out

    def chunks_of(self, slot_bytes: int) -> list[int]:
        slab = self._slabs.get(slot_bytes)
        return sorted(slab.chunks) if slab else []

    def chunk_of(self, offset: int) -> int:
        return offset // self.chunk_bytes

    def chunk_live(self, chunk: int) -> int:
        return self._chunks[chunk].live

    def carved_slots(self, chunk: int) -> range:
        """Every slot offset ever cut from this chunk since it was last taken (held or given back)."""
        ch = self._chunks[chunk]
        start = chunk * self.chunk_bytes
        return range(start, start + ch.carved * ch.slot_bytes, ch.slot_bytes or 1)

    def begin_drain(self, chunk: int, for_slot_bytes: int) -> None:
        """Hand out nothing more from this chunk; once empty it goes to ``for_slot_bytes``."""
        ch = self._chunks[chunk]
        ch.drain_for = for_slot_bytes
        self._slabs[ch.slot_bytes].room[ch.shard].pop(chunk, None)

    def end_drain(self, chunk: int) -> None:
        """Give up emptying this chunk (its remaining blocks stay pinned): it serves its slab again."""
        ch = self._chunks[chunk]
        if not ch.drain_for or not ch.slot_bytes:
            return
        ch.drain_for = 0
        if ch.free or ch.carved < self.chunk_bytes // ch.slot_bytes:
            self._slabs[ch.slot_bytes].room[ch.shard][chunk] = None

    def draining(self, chunk: int) -> bool:
        return self._chunks[chunk].drain_for != 0

    def adopt_slots(self, slot_bytes: int, offsets: np.ndarray) -> None:
        """Mark ``offsets`` (slots of ``slot_bytes``, sorted, each chunk free so far) as held: the slots a
        warm restart found committed. Each chunk is rebuilt as if carved up to its last held slot, the
        gaps being its free list. ValueError (and nothing changed) for slots that cannot be this pool's."""
        cb = self.chunk_bytes
        if not 0 < slot_bytes <= cb or not len(offsets):
            raise ValueError(f"no slots of {slot_bytes} bytes to adopt")
        chunk = offsets // cb
        inner = offsets - chunk * cb
        if (inner % slot_bytes).any() or offsets[-1] + slot_bytes > self.nbytes or (np.diff(offsets) <= 0).any():
            raise ValueError(f"slots of {slot_bytes} bytes at offsets that are not this pool's")
        wanted = np.unique(chunk)
        if any(self._chunks[c].slot_bytes for c in wanted.tolist()):
            raise ValueError("slots adopted into a chunk already in use")
        slab = self._slab(slot_bytes)
        per = cb // slot_bytes
        bounds = np.searchsorted(chunk, wanted, side="right")
        start = 0
        for c, end in zip(wanted.tolist(), bounds.tolist(), strict=True):
            held = inner[start:end] // slot_bytes  # sorted, distinct
            ch = self._chunks[c]
            self._assign(ch, slab)
            ch.carved = int(held[-1]) + 1
            ch.live = len(held)
            gap = np.ones(ch.carved, dtype=bool)
            gap[held] = False
            ch.free = (c * cb + np.flatnonzero(gap)[::-1] * slot_bytes).tolist()
            if not ch.free and ch.carved == per:
                del slab.room[ch.shard][c]
            start = end
        slab.used += len(offsets)
        taken = set(wanted.tolist())
        for heap in self._free:
            heap[:] = [c for c in heap if c not in taken]
            heapq.heapify(heap)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.buffer[offset: offset + nbytes]

    def slab_stats(self) -> list[SlabStats]:
        return [SlabStats(s.slot_bytes, len(s.chunks), s.used) for s in sorted(self._slabs.values(),
                                                                             key=lambda s: s.slot_bytes)
                if s.chunks or s.used]

    def shard_stats(self) -> list[dict]:
        """Per shard: its node, chunks, bytes usable and used, and the slots it had to spill elsewhere
        (STATS, /metrics). Costs one pass over the chunks: read at STATS and scrape time only."""
        used = [0] * len(self.shards)
        for ch in self._chunks:
            if ch.live:
                used[ch.shard] += ch.live * ch.slot_bytes
        cb, usable = self.chunk_bytes, self._usable_chunks
        return [{"shard": s.index, "node": s.node, "first_chunk": s.first_chunk, "chunks": s.num_chunks,
                 "bound": s.bound, "capacity_bytes": max(0, min(s.end_chunk, usable) - s.first_chunk) * cb,
                 "used_bytes": used[s.index], "free_chunk_bytes": self._free_usable(s.index) * cb,
                 "spilled_slots": self.spilled[s.index]} for s in self.shards]

    def stats(self) -> dict:
        return {
            "capacity_bytes": self.capacity_bytes,
            "total_bytes": self.nbytes,
            "used_bytes": self.used_bytes,
            "pinned_bytes": self.pinned_bytes,
            "free_chunk_bytes": self.free_chunk_bytes,
            "reclaimed_chunks": self.reclaimed_chunks,
            "shards": self.shard_stats(),
            "slabs": [{"slot_bytes": s.slot_bytes, "chunks": s.chunks, "used_slots": s.used_slots}
                      for s in self.slab_stats()],
        }

    def close(self) -> None:
        self.buffer = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere (tests); the OS reclaims at exit
            log.debug("pool mapping still referenced at close")
