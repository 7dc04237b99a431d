"""The block pool: one large host allocation carved into fixed-size slots.

One slot holds one block of one rank (every layer, K and V). Engines of different models have
different block sizes, so the pool hands out memory in chunks (64 MiB by default) and each chunk is
cut into slots of one size only (a slab per slot size). A slot is named by its byte offset in the
pool, which is all a transfer backend needs (``base + offset``).

The allocation is an anonymous private mapping (huge pages where the kernel gives them): it costs
nothing until touched, so the daemon is ready at once whatever the pool size. A backend that needs
the memory pinned (CUDA) makes chunks usable as it pins them (``set_usable_bytes``); until then only
usable chunks are handed out.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_CHUNK = 64 << 20


@dataclass
class _Slab:
    slot_bytes: int
    free: list[int] = field(default_factory=list)  # slot offsets, LIFO (warm memory first)
    chunks: list[int] = field(default_factory=list)  # chunk indices owned
    used: int = 0  # slots handed out


class Pool:
    def __init__(self, nbytes: int, chunk_bytes: int = DEFAULT_CHUNK):
        if nbytes < chunk_bytes:
            chunk_bytes = max(mmap.PAGESIZE, nbytes - nbytes % mmap.PAGESIZE)
        self.chunk_bytes = chunk_bytes
        self.num_chunks = nbytes // chunk_bytes
        self.nbytes = self.num_chunks * chunk_bytes
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.buffer = np.frombuffer(self._map, dtype=np.uint8)
        self.base_address = self.buffer.ctypes.data
        self._free_chunks: list[int] = list(range(self.num_chunks - 1, -1, -1))
        self._usable_chunks = self.num_chunks
        self._slabs: dict[int, _Slab] = {}
        self.pinned_bytes = 0

    # --- capacity ---------------------------------------------------------------------------------
    def set_usable_bytes(self, nbytes: int) -> None:
        """Only the first ``nbytes`` may be handed out (the rest is still being pinned)."""
        self._usable_chunks = min(self.num_chunks, nbytes // self.chunk_bytes)

    @property
    def capacity_bytes(self) -> int:
        return self._usable_chunks * self.chunk_bytes

    @property
    def used_bytes(self) -> int:
        return sum(s.used * s.slot_bytes for s in self._slabs.values())

    @property
    def free_chunk_bytes(self) -> int:
        """The largest allocation of any slot size that can still be made without eviction."""
        return sum(1 for c in self._free_chunks if c < self._usable_chunks) * self.chunk_bytes

    def slots_capacity(self, slot_bytes: int) -> int:
        """How many slots of this size the pool could hold if it held nothing else."""
        per_chunk = self.chunk_bytes // slot_bytes
        return per_chunk * self._usable_chunks

    # --- allocation ---------------------------------------------------------------------------------
    def alloc(self, slot_bytes: int, n: int) -> list[int]:
        """Up to ``n`` free slot offsets of ``slot_bytes``; fewer when the pool is full (caller evicts)."""
        if slot_bytes > self.chunk_bytes:
            return []
        slab = self._slabs.get(slot_bytes)
        if slab is None:
            slab = self._slabs[slot_bytes] = _Slab(slot_bytes)
        while len(slab.free) < n and self._grow(slab):
            pass
        take = min(n, len(slab.free))
        if take == 0:
            return []
        out = slab.free[-take:]
        del slab.free[-take:]
        out.reverse()  # ascending offsets when freshly carved: neighbours coalesce into one copy run
        slab.used += take
        return out

    def free(self, slot_bytes: int, offsets: list[int]) -> None:
        if not offsets:
            return
        slab = self._slabs[slot_bytes]
        slab.free.extend(offsets)
        slab.used -= len(offsets)

    def _grow(self, slab: _Slab) -> bool:
        for i in range(len(self._free_chunks) - 1, -1, -1):
            c = self._free_chunks[i]
            if c < self._usable_chunks:
                del self._free_chunks[i]
                break
        else:
            return self._steal_empty_chunk(slab)
        slab.chunks.append(c)
        start = c * self.chunk_bytes
        per = self.chunk_bytes // slab.slot_bytes
        # pushed in reverse so pops come out ascending
        slab.free.extend(range(start + (per - 1) * slab.slot_bytes, start - 1, -slab.slot_bytes))
        return True

    def _steal_empty_chunk(self, slab: _Slab) -> bool:
        """Reclaim a chunk that another slot size no longer uses at all."""
        for other in self._slabs.values():
            if other is slab or not other.chunks:
                continue
            per = self.chunk_bytes // other.slot_bytes
            free_set = set(other.free)
            for c in other.chunks:
                start = c * self.chunk_bytes
                members = range(start, start + per * other.slot_bytes, other.slot_bytes)
                if all(m in free_set for m in members):
                    other.chunks.remove(c)
                    member_set = set(members)
                    other.free = [f for f in other.free if f not in member_set]
                    self._free_chunks.append(c)
                    return self._grow(slab)
        return False

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.buffer[offset: offset + nbytes]

    def stats(self) -> dict[str, int]:
        return {
            "capacity_bytes": self.capacity_bytes,
            "total_bytes": self.nbytes,
            "used_bytes": self.used_bytes,
            "pinned_bytes": self.pinned_bytes,
            "free_chunk_bytes": self.free_chunk_bytes,
        }

    def close(self) -> None:
        self.buffer = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere (tests); the OS reclaims at exit
            log.debug("pool mapping still referenced at close")
