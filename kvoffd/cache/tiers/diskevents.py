"""The disk tier's KV events (medium DISK): what it tells, and the blocks it found at start.

``changed`` (set by kvoffd/cache/tiers/manager.py when the daemon publishes events) hears of every
record inserted (a spill written) and every record removed (evicted by the hand, forgotten after a
failed read, removed, cleared by namespace; a CLEAR of all is one ``AllBlocksCleared`` instead), with
the keys, on the loop. The blocks found at start are the tier's own to announce, since no spill of this
daemon wrote them: ``mark_reopened`` marks their records, and ``take_reopened`` hands them out a slice
at a time (kvoffd/events/announce.py), each only while its record is still the one found at start (a
removal clears its mark), and once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from kvoffd.cache.tiers.base import TableRef
from kvoffd.cache.tiers.diskslots import SizeClass

#: a tier's blocks changed: (table, keys stored, keys removed), keys concatenated (32 bytes each)
Changed = Callable[[TableRef, bytes, bytes], None]


class DiskEvents:
    """What the disk tier tells of its records, and the marks of those found at start (loop thread
    only). ``refs``: the tier's tables by id (kvoffd/cache/tiers/disktables.py), read, never changed."""

    def __init__(self, refs: dict[int, TableRef]):
        self._refs = refs
        self.changed: Changed | None = None
        self.marks: dict[int, np.ndarray] = {}  # slot size -> per record: found at start, not yet told nor removed
        self._reopened: dict[str, list[tuple[SizeClass, np.ndarray]]] = {}  # namespace -> rank 0's, found at start

    def mark_reopened(self, classes: Iterable[SizeClass]) -> None:
        """Mark the rank-0 blocks found at start, to be announced (``take_reopened``). Called once, by
        ``Tiers.publish`` before the daemon serves (nothing changed since the index was opened), and only
        when the daemon publishes events: otherwise the marks would cost memory for nothing."""
        for c in classes:
            self._mark(c, c.index.live())

    def _mark(self, c: SizeClass, pos: np.ndarray) -> None:
        """Rank 0's records at ``pos``, by namespace (positions as uint32: 4 bytes a block, plus a byte a
        record for the marks, freed once all are handed out). O(records x namespaces), no sort: the
        daemon is about to serve."""
        refs = self._refs
        if not len(pos) or not refs:
            return
        names = sorted({r.namespace for r in refs.values() if r.rank == 0})
        ns_of = np.full(max(refs) + 1, -1, dtype=np.int32)  # tid -> namespace number (-1: not rank 0)
        for tid, r in refs.items():
            if r.rank == 0:
                ns_of[tid] = names.index(r.namespace)
        tids = c.index.recs["tid"][pos].astype(np.int64)
        of = np.where(tids < len(ns_of), ns_of[np.minimum(tids, len(ns_of) - 1)], -1)
        for k, name in enumerate(names):
            mine = pos[of == k].astype(np.uint32)
            if not len(mine):
                continue
            marks = self.marks.get(c.slot_bytes)
            if marks is None:
                marks = self.marks[c.slot_bytes] = np.zeros(c.index.cap, dtype=bool)
            marks[mine] = True
            self._reopened.setdefault(name, []).append((c, mine))

    def reopened_namespaces(self) -> set[str]:
        return set(self._reopened)

    def take_reopened(self, namespace: str, n: int) -> tuple[bytes, bool]:
        """Up to ``n`` of ``namespace``'s rank-0 blocks found at start, still held by the same record and
        not handed out before (keys concatenated; fewer, or none, when some went since), and whether
        more remain. Looks at ``n`` positions at most: O(n) per call whatever the tier's size."""
        parts = self._reopened.get(namespace)
        if not parts:
            self._reopened.pop(namespace, None)
            return b"", False
        c, pos = parts[0]
        take, rest = pos[:n], pos[n:]
        if len(rest):
            parts[0] = (c, rest)
        else:
            parts.pop(0)
        marks = self.marks[c.slot_bytes]
        live = take[marks[take]]
        marks[live] = False
        out = c.index.recs["k"][live].tobytes()
        more = bool(parts)
        if not more:
            self._reopened.pop(namespace, None)
            if not any(c is c2 for ps in self._reopened.values() for c2, _ in ps):
                del self.marks[c.slot_bytes]  # every mark of this class handed out
        return out, more

    def unmark(self, c: SizeClass, pos: np.ndarray) -> None:
        marks = self.marks.get(c.slot_bytes)
        if marks is not None:
            marks[pos] = False

    def removing(self, c: SizeClass, pos: np.ndarray) -> None:
        """Records at ``pos`` are about to be removed: told (their keys, by table), unmarked."""
        if not len(pos):
            return
        self.unmark(c, pos)
        if self.changed is not None:
            self.tell(c, pos, removed=True)

    def tell(self, c: SizeClass, pos: np.ndarray, removed: bool) -> None:
        if self.changed is None:
            return
        tids = c.index.recs["tid"][pos]
        keys = c.index.recs["k"][pos]
        for tid in np.unique(tids).tolist():
            ref = self._refs.get(tid)
            if ref is not None:
                k = keys[tids == tid].tobytes()
                if removed:
                    self.changed(ref, b"", k)
                else:
                    self.changed(ref, k, b"")
