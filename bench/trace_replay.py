"""Prefix-cache hit ratio on a Mooncake-format trace: a real kvoffd daemon next to LRU and the optimum.

Each request of the trace is replayed through a real daemon process (CPU path) the way vLLM's
connector drives it: one LOOKUP of the request's chained keys (with a lease), one LOAD of the hit
prefix, one STORE of the rest — one message each per request, never one per block. Each block is a
small payload (``--block-bytes``, 4 KiB by default) so that thousands of blocks fit a small machine;
the daemon's pool is sized to hold exactly ``capacity`` blocks, and the capacity it really held is
read back from its STATS (resident blocks once it has evicted) rather than assumed.

Next to the daemon the bench computes, on the same trace and in pure Python:

* **lru** — the daemon's own policy, modelled exactly (kvoffd/cache/index.py): a LOOKUP touches nothing; a
  LOAD's blocks become most recently used, in key order, when it ends; a STORE first marks the keys
  it names that are already resident as most recently used, then evicts the least recently used
  blocks it needs room for, and appends its new blocks in key order (keys that still find no room
  are dropped from the end). The replay is sequential, so no block is ever pinned at eviction time.
  The daemon's per-request hits must equal this simulation's (run at the capacity the daemon
  really had); the bench stops with a clear mismatch report otherwise.
* **optimum** — Belady's MIN with bypass over blocks: a block is admitted on a miss unless its next
  use lies no nearer than that of every resident block; when full, the resident block whose next
  use is farthest is evicted (never used again = infinitely far; ties go to the deepest block).
  In the trace a block's hash id fixes its whole prefix, so a block is never used without its
  parent and a parent's next use is never later than its child's; with the tie rule the resident
  set therefore stays prefix-closed and every resident block of a request is a *leading* one. So
  this figure is both the block-level optimum (MIN is optimal for hits of unit-size blocks when
  caching is optional) and an upper bound on the prefix hits of any policy, admission included,
  at that capacity. (The bench checks that each hash id always has the same parent; if a trace
  breaks that, the figure is reported as the block-level MIN counted as leading hits and a warning
  says it is no longer a bound.)
* **unbounded** — every block ever stored stays.

``--policy`` picks the daemon's ``--eviction-policy`` (default: the daemon's default). For ``lru`` the
daemon is checked against the exact LRU model above; for any other policy against
bench/policy_sim.py's simulation of that same policy (kvoffd/cache/policy.py, driven in the daemon's
call order, on the daemon's own 32-byte keys so that a sampling policy samples the same blocks), at
the capacity the daemon held: per-request hits, stored, no-op, evicted and dropped blocks must all be
equal. A refused admission is reported in the STORE's notice (``not_admitted``) and counted in
``admission_refused_blocks``. The ``lru`` line of the table and plot is always the LRU model.

Hits are leading resident blocks (what vLLM can use). Block hit ratio = hit blocks / blocks asked
for; token hit ratio = hit tokens / input tokens, where a hit covering a request's partial last
block counts its ``input_length`` (min(hits × 512, input_length)).

    python bench/trace_replay.py [--trace PATH] [--capacities 1000,2000,4000,8000] [--block-bytes 4096]
                                 [--policy guarded-doorkeeper] [--out results.json] [--plot hit_ratio.png]
                                 [--realtime] [--no-verify]

Output JSON (``--out``; bench/plot.py reads it; lists are in ``capacities`` order)::

    {
      "trace": "mooncake_conversation_trace",   # the trace file's stem
      "block_tokens": 512,
      "daemon_policy": "guarded-doorkeeper",    # the daemon's --eviction-policy (its line is "daemon")
      "capacities": [1000, 2000, 4000, 8000],   # asked-for capacities, in blocks
      "policies": {                             # block hit ratio per capacity
        "daemon": [...], "lru": [...], "optimum": [...]
      },
      "token_policies": {                       # token hit ratio per capacity, same keys
        "daemon": [...], "lru": [...], "optimum": [...]
      },
      "unbounded": 0.366,                       # block hit ratio with unbounded capacity
      "token_unbounded": 0.36,                  # token hit ratio with unbounded capacity
      "daemon_counters": {                      # per capacity (as a string): the daemon's STATS counters
        "1000": {"capacity_blocks": 1000,       #   capacity it really held (resident blocks when full)
                 "slot_bytes": 4096, "pool_bytes": 4096000, "seconds": 12.3,
                 "bench_hit_blocks": ..., "bench_loaded_blocks": ..., "bench_dropped_blocks": ...,
                 "lookups": ..., "lookup_hit_blocks": ..., "lookup_miss_blocks": ..., "loaded_blocks": ...,
                 "stored_blocks": ..., "store_noop_blocks": ..., "evicted_blocks": ..., "dropped_stores": ...,
                 "resident_blocks": ...}
      }
    }
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import math
import shutil
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Container, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from support.daemon import BenchDaemon, start_daemon  # noqa: E402
from support.engine import ShmEngine  # noqa: E402

from kvoffd.cache.policy import DEFAULT_POLICY, POLICIES, make_policy  # noqa: E402
from kvoffd_client.client import KvoffdClient  # noqa: E402

BLOCK_TOKENS = 512
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
POOL_CHUNK = 64 << 20  # kvoffd.pool.allocator.DEFAULT_CHUNK: a pool smaller than this is one chunk
PAGE = 4096
MIN_POOL = 1 << 20  # the daemon refuses a smaller --pool-size
SLOT_ALIGN = 64  # ShmEngine: slot bytes divisible by layers (2) x key size (32)
NAMESPACE = "trace"
ENGINE_ID = "trace-0"
LEASE_MS = 30_000  # as the vLLM connector's default
JOB_TIMEOUT_S = 60.0

# ------------------------------------------------------------------------------------------------
# the trace


@dataclass(frozen=True)
class Request:
    timestamp_ms: int
    input_tokens: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class Trace:
    name: str
    requests: list[Request]

    @property
    def asked_blocks(self) -> int:
        return sum(len(r.hash_ids) for r in self.requests)

    @property
    def input_tokens(self) -> int:
        return sum(r.input_tokens for r in self.requests)


def load_trace(path: Path) -> Trace:
    """A Mooncake-format jsonl: ``timestamp`` (ms), ``input_length``, ``hash_ids`` per line."""
    reqs = []
    with open(path) as f:
        for line in f:
            if line.strip():
                o = json.loads(line)
                reqs.append(Request(int(o.get("timestamp", 0)), int(o["input_length"]), tuple(o["hash_ids"])))
    return Trace(path.stem, reqs)


def prefix_consistent(trace: Trace) -> bool:
    """Whether each hash id always follows the same parent (the ids chain the prefix)."""
    parent: dict[int, int] = {}
    for r in trace.requests:
        prev = -1
        for h in r.hash_ids:
            if parent.setdefault(h, prev) != prev:
                return False
            prev = h
    return True


def hit_tokens(r: Request, hits: int) -> int:
    """Tokens covered by ``hits`` leading blocks (the last block may be partial)."""
    return min(hits * BLOCK_TOKENS, r.input_tokens)


# ------------------------------------------------------------------------------------------------
# simulations


@dataclass
class Tally:
    """Hits per request (leading resident blocks) and what a daemon run would count."""

    hits: list[int] = field(default_factory=list)
    stored: int = 0  # blocks newly written
    noop: int = 0  # blocks a STORE named that were already resident
    evicted: int = 0
    dropped: int = 0  # blocks a STORE could not place

    def block_ratio(self, trace: Trace) -> float:
        return sum(self.hits) / max(1, trace.asked_blocks)

    def token_ratio(self, trace: Trace) -> float:
        got = sum(hit_tokens(r, h) for r, h in zip(trace.requests, self.hits, strict=True))
        return got / max(1, trace.input_tokens)


def leading_hits(ids: list[int], resident: Container[int]) -> int:
    """How many of a request's blocks, from the first, are resident: a prefix cache's hit."""
    h = 0
    for b in ids:
        if b not in resident:
            break
        h += 1
    return h


def simulate_lru(trace: Trace, capacity: int) -> Tally:
    """kvoffd's LRU, step for step (see the module docstring)."""
    lru: OrderedDict[int, None] = OrderedDict()  # oldest first
    t = Tally()
    for r in trace.requests:
        ids = r.hash_ids
        h = leading_hits(ids, lru)
        t.hits.append(h)
        for b in ids[:h]:  # the LOAD's unpin, in key order
            lru.move_to_end(b)
        rest = ids[h:]
        want = [b for b in rest if b not in lru]
        present = len(rest) - len(want)
        if present:  # Index._touch
            t.noop += present
            for b in rest:
                if b in lru:
                    lru.move_to_end(b)
        free = capacity - len(lru)
        short = len(want) - max(free, 0)
        if short > 0:  # Index.evict, then what still does not fit is dropped from the end
            n = min(short, len(lru))
            for _ in range(n):
                lru.popitem(last=False)
            t.evicted += n
            room = max(free, 0) + n
            t.dropped += len(want) - room
            want = want[:room]
        for b in want:
            lru[b] = None
        t.stored += len(want)
    return t


