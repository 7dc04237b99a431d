"""The persistent pool's metadata: one record per slot, and the namespaces' registration facts.

Names: the records are ``SlotRecords``, each chunk's slot size the chunk map, the namespaces' facts
the namespace area (``NamespaceArea``); a *table* is only ever one namespace x rank's blocks
(kvoffd/cache/entries.py's ``Table``), whose records say it by namespace id and rank.

Records: ``records_per_chunk`` 64-byte records per chunk; slot ``i`` of a chunk has record ``i`` of
that chunk when ``i < records_per_chunk`` (every slot of 16 KiB or more in 64 MiB chunks; smaller
slots beyond the first 4096 of a chunk are simply not persisted: a miss after a restart, never a
wrong byte). So per-slot metadata stays under 0.4% of the pool whatever the slot size.

A record is eight little-endian 64-bit words::

    0: state (32 bits: COMMITTED, SUMMED, SEALED or 0) | namespace id (16) | rank (16)
    1-4: the block's key (32 bytes)
    5: last-use stamp (a float64's bits)
    6: checksum of the slot's bytes (32; 0 while COMMITTED) | slot size (32)
    7: check: a mix of words 0-6 (catches a damaged record)

States: COMMITTED, the block's copy completed and its checksum is not known yet; SUMMED, with its
checksum (kvoffd/cache/checksum.py); SEALED, an older daemon's record, with zlib's crc32 of the slot
(read, never written: ``scan`` marks its checksum ``LEGACY_CRC32``).

Crash consistency (the process may die between any two instructions): a record is written only for a
block whose copy completed (``seal``: COMMITTED, or SUMMED when the checksum is known already), in three
steps: word 0 to 0, words 1-7, then word 0 with the state. Its checksum is filled in later (``fill``)
without the record ever being invalid in between: word 6 first (the check of a COMMITTED record leaves
the checksum bits out, so it still holds), then word 7 (now the check of the SUMMED form), then word 0's
state; at each step the record reads as COMMITTED or as SUMMED. It is invalidated (word 0 to 0, one
aligned store) before its slot goes back to the pool (``invalidate``). A record whose state is none of
these, or whose check matches none of its forms, is ignored at adoption. Everything is numpy,
vectorised over a batch of slots.

Namespace area: a JSON document (namespace id -> name, world size, each rank's slot size and layout,
and optionally its KV-event identity) written to the older of two areas with a generation number and a
crc32, so one copy is whole whatever instant the process dies at.

The KV-event identity (``"events": {"hash", "block_size", "group_idx"}``: what REGISTER's
``layout.kv_events`` said) is an optional key of a namespace's JSON object, not a change of the file's
layout, so ``FORMAT_VERSION`` stays: an older daemon reads the object's other keys and ignores it (its
own save then drops it: the next daemon learns the identity at REGISTER instead), and a file written
before it has none (the same). It is read leniently: a malformed value loses the identity (one
warning), never the namespace and so never its blocks.
"""

from __future__ import annotations

import json
import logging
import struct
import zlib
from dataclasses import dataclass, field

import numpy as np

from kvoffd.cache.checksum import LEGACY_CRC32, NONE
from kvoffd.cache.identity import EventIdentity, HashForm
from kvoffd.pool.format import NS_AREA_BYTES, PoolLayout

log = logging.getLogger(__name__)

SEALED = 0x5EA1ED01  # an older daemon's record: zlib's crc32 (read only)
SUMMED = 0x5EA1ED02  # committed, with its checksum (kvoffd/cache/checksum.py)
COMMITTED = 0xC0117ED1  # committed, its checksum not known yet
_STATE = np.uint64(0xFFFFFFFF)
_LOW = np.uint64(0xFFFFFFFF)
_MIX = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5,
                 0x85EBCA77C2B2AE63, 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53], dtype=np.uint64)
_NS_HEAD = struct.Struct("<4sQII")  # magic, generation, length, crc32
_NS_MAGIC = b"KVNS"
MAX_NAMESPACE_IDS = 0xFFFF


def _check(words: np.ndarray) -> np.ndarray:
    """Word 7 of records whose words 0-6 are ``words`` (n, 7): multiply-xor mixing, vectorised."""
    with np.errstate(over="ignore"):
        m = words * _MIX
        m ^= m >> np.uint64(29)
        return np.bitwise_xor.reduce(m, axis=1) ^ np.uint64(0xA5A5A5A5A5A5A5A5)


