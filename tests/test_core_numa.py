"""NUMA-aware pool, unit level (issue 20): the topology read from a faked sysfs, the shard sizing rule,
a sharded Pool's placement and spills, the memory policy each shard's range really gets (read back
from /proc/self/numa_maps), and ``kvoffd doctor``'s map.

This host has one NUMA node, so a policy on node 0 is what the kernel can really show; a policy on a
node that is not online is refused (EINVAL), and that refusal is what a fake node 1 gets here.
"""

from __future__ import annotations

import mmap
import os
import random

import numpy as np
import pytest
from fake_sysfs import make_sysfs
from kvtest import chain_keys

from kvoffd.cache.index import Index
from kvoffd.ops.ctl_status import status_rows
from kvoffd.ops.doctor_numa import check_numa
from kvoffd.ops.doctor_result import PASS, WARN, Context
from kvoffd.pool.allocator import Pool
from kvoffd.pool.mempolicy import Policy, mbind
from kvoffd.pool.shards import bind_shards, plan_shards, single_shard
from kvoffd.pool.topology import (
    UNKNOWN,
    NumaMap,
    NumaMapError,
    parse_cpulist,
    parse_numa_map,
    read_pci_node,
    read_topology,
)
from kvoffd.server.placement import Placement, place_engine
from kvoffd.transfer.base import MappedMemory

KB = 1024
CHUNK = 64 * KB


def _two_nodes(tmp_path, gpus: dict[str, int] | None = None):
    return make_sysfs(tmp_path / "sys", ["0", "1"], gpus)


def test_cpulists_and_numa_maps_parse_as_the_kernel_and_the_flag_write_them():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("") == frozenset()
    assert parse_numa_map("auto") == NumaMap() and parse_numa_map("off").mode == "off"
    assert parse_numa_map("gpu0=0, gpu1=0,gpu2=1").gpus == {0: 0, 1: 0, 2: 1}
    for bad in ("gpu0", "gpu0=x", "node1=0", "gpu0=0,gpu0=1"):
        with pytest.raises(NumaMapError):
            parse_numa_map(bad)


def test_topology_reads_nodes_gpus_and_bus_ids_from_sysfs(tmp_path):
    root = _two_nodes(tmp_path, {"0000:19:00.0": 0, "0000:3b:00.0": 0, "0000:9a:00.0": 1, "0000:c1:00.0": -1})
    topo = read_topology(str(root))
    assert [(n.node, sorted(n.cpus), n.memory) for n in topo.nodes] == [(0, [0], True), (1, [1], True)]
    assert topo.distance(0, 1) == 20 and topo.distance(1, 1) == 10
    assert [(g.ordinal, g.node, g.source) for g in topo.gpus] == [(0, 0, "sysfs"), (1, 0, "sysfs"), (2, 1, "sysfs"),
                                                                   (3, UNKNOWN, "unknown")]
    assert topo.gpus_per_node() == {0: 2, 1: 1}
    # CUDA's bus ids have an 8-digit domain; sysfs's 4
    assert read_pci_node(str(root), "00000000:9A:00.0") == 1
    assert topo.gpu_node(7, "00000000:9a:00.0") == 1 and topo.gpu_node(7, "0000:00:00.0") == UNKNOWN
    assert topo.node_of_cpus({1}) == 1 and topo.node_of_cpus({0, 1}) == UNKNOWN
    mapped = read_topology(str(root), parse_numa_map("gpu3=1,gpu0=1"))
    assert [(g.ordinal, g.node, g.source) for g in mapped.gpus][::3] == [(0, 1, "map"), (3, 1, "map")]
    assert mapped.gpu_node(0, "0000:19:00.0") == 1  # the map wins over sysfs


def test_shards_are_sized_by_the_gpus_of_each_node_else_evenly(tmp_path):
    three_one = read_topology(str(_two_nodes(tmp_path, {"0000:01:00.0": 0, "0000:02:00.0": 0,
                                                        "0000:03:00.0": 0, "0000:81:00.0": 1})))
    s = plan_shards(three_one, 8)
    assert [(x.node, x.first_chunk, x.num_chunks, x.near) for x in s] == [(0, 0, 6, (1,)), (1, 6, 2, (0,))]
    even = read_topology(str(make_sysfs(tmp_path / "cpu", ["0", "1"])))  # no GPU: every memory node alike
    assert [x.num_chunks for x in plan_shards(even, 7)] == [4, 3]
    assert [x.num_chunks for x in plan_shards(even, 1)] == [1]  # fewer chunks than nodes: one shard
    off = read_topology(str(_two_nodes(tmp_path)), parse_numa_map("off"))
    assert plan_shards(off, 8) == single_shard(8)
    one = read_topology(str(make_sysfs(tmp_path / "one", ["0-1"])))
    assert [(x.node, x.num_chunks) for x in plan_shards(one, 8)] == [(UNKNOWN, 8)]
    all_on_one = read_topology(str(_two_nodes(tmp_path / "g1", {"0000:81:00.0": 1})))
    assert [(x.node, x.num_chunks) for x in plan_shards(all_on_one, 8)] == [(1, 8)]