def next_uses(trace: Trace) -> list[list[float]]:
    """For each request, each block's next request index (inf: never again)."""
    last: dict[int, float] = {}
    out: list[list[float]] = [[] for _ in trace.requests]
    for i in range(len(trace.requests) - 1, -1, -1):
        ids = trace.requests[i].hash_ids
        out[i] = [last.get(b, math.inf) for b in ids]
        for b in ids:
            last[b] = i
    return out


def simulate_optimum(trace: Trace, capacity: int) -> Tally:
    """Belady's MIN with bypass (see the module docstring). A max-heap of (next use, depth) with lazy
    deletion: an entry is current only while it matches the block's recorded next use."""
    nxt = next_uses(trace)
    resident: dict[int, float] = {}  # block -> its next use
    heap: list[tuple[float, int, int]] = []  # (-next use, -depth, block)
    t = Tally()
    for i, r in enumerate(trace.requests):
        ids = r.hash_ids
        h = leading_hits(ids, resident)
        t.hits.append(h)
        for depth, (b, nu) in enumerate(zip(ids, nxt[i], strict=True)):
            if b in resident:
                if depth >= h:
                    t.noop += 1
                resident[b] = nu
                heapq.heappush(heap, (-nu, -depth, b))
                continue
            if len(resident) >= capacity:
                while heap and resident.get(heap[0][2]) != -heap[0][0]:
                    heapq.heappop(heap)  # stale
                if capacity == 0 or nu >= -heap[0][0]:
                    t.dropped += 1  # bypass: no resident block is used later than this one
                    continue
                _, _, victim = heapq.heappop(heap)
                del resident[victim]
                t.evicted += 1
            resident[b] = nu
            heapq.heappush(heap, (-nu, -depth, b))
            t.stored += 1
    return t