@dataclass
class Found:
    """The sealed records of one scan, as parallel arrays (record order)."""

    ns_id: np.ndarray
    rank: np.ndarray
    keys: np.ndarray  # (n, 32) uint8
    stamp: np.ndarray
    crc: np.ndarray  # the checksum (NONE: not known yet; LEGACY_CRC32 | crc32: an older daemon's)
    slot_bytes: np.ndarray
    offset: np.ndarray  # the slot's offset in the pool
    record: np.ndarray  # the record's index


class SlotRecords:
    """The slot records of one pool file, seen as an (n, 8) uint64 array."""

    def __init__(self, words: np.ndarray, chunks: np.ndarray, layout: PoolLayout):
        """``chunks``: the chunk map, each chunk's slot size as of its last sealed record, so that a
        scan reads only the records a chunk of that size can have (32 of a 64 MiB chunk of 2 MiB
        slots, not 4,096: a 64 GiB pool is scanned in milliseconds). Written before the record; a
        chunk changes slot size only once all its slots were freed, so its records were invalidated."""
        self.words = words
        self.chunks = chunks
        self.layout = layout
        self._cb = layout.chunk_bytes
        self._per = layout.records_per_chunk

    def index_of(self, slots: np.ndarray, slot_bytes: int) -> np.ndarray:
        """Record index of each slot; -1 for a slot with no record (beyond the chunk's first ones)."""
        chunk, inner = np.divmod(slots, self._cb)
        i = inner // slot_bytes
        return np.where(i < self._per, chunk * self._per + i, -1)

    def seal(self, idx: np.ndarray, ns_id: int, rank: int, keys: bytes, stamps: np.ndarray, crcs: np.ndarray,
             slot_bytes: int) -> None:
        """Write the records at ``idx`` (all >= 0) of blocks of one table whose copies completed, keys
        concatenated: SUMMED where ``crcs`` holds the checksum, COMMITTED where it is NONE (``fill``
        adds it later)."""
        n = len(idx)
        self.chunks[idx // self._per] = slot_bytes
        known = crcs >= 0
        body = np.empty((n, 7), dtype=np.uint64)
        body[:, 0] = np.where(known, np.uint64(SUMMED), np.uint64(COMMITTED)) | np.uint64((ns_id << 32) | (rank << 48))
        body[:, 1:5] = np.frombuffer(keys, dtype=np.uint64).reshape(n, 4)
        body[:, 5] = stamps.astype(np.float64).view(np.uint64)
        body[:, 6] = np.where(known, crcs, 0).astype(np.uint64) | np.uint64(slot_bytes << 32)
        w = self.words
        w[idx, 0] = 0
        w[idx, 1:7] = body[:, 1:]
        w[idx, 7] = _check(body)
        w[idx, 0] = body[:, 0]

    def fill(self, idx: np.ndarray, crcs: np.ndarray) -> int:
        """The checksums of COMMITTED records at ``idx`` (others are left as they are: gone, or summed
        already): COMMITTED becomes SUMMED, and the record is valid at every step (module docstring).
        Returns how many were filled in."""
        w = self.words
        mine = (w[idx, 0] & _STATE) == COMMITTED
        idx, crcs = idx[mine], crcs[mine]
        if not len(idx):
            return 0
        body = w[idx, :7].copy()
        body[:, 0] = (body[:, 0] & ~_STATE) | np.uint64(SUMMED)
        body[:, 6] = (body[:, 6] & ~_LOW) | crcs.astype(np.uint64)
        w[idx, 6] = body[:, 6]  # still a COMMITTED record: its check leaves these bits out
        w[idx, 7] = _check(body)  # now the check of the SUMMED form
        w[idx, 0] = body[:, 0]
        return len(idx)

    def invalidate(self, idx: np.ndarray) -> None:
        self.words[idx, 0] = 0

    def touch(self, idx: np.ndarray, stamp: float) -> None:
        """New last-use stamps for the valid records among ``idx`` (the others stay as they are)."""
        w = self.words
        state = w[idx, 0] & _STATE
        idx = idx[(state == SUMMED) | (state == COMMITTED) | (state == SEALED)]
        if not len(idx):
            return
        body = w[idx, :7].copy()
        body[:, 5] = np.float64(stamp).view(np.uint64)
        first = body[:, 0].copy()
        w[idx, 0] = 0
        w[idx, 5] = body[:, 5]
        w[idx, 7] = _check(body)
        w[idx, 0] = first

    def scan(self) -> Found:
        """Every whole, valid record, with or without its checksum (a torn or damaged one fails its check
        and is left out)."""
        w = self.words
        sizes = self.chunks.astype(np.int64)
        used = np.flatnonzero((sizes > 0) & (sizes <= self._cb))
        n = np.minimum(self._per, self._cb // np.maximum(sizes[used], 1))
        start = np.repeat(used * self._per - np.cumsum(n) + n, n)
        cand = start + np.arange(int(n.sum()), dtype=np.int64)  # chunk c's records c*per .. c*per+n-1
        state = w[cand, 0] & _STATE
        sealed = cand[(state == SUMMED) | (state == COMMITTED) | (state == SEALED)]
        rec = w[sealed]
        state = rec[:, 0] & _STATE
        ident = rec[:, 0] & ~_STATE
        summed = rec[:, :7].copy()  # the SUMMED form (also a COMMITTED record whose fill reached word 7)
        summed[:, 0] = np.where(state == SEALED, rec[:, 0], ident | np.uint64(SUMMED))
        has_sum = rec[:, 7] == _check(summed)
        committed = rec[:, :7].copy()  # the COMMITTED form: no checksum bits
        committed[:, 0] = ident | np.uint64(COMMITTED)
        committed[:, 6] &= ~_LOW
        no_sum = (state != SEALED) & ~has_sum & (rec[:, 7] == _check(committed))
        ok = has_sum | no_sum
        rec, idx, state, no_sum = rec[ok], sealed[ok], state[ok], no_sum[ok]
        slot_bytes = (rec[:, 6] >> np.uint64(32)).astype(np.int64)
        crc = (rec[:, 6] & _LOW).astype(np.int64)
        crc = np.where(no_sum, NONE, np.where(state == SEALED, crc | LEGACY_CRC32, crc))
        chunk, i = np.divmod(idx.astype(np.int64), self._per)
        return Found(ns_id=((rec[:, 0] >> np.uint64(32)) & np.uint64(0xFFFF)).astype(np.int64),
                     rank=(rec[:, 0] >> np.uint64(48)).astype(np.int64),
                     keys=rec[:, 1:5].copy().view(np.uint8).reshape(-1, 32),
                     stamp=rec[:, 5].copy().view(np.float64),
                     crc=crc,
                     slot_bytes=slot_bytes,
                     offset=chunk * self._cb + i * np.maximum(slot_bytes, 1), record=idx.astype(np.int64))


@dataclass
class RankFacts:
    slot_bytes: int
    layout: tuple[int, ...]


@dataclass
class NamespaceFacts:
    """What a namespace was registered with: a re-registering engine must match it."""

    name: str
    world_size: int
    ranks: dict[int, RankFacts] = field(default_factory=dict)  # storing ranks only (``replicas``)
    replicas: int = 1  # REGISTER.replicas: runs of ranks sharing one copy, stored by the run's first rank
    #: its engines' ``layout.kv_events`` (None: not said, or keys that are not block hashes). Not part of
    #: what a re-registering engine must match: it is what the KV-event stream shows, not the bytes.
    events: EventIdentity | None = None


def _events_doc(ident: EventIdentity | None) -> dict[str, object] | None:
    if ident is None:
        return None
    return {"hash": ident.hash_form.value, "block_size": ident.block_size, "group_idx": ident.group_idx}


def _events_of(doc: object, name: str) -> EventIdentity | None:
    """A namespace's persisted event identity; a malformed one is dropped with a warning (the namespace
    and its blocks stay: only the announcement at start waits for the engine's REGISTER)."""
    if doc is None:
        return None
    try:
        block_size, group_idx = doc["block_size"], doc.get("group_idx", 0)
        if type(block_size) is not int or type(group_idx) is not int or block_size < 1 or group_idx < 0:
            raise ValueError(f"block_size {block_size!r}, group_idx {group_idx!r}")
        return EventIdentity(HashForm(doc["hash"]), block_size, group_idx)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("the pool's namespace area: namespace %r has a malformed KV-event identity (%s); its blocks "
                    "are announced once an engine registers it", name, e)
        return None


class NamespaceArea:
    """Namespace ids and facts, kept in the file's two namespace areas."""

    def __init__(self, area: memoryview):
        self.area = area  # 2 * NS_AREA_BYTES
        self.by_id: dict[int, NamespaceFacts] = {}
        self.generation = 0

    def load(self) -> None:
        """The newest whole copy (none whole: no namespaces, so no record is adopted)."""
        best = None
        for a in (0, 1):
            raw = self.area[a * NS_AREA_BYTES:(a + 1) * NS_AREA_BYTES]
            magic, gen, length, crc = _NS_HEAD.unpack_from(raw)
            body = bytes(raw[_NS_HEAD.size:_NS_HEAD.size + length]) if length <= NS_AREA_BYTES - _NS_HEAD.size else b""
            if magic == _NS_MAGIC and body and zlib.crc32(body) == crc and (best is None or gen > best[0]):
                best = (gen, body)
        if best is None:
            return
        self.generation = best[0]
        try:
            doc = json.loads(best[1])
            for item in doc["namespaces"]:
                ranks = {int(r): RankFacts(int(f["slot_bytes"]), tuple(int(x) for x in f["layout"]))
                         for r, f in item["ranks"].items()}
                replicas = int(item.get("replicas", 1))
                if replicas < 1:
                    raise ValueError(f"replicas {replicas}")
                name = str(item["name"])
                self.by_id[int(item["id"])] = NamespaceFacts(name, int(item["world_size"]), ranks, replicas,
                                                             _events_of(item.get("events"), name))
        except (ValueError, KeyError, TypeError) as e:
            log.warning("the pool's namespace area is damaged (%s); its blocks are not adopted", e)
            self.by_id.clear()

    def id_for(self, facts: NamespaceFacts) -> int | None:
        """The id of a namespace with exactly these facts, made (and saved) if new; None when full."""
        for i, f in self.by_id.items():
            if f.name == facts.name and f.world_size == facts.world_size and f.replicas == facts.replicas and all(
                    f.ranks.get(r, rf) == rf for r, rf in facts.ranks.items()):
                if any(r not in f.ranks for r in facts.ranks):
                    f.ranks.update(facts.ranks)
                    if not self.save():
                        return None
                return i
        new = max(self.by_id, default=0) + 1
        if new > MAX_NAMESPACE_IDS:
            return None
        self.by_id[new] = facts
        if not self.save():
            del self.by_id[new]
            return None
        return new

    def set_events(self, name: str, ident: EventIdentity | None) -> None:
        """What REGISTER's ``layout.kv_events`` now says for namespace ``name``: saved if it changed."""
        changed = [f for f in self.by_id.values() if f.name == name and f.events != ident]
        for f in changed:
            f.events = ident
        if changed:
            self.save()

    def keep_only(self, ids: set[int]) -> None:
        """Forget the namespaces no adopted block uses (the area stays small across restarts)."""
        self.by_id = {i: f for i, f in self.by_id.items() if i in ids}
        self.save()

    def save(self) -> bool:
        doc = {"namespaces": [{"id": i, "name": f.name, "world_size": f.world_size, "replicas": f.replicas,
                               "ranks": {str(r): {"slot_bytes": rf.slot_bytes, "layout": list(rf.layout)}
                                         for r, rf in f.ranks.items()},
                               **({"events": _events_doc(f.events)} if f.events is not None else {})}
                              for i, f in self.by_id.items()]}
        body = json.dumps(doc, separators=(",", ":")).encode()
        if len(body) > NS_AREA_BYTES - _NS_HEAD.size:
            log.warning("the pool's namespace area is full (%d bytes); new namespaces are not persisted", len(body))
            return False
        self.generation += 1
        a = self.generation % 2
        base = a * NS_AREA_BYTES
        self.area[base:base + _NS_HEAD.size] = b"\0" * _NS_HEAD.size  # invalid while written
        self.area[base + _NS_HEAD.size:base + _NS_HEAD.size + len(body)] = body
        self.area[base:base + _NS_HEAD.size] = _NS_HEAD.pack(_NS_MAGIC, self.generation, len(body), zlib.crc32(body))
        return True
