"""Two-level hit ratio: a DRAM pool plus a disk tier below it, every pool x disk policy on one harness.

Why: with a pool of 2,000 blocks and a disk tier of 16,000 the daemon keeps 73.2% of the unbounded
hit ratio on the conversation trace where issue 15 asks for 85%; the pool's policies are searched by
bench/policy_sim.py, the disk's here. The pool is bench/policy_sim.py's ``TierModel`` (the daemon's
call order, any ``EvictionPolicy``); the disk is a second ``TierModel`` whose STOREs are the pool's
evictions, in eviction order, as ``kvoffd/cache/tiers/manager.py`` spills them. Per request:

* LOOKUP: the pool's leading hits, then (``Tiers.find_below`` and ``promote``) the following keys found in the
  pool or on disk. The disk's blocks are read (a use: ``on_access`` on the disk's policy) and promoted
  into the pool bypassing admission (``prepare_store(admit=False)``), the request's pool hits pinned;
  the pool's victims are spilled after the reads. *exclusive*: a promoted block leaves the disk;
  *inclusive* (the daemon today): it stays.
* LOAD: ``on_access`` on the pool for every hit block, in key order.
* STORE: the rest, through the pool's admission; its victims are spilled (and, with
  ``--spill-refused``, the blocks the pool refused: the daemon does not do that today).
* A spill of a block the disk holds is a touch (``DiskTier.contains(touch=True)``); a new one goes
  through the disk policy's ``admit`` (its parent is present if it is in the pool or on disk).

Disk policies beyond bench/policy_zoo.py's: ``clockN`` (CLOCK with an N-bit count, raised by a read or
a re-spill, lowered by each pass of the hand: ``clock2`` is kvoffd/cache/tiers/diskslots.py's CLOCK, step
for step) and prefix-aware CLOCK variants of our own (``Clock`` below). The ceiling for context is
Belady's MIN over pool + disk blocks in one tier (bench/trace_replay.py's optimum).

    python bench/tier_sim.py [--trace PATH ...] [--splits 2000+16000,1000+8000,4000+32000]
                             [--pool lru,guarded-doorkeeper] [--disk clock2,lru,...] [--modes incl,excl]
                             [--parts all,first_half,second_half] [--jobs 2] [--out F.json]

Output JSON: ``{trace: {part: {"unbounded": x, "asked_blocks": n, "rows": [{"split": "2000+16000",
"pool": p, "disk": d, "mode": "incl", "ratio": r, "of_unbounded": r / unbounded, "disk_hits": n}],
"one_tier": {"2000+16000": {"lru": r, "optimum": r}}}}}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
for p in (ROOT.parent, ROOT):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import numpy as np  # noqa: E402
import policy_sim as S  # noqa: E402
import trace_replay as T  # noqa: E402

from kvoffd.cache.policy import EvictionPolicy, Key  # noqa: E402
from kvoffd.cache.tiers.ghost import GhostFilter  # noqa: E402

SPLITS = ("2000+16000", "1000+8000", "4000+32000")
POOLS = ("lru", "guarded-doorkeeper", "tail-first-lru", "2q-0.5")
MODES = ("incl", "excl")


class Clock:
    """CLOCK with a ``bits``-bit count over a ring of slots: kvoffd/cache/tiers/diskslots.py's ``SizeClass.alloc``.

    A new block starts at 0; a read or a re-spill (``on_access``) raises the count by one (saturating);
    the hand lowers each count it passes and takes the first block at 0. Prefix-aware options, each a
    field or two in the disk tier's per-slot arrays (the record stays well under 100 B/block):

    * ``orphans``: the hand takes a block whose parent is neither on disk nor in the pool whatever its
      count (it can never be a leading hit again), and a spill whose parent is absent is refused.
      Needs the parent's slot per block (4 B) and the pool's presence (``pool``, set by the driver).
    * ``leaves``: at count 0 a block with children on disk is passed over once more (a chain is
      dropped from its tail, the shared head last). Needs the parent's slot and a child count (1 B).
    * ``ghost``: fingerprints of the last ``ghost`` x capacity blocks the hand evicted (8 B each); a
      spill found there starts at count ``ghost_ref`` (it was on disk before and came back: reuse).
    * ``hint``: a spill starts at min(max, times the block was hit before): the pool's entry would
      carry its hit count down (``hint_of``, set by the driver).
    """

    def __init__(self, capacity: int, bits: int = 2, *, orphans: bool = False, leaves: bool = False,
                 ghost: float = 0.0, ghost_ref: int = 1, hint: bool = False, direct: bool = False,
                 bloom: bool = False, name: str = ""):
        self.capacity = capacity
        self.name = name or f"clock{bits}"
        self.max = (1 << bits) - 1
        self.ring: list = []
        self.ref: list[int] = []
        self.slot: dict = {}
        self.free: deque[int] = deque()  # in the hand's order: a batch's first block takes its first victim's slot
        self.hand = 0
        self.orphans, self.leaves, self.hint = orphans, leaves, hint
        self.parent: dict = {}
        self.children: dict = {}
        self.pool: set = set()
        self.hint_of: dict = {}
        self._ghost: OrderedDict | None = OrderedDict() if ghost else None
        self._ghost_max = int(ghost * capacity)
        self._direct: list | None = [None] * max(1, self._ghost_max) if ghost and direct else None
        self._bloom = GhostFilter(max(1, self._ghost_max // 2)) if ghost and bloom else None
        self.ghost_ref = ghost_ref

    def __len__(self) -> int:
        return len(self.slot)

    def on_lookup_miss(self, keys: Iterable[Key]) -> None:
        pass

    def admit(self, key: Key, parent_present: bool) -> bool:
        return parent_present or not self.orphans

    def on_insert(self, key: Key, parent: Key | None) -> None:
        if self.free:
            s = self.free.popleft()
        else:
            s = len(self.ring)
            self.ring.append(None)
            self.ref.append(0)
        self.ring[s] = key
        self.slot[key] = s
        init = 0
        if self._bloom is not None:
            if self._bloom.contains(_words(key))[0]:
                init = self.ghost_ref
        elif self._direct is not None:
            j = _mix(key) % len(self._direct)
            if self._direct[j] == key:
                self._direct[j] = None
                init = self.ghost_ref
        elif self._ghost is not None and self._ghost.pop(key, 0) is None:
            init = self.ghost_ref
        if self.hint:
            init = max(init, self.hint_of.get(key, 0))
        self.ref[s] = min(self.max, init)
        if self.orphans or self.leaves:
            self.parent[key] = parent
            if parent in self.slot:
                self.children[parent] = self.children.get(parent, 0) + 1

    def on_access(self, key: Key) -> None:
        s = self.slot.get(key)
        if s is None:
            self.on_insert(key, None)
            return
        self.ref[s] = min(self.ref[s], self.max - 1) + 1

    def _orphan(self, key: Key) -> bool:
        p = self.parent.get(key)
        return p is not None and p not in self.slot and p not in self.pool

    def _drop(self, s: int) -> Key:
        key = self.ring[s]
        self.ring[s] = None
        del self.slot[key]
        self.free.append(s)
        if self.orphans or self.leaves:
            p = self.parent.pop(key, None)
            if p in self.children:
                self.children[p] -= 1
                if not self.children[p]:
                    del self.children[p]
            self.children.pop(key, None)
        return key

    def victim(self) -> Key | None:
        n = len(self.ring)
        if not self.slot:
            return None
        passed = 0
        while True:
            s = self.hand
            self.hand = (s + 1) % n
            k = self.ring[s]
            if k is None:
                continue
            passed += 1
            if self.orphans and self._orphan(k):
                break
            if self.ref[s] == 0:
                if self.leaves and self.children.get(k) and passed <= n:
                    continue
                break
            self.ref[s] -= 1
        key = self._drop(s)
        if self._bloom is not None:
            self._bloom.add(_words(key))
        elif self._direct is not None:
            self._direct[_mix(key) % len(self._direct)] = key
        elif self._ghost is not None:
            self._ghost[key] = None
            if len(self._ghost) > self._ghost_max:
                self._ghost.popitem(last=False)
        return key

    def on_remove(self, key: Key) -> None:
        s = self.slot.get(key)
        if s is not None:
            self._drop(s)


def _mix(key: Key) -> int:
    """A fingerprint's bucket: trace ids are small consecutive integers, the daemon's keys are hashes."""
    return (hash(key) * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF) >> 20


def _words(key: Key) -> np.ndarray:
    """A trace id as the daemon's key words (a 32-byte hash as (1, 4) uint64), for GhostFilter."""
    return np.frombuffer(hashlib.blake2b(str(key).encode(), digest_size=32).digest(), "<u8").reshape(1, 4)