def simulate_unbounded(trace: Trace) -> Tally:
    seen: set[int] = set()
    t = Tally()
    for r in trace.requests:
        h = 0
        for b in r.hash_ids:
            if b not in seen:
                break
            h += 1
        t.hits.append(h)
        new = [b for b in r.hash_ids[h:] if b not in seen]
        t.noop += len(r.hash_ids) - h - len(new)
        t.stored += len(new)
        seen.update(new)
    return t


# ------------------------------------------------------------------------------------------------
# the daemon


@dataclass(frozen=True)
class PoolGeometry:
    slot_bytes: int
    pool_bytes: int
    expected_blocks: int  # what kvoffd/pool/allocator.py's carving gives today; STATS has the last word


def pool_geometry(capacity: int, block_bytes: int) -> PoolGeometry:
    """A slot size (at least ``block_bytes``) and pool size that hold exactly ``capacity`` slots.

    Today's pool is one chunk when smaller than 64 MiB, cut into ``chunk // slot`` slots, and the
    daemon wants at least 1 MiB: the slot grows until a page-rounded pool of ``capacity`` slots is
    at least 1 MiB and holds no extra slot; it shrinks (never below 64 bytes) when ``capacity``
    slots would pass 64 MiB. Changes to the pool (minimum slot, lazy carving) are caught by the
    capacity check after the replay, not here.
    """
    if capacity <= 0:
        raise ValueError("capacity must be positive")
    slot = -(-block_bytes // SLOT_ALIGN) * SLOT_ALIGN
    slot = max(slot, -(-MIN_POOL // capacity // SLOT_ALIGN) * SLOT_ALIGN)
    if capacity * slot >= POOL_CHUNK:
        slot = (POOL_CHUNK - PAGE) // capacity // SLOT_ALIGN * SLOT_ALIGN
        if slot < SLOT_ALIGN:
            raise ValueError(f"capacity {capacity} blocks needs a pool past one 64 MiB chunk")
    for s in range(slot, slot + PAGE + SLOT_ALIGN, SLOT_ALIGN):
        pool = -(-capacity * s // PAGE) * PAGE
        if pool // s == capacity and MIN_POOL <= pool < POOL_CHUNK:
            return PoolGeometry(s, pool, capacity)
    raise ValueError(f"no pool geometry for {capacity} blocks of {block_bytes} bytes")


def register_engine(client: KvoffdClient, num_blocks: int, slot_bytes: int) -> ShmEngine:
    """The stand-in engine's memory, registered. The one place that knows how CPU engine memory is
    shared with the daemon (bench/support/engine.py's ShmEngine), so a change of mechanism is made here."""
    eng = ShmEngine(num_blocks, slot_bytes, layers=2, tag="trace-replay")
    try:
        client.register(ENGINE_ID, NAMESPACE, 0, 1, eng.memory, eng.layout)
    except BaseException:
        eng.close()
        raise
    return eng


def block_key(hash_id: int) -> bytes:
    """The 32-byte key of a trace block: its hash id already names its whole prefix."""
    return hashlib.blake2b(hash_id.to_bytes(8, "little", signed=True), digest_size=32,
                           person=b"kvoffd-trace").digest()


@dataclass
class DaemonRun:
    tally: Tally
    counters: dict
    seconds: float
    loaded: int  # blocks the LOAD notices reported done
    bad_bytes: int  # loaded blocks whose bytes were not their key's


class Replayer:
    """Drives one registered stand-in engine through the trace, one request at a time.

    Engine block ids are handed out cyclically from a ring as long as the longest request: block j of
    a request sits in engine block (base + j) mod ring, as a prompt's blocks sit in vLLM's KV cache.
    """

    def __init__(self, client: KvoffdClient, eng: ShmEngine, keys: dict[int, bytes], verify: bool):
        self.client, self.eng, self.keys, self.verify = client, eng, keys, verify
        self.base = 0
        self.job = 0

    def _ids(self, n: int) -> list[int]:
        ring = self.eng.num_blocks
        ids = [(self.base + j) % ring for j in range(n)]
        self.base = (self.base + n) % ring
        return ids

    def _wait(self, job: int) -> list[int]:
        got = self.client.wait_notices({job}, JOB_TIMEOUT_S)
        if not got:
            raise RuntimeError(f"job {job}: no notice within {JOB_TIMEOUT_S} s")
        n = got[0]
        if n.failed and n.code not in ("pool_full", "not_admitted"):
            raise RuntimeError(f"job {job} failed: {n.code} {n.message} ({len(n.failed)} blocks)")
        return list(n.failed)

    def request(self, r: Request) -> tuple[int, int, int, int]:
        """One request: (hits, loaded blocks, dropped blocks, blocks loaded with wrong bytes)."""
        keys = [self.keys[b] for b in r.hash_ids]
        ids = self._ids(len(keys))
        res = self.client.lookup(NAMESPACE, b"".join(keys), lease_ms=LEASE_MS)
        h = res.hits
        loaded = bad = dropped = 0
        if h:
            self.job += 1
            if self.verify:
                self.eng.poison(ids[:h])
            self.client.submit_load(ENGINE_ID, self.job, b"".join(keys[:h]), ids[:h], lease_id=res.lease_id)
            failed = self._wait(self.job)
            if failed:
                raise RuntimeError(f"LOAD of {h} hit blocks failed for {len(failed)} of them")
            loaded = h
            if self.verify:
                bad = int((~self.eng.matches(ids[:h], keys[:h])).sum())
        if h < len(keys):
            self.job += 1
            if self.verify:
                self.eng.fill(ids[h:], keys[h:])
            self.client.submit_store(ENGINE_ID, self.job, b"".join(keys[h:]), ids[h:])
            dropped = len(self._wait(self.job))
        return h, loaded, dropped, bad


def disk_args(tmp: str, geo: PoolGeometry, disk_blocks: int) -> list[str]:
    """``--disk-path``/``--disk-size`` for a disk tier of exactly ``disk_blocks`` slots (none for 0)."""
    if not disk_blocks:
        return []
    stride = -(-geo.slot_bytes // 4096) * 4096  # kvoffd/cache/tiers/disk.py's slot stride
    return ["--disk-path", f"{tmp}/disk", "--disk-size", str(max(disk_blocks * stride, 1 << 20) // stride * stride)]


def replay_daemon(trace: Trace, geo: PoolGeometry, keys: dict[int, bytes], verify: bool,
                  realtime: bool, policy: str = DEFAULT_POLICY, disk_blocks: int = 0) -> DaemonRun:
    """The trace through a fresh daemon whose pool is ``geo`` (and a disk tier of ``disk_blocks``);
    its STATS counters at the end."""
    tmp = tempfile.mkdtemp(prefix="kvoffd-trace-")
    d: BenchDaemon = start_daemon(f"ipc://{tmp}/kvoffd.sock", str(geo.pool_bytes), "--log-level", "warning",
                                  "--backend", "cpu", "--eviction-policy", policy,
                                  *disk_args(tmp, geo, disk_blocks))
    eng = None
    try:
        client = d.client(name="trace-replay", timeout_s=30.0, job_deadline_s=JOB_TIMEOUT_S)
        ring = max((len(r.hash_ids) for r in trace.requests), default=1)
        eng = register_engine(client, max(ring, 1), geo.slot_bytes)
        rep = Replayer(client, eng, keys, verify)
        t = Tally()
        loaded = bad = 0
        t0 = time.monotonic()
        first_ms = trace.requests[0].timestamp_ms if trace.requests else 0
        for r in trace.requests:
            if realtime:
                wait = (r.timestamp_ms - first_ms) / 1000 - (time.monotonic() - t0)
                if wait > 0:
                    time.sleep(wait)
            h, n_loaded, n_dropped, n_bad = rep.request(r)
            t.hits.append(h)
            t.dropped += n_dropped
            loaded += n_loaded
            bad += n_bad
        seconds = time.monotonic() - t0
        st = client.stats()
        counters = dict(st["counters"], resident_blocks=st["resident_blocks"])
        for tier in st.get("tiers", []):
            if tier.get("name") == "disk":
                counters.update({f"disk_{k}": tier.get(k, 0) for k in ("hits", "promotions", "promotion_failures",
                                                                       "spills", "evictions", "resident_blocks",
                                                                       "staged_hits", "spill_copies")})
                counters["disk_spills_dropped"] = sum(tier.get("spills_dropped", {}).values())
                counters["disk_spills_dropped_by_reason"] = dict(tier.get("spills_dropped", {}))
        t.stored, t.noop, t.evicted = counters["stored_blocks"], counters["store_noop_blocks"], \
            counters["evicted_blocks"]
        client.unregister(ENGINE_ID)
        return DaemonRun(t, counters, seconds, loaded, bad)
    finally:
        d.stop()
        if eng is not None:
            eng.close()
        shutil.rmtree(tmp, ignore_errors=True)  # the socket's directory (and the disk tier's files)


def measured_capacity(run: DaemonRun, geo: PoolGeometry) -> int:
    """Blocks the pool really held: its resident count once it has had to evict (blocks leave only by
    eviction here). Without any eviction the pool was never full: the planned figure stands."""
    if run.counters["evicted_blocks"] or run.tally.dropped:
        return int(run.counters["resident_blocks"])
    return geo.expected_blocks


def simulate_policy(trace: Trace, keys: dict[int, bytes], policy: str, capacity: int) -> Tally:
    """bench/policy_sim.py's simulation of ``policy`` at ``capacity``, on the daemon's 32-byte keys (a
    sampling policy hashes the key: on the hash ids it would sample other blocks than the daemon)."""
    import policy_sim

    keyed = Trace(trace.name, [Request(r.timestamp_ms, r.input_tokens, tuple(keys[b] for b in r.hash_ids))
                               for r in trace.requests])
    return policy_sim.simulate(keyed, make_policy(policy, capacity), capacity)


def agreement(trace: Trace, run: DaemonRun, model: Tally, name: str = "lru") -> list[str]:
    """Every way the daemon's counters disagree with the bench's own count and with the policy's model
    (``name``: the exact LRU model, or bench/policy_sim.py's simulation of the daemon's policy)."""
    c, t = run.counters, run.tally
    hits = sum(t.hits)
    refused = c.get("admission_refused_blocks", 0)
    checks = {
        "lookups": (c["lookups"], len(trace.requests)),
        "lookup_hit_blocks": (c["lookup_hit_blocks"], hits),
        "lookup_miss_blocks": (c["lookup_miss_blocks"], trace.asked_blocks - hits),
        "loaded_blocks": (c["loaded_blocks"], run.loaded),
        "dropped_stores+admission_refused": (c["dropped_stores"] + refused, t.dropped),
        "stored+noop+dropped+refused": (c["stored_blocks"] + c["store_noop_blocks"] + c["dropped_stores"] + refused,
                                        trace.asked_blocks - hits),
        f"hit_blocks vs {name} model": (hits, sum(model.hits)),
        f"stored_blocks vs {name} model": (c["stored_blocks"], model.stored),
        f"store_noop_blocks vs {name} model": (c["store_noop_blocks"], model.noop),
        f"evicted_blocks vs {name} model": (c["evicted_blocks"], model.evicted),
        f"dropped_stores vs {name} model": (c["dropped_stores"], model.dropped),
        "loaded blocks with wrong bytes": (run.bad_bytes, 0),
    }
    if name == "lru":
        checks["admission_refused_blocks"] = (refused, 0)
    out = [f"{label}: daemon {a} != bench {b}" for label, (a, b) in checks.items() if a != b]
    if t.hits != model.hits:
        first = next(i for i, (a, b) in enumerate(zip(t.hits, model.hits, strict=True)) if a != b)
        out.append(f"per-request hits differ first at request {first}: daemon {t.hits[first]}, "
                   f"{name} model {model.hits[first]}")
    return out


# ------------------------------------------------------------------------------------------------
# report


@dataclass
class Result:
    trace: str
    block_tokens: int
    daemon_policy: str
    capacities: list[int]
    policies: dict[str, list[float]]
    token_policies: dict[str, list[float]]
    unbounded: float
    token_unbounded: float
    daemon_counters: dict[str, dict]


def table(res: Result) -> str:
    head = ("| capacity (blocks) | held | daemon | LRU (sim) | optimum | daemon tokens | LRU tokens "
            "| optimum tokens | replay s |")
    rows = [head, "|" + "---|" * 9]
    for i, cap in enumerate(res.capacities):
        dc = res.daemon_counters[str(cap)]
        p, tp = res.policies, res.token_policies
        rows.append(f"| {cap:,} | {dc['capacity_blocks']:,} | {p['daemon'][i]:.1%} | {p['lru'][i]:.1%} "
                    f"| {p['optimum'][i]:.1%} | {tp['daemon'][i]:.1%} | {tp['lru'][i]:.1%} "
                    f"| {tp['optimum'][i]:.1%} | {dc['seconds']:.1f} |")
    rows.append(f"| unbounded | — | — | {res.unbounded:.1%} | {res.unbounded:.1%} | — "
                f"| {res.token_unbounded:.1%} | {res.token_unbounded:.1%} | — |")
    return "\n".join(rows)


def plot(res: Result, path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    styles = {"daemon": ("o-", f"kvoffd daemon ({res.daemon_policy})"), "lru": ("x--", "LRU (simulated)"),
              "optimum": ("s-", "optimum (Belady MIN)")}
    for name, ratios in res.policies.items():
        fmt, label = styles.get(name, ("-", name))
        ax.plot(res.capacities, [100 * r for r in ratios], fmt, label=label)
    ax.axhline(100 * res.unbounded, color="grey", linestyle=":", label="unbounded")
    ax.set_xscale("log")
    ax.set_xticks(res.capacities)
    ax.set_xticklabels([f"{c:,}" for c in res.capacities])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel(f"capacity (blocks of {res.block_tokens} tokens)")
    ax.set_ylabel("block hit ratio (%)")
    ax.set_title(f"prefix hit ratio: {res.trace}")
    ax.grid(True, alpha=0.3)
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")  # outside: any trace
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(trace: Trace, capacities: Sequence[int], block_bytes: int, verify: bool = True,
        realtime: bool = False, parallel: int = 1, log=print, policy: str = DEFAULT_POLICY,
        disk_blocks: int = 0) -> Result:
    """Replay and simulate at every capacity; raises AssertionError if the daemon and the bench disagree.

    Each capacity gets its own daemon; ``parallel`` of them replay at once (the replay waits on
    round trips far more than it computes, so a small machine runs several side by side)."""
    chained = prefix_consistent(trace)
    if not chained:
        log("WARNING: a hash id follows different parents: the optimum is block-level MIN, not a bound")
    keys = {b: block_key(b) for r in trace.requests for b in r.hash_ids}
    geos = {cap: pool_geometry(cap, block_bytes) for cap in capacities}
    with ThreadPoolExecutor(max(1, parallel)) as ex:
        runs = dict(zip(capacities, ex.map(lambda c: replay_daemon(trace, geos[c], keys, verify, realtime, policy,
                                                                   disk_blocks), capacities), strict=True))
    unb = simulate_unbounded(trace)
    pol: dict[str, list[float]] = {"daemon": [], "lru": [], "optimum": []}
    tok: dict[str, list[float]] = {"daemon": [], "lru": [], "optimum": []}
    counters: dict[str, dict] = {}
    problems: list[str] = []
    for cap in capacities:
        geo, d = geos[cap], runs[cap]
        held = measured_capacity(d, geo)
        if held != cap:
            log(f"WARNING: asked for {cap} blocks, the daemon held {held} (slot {geo.slot_bytes} B, "
                f"pool {geo.pool_bytes} B)")
        lru = simulate_lru(trace, cap)
        if policy == "lru":
            model = lru if held == cap else simulate_lru(trace, held)
        else:
            model = simulate_policy(trace, keys, policy, held)
        opt = simulate_optimum(trace, cap)
        # with a disk tier the daemon's hits include the disk's: no pool model to agree with (its LOADs
        # were still checked byte for byte); the figure is its share of the unbounded ratio
        bad = agreement(trace, d, model, policy) if not disk_blocks else []
        if chained and opt.noop:  # the argument that makes it a bound on prefix hits has failed
            bad.append(f"optimum kept {opt.noop} blocks resident behind a missing parent")
        problems += [f"capacity {cap}: {b}" for b in bad]
        for name, tally in (("daemon", d.tally), ("lru", lru), ("optimum", opt)):
            pol[name].append(tally.block_ratio(trace))
            tok[name].append(tally.token_ratio(trace))
        counters[str(cap)] = {"capacity_blocks": held, "slot_bytes": geo.slot_bytes, "pool_bytes": geo.pool_bytes,
                              "seconds": round(d.seconds, 3), "bench_hit_blocks": sum(d.tally.hits),
                              "bench_loaded_blocks": d.loaded, "bench_dropped_blocks": d.tally.dropped,
                              **d.counters}
        log(f"capacity {cap}: daemon {pol['daemon'][-1]:.2%} lru {pol['lru'][-1]:.2%} "
            f"optimum {pol['optimum'][-1]:.2%} ({d.seconds:.1f} s replay)"
            + (f"; with {disk_blocks} disk blocks: {pol['daemon'][-1] / max(unb.block_ratio(trace), 1e-12):.1%} of "
               f"unbounded ({unb.block_ratio(trace):.2%}), {d.counters.get('disk_hits', 0)} disk hits, "
               f"{d.counters.get('disk_spills', 0)} spills ({d.counters.get('disk_spills_dropped', 0)} dropped: "
               f"{d.counters.get('disk_spills_dropped_by_reason', {})}), "
               f"{d.counters.get('disk_evictions', 0)} disk evictions, {d.counters.get('disk_staged_hits', 0)} "
               f"staged hits" if disk_blocks else "")
            + ("" if not bad else f"  MISMATCH: {'; '.join(bad)}"))
    res = Result(trace.name, BLOCK_TOKENS, policy, list(capacities), pol, tok, unb.block_ratio(trace),
                 unb.token_ratio(trace), counters)
    if problems:
        raise AssertionError("the daemon's counters disagree with the bench:\n  " + "\n  ".join(problems))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format jsonl")
    ap.add_argument("--capacities", default="1000,2000,4000,8000", help="comma-separated, in blocks")
    ap.add_argument("--block-bytes", type=int, default=4096, help="payload per block (the slot may grow)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--plot", type=Path, help="write a PNG of hit ratio vs capacity here")
    ap.add_argument("--realtime", action="store_true", help="honour the trace's timestamps")
    ap.add_argument("--no-verify", dest="verify", action="store_false",
                    help="skip filling stored blocks and checking loaded bytes")
    ap.add_argument("--parallel", type=int, default=4, help="daemons replaying at once (one per capacity)")
    ap.add_argument("--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES),
                    help=f"the daemon's --eviction-policy (default {DEFAULT_POLICY})")
    ap.add_argument("--disk-blocks", type=int, default=0,
                    help="give each daemon a disk tier of this many blocks under its pool (a tmp directory)")
    a = ap.parse_args(argv)
    capacities = [int(x) for x in a.capacities.split(",") if x.strip()]
    trace = load_trace(a.trace)
    print(f"{trace.name}: {len(trace.requests):,} requests, {trace.asked_blocks:,} blocks asked for, "
          f"{len(set(b for r in trace.requests for b in r.hash_ids)):,} distinct", flush=True)
    t0 = time.monotonic()
    res = run(trace, capacities, a.block_bytes, a.verify, a.realtime, a.parallel,
              log=lambda s: print(s, flush=True), policy=a.policy, disk_blocks=a.disk_blocks)
    print(table(res))
    print(f"daemon and bench agree at every capacity; wall time {time.monotonic() - t0:.1f} s")
    if a.out:
        a.out.write_text(json.dumps(asdict(res), indent=2) + "\n")
    if a.plot:
        plot(res, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
