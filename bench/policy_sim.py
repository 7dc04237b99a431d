"""Every admission/eviction policy at every capacity on a Mooncake-format trace (issue 15 point 2).

Drives each policy (``kvoffd.cache.policy.EvictionPolicy``: the default and LRU from
kvoffd/cache/policy.py, the others from bench/policy_zoo.py) through the daemon's call sequence, per
request: LOOKUP (hits = leading resident blocks; ``on_lookup_miss`` with the rest), LOAD
(``on_access`` per hit block, in key order), STORE (``on_access`` per named resident key, then
``admit`` per new key in key order, ``victim`` per slot needed, ``on_insert`` per placed block; keys
admitted but left without room are dropped from the end, ``on_remove``). The trace loading, the exact
model of kvoffd's LRU, the optimum (Belady MIN with bypass: an upper bound) and the unbounded figure
come from bench/trace_replay.py; the bench checks that the LRU *policy* through this driver gives the
same hits as that exact model, request for request, so the driver is the daemon's sequence.

Each trace is run whole and also as its first and second halves (each from a cold cache): parameters
are chosen on the first half, the second half shows they were not tuned to it.

    python bench/policy_sim.py [--trace PATH ...] [--capacities 500,1000,2000,4000,8000,16000,18000]
                               [--policies a,b] [--jobs 2] [--out results.json]
    python bench/policy_sim.py --micro      # ns per block of each policy call path

Output JSON: ``{trace: {part: {"capacities": [...], "block_hit_ratio": {policy: [...]},
"unbounded": x, "seconds": {policy: s}}}}`` where part is ``all``, ``first_half``, ``second_half`` and
policy includes ``lru``, ``lru-exact`` (the trace_replay model), ``optimum``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Container, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent
for p in (ROOT.parent, ROOT):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import trace_replay as T  # noqa: E402
from policy_zoo import zoo  # noqa: E402

from kvoffd.cache.policy import DEFAULT_POLICY, LRU, EvictionPolicy  # noqa: E402

CAPACITIES = (500, 1000, 2000, 4000, 8000, 16000, 18000)
PARTS = ("all", "first_half", "second_half")


def factories() -> dict[str, Callable[[int], EvictionPolicy]]:
    return {"lru": LRU, **zoo()}


class TierModel:
    """One tier of ``capacity`` blocks driven through ``policy`` in the daemon's call order.

    Split out of ``simulate`` so that bench/tier_sim.py drives a pool *and* a disk tier with the same
    code: the disk tier is a second model whose STOREs are the pool's evictions. ``store`` returns the
    blocks it evicted (in eviction order) and the ones the policy refused, for the tier below."""

    def __init__(self, policy: EvictionPolicy, capacity: int, tally: T.Tally | None = None):
        self.policy = policy
        self.capacity = capacity
        self.resident: set = set()
        self.t = tally if tally is not None else T.Tally()

    def load(self, keys: Sequence) -> None:
        """A LOAD ended: its blocks were used, in key order."""
        for b in keys:
            self.policy.on_access(b)

    def evict(self, n: int, pinned: Container = ()) -> list:
        """Up to ``n`` victims; a pinned one is skipped and handed back as just used (Index.release)."""
        out: list = []
        back: list = []
        policy, resident = self.policy, self.resident
        while len(out) < n:
            v = policy.victim()
            if v is None:
                break
            if v in pinned:
                back.append(v)
                continue
            resident.remove(v)  # KeyError: the policy named a block it never held
            out.append(v)
        self.t.evicted += len(out)
        for v in back:
            policy.on_access(v)
        return out

    def store(self, keys: Sequence, parents: Sequence, present: Container = (), admit: bool = True,
              pinned: Container = ()) -> tuple[list, list]:
        """A STORE of ``keys`` (``parents[i]``: the block before ``keys[i]`` in its prefix, None for a
        head). ``present``: blocks outside this tier that count as a present parent (the pool, for the
        disk). ``admit=False``: a promotion (the index bypasses admission). Returns (evicted, refused)."""
        policy, resident = self.policy, self.resident
        for b in keys:  # Index._touch: the STORE's resident keys first
            if b in resident:
                policy.on_access(b)
                self.t.noop += 1
        admitted: list = []
        ps: list = []
        refused: list = []
        taken: set = set()
        for b, parent in zip(keys, parents, strict=True):
            if b in resident or b in taken:
                continue
            ok = parent is None or parent in resident or parent in taken or parent in present
            if not admit or policy.admit(b, ok):
                admitted.append(b)
                ps.append(parent)
                taken.add(b)
            else:
                refused.append(b)
        short = len(admitted) - (self.capacity - len(resident))
        evicted = self.evict(short, pinned) if short > 0 else []
        room = max(0, self.capacity - len(resident))
        for b in admitted[room:]:
            policy.on_remove(b)
        self.t.dropped += max(0, len(admitted) - room)
        for b, parent in zip(admitted[:room], ps[:room], strict=True):
            resident.add(b)
            policy.on_insert(b, parent)
        self.t.stored += min(room, len(admitted))
        return evicted, refused

    def remove(self, key) -> None:
        """The block leaves for a reason of the caller's (an exclusive tier promoted it)."""
        self.resident.discard(key)
        self.policy.on_remove(key)

    def check(self) -> None:
        if len(self.policy) != len(self.resident):
            raise AssertionError(f"{self.policy.name}: tracks {len(self.policy)} blocks, "
                                 f"{len(self.resident)} resident")