def clock_variant(name: str) -> Callable[[int], EvictionPolicy] | None:
    """A CLOCK named by its options: ``clock<bits>[-ghost<factor>x<ref>][-dm][-hint][-orphans][-leaves]``
    (``-dm``: the ghost is a direct-mapped table of ``factor`` x capacity fingerprints instead of an exact
    FIFO; ``-bloom``: the daemon's kvoffd/cache/tiers/ghost.py, two segments of ``factor`` / 2 x capacity)."""
    m = re.fullmatch(r"clock(\d)((?:-ghost[\d.]+x\d)?)((?:-dm|-bloom)?)((?:-hint)?)((?:-orphans)?)((?:-leaves)?)",
                     name)
    if m is None:
        return None
    bits = int(m.group(1))
    g = re.fullmatch(r"-ghost([\d.]+)x(\d)", m.group(2)) if m.group(2) else None
    return lambda c: Clock(c, bits, ghost=float(g.group(1)) if g else 0.0, ghost_ref=int(g.group(2)) if g else 1,
                           direct=m.group(3) == "-dm", bloom=m.group(3) == "-bloom", hint=bool(m.group(4)), orphans=bool(m.group(5)),
                           leaves=bool(m.group(6)), name=name)


def disk_policies() -> dict[str, Callable[[int], EvictionPolicy]]:
    """name -> factory(capacity) for the disk tier: the zoo, LRU and the CLOCK family."""
    out: dict[str, Callable[[int], EvictionPolicy]] = dict(S.factories())
    out.update({
        "clock1": lambda c: Clock(c, 1),
        "clock2": lambda c: Clock(c, 2),
        "clock3": lambda c: Clock(c, 3),
        "clock2-orphans": lambda c: Clock(c, 2, orphans=True, name="clock2-orphans"),
        "clock2-leaves": lambda c: Clock(c, 2, leaves=True, name="clock2-leaves"),
        "clock2-ghost1x1": lambda c: Clock(c, 2, ghost=1.0, name="clock2-ghost1x1"),
        "clock2-ghost1x2": lambda c: Clock(c, 2, ghost=1.0, ghost_ref=2, name="clock2-ghost1x2"),
        "clock2-bloom": lambda c: Clock(c, 2, ghost=2.0, ghost_ref=2, bloom=True, name="clock2-bloom"),
        "clock2-hint": lambda c: Clock(c, 2, hint=True, name="clock2-hint"),
        "clock2-prefix": lambda c: Clock(c, 2, orphans=True, leaves=True, ghost=1.0, hint=True,
                                         name="clock2-prefix"),
    })
    return out


