"""What the cluster tier costs the event loop per call, this tree against an older one, in one run.

The cluster tier answers on the loop from what it knows the cluster holds (``Known``) and the Publisher
takes each loop turn's admitted blocks there. This times, per call (median of ``--reps`` passes):

* ``Known.leading`` of 1, 64 and 1,024 keys all known, in a table holding ``--known`` other pairs (the old
  one is given its keys already split, as its callers split them; ``RemoteTier.probe`` below includes it);
* ``RemoteTier.probe`` of the same keys (what a LOOKUP past the local hits calls on the loop);
* Publisher admission of 64 and 1,024 blocks committed in one turn: ``committed`` and the turn's callback
  (``_take``: filter, "already there?", hold, queue), plus the release a dropped publish calls (the tier's
  queue is 0 blocks long here, so every batch is released at once, BUSY: the loop's whole share of one
  admission; no server is needed, none is reached), and under it the part that is the index's own: one
  ref taken and dropped per block (``hold_entries`` + ``release``, which hands each block back to its
  policy), the floor of any Publisher.

The older versions of kvoffd/cache/tiers/remote/tier.py and publisher.py are read from git (``--old``, by
default the commit before the one that added known.py) and loaded under other names for this run only;
everything else (index, pool, store) is this tree's. Prints microseconds per call and old / new.

    flock /work/notes/heavy.lock .venv/bin/python bench/remote_loop.py [--old REV] [--reps 7] [--out f.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvoffd.cache.index import Index  # noqa: E402
from kvoffd.cache.tiers.base import TableRef  # noqa: E402
from kvoffd.cache.tiers.remote import publisher as new_publisher  # noqa: E402
from kvoffd.cache.tiers.remote import tier as new_tier  # noqa: E402
from kvoffd.cache.tiers.remote.address import parse_url  # noqa: E402
from kvoffd.cache.tiers.remote.store import RemoteConfig, RemoteStore  # noqa: E402
from kvoffd.pool.allocator import Pool  # noqa: E402

SLOT = 4096  # the loop's cost does not depend on the block size
LAYOUT = (SLOT // 2, SLOT // 2)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def default_old() -> str:
    added = git("log", "--diff-filter=A", "--format=%H", "--", "kvoffd/cache/tiers/remote/known.py").splitlines()
    return f"{added[-1]}^" if added else "HEAD"


def load_old(rev: str) -> tuple[types.ModuleType, types.ModuleType]:
    """tier.py and publisher.py as they were at ``rev``, as modules of their own (the old publisher is given
    the old tier's module for its import)."""
    mods = []
    for name, path in (("tier", "kvoffd/cache/tiers/remote/tier.py"), ("publisher", "kvoffd/cache/tiers/remote/publisher.py")):
        src = git("show", f"{rev}:{path}")
        if name == "publisher":
            src = src.replace("from kvoffd.cache.tiers.remote.tier import", "from kvoffd_old_remote_tier import")
        mod = types.ModuleType(f"kvoffd_old_remote_{name}")
        mod.__file__ = f"{rev}:{path}"
        sys.modules[mod.__name__] = mod
        exec(compile(src, mod.__file__, "exec"), mod.__dict__)
        mods.append(mod)
    return mods[0], mods[1]


def per_call(fn, calls: int, reps: int) -> float:
    """Median microseconds per call of ``fn()`` over ``reps`` passes of ``calls`` calls."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(out)


def make_tier(mod: types.ModuleType, known_cap: int):
    store = RemoteStore(RemoteConfig(parse_url("redis://127.0.0.1:1")))  # never started: nothing is reached
    return mod.RemoteTier(store, queue_blocks=0, known_cap=known_cap)


def fill(tier, ns: bytes, keys: bytes, old: bool) -> None:
    tier.known.add(ns, new_tier.split_keys(keys) if old else keys)


def bench_known(mods: dict, rng: np.random.Generator, others: int, reps: int) -> list[dict]:
    rows = []
    table = TableRef("bench", 0, 1, LAYOUT)
    tiers = {}
    run = rng.integers(0, 256, 1024 * 32, dtype=np.uint8).tobytes()
    bg = rng.integers(0, 256, others * 32, dtype=np.uint8).tobytes()
    for v, mod in mods.items():
        t = make_tier(mod, 4 * others)
        ns = t._ns_id(table)
        for lo in range(0, len(bg), 1 << 20):
            fill(t, ns, bg[lo:lo + (1 << 20)], v == "old")
        fill(t, ns, run, v == "old")
        tiers[v] = (t, ns)
    for n in (1, 64, 1024):
        keys = run[:n * 32]
        split = new_tier.split_keys(keys)
        calls = max(20, 20000 // n)
        got = {}
        for what in ("Known.leading", "RemoteTier.probe"):
            row = {"what": what, "keys": n}
            for v, (t, ns) in tiers.items():
                arg = split if v == "old" else keys
                if what == "Known.leading":
                    assert t.known.leading(ns, arg) == n
                    row[v] = per_call(lambda t=t, ns=ns, arg=arg: t.known.leading(ns, arg), calls, reps)
                else:
                    assert t.probe(table, keys) == n
                    row[v] = per_call(lambda t=t, keys=keys: t.probe(table, keys), calls, reps)
            got[what] = row
            rows.append(row)
    return rows


def bench_publisher(mods: dict, pubs: dict, rng: np.random.Generator, others: int, reps: int) -> list[dict]:
    rows = []
    for n in (64, 1024):
        row = {"what": "Publisher admission", "keys": n}
        for v, mod in mods.items():
            loop = asyncio.new_event_loop()
            index = Index(Pool(64 * 1024 * SLOT, chunk_bytes=1024 * SLOT))
            tier = make_tier(mod, 4 * others)
            t = index.table("bench", 0, 1, SLOT, LAYOUT)
            ns = tier._ns_id(TableRef("bench", 0, 1, LAYOUT))
            fill(tier, ns, rng.integers(0, 256, others * 32, dtype=np.uint8).tobytes(), v == "old")
            pub = pubs[v].Publisher(index, tier)
            pub.start(loop)
            times = []
            for i in range(reps * max(3, 3000 // n)):
                ks = rng.integers(0, 256, n * 32, dtype=np.uint8).tobytes()
                plan = index.prepare_store(t, new_tier.split_keys(ks))
                entries = index.add_pending(plan)
                index.complete_store(plan, True)
                assert len(entries) == n
                t0 = time.perf_counter()
                pub.committed(entries)
                pub._take()
                times.append((time.perf_counter() - t0) * 1e6)
                loop.run_until_complete(asyncio.sleep(0))  # the callback ``committed`` scheduled: nothing left
                assert index.refs_taken == 0 and pub.held_bytes == 0 and tier.st.spills_dropped.get("busy") == n * (i + 1)
            row[v] = statistics.median(times)
            if v == "new":  # the index's own per-block share (a ref taken and dropped): the same in both
                refs = []
                for _ in range(reps * max(3, 3000 // n)):
                    t0 = time.perf_counter()
                    index.hold_entries(entries)
                    index.release(entries)
                    refs.append((time.perf_counter() - t0) * 1e6)
                floor = statistics.median(refs)
            loop.close()
            index.pool.close()
        rows.append(row)
        rows.append({"what": "  of it, index refs", "keys": n, "old": floor, "new": floor})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default=None, help="the git revision to compare with (default: before known.py)")
    ap.add_argument("--known", type=int, default=200_000, help="other pairs known (the table's fill)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rev = a.old or default_old()
    old_tier, old_pub = load_old(rev)
    mods = {"old": old_tier, "new": new_tier}
    pubs = {"old": old_pub, "new": new_publisher}
    rng = np.random.default_rng(a.seed)
    rows = bench_known(mods, rng, a.known, a.reps) + bench_publisher(mods, pubs, rng, a.known, a.reps)
    print(f"old = {git('rev-parse', '--short', rev)} ({rev}), new = this tree; {a.known:,} other pairs known; "
          f"python {platform.python_version()}, numpy {np.__version__}; microseconds per call, median of {a.reps}")
    print(f"{'':22s} {'keys':>5s} {'old us':>9s} {'new us':>9s} {'old/new':>8s}")
    for r in rows:
        r["old_over_new"] = r["old"] / r["new"]
        print(f"{r['what']:22s} {r['keys']:5d} {r['old']:9.1f} {r['new']:9.1f} {r['old_over_new']:7.2f}x")
    if a.out:
        Path(a.out).write_text(json.dumps({"old": rev, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
