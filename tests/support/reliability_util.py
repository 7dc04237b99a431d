"""Helpers for the reliability drills (tests/test_reliability_*.py), and the soak worker process.

Everything talks to a real daemon over real sockets. Engine memory (``ShmEngine``: a numpy view of a
sealed memfd, without torch) and block contents that are a pure function of the block's key
(``block_content``) are bench/support/engine.py's, shared with the CPU benches.

Run as a script it is the soak worker: ``python tests/support/reliability_util.py soak --address ...``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "tests" / "support") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests" / "support"))
if str(ROOT / "bench") not in sys.path:  # bench/support: the engine stand-in the benches share (run as a script)
    sys.path.append(str(ROOT / "bench"))

from support.engine import ShmEngine, block_content, proc_status, rss_kb  # noqa: E402, F401 - one definition, shared with bench/

from kvoffd_client import protocol as P  # noqa: E402
from kvoffd_client.client import KvoffdClient  # noqa: E402
from kvoffd_client.fdpass import send_fd  # noqa: E402
from kvoffd_client.memory.local import LocalMemory  # noqa: E402

# --------------------------------------------------------------------------------------------------
# process measurements


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def maps_mention(pid: int, text: str) -> bool:
    """Whether /proc/PID/maps names ``text`` (a mapped file's path)."""
    with open(f"/proc/{pid}/maps") as f:
        return any(text in line for line in f)


def anyone_maps(text: str) -> bool:
    """Whether any process maps or holds open a file named ``text`` (e.g. "/memfd:kvoffd-x (deleted)"):
    a memfd's memory is freed once none does."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if maps_mention(int(pid), text):
                return True
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # gone, or not ours to read
        for fd in fds:
            try:
                if text in os.readlink(f"/proc/{pid}/fd/{fd}"):
                    return True
            except OSError:
                continue
    return False


def find_pool_base(pid: int, pool_bytes: int) -> int:
    """Start address of the daemon's pool: its only shared anonymous mapping of exactly that size.

    Fallback for daemons that do not report ``pool_base`` in stats.
    """
    found = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)", line)
            if not m:
                continue
            lo, hi, perms, name = int(m[1], 16), int(m[2], 16), m[3], m[4]
            if hi - lo == pool_bytes and perms.endswith("s") and ("/dev/zero" in name or "SYSV" in name
                                                                 or "anon_shmem" in name):
                found.append(lo)
    if len(found) != 1:
        raise RuntimeError(f"expected one {pool_bytes}-byte shared anonymous mapping in pid {pid}, found {found}")
    return found[0]


def poke(pid: int, address: int, data: bytes) -> None:
    """Write into another process's memory behind its back (/proc/PID/mem; needs ptrace rights)."""
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as f:
        f.seek(address)
        f.write(data)


def peek(pid: int, address: int, n: int) -> bytes:
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
        f.seek(address)
        return f.read(n)


# --------------------------------------------------------------------------------------------------
# keys and block contents


def keyspace(n: int, salt: bytes) -> list[bytes]:
    return [hashlib.sha256(salt + i.to_bytes(8, "little")).digest() for i in range(n)]


# --------------------------------------------------------------------------------------------------
# a raw peer: the protocol without the client library's manners


def wire_memory(fd_socket: str, memory: LocalMemory | dict[str, Any]) -> dict[str, Any]:
    """REGISTER's memory as it travels: the descriptor handed to the fd socket, named by its token
    (``memory``: an engine's, or a raw ``{"kind": "cpu_fd", "fd": ..., "size": ...}`` of a test's making)."""
    fd, size = (memory.fds[0], memory.spec.size) if isinstance(memory, LocalMemory) else (memory["fd"], memory["size"])
    token = send_fd(fd_socket, fd, size)
    return {"kind": "cpu_fd", "token": token, "size": size}


class RawPeer:
    """A bare DEALER. Sends whatever it is given; reads replies only when asked."""

    def __init__(self, address: str, *, sndhwm: int = 100_000, rcvhwm: int = 100_000,
                 routing_id: bytes | None = None):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, sndhwm)
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sock.setsockopt(zmq.ROUTING_ID, routing_id or uuid.uuid4().bytes)
        self.sock.connect(address)
        self._seq = 1 << 40
        self.fd_socket = ""  # from HELLO_OK: where REGISTER's cpu_fd descriptors are handed over

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def send(self, frame: bytes | list[bytes]) -> None:
        if isinstance(frame, list):
            self.sock.send_multipart(frame)
        else:
            self.sock.send(frame)

    def send_msg(self, msg: P.Message) -> int:
        if not msg.seq:
            msg.seq = self.next_seq()
        if isinstance(msg, P.Register) and (isinstance(msg.memory, LocalMemory) or (
                isinstance(msg.memory, dict) and msg.memory.get("kind") == "cpu_fd" and "fd" in msg.memory)):
            msg.memory = wire_memory(self.fd_socket, msg.memory)
        self.send(P.encode(msg))
        return msg.seq

    def recv(self, timeout_s: float = 5.0) -> dict | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return msgpack.unpackb(self.sock.recv(), raw=False)

    def recv_until(self, pred, timeout_s: float = 10.0) -> list[dict]:
        """Every reply up to and including the first one ``pred`` accepts (raises on timeout)."""
        out: list[dict] = []
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            r = self.recv(max(left, 0.0))
            if r is None:
                raise TimeoutError(f"no matching reply within {timeout_s} s ({len(out)} others received)")
            out.append(r)
            if pred(r):
                return out

    def ask(self, msg: P.Message, timeout_s: float = 10.0) -> dict:
        seq = self.send_msg(msg)
        return self.recv_until(lambda r: r.get("seq") == seq and r.get("op") != "notice", timeout_s)[-1]

    def hello(self, pid: int = 0, start_ticks: int = 0) -> dict:
        r = self.ask(P.Hello(pid=pid, start_ticks=start_ticks, client="reliability"))
        assert r["op"] == "hello_ok", r
        self.fd_socket = r.get("fd_socket", "")
        return r

    def barrier(self, timeout_s: float = 30.0) -> list[dict]:
        """Replies to everything sent so far (the daemon answers in order), ending with a PONG."""
        seq = self.send_msg(P.Ping())
        out = self.recv_until(lambda r: r.get("op") == "pong" and r.get("seq") == seq, timeout_s)
        return out[:-1]

    def close(self) -> None:
        self.sock.close(0)


