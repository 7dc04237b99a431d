"""The disk tier's tables: ``tables.json``, table id -> namespace, rank, world size and layout.

A table is one namespace x rank's blocks (kvoffd/cache/tiers/base.py's ``TableRef``); the disk index
(kvoffd/cache/tiers/diskindex.py) keys each record by its table's 32-bit id, so the ids must outlive the
process. What the file says is checked as data: a row not of the shape this daemon writes, or a table
id said twice, is left out (its blocks are then dropped as unknown: a colder tier), with one log line,
never an error at start.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os

import numpy as np

from kvoffd.cache.tiers.base import TableRef, TierStats

log = logging.getLogger(__name__)

MAX_TID = 0xFFFFFFFF  # table ids are 32-bit in the index (0: an empty record)
_NAME = "tables.json"


class TableIds:
    """The tables a disk tier holds blocks of, by id, saved in ``tables.json`` under the tier's
    directory (``dir_fd``) at each new one; and each table's CLEAR generation (in memory: a spill that
    straddles a CLEAR of its table is dropped)."""

    def __init__(self, path: str, dir_fd: int, st: TierStats):
        self._path = os.path.join(path, _NAME)
        self._dir = dir_fd
        self._st = st  # a failed save counts as an I/O error
        self._tids: dict[TableRef, int] = {}
        self.refs: dict[int, TableRef] = {}  # tid -> its table
        self._gen: dict[int, int] = {}  # tid -> CLEAR generation
        self._load()

    def _load(self) -> None:
        p = self._path
        try:
            fd = os.open(_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir)
            with os.fdopen(fd, "rb") as f:
                doc = json.loads(f.read(64 << 20))
        except FileNotFoundError:
            return
        except (OSError, ValueError, RecursionError) as e:
            log.error("disk tier: %s unreadable (%s): its blocks are not served", p, e)
            return
        rows = doc.get("tables") if isinstance(doc, dict) else None
        if not isinstance(rows, list):
            log.error("disk tier: %s is not {\"tables\": [...]}: its blocks are not served", p)
            return
        parsed = [_table_row(r) for r in rows]
        ids = [g[0] for g in parsed if g is not None]
        twice = {t for t in ids if ids.count(t) > 1} if len(set(ids)) < len(ids) else set()
        refs: dict[int, TableRef] = {}
        for got in parsed:  # a table id said twice: none of its rows can be trusted
            if got is not None and got[0] not in twice and got[1] not in refs.values():
                refs[got[0]] = got[1]
        bad = len(rows) - len(refs)
        if bad:
            log.error("disk tier: %s: %d of %d tables are not of the right shape or repeat another; their "
                      "blocks are not served", p, bad, len(rows))
        for tid, ref in refs.items():
            self._tids[ref] = tid
            self.refs[tid] = ref

    def _save(self) -> None:
        rows = [{"tid": t, "namespace": r.namespace, "rank": r.rank, "world_size": r.world_size,
                 "layout": list(r.layout)} for r, t in self._tids.items()]
        try:
            with contextlib.suppress(FileNotFoundError):  # a leftover (or anything else by that name) goes
                os.unlink(_NAME + ".tmp", dir_fd=self._dir)
            fd = os.open(_NAME + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600, dir_fd=self._dir)
            with os.fdopen(fd, "w") as f:
                json.dump({"tables": rows}, f)
                f.flush()
                os.fsync(f.fileno())
            os.rename(_NAME + ".tmp", _NAME, src_dir_fd=self._dir, dst_dir_fd=self._dir)
        except OSError as e:  # the table works until the restart; its blocks are then not found
            self._st.io_errors += 1
            log.error("disk tier: cannot save %s: %s", self._path, e)

    def tid(self, ref: TableRef, create: bool) -> int:
        """``ref``'s id (0: not known, unless ``create``: then a new one, saved before it is used)."""
        tid = self._tids.get(ref)
        if tid is None and create:
            tid = max(self.refs, default=0) + 1
            if tid > MAX_TID:  # ids are never reused while known, so this takes a free one below
                tid = next(t for t in itertools.count(1) if t not in self.refs)
            self._tids[ref] = tid
            self.refs[tid] = ref
            self._save()
        return tid or 0

    def known(self) -> np.ndarray:
        """Every known table id (uint32)."""
        return np.fromiter(self.refs, dtype=np.uint32, count=len(self.refs))

    def of_namespace(self, namespace: str) -> list[int]:
        """The ids of ``namespace``'s tables ("": of every table)."""
        return [t for t, r in self.refs.items() if not namespace or r.namespace == namespace]

    def generation(self, tid: int) -> int:
        return self._gen.get(tid, 0)

    def cleared(self, tids: list[int]) -> None:
        """A CLEAR of these tables: a spill of theirs still in flight is dropped when it lands."""
        for t in tids:
            self._gen[t] = self._gen.get(t, 0) + 1


def _table_row(r: object) -> tuple[int, TableRef] | None:
    """A ``tables.json`` row as (table id, table), None unless it has the shape this daemon writes."""
    if not isinstance(r, dict):
        return None
    tid, ns, rank, world, layout = (r.get(k) for k in ("tid", "namespace", "rank", "world_size", "layout"))
    ints = all(type(v) is int for v in (tid, rank, world))  # (not bool)
    if not (ints and isinstance(ns, str) and isinstance(layout, list) and layout and 0 < tid <= MAX_TID
            and 0 <= rank < world <= 1 << 16 and all(type(x) is int and 0 < x < 1 << 40 for x in layout)):
        return None
    return tid, TableRef(ns, rank, world, tuple(layout))