class _Either:
    def __init__(self, a: set, b: set):
        self.a, self.b = a, b

    def __contains__(self, k: object) -> bool:
        return k in self.a or k in self.b


@dataclass
class Result:
    hits: list[int]
    disk_hits: int
    first_reuse_hits: int  # hits on a block's first reuse (no policy has any signal about those yet)


def simulate2(trace: T.Trace, pool_pol: EvictionPolicy, pool_cap: int, disk_pol: EvictionPolicy,
              disk_cap: int, exclusive: bool = False, spill_refused: bool = False) -> Result:
    """The trace through a pool and a disk tier (module docstring for the order of the calls)."""
    parent: dict = {}
    for r in trace.requests:
        prev = None
        for b in r.hash_ids:
            parent.setdefault(b, prev)
            prev = b
    pool = S.TierModel(pool_pol, pool_cap)
    disk = S.TierModel(disk_pol, disk_cap)
    uses: dict = {}
    if isinstance(disk_pol, Clock):
        disk_pol.pool = pool.resident
        disk_pol.hint_of = uses
    pres, dres = pool.resident, disk.resident

    def spill(blocks: list) -> None:
        if blocks:  # a parent evicted in the same batch counts as present (it is being spilled too)
            disk.store(blocks, [parent[b] for b in blocks], present=_Either(pres, set(blocks)))

    hits: list[int] = []
    disk_hits = 0
    reused: set = set()
    for r in trace.requests:
        ids = r.hash_ids
        n = len(ids)
        h = T.leading_hits(ids, pres)
        pool_pol.on_lookup_miss(ids[h:])
        disk_pol.on_lookup_miss(ids[h:])
        m = h
        wanted: list = []
        while m < n:
            b = ids[m]
            if b not in pres:
                if b not in dres:
                    break
                wanted.append(b)
            m += 1
        if wanted:
            # the pool's slots first (``Tiers._promote``: ``prepare_store(admit=False)``); what finds no
            # room (a request longer than the pool, its hits pinned) ends the hits there, unread
            ev, _ = pool.store(wanted, [parent[b] for b in wanted], admit=False, pinned=set(ids[:m]))
            placed = [b for b in wanted if b in pres]
            if len(placed) < len(wanted):
                m = ids.index(wanted[len(placed)])
                wanted = placed
            disk_hits += len(wanted)
            for b in wanted:  # the reads: a use
                disk_pol.on_access(b)
            if exclusive:
                for b in wanted:
                    disk.remove(b)
            spill(ev)
        hits.append(m)
        for b in ids[:m]:
            uses[b] = uses.get(b, 0) + 1
        reused.update(ids[:m])
        pool.load(ids[:m])
        if m < n:
            ev, refused = pool.store(ids[m:], (ids[m - 1] if m else None, *ids[m:-1]))
            spill(ev)
            if spill_refused:
                spill(refused)
        pool.check()
        disk.check()
    return Result(hits, disk_hits, len(reused))


