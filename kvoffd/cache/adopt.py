"""Adoption: the sealed records of a previous daemon's pool become the new daemon's pool and index.

Nothing a record says is trusted beyond what can be checked here: its namespace must be in the
namespace table with a rank (a storing rank, for replicas), world size and slot size that agree
with it; its slot must lie inside one chunk of the pool, on that slot size's grid; every record of a
chunk must name one slot size; a key present twice in one table keeps its newest record. Whatever fails is not adopted (its
record is invalidated) and counted. The bytes themselves are checked later, against each record's
crc32 (kvoffd/cache/persist.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvoffd.cache.index import Entry, Index, Table
from kvoffd.cache.pool import Pool
from kvoffd.cache.slots_table import Found, NamespaceFacts


@dataclass
class Adopted:
    entries: list[Entry] = field(default_factory=list)
    table_ids: dict[Table, int] = field(default_factory=dict)  # every table made, -> its namespace id
    dropped_records: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    not_adopted: int = 0
    why: str = ""  # the first reason records were left out


def _plausible(f: Found, ns: dict[int, NamespaceFacts], pool: Pool) -> tuple[np.ndarray, str]:
    """Mask of the records whose namespace facts and slot geometry check out."""
    ok = np.zeros(len(f.ns_id), dtype=bool)
    why = ""
    for i, (n, r, sb) in enumerate(zip(f.ns_id.tolist(), f.rank.tolist(), f.slot_bytes.tolist(), strict=True)):
        facts = ns.get(n)
        rf = facts.ranks.get(r) if facts is not None and r < facts.world_size and r % facts.replicas == 0 else None
        ok[i] = rf is not None and rf.slot_bytes == sb
        if not ok[i] and not why:
            why = "records of namespaces the table does not describe"
    cb = pool.chunk_bytes
    fits = (f.slot_bytes > 0) & ((f.offset % cb) + f.slot_bytes <= cb) & (f.offset + f.slot_bytes <= pool.nbytes)
    if (ok & ~fits).any() and not why:
        why = "records of slots outside the pool's chunks"
    ok &= fits
    chunk = f.offset // cb
    sizes: dict[int, int] = {}
    mixed: set[int] = set()
    for c, sb in zip(chunk[ok].tolist(), f.slot_bytes[ok].tolist(), strict=True):
        if sizes.setdefault(c, sb) != sb:
            mixed.add(c)
    if mixed:
        ok &= ~np.isin(chunk, list(mixed))
        why = why or f"{len(mixed)} chunks whose records name two slot sizes"
    return ok, why


def adopt_records(f: Found, ns: dict[int, NamespaceFacts], pool: Pool, index: Index) -> Adopted:
    """Rebuild ``pool`` and ``index`` (both empty) from the sealed records ``f``."""
    out = Adopted()
    ok, out.why = _plausible(f, ns, pool)
    newest: dict[tuple[int, int, bytes], int] = {}
    keys = [bytes(k) for k in f.keys]
    for i in np.flatnonzero(ok).tolist():
        k = (int(f.ns_id[i]), int(f.rank[i]), keys[i])
        j = newest.get(k)
        if j is None or f.stamp[i] > f.stamp[j]:
            newest[k] = i
    keep = np.array(sorted(newest.values(), key=lambda i: (f.stamp[i], f.offset[i])), dtype=np.int64)
    tables: dict[tuple[int, int], Table] = {}
    for n in sorted({int(x) for x in f.ns_id[keep]}) if len(keep) else ():
        facts = ns[n]
        try:
            for r, rf in sorted(facts.ranks.items()):
                t = tables[(n, r)] = index.table(facts.name, r, facts.world_size, rf.slot_bytes, rf.layout,
                                                 facts.replicas)
                out.table_ids[t] = n
        except ValueError:
            out.why = out.why or f"namespace {facts.name!r} described twice"
            keep = keep[f.ns_id[keep] != n]
    for sb in np.unique(f.slot_bytes[keep]).tolist():
        sel = keep[f.slot_bytes[keep] == sb]
        pool.adopt_slots(int(sb), np.sort(f.offset[sel]))
    out.entries = index.adopt([tables[(int(f.ns_id[i]), int(f.rank[i]))] for i in keep], [keys[i] for i in keep],
                              f.offset[keep].tolist(), f.stamp[keep].tolist(), f.crc[keep].tolist())
    dropped = np.ones(len(f.ns_id), dtype=bool)
    dropped[keep] = False
    out.dropped_records = f.record[dropped]
    out.not_adopted = int(dropped.sum())
    return out