def test_four_nodes_spill_to_the_nearest_first(tmp_path):
    root = make_sysfs(tmp_path / "sys", ["0", "1", "2", "3"])
    dist = {0: "10 12 32 32", 1: "12 10 32 32", 2: "32 32 10 12", 3: "32 32 12 10"}
    for n, d in dist.items():
        (root / "devices" / "system" / "node" / f"node{n}" / "distance").write_text(d + "\n")
    shards = plan_shards(read_topology(str(root)), 8)
    assert [s.near for s in shards] == [(1, 2, 3), (0, 2, 3), (3, 0, 1), (2, 0, 1)]
    pool = Pool(8 * CHUNK, chunk_bytes=CHUNK, shards=shards)
    try:
        got = pool.alloc(CHUNK, 3, shard=2)  # shard 2's two chunks, then its neighbour 3's
        assert [pool.shard_of(o) for o in got] == [2, 2, 3] and pool.spilled == [0, 0, 1, 0]
    finally:
        pool.close()


def test_a_sharded_pool_places_spills_and_frees_per_shard(tmp_path):
    shards = plan_shards(read_topology(str(_two_nodes(tmp_path))), 4)
    pool = Pool(4 * CHUNK, chunk_bytes=CHUNK, shards=shards)
    try:
        per = CHUNK // (4 * KB)
        a = pool.alloc(4 * KB, per, shard=1)
        assert {pool.shard_of(o) for o in a} == {1} and pool.spilled == [0, 0]
        b = pool.alloc(4 * KB, 3, shard=0)
        assert {pool.shard_of(o) for o in b} == {0}
        rest = pool.alloc(4 * KB, per + 5, shard=1)  # shard 1 holds one chunk more, then spills to shard 0
        assert [pool.shard_of(o) for o in rest].count(0) == 5 and pool.spilled == [0, 5]
        st = {s["shard"]: s for s in pool.stats()["shards"]}
        assert st[1]["used_bytes"] == 2 * CHUNK and st[0]["used_bytes"] == 8 * 4 * KB
        assert st[1]["spilled_slots"] == 5 and st[0]["capacity_bytes"] == 2 * CHUNK
        pool.free(4 * KB, a)  # a whole chunk of shard 1 back: shard 1 serves its own again
        again = pool.alloc(4 * KB, 2, shard=1)
        assert {pool.shard_of(o) for o in again} == {1}
        assert pool.alloc(4 * KB, 2) and pool.spilled == [0, 5]  # no preference: never counted
        assert pool.chunk_node.tolist() == [0, 0, 1, 1]
    finally:
        pool.close()


def test_a_full_sharded_pool_evicts_globally_and_never_fails_a_store(tmp_path):
    shards = plan_shards(read_topology(str(_two_nodes(tmp_path))), 2)
    index = Index(Pool(2 * CHUNK, chunk_bytes=CHUNK, shards=shards), "lru")
    t = index.table("ns", 0, 1, 16 * KB, (16 * KB,))
    stored = 0
    for i in range(6):  # 4 slots per chunk, 8 in the pool: 24 blocks stored on shard 1's engine
        p = index.prepare_store(t, chain_keys(4, salt=bytes([i])), shard=1)
        index.add_pending(p)
        index.complete_store(p, True)
        stored += len(p.slots)
    # stores 2 and 5 find the other shard's chunk free and spill there; once the pool is full each
    # store evicts (the LRU's order) until its own shard has room
    assert stored == 24 and index.pool.spilled == [0, 8] and index.evictions == 16
    index.pool.close()