def first_reuses(trace: T.Trace) -> set:
    """The blocks an unbounded cache hits at least once: each of them has one first reuse."""
    seen: set = set()
    out: set = set()
    for r in trace.requests:
        for b in r.hash_ids:
            if b not in seen:
                break
            out.add(b)
        seen.update(r.hash_ids)
    return out


def _job(args: tuple) -> tuple:
    path, part, split, pool_name, disk_name, mode = args
    trace = S.halves(T.load_trace(path))[part]
    p, d = (int(x) for x in split.split("+"))
    t0 = time.process_time()
    if pool_name == "one-tier":  # LRU and the optimum over p + d blocks, one tier
        f = T.simulate_lru if disk_name == "lru" else T.simulate_optimum
        return path.stem, part, split, pool_name, disk_name, mode, f(trace, p + d).block_ratio(trace), (0, 0), \
            time.process_time() - t0
    make = disk_policies().get(disk_name) or clock_variant(disk_name)
    res = simulate2(trace, S.factories()[pool_name](p), p, make(d), d,
                    exclusive=mode.startswith("excl"), spill_refused=mode.endswith("+refused"))
    ratio = sum(res.hits) / max(1, trace.asked_blocks)
    return (path.stem, part, split, pool_name, disk_name, mode, ratio, (res.disk_hits, res.first_reuse_hits),
            time.process_time() - t0)