def simulate(trace: T.Trace, policy: EvictionPolicy, capacity: int) -> T.Tally:
    """The trace through ``policy`` at ``capacity`` blocks, in the daemon's call order (module docstring)."""
    m = TierModel(policy, capacity)
    for r in trace.requests:
        ids = r.hash_ids
        h = T.leading_hits(ids, m.resident)
        m.t.hits.append(h)
        policy.on_lookup_miss(ids[h:])
        m.load(ids[:h])
        if h < len(ids):
            m.store(ids[h:], (ids[h - 1] if h else None, *ids[h:-1]))
        m.check()
    return m.t


def halves(trace: T.Trace) -> dict[str, T.Trace]:
    n = len(trace.requests) // 2
    return {"all": trace, "first_half": T.Trace(trace.name + "[:half]", trace.requests[:n]),
            "second_half": T.Trace(trace.name + "[half:]", trace.requests[n:])}


def _job(args: tuple[Path, str, str, int]) -> tuple[str, str, int, float, float]:
    path, part, name, cap = args
    trace = halves(T.load_trace(path))[part]
    t0 = time.process_time()
    if name == "optimum":
        tally = T.simulate_optimum(trace, cap)
    elif name == "lru-exact":
        tally = T.simulate_lru(trace, cap)
    else:
        tally = simulate(trace, factories()[name](cap), cap)
        if name == "lru" and tally.hits != T.simulate_lru(trace, cap).hits:
            raise AssertionError(f"the driver's LRU differs from trace_replay's exact model at {cap}")
    return part, name, cap, tally.block_ratio(trace), time.process_time() - t0


def run(path: Path, capacities: Sequence[int], names: Sequence[str], jobs: int = 2,
        parts: Sequence[str] = PARTS) -> dict:
    trace = T.load_trace(path)
    if not T.prefix_consistent(trace):
        print(f"WARNING: {path.name}: a hash id follows different parents: the optimum is not a bound")
    every = ["lru-exact", *names, "optimum"]
    work = [(path, part, n, c) for part in parts for n in every for c in capacities]
    out: dict = {}
    for part in parts:
        tr = halves(trace)[part]
        out[part] = {"requests": len(tr.requests), "asked_blocks": tr.asked_blocks,
                     "capacities": list(capacities), "block_hit_ratio": {n: [0.0] * len(capacities) for n in every},
                     "seconds": {n: 0.0 for n in every},
                     "unbounded": T.simulate_unbounded(tr).block_ratio(tr)}
    with ProcessPoolExecutor(max(1, jobs)) as ex:
        for part, name, cap, ratio, secs in ex.map(_job, work):
            o = out[part]
            o["block_hit_ratio"][name][list(capacities).index(cap)] = ratio
            o["seconds"][name] += secs
    return out


def table(res: dict) -> str:
    caps = res["capacities"]
    lru = res["block_hit_ratio"]["lru-exact"]
    rows = ["| policy | " + " | ".join(f"{c:,}" for c in caps) + " |", "|---|" + "---|" * len(caps)]
    for name, ratios in res["block_hit_ratio"].items():
        cells = []
        for r, base in zip(ratios, lru, strict=True):
            rel = "" if name in ("lru", "lru-exact", "optimum") or not base else f" ({r / base:.2f}×)"
            cells.append(f"{r:.1%}{rel}")
        label = f"**{name}** (default)" if name == DEFAULT_POLICY else name
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    rows.append("| unbounded | " + " | ".join(f"{res['unbounded']:.1%}" for _ in caps) + " |")
    return "\n".join(rows)