def metric_value(text: str, name: str) -> float:
    """A sample's value from Prometheus text (``name`` includes labels, e.g. 'x_total{code="a"}')."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


# --------------------------------------------------------------------------------------------------
# soak worker


def soak_worker(a: argparse.Namespace) -> dict[str, Any]:
    """Mixed lookups (with leases), loads and stores over a key space larger than the pool.

    One *operation* is one block named in one request: a LOOKUP of 64 keys is 64 operations, a LOAD
    of h blocks h, a STORE of 64-h blocks 64-h. Every loaded block is checked byte for byte.
    """
    rng = np.random.default_rng(a.seed)
    keys = keyspace(a.keys, a.salt.encode())
    B = a.batch
    eng = ShmEngine(2 * B, a.slot_bytes, layers=2, tag=a.engine_id)
    client = KvoffdClient(a.address, name="soak", timeout_s=10.0, job_deadline_s=60.0)
    st = {"ops": 0, "messages": 0, "lookups": 0, "lookup_keys": 0, "lookup_hits": 0, "loads": 0,
          "loaded_blocks": 0, "load_failed": 0, "leased_load_failed": 0, "stores": 0, "store_keys": 0,
          "store_failed": 0, "store_failed_codes": {}, "verified_blocks": 0, "mismatched_blocks": 0,
          "released_leases": 0, "iterations": 0, "lost_notices": 0}
    try:
        if not client.connect(10):
            raise SystemExit("daemon not reachable")
        client.register(a.engine_id, a.namespace, 0, 1, eng.memory, eng.layout)
        print(json.dumps({"ready": a.engine_id}), flush=True)
        load_ids, store_ids = list(range(B)), list(range(B, 2 * B))
        job = 0
        t0 = time.monotonic()
        while st["ops"] < a.ops and (a.seconds <= 0 or time.monotonic() - t0 < a.seconds):
            start = int(rng.integers(0, a.keys - B + 1))
            batch = keys[start:start + B]
            lease_ms = 10_000 if rng.random() < 0.9 else 0
            r = client.lookup(a.namespace, batch, lease_ms=lease_ms)
            h = r.hits
            st["lookups"] += 1
            st["lookup_keys"] += B
            st["lookup_hits"] += h
            st["messages"] += 1
            st["ops"] += B
            waits: dict[int, str] = {}
            if h and r.lease_id and rng.random() < 0.1:
                client.release(r.lease_id)  # a request the scheduler dropped before loading
                st["released_leases"] += 1
                st["messages"] += 1
                h_load = 0
            else:
                h_load = h
            if h_load:
                job += 1
                eng.poison(load_ids[:h_load])
                client.submit_load(a.engine_id, job, batch[:h_load], load_ids[:h_load], lease_id=r.lease_id)
                waits[job] = "load"
                st["loads"] += 1
                st["messages"] += 1
                st["ops"] += h_load
            if h < B:
                job += 1
                eng.fill(store_ids[: B - h], batch[h:])
                client.submit_store(a.engine_id, job, batch[h:], store_ids[: B - h])
                waits[job] = "store"
                st["stores"] += 1
                st["store_keys"] += B - h
                st["messages"] += 1
                st["ops"] += B - h
            notices = {n.job_id: n for n in client.wait_notices(set(waits), 60)}
            st["lost_notices"] += len(set(waits) - set(notices))
            for jid, kind in waits.items():
                n = notices.get(jid)
                if n is None:
                    continue
                if kind == "load":
                    bad = set(n.failed)
                    ok = [i for i in range(h_load) if i not in bad]
                    st["load_failed"] += len(n.failed)
                    if r.lease_id:
                        st["leased_load_failed"] += len(n.failed)
                    st["loaded_blocks"] += len(ok)
                    good = eng.matches([load_ids[i] for i in ok], [batch[i] for i in ok])
                    st["verified_blocks"] += int(good.sum())
                    st["mismatched_blocks"] += int((~good).sum())
                else:
                    st["store_failed"] += len(n.failed)
                    if n.failed:
                        st["store_failed_codes"][n.code] = st["store_failed_codes"].get(n.code, 0) + len(n.failed)
            st["iterations"] += 1
        st["seconds"] = round(time.monotonic() - t0, 3)
        if a.hold:  # keep the engine mapped until the coordinator has its last RSS sample
            print(json.dumps({"done": a.engine_id}), flush=True)
            sys.stdin.readline()
        client.unregister(a.engine_id)
    finally:
        client.close()
        eng.close()
    return st


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("soak")
    s.add_argument("--address", required=True)
    s.add_argument("--engine-id", required=True)
    s.add_argument("--namespace", default="soak")
    s.add_argument("--salt", default="soak")
    s.add_argument("--keys", type=int, default=6144)
    s.add_argument("--batch", type=int, default=64)
    s.add_argument("--slot-bytes", type=int, default=16384)
    s.add_argument("--ops", type=int, default=250_000)
    s.add_argument("--seconds", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--hold", action="store_true", help="wait for a line on stdin before unregistering")
    a = ap.parse_args(argv)
    if a.cmd == "soak":
        print(json.dumps({"summary": soak_worker(a)}), flush=True)


def record(drill: str, **figures: Any) -> None:
    """Print a drill's measured figures (run pytest with -s to see them; docs/reliability.md cites them).

    With KVOFFD_FIGURES=path set they are also appended to that file, one JSON object per line.
    """
    line = json.dumps({"drill": drill, **figures}, sort_keys=True, default=str)
    print(f"\nFIGURES {line}", flush=True)
    path = os.environ.get("KVOFFD_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