def test_a_full_pool_keeps_most_of_each_engines_blocks_on_its_node(tmp_path):
    """Two engines storing at random on a full pool: eviction in the policy's order alone put about
    half of every store on the other node (424/840 and 384/760 placed locally with this seed); evicting
    until the asked-for shard has room (``Eviction.evict_for``) keeps three quarters local at the same
    eviction count."""
    shards = plan_shards(read_topology(str(_two_nodes(tmp_path))), 4)
    index = Index(Pool(4 * CHUNK, chunk_bytes=CHUNK, shards=shards), "guarded-doorkeeper")
    t = index.table("ns", 0, 1, 4 * KB, (4 * KB,))
    rng = random.Random(1)
    local = remote = 0
    for i in range(400):
        shard = rng.randrange(2)
        p = index.prepare_store(t, chain_keys(8, salt=i.to_bytes(4, "little")), admit=False, shard=shard)
        index.add_pending(p)
        index.complete_store(p, True)
        if i >= 200:  # the pool has been full for a while
            far = sum(index.pool.shard_of(s) != shard for s in p.slots)
            local, remote = local + len(p.slots) - far, remote + far
    assert local + remote == 1600 and remote / (local + remote) < 0.3, (local, remote)
    assert index.evictions == 3136  # what plain eviction did too: no block leaves earlier in all
    index.pool.close()


def test_adopted_slots_rebuild_each_shards_free_chunks(tmp_path):
    shards = plan_shards(read_topology(str(_two_nodes(tmp_path))), 4)
    pool = Pool(4 * CHUNK, chunk_bytes=CHUNK, shards=shards)
    try:
        pool.adopt_slots(4 * KB, np.array([0, 3 * CHUNK + 4 * KB], dtype=np.int64))  # one in each shard
        st = {s["shard"]: s for s in pool.stats()["shards"]}
        assert st[0]["free_chunk_bytes"] == CHUNK == st[1]["free_chunk_bytes"]
        got = pool.alloc(4 * KB, 1, shard=1)  # the adopted chunk's free slot first, on shard 1
        assert pool.shard_of(got[0]) == 1 and got == [3 * CHUNK]
    finally:
        pool.close()


def _policy_at(address: int) -> str:
    """The policy numa_maps shows for the mapping (piece) that starts at ``address``."""
    with open("/proc/self/numa_maps") as f:
        for line in f:
            start, policy = line.split()[:2]
            if int(start, 16) == address:
                return policy
    return "no mapping starts there"


@pytest.mark.parametrize("backing", ["private", "shmem"])
def test_each_shards_range_gets_its_nodes_policy_before_any_page_exists(tmp_path, backing):
    """mbind really runs on each shard's range: numa_maps shows node 0's shard as ``prefer:0`` (for
    a shmem pool file too, whose policy then also governs posix_fallocate); the fake node 1 is not
    online here, so the kernel refuses it (EINVAL) and its range keeps the default policy."""
    shards = plan_shards(read_topology(str(_two_nodes(tmp_path))), 4)
    mapping = None
    if backing == "shmem":
        fd = os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR, 0o600)
        os.ftruncate(fd, 4 * (1 << 20))
        mapping = mmap.mmap(fd, 4 << 20, flags=mmap.MAP_SHARED)
        os.close(fd)
    pool = Pool(4 << 20, chunk_bytes=1 << 20, mapping=mapping, shards=shards)
    try:
        pool.shards = bind_shards(pool.shards, pool.base_address, pool.chunk_bytes)
        assert [s.bound for s in pool.shards] == [True, False]
        assert _policy_at(pool.base_address) == "prefer:0"
        assert _policy_at(pool.base_address + 2 * pool.chunk_bytes) == "default"
        if backing == "shmem":  # fallocate after the policy: the pages exist (on node 0: the only one)
            pool.buffer[:: mmap.PAGESIZE] = 1
        assert mbind(pool.base_address, 1 << 20, 0, Policy.BIND).ok
        assert _policy_at(pool.base_address) == "bind:0"
    finally:
        pool.close()


def test_one_node_means_one_shard_and_no_policy(tmp_path):
    """A one-node host is the pool as before shards: one range, nothing bound, numa_maps default."""
    shards = plan_shards(read_topology(str(make_sysfs(tmp_path / "sys", ["0-1"]))), 4)
    pool = Pool(4 << 20, chunk_bytes=1 << 20, shards=shards)
    try:
        pool.shards = bind_shards(pool.shards, pool.base_address, pool.chunk_bytes)
        assert len(pool.shards) == 1 and not pool.shards[0].bound
        assert _policy_at(pool.base_address) == "default"
    finally:
        pool.close()


def _ctx(root, **kw) -> Context:
    base = dict(pool_size=256 << 20, pool_size_source="test", address="ipc:///nonexistent/kvoffd.sock",
                bandwidth_bytes=0, ipc=False, gpu_timeout_s=60, sysfs_root=str(root), gpu_probe={})
    base.update(kw)
    return Context(**base)


