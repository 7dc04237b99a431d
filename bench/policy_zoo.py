"""The policies tried against kvoffd/cache/policy.py's default (issue 15 point 2), same interface.

Research code for bench/policy_sim.py: each class follows ``kvoffd.cache.policy.EvictionPolicy``
(see that module for the order of the calls). They lost on the conversation trace (docs/benchmarks.md
has every figure), so the daemon does not ship them. Textbook versions, adapted only where the
prefix cache differs from a page cache: ``parent_present=False`` is refused by the prefix-aware ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvoffd.cache.policy import AdaptiveDoorkeeper, GuardedDoorkeeper, Key


class _Base:
    name = "base"

    def __init__(self, capacity: int):
        self.capacity = capacity

    def on_lookup_miss(self, keys: Iterable[Key]) -> None:
        pass

    def on_remove(self, key: Key) -> None:
        raise NotImplementedError


class Doorkeeper(_Base):
    """LRU behind a plain doorkeeper: a block is admitted on its second request only (a ghost FIFO of
    ``ghost_factor`` x capacity first-time keys, fed by STORE offers), even while the cache has room."""

    name = "doorkeeper"

    def __init__(self, capacity: int, ghost_factor: float = 4.0):
        super().__init__(capacity)
        self._lru: OrderedDict[Key, None] = OrderedDict()
        self._seen: OrderedDict[Key, None] = OrderedDict()
        self._max = max(1, int(ghost_factor * capacity))

    def __len__(self) -> int:
        return len(self._lru)

    def admit(self, key: Key, parent_present: bool) -> bool:
        if self._seen.pop(key, 0) is None:
            return parent_present
        self._seen[key] = None
        if len(self._seen) > self._max:
            self._seen.popitem(last=False)
        return False

    def on_insert(self, key: Key, parent: Key | None) -> None:
        self._lru[key] = None

    def on_access(self, key: Key) -> None:
        self._lru[key] = None
        self._lru.move_to_end(key)

    def victim(self) -> Key | None:
        return self._lru.popitem(last=False)[0] if self._lru else None

    def on_remove(self, key: Key) -> None:
        self._lru.pop(key, None)


class TailFirstLRU(_Base):
    """Prefix-aware LRU: a LOAD's and a STORE's blocks are refreshed deepest first, so a prefix's head
    is always more recent than its tail and eviction takes chains from the tail (a block is worthless
    once its parent is gone); orphans are refused. Per-key calls cannot see a batch, so the policy
    defers the refresh: accesses and inserts of one request are queued and applied in reverse when
    the next request begins (``on_lookup_miss``) or a victim is needed."""

    name = "tail-first-lru"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._lru: OrderedDict[Key, None] = OrderedDict()
        self._batch: list[Key] = []

    def __len__(self) -> int:
        return len(self._lru)

    def _flush(self) -> None:
        lru = self._lru
        for k in reversed(self._batch):
            if k in lru:
                lru.move_to_end(k)
        self._batch.clear()

    def on_lookup_miss(self, keys: Iterable[Key]) -> None:
        self._flush()

    def admit(self, key: Key, parent_present: bool) -> bool:
        return parent_present

    def on_insert(self, key: Key, parent: Key | None) -> None:
        self._lru[key] = None
        self._batch.append(key)

    def on_access(self, key: Key) -> None:
        self._lru[key] = None
        self._batch.append(key)

    def victim(self) -> Key | None:
        self._flush()
        return self._lru.popitem(last=False)[0] if self._lru else None

    def on_remove(self, key: Key) -> None:
        self._lru.pop(key, None)


class TwoQueue(_Base):
    """Probation FIFO of a FIXED share ``probation`` of the capacity (first-time blocks) + protected
    LRU, with a ghost of first-time keys admitting straight to protected (2Q / SLRU with a doorkeeper).
    ``probation=0`` is a doorkeeper with a protected LRU; the adaptive default chooses the share."""

    name = "2q"

    def __init__(self, capacity: int, probation: float = 0.25, ghost_factor: float = 4.0):
        super().__init__(capacity)
        self.name = f"2q-{probation:g}"
        self._pc = probation * capacity
        self._p: OrderedDict[Key, None] = OrderedDict()
        self._q: OrderedDict[Key, None] = OrderedDict()
        self._seen: OrderedDict[Key, None] = OrderedDict()
        self._max = max(1, int(ghost_factor * capacity))
        self._promote: set[Key] = set()

    def __len__(self) -> int:
        return len(self._p) + len(self._q)

    def _ghost(self, key: Key) -> None:
        self._seen[key] = None
        if len(self._seen) > self._max:
            self._seen.popitem(last=False)

    def admit(self, key: Key, parent_present: bool) -> bool:
        if self._seen.pop(key, 0) is None and parent_present:  # asked for again
            self._promote.add(key)
            return True
        if parent_present and self._pc >= 1:
            return True
        self._ghost(key)
        return False

    def on_insert(self, key: Key, parent: Key | None) -> None:
        if key in self._promote:
            self._promote.discard(key)
            self._q[key] = None
        else:
            self._p[key] = None

    def on_access(self, key: Key) -> None:
        self._p.pop(key, None)
        self._q[key] = None
        self._q.move_to_end(key)

    def victim(self) -> Key | None:
        if self._p and (len(self._p) >= self._pc or not self._q):
            key = self._p.popitem(last=False)[0]
            self._ghost(key)
            return key
        return self._q.popitem(last=False)[0] if self._q else None

    def on_remove(self, key: Key) -> None:
        self._p.pop(key, None)
        self._q.pop(key, None)
        self._promote.discard(key)


class S3FIFO(_Base):
    """S3-FIFO (Yang et al., SOSP'23): small FIFO (10%), main FIFO with 2-bit frequencies and
    reinsertion, ghost FIFO of small's victims (main's size) admitting straight to main."""

    name = "s3-fifo"

    def __init__(self, capacity: int, small: float = 0.1):
        super().__init__(capacity)
        self._sc = max(1, int(small * capacity))
        self._s: OrderedDict[Key, None] = OrderedDict()
        self._m: OrderedDict[Key, None] = OrderedDict()
        self._g: OrderedDict[Key, None] = OrderedDict()
        self._f: dict[Key, int] = {}

    def __len__(self) -> int:
        return len(self._s) + len(self._m)

    def admit(self, key: Key, parent_present: bool) -> bool:
        return True

    def on_insert(self, key: Key, parent: Key | None) -> None:
        self._f[key] = 0
        if self._g.pop(key, 0) is None:
            self._m[key] = None
        else:
            self._s[key] = None

    def on_access(self, key: Key) -> None:
        f = self._f.get(key)
        if f is None:  # a handed-back victim
            self._f[key] = 0
            self._m[key] = None
        elif f < 3:
            self._f[key] = f + 1

    def victim(self) -> Key | None:
        while self._s or self._m:
            if self._s and (len(self._s) >= self._sc or not self._m):
                key = self._s.popitem(last=False)[0]
                if self._f[key] > 0:
                    self._f[key] = 0
                    self._m[key] = None
                    continue
                del self._f[key]
                self._g[key] = None
                if len(self._g) > self.capacity - self._sc:
                    self._g.popitem(last=False)
                return key
            key = self._m.popitem(last=False)[0]
            if self._f[key] > 0:
                self._f[key] -= 1
                self._m[key] = None
                continue
            del self._f[key]
            return key
        return None

    def on_remove(self, key: Key) -> None:
        self._s.pop(key, None)
        self._m.pop(key, None)
        self._f.pop(key, None)


class ARC(_Base):
    """ARC (Megiddo & Modha, FAST'03): T1 (seen once) / T2 (seen twice) LRUs, ghosts B1 / B2 steer the
    target size of T1. Admits everything."""

    name = "arc"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.p = 0.0
        self._t1: OrderedDict[Key, None] = OrderedDict()
        self._t2: OrderedDict[Key, None] = OrderedDict()
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def admit(self, key: Key, parent_present: bool) -> bool:
        if key in self._b1:
            self.p = min(self.capacity, self.p + max(1.0, len(self._b2) / len(self._b1)))
        elif key in self._b2:
            self.p = max(0.0, self.p - max(1.0, len(self._b1) / len(self._b2)))
        return True

    def on_insert(self, key: Key, parent: Key | None) -> None:
        if self._b1.pop(key, 0) is None or self._b2.pop(key, 0) is None:
            self._t2[key] = None
        else:
            self._t1[key] = None
        c = self.capacity
        while len(self._t1) + len(self._b1) > c and self._b1:
            self._b1.popitem(last=False)
        while len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * c and self._b2:
            self._b2.popitem(last=False)

    def on_access(self, key: Key) -> None:
        self._t1.pop(key, None)
        self._t2[key] = None
        self._t2.move_to_end(key)

    def victim(self) -> Key | None:
        if self._t1 and (len(self._t1) > self.p or not self._t2):
            key = self._t1.popitem(last=False)[0]
            self._b1[key] = None
        elif self._t2:
            key = self._t2.popitem(last=False)[0]
            self._b2[key] = None
        else:
            return None
        return key

    def on_remove(self, key: Key) -> None:
        self._t1.pop(key, None)
        self._t2.pop(key, None)


class _CountMin:
    """TinyLFU's frequency sketch: 4 rows of 4-bit-capped counters (width ~4 x capacity), a doorkeeper
    set in front, everything halved every 10 x capacity additions (aging)."""

    def __init__(self, capacity: int):
        width = 1 << max(6, (4 * capacity - 1).bit_length())
        self._mask = width - 1
        self._rows = [bytearray(width) for _ in range(4)]
        self._door: set[Key] = set()
        self._n = 0
        self._limit = 10 * max(1, capacity)

    def _slots(self, key: Key) -> list[int]:
        h = hash(key)
        return [((h * (2 * i + 0x9E3779B1)) >> (i * 7)) & self._mask for i in range(4)]

    def add(self, key: Key) -> None:
        if key not in self._door:
            self._door.add(key)
        else:
            for row, j in zip(self._rows, self._slots(key), strict=True):
                if row[j] < 15:
                    row[j] += 1
        self._n += 1
        if self._n >= self._limit:
            self._n //= 2
            self._door.clear()
            self._rows = [bytearray(v >> 1 for v in row) for row in self._rows]

    def estimate(self, key: Key) -> int:
        base = min(row[j] for row, j in zip(self._rows, self._slots(key), strict=True))
        return base + (key in self._door)


class WTinyLFU(_Base):
    """W-TinyLFU (Einziger et al., 2017; Caffeine): a window LRU (``window`` share) in front of an SLRU
    main (80% protected); a window victim enters main only if the sketch (fed by every lookup key)
    says it is more frequent than main's victim."""

    name = "w-tinylfu"

    def __init__(self, capacity: int, window: float = 0.01):
        super().__init__(capacity)
        self.name = "w-tinylfu" if window == 0.01 else f"w-tinylfu-{window:g}"
        self._wc = max(1, int(capacity * window))
        self._w: OrderedDict[Key, None] = OrderedDict()
        self._prob: OrderedDict[Key, None] = OrderedDict()
        self._prot: OrderedDict[Key, None] = OrderedDict()
        self._protc = int((capacity - self._wc) * 0.8)
        self._sketch = _CountMin(capacity)

    def __len__(self) -> int:
        return len(self._w) + len(self._prob) + len(self._prot)

    def on_lookup_miss(self, keys: Iterable[Key]) -> None:
        for k in keys:
            self._sketch.add(k)

    def admit(self, key: Key, parent_present: bool) -> bool:
        return True

    def on_insert(self, key: Key, parent: Key | None) -> None:
        self._w[key] = None

    def on_access(self, key: Key) -> None:
        self._sketch.add(key)
        if key in self._w:
            self._w.move_to_end(key)
        elif key in self._prob:
            del self._prob[key]
            self._prot[key] = None
            if len(self._prot) > self._protc:
                self._prob[self._prot.popitem(last=False)[0]] = None
        else:
            self._prot[key] = None
            self._prot.move_to_end(key)

    def victim(self) -> Key | None:
        main = self.capacity - self._wc
        while len(self._w) > self._wc and len(self._prob) + len(self._prot) < main:
            self._prob[self._w.popitem(last=False)[0]] = None
        if len(self._w) > self._wc or not (self._prob or self._prot):
            if not self._w:
                return None
            cand = self._w.popitem(last=False)[0]
            src = self._prob if self._prob else self._prot
            if not src:
                return cand
            other = next(iter(src))
            if self._sketch.estimate(cand) > self._sketch.estimate(other):
                del src[other]
                self._prob[cand] = None
                return other
            return cand
        src = self._prob if self._prob else self._prot
        return src.popitem(last=False)[0]

    def on_remove(self, key: Key) -> None:
        for d in (self._w, self._prob, self._prot):
            d.pop(key, None)


def zoo() -> dict[str, type | object]:
    """name -> factory(capacity) for every policy bench/policy_sim.py runs (the default included)."""
    return {
        "doorkeeper": Doorkeeper,
        "tail-first-lru": TailFirstLRU,
        "2q-0.05": lambda c: TwoQueue(c, 0.05),
        "2q-0.5": lambda c: TwoQueue(c, 0.5),
        "s3-fifo": S3FIFO,
        "arc": ARC,
        "w-tinylfu": WTinyLFU,
        "w-tinylfu-0.2": lambda c: WTinyLFU(c, 0.2),
        "adaptive-doorkeeper": AdaptiveDoorkeeper,
        "guarded-doorkeeper": GuardedDoorkeeper,
    }
