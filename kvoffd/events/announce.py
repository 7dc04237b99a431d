"""Announcing a warm restart's adopted blocks on the KV-event stream, so that it matches the index.

A daemon that adopts the previous daemon's pool file (kvoffd/cache/restart/filekeeper.py) holds blocks its own
stream never named: no STORE committed them here. A router that consumes the stream (and dropped the
node's kvoffd blocks when ``seq`` went back to 0) would score them uncached for as long as they live.
So each adopted rank-0 block is announced once, as a ``BlockStored`` like any other (medium CPU; no
tokens, no parent: the pool file keeps neither, and vLLM's ``BlockStored`` allows ``token_ids=[]``,
what the daemon already sends for a block stored without a description).

When: as soon as its namespace's event identity is known. That is at start for a namespace whose
identity the pool file kept (``FileKeeper.take_adopted``), else at the REGISTER that says it
(``layout.kv_events``). Until then nothing can be published (the daemon cannot know the hash form), and
an adopted block evicted meanwhile is simply never announced (nor removed: the stream never named it).

Cost: one ``BlockStored`` per slice of at most ``SLICE_KEYS`` keys, one slice per loop turn, so a pool
of a million adopted blocks never holds the loop for more than one slice's Python (~0.05 ms per
thousand keys: a filter of dead entries and a list of keys; the hashes are made on the publisher
thread). Sorting the adopted entries by namespace is sliced too (``SORT_SLICE`` per turn: ~0.1 µs an
entry, so 4 M adopted blocks would otherwise hold the start, and the first hit, for ~0.4 s). When the publisher thread's queue is half full the next slice waits ``BACKOFF_S``: an
announcement never makes the publisher drop the live events behind it.

Only the entries still present when their slice is taken are announced: an adopted block evicted (or
cleared, or found corrupt) before its slice gets its ordinary ``BlockRemoved`` (the identity is known by
then) and is never announced after its removal; one evicted after its slice has both, in that order.

A tier below the pool that reopens what it held (the disk tier's persistent index) is announced the
same way, under its own medium (``Reopened``: it hands out its blocks found at start a slice at a time,
each while still held, and once), after the namespace's pool blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvoffd.cache.identity import MEDIUM_CPU
from kvoffd_client.protocol import KEY_SIZE

if TYPE_CHECKING:
    from kvoffd.cache.entries import Entry

SLICE_KEYS = 4096  # keys per announcement event and per loop turn
SORT_SLICE = 8192  # adopted entries sorted by namespace per loop turn (~1 ms), before any is announced
BACKOFF_S = 0.005  # the publisher thread's queue is half full: the next slice waits this long


class Reopened(Protocol):
    """A tier that found blocks at start (kvoffd/cache/tiers/disk.py)."""

    medium: str

    def reopened_namespaces(self) -> set[str]: ...

    def take_reopened(self, namespace: str, n: int) -> tuple[bytes, bool]: ...


@dataclass
class Announcement:
    """One slice to publish: ``keys`` of ``namespace``'s rank 0 (pool ones in adoption, i.e. last-use,
    order), held in ``medium``."""

    namespace: str
    keys: list[bytes]
    medium: str = MEDIUM_CPU


@dataclass
class Adopted:
    """The adopted rank-0 entries not yet announced, by namespace, and the namespaces whose turn it is."""

    slice_keys: int = SLICE_KEYS
    backlog: deque[tuple[Sequence[Entry], int]] = field(default_factory=deque)  # not sorted yet (list, from)
    waiting: dict[str, deque[Entry]] = field(default_factory=dict)
    below: dict[str, list[Reopened]] = field(default_factory=dict)  # namespace -> tiers with its blocks
    ready: deque[str] = field(default_factory=deque)  # identity known: announced slice by slice
    announced: int = 0
    announced_below: int = 0
    skipped: int = 0  # gone before their slice

    def add(self, entries: Sequence[Entry]) -> None:
        """Adopted entries, to be sorted by namespace a slice at a time (``sort_some``)."""
        if entries:
            self.backlog.append((entries, 0))

    def sort_some(self, n: int = SORT_SLICE) -> set[str]:
        """Sort up to ``n`` backlog entries (rank 0's) into their namespaces; returns those seen."""
        seen: set[str] = set()
        while n > 0 and self.backlog:
            entries, at = self.backlog[0]
            end = min(len(entries), at + n)
            for e in entries[at:end]:
                t = e.table
                if t.rank == 0:
                    q = self.waiting.get(t.namespace)
                    if q is None:
                        q = self.waiting[t.namespace] = deque()
                        seen.add(t.namespace)
                    q.append(e)
            n -= end - at
            if end == len(entries):
                self.backlog.popleft()
            else:
                self.backlog[0] = (entries, end)
        return seen

    def add_below(self, tier: Reopened) -> None:
        for ns in tier.reopened_namespaces():
            self.below.setdefault(ns, []).append(tier)

    def known(self, namespace: str) -> bool:
        """``namespace``'s identity is known now: True if it has blocks to announce (newly queued)."""
        if (namespace in self.waiting or namespace in self.below) and namespace not in self.ready:
            self.ready.append(namespace)
            return True
        return False

    def forget(self, namespace: str | None = None) -> None:
        """A CLEAR of ``namespace`` (None: of all): its adopted blocks are gone, none is to be announced."""
        if namespace is None:
            self.backlog.clear()
            self.waiting.clear()
            self.below.clear()
            self.ready.clear()
            return
        self.waiting.pop(namespace, None)
        self.below.pop(namespace, None)
        if namespace in self.ready:
            self.ready.remove(namespace)

    def withdrawn(self, namespace: str) -> None:
        """An engine said its keys are not block hashes any more: its blocks wait for another identity."""
        if namespace in self.ready:
            self.ready.remove(namespace)

    def next_slice(self) -> Announcement | None:
        """The next slice of the first ready namespace (its pool blocks, then each tier's): at most
        ``slice_keys`` blocks looked at, the live ones' keys (maybe none: the caller goes on at the next
        turn). None: nothing is ready."""
        if not self.ready:
            return None
        ns = self.ready[0]
        q = self.waiting.get(ns)
        if q:
            part = [q.popleft() for _ in range(min(self.slice_keys, len(q)))]
            keys = [e.key for e in part if e.ready and not e.dead]
            self.skipped += len(part) - len(keys)
            self.announced += len(keys)
            out = Announcement(ns, keys)
        else:
            tiers = self.below.get(ns)
            out = Announcement(ns, [])
            if tiers:
                tier = tiers[0]
                raw, more = tier.take_reopened(ns, self.slice_keys)
                if not more:
                    tiers.pop(0)
                out = Announcement(ns, [raw[i:i + KEY_SIZE] for i in range(0, len(raw), KEY_SIZE)], tier.medium)
                self.announced_below += len(out.keys)
        if not q:
            self.waiting.pop(ns, None)
        if ns not in self.waiting and not self.below.get(ns):
            self.below.pop(ns, None)
            self.ready.popleft()
        return out

    @property
    def pending(self) -> int:
        """Adopted blocks not announced yet (dead ones, and other ranks' until sorted, included)."""
        return sum(len(q) for q in self.waiting.values()) + sum(len(es) - at for es, at in self.backlog)
