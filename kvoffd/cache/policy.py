"""Admission and eviction policies for a tier of KV blocks, behind one small interface.

The index owns the blocks (slots, refs, visibility); a policy only decides *which* key to store and
*which* key to drop, from events the index reports. Every call is O(1) per block (dict and
OrderedDict operations in C, no scans), and a policy's memory is bounded by its capacity (ghost lists
are a fixed multiple of it), so the same policy can sit in front of a DRAM pool or a disk tier.

How the index drives a policy (the order ``bench/policy_sim.py`` replays; kvoffd/cache/index.py with
``--eviction-policy``, ``lru`` included: the index has no other LRU; the index passes no keys to
``on_lookup_miss``, which no policy here reads):

* LOOKUP: ``on_lookup_miss(keys)`` with the keys past the hit prefix, on every LOOKUP (empty when
  all hit): the default takes it as the start of a request for its shadows' prefix accounting.
* LOAD done: ``on_access(key)`` for each loaded block, in key order.
* STORE: ``on_access(key)`` for each named key already resident; then, for each key not resident, in
  key order, ``admit(key, parent_present)`` (``parent_present``: the previous key of the prefix is
  resident or admitted earlier in this STORE, or the key is a prefix's first); for each slot it needs,
  ``victim()``; then ``on_insert(key, parent)`` for each block it really placed, and
  ``on_remove(key)`` for each admitted key that found no room (dropped from the end).
* A block dropped for any other reason (CLEAR, found corrupt): ``on_remove(key)``.

A refused ``admit`` means the STORE skips that block: no slot, no copy (the index reports it as
dropped, as it does a block that finds no room).

``victim()`` hands a key over: the policy forgets it at once (it may remember it in a ghost list). An
index that cannot evict that key (held by a LOAD or a lease: a ref) keeps it and gives it back with
``on_access(key)`` when its last ref drops: a key the policy does not track is then tracked again as
just used.

A warm restart's blocks are tracked with ``on_insert`` in their last-use order, oldest first, or with
``on_insert_oldest(keys)`` when they are older than every block tracked already (a slice of older
blocks adopted after newer ones). A policy that admits every block says so (``admits_all``): the index
then does not ask it key by key.

Policies:

* :class:`LRU` — least recently used, admitting everything (the pool's policy under a disk tier).
* :class:`AdaptiveDoorkeeper` — admits a block on its second request; a probation segment for
  first-time blocks is sized by ghost hits.
* :class:`GuardedDoorkeeper` — the default: the adaptive doorkeeper, turned into plain LRU while a
  sampled LRU shadow beats a sampled doorkeeper shadow. docs/benchmarks.md ("Admission and
  eviction policies") has every policy tried, at every capacity, on the conversation trace and on
  synthetic traces; bench/policy_sim.py reproduces it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator
from enum import StrEnum
from typing import Protocol

Key = Hashable


class DiskPolicy(StrEnum):
    """The disk tier's replacement policies (kvoffd/cache/tiers/disk.py), named here with the pool's so
    that the configuration can list them without importing the tier; the first is the default."""

    CLOCK2_GHOST = "clock2-ghost"
    CLOCK2 = "clock2"


DISK_POLICIES = tuple(p.value for p in DiskPolicy)


class RemotePublish(StrEnum):
    """When the cluster tier (kvoffd/cache/tiers/remote/) receives a block; the first is the default.

    * ``admitted``: written behind as the pool admits it, so that another node finds it within
      milliseconds while it is still in this node's pool (disaggregated prefill, KV-aware routers);
      the cluster then also holds a copy of every block the nodes' pools hold.
    * ``evicted``: written as it leaves the pool (the disk tier's rule), so that the cluster holds
      what no pool does: more distinct blocks for the same memory, but another node sees a block
      only once this node evicted it. docs/benchmarks.md (*Cluster tier*) measures both.
    """

    ADMITTED = "admitted"
    EVICTED = "evicted"


class EvictionPolicy(Protocol):
    """What the index calls; see the module docstring for the order of the calls."""

    name: str
    capacity: int
    admits_all: bool

    def on_lookup_miss(self, keys: Iterable[Key]) -> None: ...

    def admit(self, key: Key, parent_present: bool) -> bool: ...

    def on_insert(self, key: Key, parent: Key | None) -> None: ...

    def on_insert_oldest(self, keys: Iterable[Key]) -> None: ...

    def on_access(self, key: Key) -> None: ...

    def victim(self) -> Key | None: ...

    def on_remove(self, key: Key) -> None: ...

    def __len__(self) -> int: ...


class LRU:
    """Least recently used, admitting every block; a held victim handed back is most recently used
    (bench/trace_replay.py checks the index with it against an exact model)."""

    name = "lru"
    admits_all = True

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._order: OrderedDict[Key, None] = OrderedDict()  # oldest first

    def set_capacity(self, capacity: int) -> None:
        self.capacity = capacity

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: Key) -> bool:
        return key in self._order

    def __iter__(self) -> Iterator[Key]:
        """The keys tracked, least recently used first."""
        return iter(self._order)

    def on_lookup_miss(self, keys: Iterable[Key]) -> None:
        pass

    def admit(self, key: Key, parent_present: bool) -> bool:
        return True

    def on_insert(self, key: Key, parent: Key | None) -> None:
        self._order[key] = None

    def on_insert_oldest(self, keys: Iterable[Key]) -> None:
        order, keys = self._order, list(keys)
        for k in keys:
            order[k] = None
        for k in reversed(keys):
            order.move_to_end(k, last=False)

    def on_access(self, key: Key) -> None:
        try:
            self._order.move_to_end(key)  # one probe when tracked: every block a LOAD read
        except KeyError:
            self._order[key] = None  # re-tracks a handed-back victim

    def victim(self) -> Key | None:
        return self._order.popitem(last=False)[0] if self._order else None

    def on_remove(self, key: Key) -> None:
        self._order.pop(key, None)


#: At most about this many touched keys of ended requests wait for ``AdaptiveDoorkeeper._refresh``, which
#: runs on the event loop: letting a pool's capacity pile up made one refresh of 65,536 keys stall the
#: loop 11-16 ms every 64 leased LOOKUPs of 1,024 keys, and it ran at a LOOKUP's start
#: (bench/control_plane.py's p99: 16 ms, 40x the floor). Whole requests are refreshed, oldest first,
#: each deepest first, as before; a block inserted in the meantime now ranks after the ones used
#: before it, not before them (as their times say).
REFRESH_KEYS = 4096


class AdaptiveDoorkeeper:
    """Admit a block on its second request, unless a probation segment pays for itself; sized by ghosts.

    Why: on a prefix-cache trace most blocks are asked for once (76% on the Mooncake conversation
    trace) and a long new prompt flushes an LRU cache before the conversations already in it come
    back. So:

    * **protected** (LRU): blocks asked for at least twice. A first-time block is refused (a
      doorkeeper: the ghost ``_seen`` remembers it) and admitted straight into protected when it is
      asked for again while the ghost still remembers it (``ghost_factor`` × capacity first-time
      blocks). A block evicted from protected is remembered in ``_evicted`` (capacity keys) and also
      readmitted to protected when it comes back.
    * **probation** (FIFO, target size ``target``, starts at 0): first-time blocks admitted anyway.
      Hits promote them to protected; evictions remember them in ``_seen``.
    * **adaptation** (marginal utility, from the ghosts): a first-time block that comes back after
      ``d`` first-time offers would have been a hit with a probation of more than ``d`` slots; a
      block evicted from protected that comes back after ``d`` protected evictions would have been
      a hit with ``d`` more protected slots. A ghost hit just past probation's edge
      (``target <= d < target + window``) moves ``target`` up by ``step``; a protected ghost hit with
      ``d < window`` moves it down. Small caches settle at a pure doorkeeper (protected only); large
      ones grow probation until the policy behaves like LRU with a protected segment, so it does not
      fall below LRU where everything fits (a plain doorkeeper does).
    * **prefix-aware admission**: a block whose parent is absent is refused (it can never be a
      leading hit), and while the cache still has free slots every block with its parent is admitted
      (refusing then would only lose hits).
    * **tail-first eviction**: the blocks a request used are refreshed when the next request starts
      (or a victim is needed), deepest first, so a prefix's head stays more recent than its tail and
      protected gives up chains from the tail (LRU refreshes in key order and evicts the head first,
      leaving the rest resident and unreachable).

    Memory: at most capacity tracked keys + ``ghost_factor`` × capacity + capacity ghost keys.
    """

    name = "adaptive-doorkeeper"
    admits_all = False

    def __init__(self, capacity: int, ghost_factor: float = 4.0, window: float = 1 / 16,
                 step: float = 1 / 256, max_probation: float = 0.9):
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._ghost_factor = ghost_factor
        self._window_frac = window
        self._step_frac = step
        self._max_frac = max_probation
        self.target = 0.0  # probation's target size, in blocks
        self._probation: OrderedDict[Key, None] = OrderedDict()  # first-time blocks, oldest first
        self._protected: OrderedDict[Key, None] = OrderedDict()  # least recently used first
        self._seen: OrderedDict[Key, int] = OrderedDict()  # first-time key -> first-time serial then
        self._evicted: OrderedDict[Key, int] = OrderedDict()  # protected victim -> eviction serial then
        self._promote: set[Key] = set()  # admitted to protected, insert pending
        self._first_serial = 0  # first-time offers so far
        self._evict_serial = 0  # protected evictions so far
        self._pending = 0  # first-time blocks admitted into free slots, insert pending
        self.refused = 0  # admissions refused (a refused store costs no copy)
        self.lru_mode = False  # admit every block straight to protected: plain LRU (GuardedDoorkeeper sets it)
        self._touched: list[Key] = []  # protected keys used since the last refresh, in call order
        self._cuts = [0]  # where each request's keys start in _touched
        self._sizes()

    def _sizes(self) -> None:
        c = self.capacity
        self._seen_max = max(1, int(self._ghost_factor * c))
        self._evicted_max = max(1, c)
        self._window = max(1.0, c * self._window_frac)
        self._step = max(1.0, c * self._step_frac)
        self._max_target = self._max_frac * c
        self.target = min(self.target, self._max_target)

    def set_capacity(self, capacity: int) -> None:
        """The tier grew or shrank (ghosts shrink lazily, as they are next written)."""
        self.capacity = capacity
        self._sizes()

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __contains__(self, key: Key) -> bool:
        return key in self._protected or key in self._probation

    # --- events -------------------------------------------------------------------------------------
    def on_lookup_miss(self, keys: Iterable[Key]) -> None:
        """A new request begins: O(1), so a LOOKUP costs the policy nothing per key. (The keys are not
        counted: the STORE that follows a miss offers the same keys, and counting both would admit a
        block on its first request.)"""
        n = len(self._touched)
        if n and self._cuts[-1] != n:
            self._cuts.append(n)

    def _touch(self, key: Key) -> None:
        """``key`` was used (or inserted) by the current request. Once whole requests worth more than
        ``REFRESH_KEYS`` wait, they are refreshed here, on the paths that run after a job's notice or
        a lease's release, not at a LOOKUP's start."""
        touched = self._touched
        touched.append(key)
        if self._cuts[-1] > min(self.capacity, REFRESH_KEYS):  # bounded even while nothing is evicted
            self._refresh(whole=True)
        elif len(touched) > 4 * max(self.capacity, REFRESH_KEYS):  # no request ends (no LOOKUP): all of it
            self._refresh()

    def _refresh(self, whole: bool = False) -> None:
        """Make the blocks each request used most recently used, its deepest first, requests in order,
        so that a prefix's head is always more recent than its tail and eviction takes chains from the
        tail (a block is worthless once its parent is gone; in key order LRU evicts the head first).
        Deferred to the next ``victim`` (order matters only then) or until ``REFRESH_KEYS`` wait:
        amortized O(1) per block. ``whole``: only the requests that ended (the current one's keys
        wait for the next refresh)."""
        touched, prot = self._touched, self._protected
        cuts = self._cuts
        end = cuts[-1] if whole else len(touched)
        if not whole:
            cuts.append(end)
        for a, b in zip(cuts, cuts[1:], strict=False):
            for i in range(b - 1, a - 1, -1):
                key = touched[i]
                if key in prot:
                    prot.move_to_end(key)
        del touched[:end]
        self._cuts = [0]

    def admit(self, key: Key, parent_present: bool) -> bool:
        seen = self._seen.pop(key, None)
        if seen is not None:  # asked for again: the doorkeeper opens
            d = self._first_serial - seen
            if self.target <= d < self.target + self._window:
                self.target = min(self._max_target, self.target + self._step)
            return self._to_protected(key, parent_present)
        gone = self._evicted.pop(key, None)
        if gone is not None:
            if self._evict_serial - gone < self._window:
                self.target = max(0.0, self.target - self._step)
            return self._to_protected(key, parent_present)
        self._first_serial += 1
        if self.lru_mode:
            return self._to_protected(key, parent_present)
        if parent_present and (self.target >= 1 or len(self) + len(self._promote) + self._pending
                               < self.capacity):
            self._pending += 1
            return True
        self._remember(key)
        self.refused += 1
        return False

    def _to_protected(self, key: Key, parent_present: bool) -> bool:
        if parent_present:
            self._promote.add(key)
            return True
        self._remember(key)  # an orphan is worthless now; remember that it was asked for
        self.refused += 1
        return False

    def on_insert(self, key: Key, parent: Key | None) -> None:
        if key in self._promote:
            self._promote.discard(key)
            self._protected[key] = None
            self._touch(key)
        else:
            self._probation[key] = None
            if self._pending:
                self._pending -= 1

    def on_insert_oldest(self, keys: Iterable[Key]) -> None:
        """Adopted blocks: tracked as inserted, in order (ages within probation and protected are not
        reordered around them)."""
        for k in keys:
            self.on_insert(k, None)

    def on_access(self, key: Key) -> None:
        if key in self._probation:
            del self._probation[key]
        self._protected[key] = None  # also re-tracks a handed-back victim
        self._touch(key)

    def victim(self) -> Key | None:
        if self._touched:
            self._refresh()
        self._pending = 0  # evicting: the cache is full, no free slot is pending
        if self._probation and (len(self._probation) >= self.target or not self._protected):
            key = self._probation.popitem(last=False)[0]
            self._remember(key)
            return key
        if not self._protected:
            return None
        key = self._protected.popitem(last=False)[0]
        self._evict_serial += 1
        self._evicted[key] = self._evict_serial
        if len(self._evicted) > self._evicted_max:
            self._evicted.popitem(last=False)
        return key

    def on_remove(self, key: Key) -> None:
        if self._probation.pop(key, 0) is None or self._protected.pop(key, 0) is None:
            return
        if key in self._promote:
            self._promote.discard(key)
        elif self._pending:  # a first-time block admitted into a free slot that it did not get
            self._pending -= 1

    def _remember(self, key: Key) -> None:
        self._seen[key] = self._first_serial
        while len(self._seen) > self._seen_max:
            self._seen.popitem(last=False)


_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing: spreads consecutive ids (a chain's blocks) over the samples
_M64 = (1 << 64) - 1


def _sample_hash(key: Key) -> int:
    """A hash of ``key`` that is the same in every process, for the shadows' sample: Python's hash of
    bytes changes with each process (PYTHONHASHSEED) and an object's with its address, so the daemon
    would sample other keys on every run and could not be replayed against bench/policy_sim.py. The
    index's keys are ``(table, 32-byte key)`` and the key bytes are already a hash: their first 8
    bytes are used; an int (a trace's hash id) is its own hash."""
    if type(key) is tuple:
        key = key[-1]
    if type(key) is bytes:
        return int.from_bytes(key[:8], "little")
    return hash(key)


class GuardedDoorkeeper(AdaptiveDoorkeeper):
    """The default: an :class:`AdaptiveDoorkeeper` that turns into plain LRU while LRU would do better.

    Why: the doorkeeper's refusals pay off where a cache thrashes (2x LRU on the conversation trace
    at 2,000 blocks) but cost a few percent where nearly every block comes back soon (a synthetic
    chat trace with Zipf-shared system prompts), and "never below LRU" is the promise. So the policy
    runs two miniature simulations (Waldspurger et al., "Cache Modeling and Optimization using
    Miniature Simulations", USENIX ATC'17) on a hash-sampled share of the keys (``rate``, at least
    ``min_sample`` blocks of capacity): an :class:`LRU` and an :class:`AdaptiveDoorkeeper`, each at
    the sampled capacity and each fed every request of a sampled key (a hit becomes ``on_access``, a
    miss ``admit`` + ``victim`` + ``on_insert``). A shadow counts a hit only until its first miss in
    the request (``on_lookup_miss`` starts one): a hit behind a missing block is no prefix hit, and
    LRU, which evicts a prefix's head first, would otherwise be credited with those. Their hits
    decay by half every ``period`` sampled requests; while the LRU shadow leads, ``lru_mode`` admits
    every block straight to protected (the switch is made for whole periods only, so it does not
    flap).

    Cost: one multiply and mask per block, plus the shadows' work on the sampled share (1/16 at large
    capacities); memory: two sampled policies, about 2 x ``rate`` of this one's.
    """

    name = "guarded-doorkeeper"

    def __init__(self, capacity: int, rate: float = 1 / 16, min_sample: int = 512, period: int = 16384,
                 margin: float = 1.0, **kw):
        super().__init__(capacity, **kw)
        bits = 0  # the sampled share is 1/2**bits: down to ``rate``, keeping min_sample blocks of capacity
        while 2 ** -(bits + 1) >= rate and capacity >> (bits + 1) >= min_sample and bits < 6:
            bits += 1
        self._mask = (1 << bits) - 1
        small = max(1, capacity >> bits)
        self._shadows = (LRU(small), AdaptiveDoorkeeper(small, **kw))
        self._shadow_hits = [0.0, 0.0]
        self._broken = [False, False]  # this request already missed a sampled block in that shadow
        self._sampled = 0
        self._period = period
        self._margin = margin
        self._bits = bits

    def set_capacity(self, capacity: int) -> None:
        super().set_capacity(capacity)
        small = max(1, capacity >> self._bits)
        self._shadows[0].capacity = small
        self._shadows[1].set_capacity(small)

    def _sampled_request(self, key: Key) -> None:
        for i, sh in enumerate(self._shadows):
            if key in sh:
                sh.on_access(key)
                if not self._broken[i]:  # a hit behind a missing block is no prefix hit
                    self._shadow_hits[i] += 1
                continue
            self._broken[i] = True
            if sh.admit(key, True):
                while len(sh) >= sh.capacity and sh.victim() is not None:
                    pass
                sh.on_insert(key, None)
        self._sampled += 1
        if self._sampled >= self._period:
            self._sampled = 0
            lru, door = self._shadow_hits
            self.lru_mode = lru > door * self._margin
            self._shadow_hits = [lru / 2, door / 2]

    def on_lookup_miss(self, keys: Iterable[Key]) -> None:
        self._broken = [False, False]  # a new request
        super().on_lookup_miss(keys)

    def admit(self, key: Key, parent_present: bool) -> bool:
        if not (_sample_hash(key) * _MIX & _M64) >> 58 & self._mask:
            self._sampled_request(key)
        return super().admit(key, parent_present)

    def on_access(self, key: Key) -> None:
        if not (_sample_hash(key) * _MIX & _M64) >> 58 & self._mask:
            self._sampled_request(key)
        super().on_access(key)


POLICIES = {LRU.name: LRU, AdaptiveDoorkeeper.name: AdaptiveDoorkeeper, GuardedDoorkeeper.name: GuardedDoorkeeper}
DEFAULT_POLICY = GuardedDoorkeeper.name


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """The policy called ``name`` (``POLICIES``) for a tier of ``capacity`` blocks; ValueError names
    the choices."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r}; choose one of {', '.join(sorted(POLICIES))}") from None
    return cls(capacity)