def run(paths: Sequence[Path], parts: Sequence[str], splits: Sequence[str], pools: Sequence[str],
        disks: Sequence[str], modes: Sequence[str], jobs: int) -> dict:
    out: dict = {}
    work = []
    for path in paths:
        trace = T.load_trace(path)
        for part in parts:
            tr = S.halves(trace)[part]
            out.setdefault(path.stem, {})[part] = {
                "requests": len(tr.requests), "asked_blocks": tr.asked_blocks,
                "unbounded": T.simulate_unbounded(tr).block_ratio(tr), "rows": [], "one_tier": {},
                "unbounded_first_reuse_hits": len(first_reuses(tr))}
            for split in splits:
                work += [(path, part, split, "one-tier", d, "") for d in ("lru", "optimum")]
                work += [(path, part, split, p, d, m) for p in pools for d in disks for m in modes]
    with ProcessPoolExecutor(max(1, jobs)) as ex:
        for stem, part, split, pool, disk, mode, ratio, dh, secs in ex.map(_job, work):
            o = out[stem][part]
            if pool == "one-tier":
                o["one_tier"].setdefault(split, {})[disk] = ratio
                continue
            o["rows"].append({"split": split, "pool": pool, "disk": disk, "mode": mode, "ratio": ratio,
                              "of_unbounded": ratio / o["unbounded"], "disk_hits": dh[0],
                              "first_reuse_hits": dh[1],
                              "seconds": round(secs, 1)})
    return out


def table(res: dict, splits: Sequence[str]) -> str:
    """One row per (pool, disk, mode), one column per split: block hit ratio (share of unbounded)."""
    cells: dict[tuple, dict[str, str]] = {}
    for r in res["rows"]:
        cells.setdefault((r["pool"], r["disk"], r["mode"]), {})[r["split"]] = \
            f"{r['ratio']:.1%} ({r['of_unbounded']:.1%})"
    head = "| pool | disk | mode | " + " | ".join(splits) + " |"
    rows = [head, "|---|---|---|" + "---|" * len(splits)]
    for (p, d, m), c in cells.items():
        rows.append(f"| {p} | {d} | {m} | " + " | ".join(c.get(s, "") for s in splits) + " |")
    u = res["unbounded"]
    for name in ("lru", "optimum"):
        vals = [res["one_tier"].get(s, {}).get(name) for s in splits]
        rows.append(f"| one tier of pool + disk blocks | {name} | — | "
                    + " | ".join(f"{v:.1%} ({v / u:.1%})" if v is not None else "" for v in vals) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, action="append", help="Mooncake-format jsonl (repeatable)")
    ap.add_argument("--splits", default=",".join(SPLITS), help="pool+disk blocks, comma-separated")
    ap.add_argument("--pool", default=",".join(POOLS), help="pool policies (bench/policy_sim.py's names)")
    ap.add_argument("--disk", default="", help="disk policies (default: all)")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="incl, excl (a promoted block leaves the disk); +refused: the pool's refusals spill too")
    ap.add_argument("--parts", default="all", help="all,first_half,second_half")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    split = [s for s in a.splits.split(",") if s]
    pools = [p for p in a.pool.split(",") if p]
    disks = [d for d in a.disk.split(",") if d] or list(disk_policies())
    bad = (set(pools) - set(S.factories())) | {d for d in disks if d not in disk_policies() and not clock_variant(d)}
    if bad:
        ap.error(f"unknown policies {sorted(bad)}")
    t0 = time.monotonic()
    res = run(a.trace or [T.DEFAULT_TRACE], [p for p in a.parts.split(",") if p], split, pools, disks,
              [m for m in a.modes.split(",") if m], a.jobs)
    for stem, parts in res.items():
        for part, r in parts.items():
            print(f"\n{stem} — {part}: {r['requests']:,} requests, {r['asked_blocks']:,} blocks; unbounded "
                  f"{r['unbounded']:.1%}; block hit ratio (share of unbounded)")
            print(table(r, split), flush=True)
    print(f"\nwall time {time.monotonic() - t0:.0f} s")
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
