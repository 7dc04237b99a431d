"""``Stack``: the tiers below the pool in the order a LOOKUP asks them, local first (the disk tier, then
the cluster tier). Which tier serves a key is decided here, once, for every caller (``Tiers``):

* a key any tier holds is a hit; a run of hits may mix tiers (blocks 0-9 on disk, 10-19 only in the
  cluster, 20-29 on disk again);
* a key several tiers hold is read from the first of them (a block on this node's disk and in the
  cluster is read from the disk, once): the cluster is a round trip away and shared by every node;
* a lower tier is asked only about what the tiers above it lack, so a LOOKUP answered by the disk does
  exactly the disk's work (one call of its compiled probe) and never reaches the cluster tier's
  in-memory table.

Every call answers from memory on the loop (the ``Tier`` protocol's ``probe``/``contains``, no I/O);
the cluster tier's knowledge of other nodes' blocks comes from its probe of a LOOKUP's misses
(``RemoteTier.note_misses``, asked by the keyspace), not from here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvoffd.cache.tiers.base import TableRef, Tier
from kvoffd_client.protocol import KEY_SIZE

_K = KEY_SIZE
NOWHERE = -1  # ``sources``: no tier holds the key


class Stack:
    """``tiers``: local first. Empty: no tier (every call says "not held")."""

    def __init__(self, tiers: Sequence[Tier]):
        self.tiers = list(tiers)

    def __len__(self) -> int:
        return len(self.tiers)

    def holds(self, ref: TableRef, key: bytes) -> bool:
        """Whether some tier holds this one key now (exact)."""
        return any(t.contains(ref, key)[0] for t in self.tiers)

    def run(self, ref: TableRef, keys: bytes) -> int:
        """How many leading keys of ``keys`` one tier may hold (its ``probe``): the longest such run
        over the tiers, asked in order and no further once one covers all of ``keys``. Never fewer than
        one tier holds; a mixed run is found by asking again from where this one ends
        (``Tiers._count``)."""
        n = len(keys) // _K
        best = 0
        for t in self.tiers:
            best = max(best, t.probe(ref, keys))
            if best >= n:
                return n
        return best

    def sources(self, ref: TableRef, keys: bytes) -> np.ndarray:
        """Per key, the position in ``tiers`` of the first tier that holds it now (exact), or
        ``NOWHERE``: each tier is asked only about the keys the ones above it lack."""
        n = len(keys) // _K
        if not self.tiers:
            return np.full(n, NOWHERE, dtype=np.int8)
        on = np.asarray(self.tiers[0].contains(ref, keys), dtype=bool)
        if on.all():  # the usual case: the first tier holds them all
            return np.zeros(n, dtype=np.int8)
        out = np.where(on, 0, NOWHERE).astype(np.int8)
        todo = np.flatnonzero(~on)
        for i, t in enumerate(self.tiers[1:], 1):
            if not len(todo):
                break
            part = b"".join([keys[j * _K:(j + 1) * _K] for j in todo.tolist()])
            on = np.asarray(t.contains(ref, part), dtype=bool)
            out[todo[on]] = i
            todo = todo[~on]
        return out
