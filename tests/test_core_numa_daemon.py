"""NUMA-aware pool through a real daemon on a faked 2-node host (issue 20).

The daemon reads a fake sysfs (``--sysfs-root``: node 0 = CPU 0, node 1 = CPU 1); the engines are
real stand-in engine processes (CPU memory) bound to one CPU each with ``taskset``, so the daemon
finds each one's node the way it does in production, from the process's affinity. What must hold:
each engine's blocks land on its node's shard (STATS), a block stored on one shard loads byte-exact
into the engine of the other node (counted as a cross-node load), a full shard spills to the other
(counted) and never drops a store, each shard's range has its memory policy (/proc/<daemon>/numa_maps:
node 0 is real here, node 1 is not, so its mbind is refused and logged), and a warm restart with
another topology still serves every adopted block.
"""

from __future__ import annotations

import os
import shutil
import uuid

import pytest
from fake_sysfs import make_sysfs
from kvtest import Engine, chain_keys

SLOT_ARGS = {"head_dim": 256, "blocks": 256}  # 2 layers x 2 heads x 16 tokens x 2 x 256 fp32: 128 KiB slots
SLOT = 128 << 10
SHARD_SLOTS = (128 << 20) // SLOT  # a 256 MiB pool on two nodes: two shards of two 64 MiB chunks
NEEDS_TWO_CPUS = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not shutil.which("taskset"),
                                    reason="two CPUs and taskset are needed to put engines on two fake nodes")


@pytest.fixture
def sysfs(tmp_path):
    return make_sysfs(tmp_path / "sys", ["0", "1"])


def _engine(d, name: str, cpu: int, ns: str = "numa") -> Engine:
    return Engine(d.address, name, wrapper=("taskset", "-c", str(cpu)), namespace=ns, **SLOT_ARGS)


def _shards(d) -> dict[int, dict]:
    return {s["shard"]: s for s in d.client().stats()["pool"]["shards"]}


def _policy_at(pid: int, address: int) -> str:
    with open(f"/proc/{pid}/numa_maps") as f:
        for line in f:
            start, policy = line.split()[:2]
            if int(start, 16) == address:
                return policy
    return "no mapping starts there"


@NEEDS_TWO_CPUS
def test_blocks_follow_the_engines_node_and_load_from_the_other(make_daemon, sysfs):
    d = make_daemon("256MiB", "--sysfs-root", str(sysfs), "--eviction-policy", "lru")
    e0, e1 = _engine(d, "n0", 0), _engine(d, "n1", 1)
    try:
        engines = {e["engine_id"]: e for e in d.client().stats()["engines"]}
        assert (engines["n0"]["numa_node"], engines["n0"]["shard"]) == (0, 0)
        assert (engines["n1"]["numa_node"], engines["n1"]["shard"]) == (1, 1)
        a, b = chain_keys(64, b"node0"), chain_keys(64, b"node1")
        e0("fill", ids=list(range(64)), seed=1)
        e1("fill", ids=list(range(64)), seed=2)
        assert e0.store(1, a, list(range(64)))["ok"]
        assert e1.store(1, b, list(range(64)))["ok"]
        sh = _shards(d)
        assert sh[0]["node"] == 0 and sh[1]["node"] == 1
        assert sh[0]["used_bytes"] == 64 * SLOT == sh[1]["used_bytes"], sh
        # node 0's blocks into node 1's engine, byte-exact, counted; its own blocks are not counted
        assert e1.load(2, a, list(range(100, 164)))["ok"]
        assert e1("digest", ids=list(range(100, 164))) == e0("digest", ids=list(range(64)))
        assert e1.load(3, b, list(range(200, 256)) + list(range(164, 172)))["ok"]
        st = d.client().stats()
        assert st["counters"]["cross_numa_load_blocks"] == 64
        assert "kvoffd_cross_numa_loads_total 64.0" in d.metrics()
        assert 'kvoffd_pool_shard_bytes{node="1",shard="1",state="used"} 8.388608e+06' in d.metrics()
        # shard 1 filled, then 100 more: spilled to shard 0, none dropped
        job = 10
        for i, n in enumerate((256, 256, 256, SHARD_SLOTS - 64 - 3 * 256, 100)):
            job += 1
            r = e1.store(job, chain_keys(n, b"fill%d" % i), list(range(n)))
            assert r["ok"] and not r["failed"], r
        sh = _shards(d)
        assert sh[1]["used_bytes"] == SHARD_SLOTS * SLOT and sh[1]["spilled_slots"] == 100, sh
        assert sh[0]["used_bytes"] == (64 + 100) * SLOT and sh[0]["spilled_slots"] == 0
        assert 'kvoffd_pool_shard_spilled_slots_total{node="1",shard="1"} 100.0' in d.metrics()
        # each shard's range got its node's policy before any page existed; node 1 is not online here
        base = st["pool"]["base_address"]
        assert _policy_at(d.proc.pid, base) == "prefer:0"
        assert _policy_at(d.proc.pid, base + 2 * (64 << 20)) == "default"
        assert [s["bound"] for s in st["pool"]["shards"]] == [True, False]
        assert "pool shard 1 (node 1, 2 chunks): mbind refused (EINVAL" in d.log()
    finally:
        e0.close()
        e1.close()


@NEEDS_TWO_CPUS
def test_a_warm_restart_with_another_topology_serves_every_adopted_block(make_daemon, sysfs):
    """Blocks adopted from a sharded pool file are where they are: a daemon started with another map
    (here ``--numa-map off``: one shard) serves them all, byte-exact."""
    d_dir = f"/dev/shm/kvtest-numa-{uuid.uuid4().hex[:10]}"
    os.makedirs(d_dir, mode=0o700)
    path = f"{d_dir}/kvoffd.pool"
    try:
        d = make_daemon("256MiB", "--sysfs-root", str(sysfs), "--pool-path", path, "--eviction-policy", "lru",
                        name="warm")
        e0, e1 = _engine(d, "w0", 0, "warm"), _engine(d, "w1", 1, "warm")
        a, b = chain_keys(32, b"w0"), chain_keys(32, b"w1")
        try:
            e0("fill", ids=list(range(32)), seed=3)
            e1("fill", ids=list(range(32)), seed=4)
            assert e0.store(1, a, list(range(32)))["ok"] and e1.store(1, b, list(range(32)))["ok"]
            assert _policy_at(d.proc.pid, d.client().stats()["pool"]["base_address"]) == "prefer:0"
            want = e0("digest", ids=list(range(32))) + e1("digest", ids=list(range(32)))
        finally:
            e0.close()
            e1.close()
        assert d.stop() == 0
        d2 = make_daemon("256MiB", "--sysfs-root", str(sysfs), "--pool-path", path, "--numa-map", "off",
                         "--eviction-policy", "lru", name="warm")
        st = d2.client().stats()
        assert st["persistence"]["adopted_blocks"] == 64 and len(st["pool"]["shards"]) == 1
        e = _engine(d2, "w2", 1, "warm")
        try:
            assert e.load(1, a + b, list(range(64)))["ok"]
            assert e("digest", ids=list(range(64))) == want
            assert d2.client().stats()["counters"]["cross_numa_load_blocks"] == 0  # one shard: nothing counted
        finally:
            e.close()
    finally:
        shutil.rmtree(d_dir, ignore_errors=True)