def _offer(pol: EvictionPolicy, keys: Sequence[bytes], capacity: int) -> None:
    """``keys`` as one STORE's new blocks, in the index's order: admit each, then the victims for all,
    then insert each."""
    taken = [k for k in keys if pol.admit(k, True)]
    for _ in range(len(pol) + len(taken) - capacity):
        pol.victim()
    prev = None
    for k in taken:
        pol.on_insert(k, prev)
        prev = k


def micro(capacity: int = 100_000, blocks: int = 200_000, request: int = 64) -> dict[str, dict[str, float]]:
    """Per-block cost of each call path, for LRU and the default, on a full tier of ``capacity`` blocks
    with 32-byte keys (the daemon's): ``store_first`` = a new block's first request (the default
    refuses it), ``store_again`` = its second (admitted: admit + victim + on_insert), ``access`` =
    on_access of a resident block (a LOAD ends), ``lookup`` = on_lookup_miss per LOOKUP of ``request``
    keys (ns per call), ``bytes_per_block`` = the policy's memory (tracemalloc) per block of capacity
    once its ghosts are full."""
    import gc
    import tracemalloc

    out: dict[str, dict[str, float]] = {}
    keys = [i.to_bytes(32, "little") for i in range(capacity + 2 * blocks)]
    for name in ("lru", DEFAULT_POLICY):
        gc.collect()
        tracemalloc.start()
        pol = factories()[name](capacity)
        for rounds in (keys[:capacity], keys[capacity + blocks:]):  # asked for twice, ghosts full
            _offer(pol, rounds, capacity)
            _offer(pol, rounds, capacity)
        res: dict[str, float] = {"bytes_per_block": tracemalloc.get_traced_memory()[0] / capacity}
        tracemalloc.stop()
        del pol
        gc.collect()
        pol = factories()[name](capacity)
        _offer(pol, keys[:capacity], capacity)
        _offer(pol, keys[:capacity], capacity)  # asked for twice: resident under every policy
        for label, batch in (("store_first", keys[capacity:capacity + blocks]),
                             ("store_again", keys[capacity:capacity + blocks])):
            t0 = time.perf_counter_ns()
            for a in range(0, len(batch), request):
                pol.on_lookup_miss(())
                _offer(pol, batch[a:a + request], capacity)
            res[label] = (time.perf_counter_ns() - t0) / len(batch)
        _offer(pol, keys[capacity + blocks:], capacity)
        _offer(pol, keys[capacity + blocks:], capacity)
        hot = keys[capacity + 2 * blocks - capacity // 2:]
        t0 = time.perf_counter_ns()
        n = 0
        while n < blocks:
            for a in range(0, len(hot), request):
                pol.on_lookup_miss(())
                for k in hot[a:a + request]:
                    pol.on_access(k)
            n += len(hot)
        if hasattr(pol, "victim"):
            pol.victim()  # the default's deferred refresh is part of the cost
        res["access"] = (time.perf_counter_ns() - t0) / n
        t0 = time.perf_counter_ns()
        for _ in range(10_000):
            pol.on_lookup_miss(())
        res["lookup_ns_per_call"] = (time.perf_counter_ns() - t0) / 10_000
        out[name] = res
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, action="append", help="Mooncake-format jsonl (repeatable)")
    ap.add_argument("--capacities", default=",".join(map(str, CAPACITIES)), help="comma-separated, blocks")
    ap.add_argument("--policies", default="", help="comma-separated (default: all, lru first)")
    ap.add_argument("--parts", default=",".join(PARTS), help="all,first_half,second_half")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--micro", action="store_true", help="only the per-block cost of each call path")
    a = ap.parse_args(argv)
    if a.micro:
        for name, res in micro().items():
            print(f"{name}: " + ", ".join(f"{k} {v:.0f}" for k, v in res.items()))
        return 0
    caps = [int(x) for x in a.capacities.split(",") if x.strip()]
    names = [n for n in a.policies.split(",") if n] or list(factories())
    unknown = set(names) - set(factories())
    if unknown:
        ap.error(f"unknown policies {sorted(unknown)}; choose from {sorted(factories())}")
    results: dict = {}
    t0 = time.monotonic()
    for path in a.trace or [T.DEFAULT_TRACE]:
        results[path.stem] = res = run(path, caps, names, a.jobs, [p for p in a.parts.split(",") if p])
        for part, r in res.items():
            print(f"\n{path.stem} — {part}: {r['requests']:,} requests, {r['asked_blocks']:,} blocks asked for; "
                  "block hit ratio (× LRU)")
            print(table(r), flush=True)
    print(f"\nwall time {time.monotonic() - t0:.0f} s")
    if a.out:
        a.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
