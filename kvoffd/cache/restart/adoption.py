"""Adoption: the blocks a warm restart found committed in the pool file become index entries again.

Warm-restart code over the index's public verbs (``Index.place``, ``Index.namespaces``): called at
start, a slice per loop turn (kvoffd/cache/restart/plan.py, kvoffd/cache/restart/filekeeper.py), on
the loop thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvoffd.cache.entries import Entry, Table
from kvoffd.cache.runs import Run

if TYPE_CHECKING:
    from kvoffd.cache.index import Index


def adopt(index: Index, tables: Sequence[Table], keys: Sequence[bytes], slots: Sequence[int],
          stamps: Sequence[float], checksums: Sequence[int], cold_end: bool = False) -> list[Entry]:
    """Blocks a warm restart found committed, in last-use order, oldest first: visible at once, least
    recently used first for their policy; ``cold_end``: all of them before (colder than) the blocks
    already there, as a slice of older blocks than the slices adopted before it. Their slots are
    already held in the pool (``Pool.adopt_slots``); the observers are not told (the blocks are
    already what they mirror). One run per table and stamp (a commit's blocks share one), so a
    prompt's lookups take the run shortcut again."""
    out: list[Entry] = []
    runs: dict[Table, tuple[float, list[Entry]]] = {}
    for t, k, s, when, crc in zip(tables, keys, slots, stamps, checksums, strict=True):
        e = Entry(k, t, s)
        e.stored_at, e.checksum = when, crc
        out.append(e)
        cur = runs.get(t)
        if cur is None or cur[0] != when:
            _close_run(cur)
            cur = runs[t] = (when, [])
        cur[1].append(e)
    for cur in runs.values():
        _close_run(cur)
    index.place(out, cold_end)
    return out


def holds_table(index: Index, t: Table) -> bool:
    """Whether ``t`` is still the table its namespace and rank read (not CLEARed away or forgotten)."""
    ns = index.namespaces.get(t.namespace)
    return ns is not None and ns.tables.get(t.rank) is t


def _close_run(cur: tuple[float, list[Entry]] | None) -> None:
    if cur:
        run = Run(b"".join([e.key for e in cur[1]]), cur[1])
        for i, e in enumerate(cur[1]):
            e.run, e.run_at = run, i