def test_doctor_shows_the_gpu_node_shard_map(tmp_path):
    root = _two_nodes(tmp_path, {"0000:19:00.0": 0, "0000:9a:00.0": 1, "0000:9b:00.0": 1, "0000:9c:00.0": 1})
    r = check_numa(_ctx(root))
    # node 1 is fake: the kernel refuses a policy there, and the check says so
    assert r.status == WARN and "node 1 (EINVAL" in r.detail, r
    assert "node 0 (CPUs 0): GPU0 0000:19:00.0; shard 0: 1/4 chunks" in r.detail
    assert "node 1 (CPUs 1): GPU1 0000:9a:00.0, GPU2 0000:9b:00.0, GPU3 0000:9c:00.0; shard 1: 3/4 chunks" in r.detail
    probed = check_numa(_ctx(root, gpu_probe={"gpus": [{"index": 0, "bus_id": "00000000:9A:00.0"}]}))
    assert "node 1 (CPUs 1): GPU0 00000000:9A:00.0; the one shard" in probed.detail  # CUDA's view wins
    unknown = check_numa(_ctx(_two_nodes(tmp_path / "u", {"0000:19:00.0": -1, "0000:9a:00.0": 1})))
    assert unknown.status == WARN and "GPU0: firmware gives no NUMA node" in unknown.detail
    one = check_numa(_ctx(make_sysfs(tmp_path / "one", ["0-1"])))
    assert one.status == PASS and "one pool shard" in one.detail
    off = check_numa(_ctx(root, numa_map="off"))
    assert off.status == PASS and "--numa-map off" in off.detail


def test_a_gpu_engine_is_placed_by_its_devices_bus_id_or_the_map(tmp_path):
    """What the CUDA backend hands over at REGISTER (the device's ordinal and PCI bus id) places the
    engine: sysfs's numa_node of that bus id, or --numa-map for that ordinal; a pool of one shard
    places nobody."""
    root = _two_nodes(tmp_path, {"0000:19:00.0": 0, "0000:9a:00.0": 1})
    topo = read_topology(str(root))
    pool = Pool(4 * CHUNK, chunk_bytes=CHUNK, shards=plan_shards(topo, 4))
    one = Pool(4 * CHUNK, chunk_bytes=CHUNK)
    try:
        gpu = MappedMemory(engine_id="g", kind="cuda_ipc", size=1, num_blocks=1, segments=[], slot_bytes=1,
                           gpu_ordinal=1, pci_bus_id="00000000:9A:00.0")
        assert place_engine(pool, topo, gpu, os.getpid()) == Placement(1, 1, "gpu")
        mapped = read_topology(str(root), parse_numa_map("gpu1=0"))
        assert place_engine(pool, mapped, gpu, os.getpid()) == Placement(0, 0, "gpu")
        assert place_engine(one, topo, gpu, os.getpid()) == Placement()
        cpu = MappedMemory(engine_id="c", kind="cpu_fd", size=1, num_blocks=1, segments=[], slot_bytes=1)
        here = topo.node_of_cpus(frozenset(os.sched_getaffinity(0)))  # this process: both CPUs, no node
        assert place_engine(pool, topo, cpu, os.getpid()) == (Placement() if here == UNKNOWN else
                                                              Placement(here, here, "cpu-affinity"))
    finally:
        pool.close()
        one.close()


def test_kvoffctl_status_shows_each_shard():
    st = {"pool": {"used_bytes": 3 << 20, "capacity_bytes": 8 << 20, "shards": [
        {"shard": 0, "node": 0, "capacity_bytes": 4 << 20, "used_bytes": 1 << 20, "spilled_slots": 0, "bound": True},
        {"shard": 1, "node": 1, "capacity_bytes": 4 << 20, "used_bytes": 2 << 20, "spilled_slots": 7, "bound": False}]},
        "counters": {"cross_numa_load_blocks": 5}}
    rows = dict(status_rows(st, "ipc:///x", 0.001))
    assert rows["pool shard 0"].startswith("node 0: 1.0 MiB used of 4.0 MiB (25")
    assert "5 blocks loaded across nodes" in rows["pool shard 0"]
    assert "7 slots spilled" in rows["pool shard 1"] and "not placed (mbind refused)" in rows["pool shard 1"]
    one = dict(status_rows({"pool": {"shards": [{"shard": 0, "node": -1}]}}, "ipc:///x", 0.001))
    assert not any(k.startswith("pool shard") for k in one)
