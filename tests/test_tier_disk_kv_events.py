"""KV events of the disk tier (medium STORAGE), through real daemons: its spills and removals are published
as they happen, and after a restart (SIGTERM or SIGKILL) the blocks its persistent index reopened are
announced once the namespace's identity is known, so that a subscriber replaying from seq 0 sees,
per medium, what the pool and the disk hold.

The pool is private memory (``--pool-path none``) so that the restart is cold for the pool and warm for
the disk alone: the new daemon learns the namespace's identity at the engine's REGISTER (the disk tier
keeps none; a pool file would, see tests/test_warm_restart_kv_events.py).
"""

from __future__ import annotations

import signal

import pytest
from kvevents_sub import EventSubscriber
from kvtest import chain_keys, start_daemon, wait_until
from reliability_util import ShmEngine

SLOT = 64 << 10
POOL = "8MiB"  # 128 slots
NS = "disk-ev"
IDENTITY = {"hash": "int64", "block_size": 16}


def _args(tmp_path) -> tuple[str, ...]:
    return ("--disk-path", str(tmp_path / "disk"), "--disk-size", "64MiB", "--eviction-policy", "lru",
            "--pool-path", "none", "--kv-events-address", "ipc")


class Rig:
    def __init__(self, d):
        self.d, self.job = d, 0
        self.eng = ShmEngine(128, SLOT, tag="disk-ev")
        self.c = d.client(job_deadline_s=30.0)
        self.c.register("dev-0", NS, 0, 1, self.eng.memory, {**self.eng.layout, "kv_events": IDENTITY})
        ev = self.c.stats()["daemon"]["kv_events"]
        self.sub = EventSubscriber(ev["endpoint"], ev["replay_endpoint"])

    def store(self, keys: list[bytes]) -> None:
        self.eng.fill(range(len(keys)), keys)
        self.job += 1
        self.c.submit_store("dev-0", self.job, keys, range(len(keys)))
        (n,) = self.c.wait_notices({self.job}, 30)
        assert n.ok, n

    def disk(self) -> dict:
        return next(t for t in self.c.stats()["tiers"] if t["name"] == "disk")

    def in_pool(self, keys: list[bytes]) -> set[int]:
        out = set()
        for i in range(0, len(keys), 64):
            part = keys[i:i + 64]
            out |= {_h(k) for k, e in zip(part, self.c.explain(NS, part), strict=True) if e["state"] == "resident"}
        return out

    def close(self) -> None:
        self.sub.close()
        self.c.close()
        self.eng.close()


def _h(key: bytes) -> int:
    return int.from_bytes(key[-8:], "big")


def _by_medium(events: list[dict]) -> dict[str, set]:
    held: dict[str, set] = {"CPU": set(), "STORAGE": set()}
    for e in events:
        if e["type"] == "BlockStored":
            held[e["medium"]].update(e["block_hashes"])
        elif e["type"] == "BlockRemoved":
            held[e["medium"]].difference_update(e["block_hashes"])
        elif e["type"] == "AllBlocksCleared":
            for s in held.values():
                s.clear()
    return held


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_disk_blocks_are_published_and_announced_again_after_a_restart(tmp_path, sig):
    keys = chain_keys(400, b"disk-ev")
    d = start_daemon(f"ipc://{tmp_path}/a.sock", POOL, *_args(tmp_path))
    try:
        rig = Rig(d)
        for i in range(0, 400, 100):  # 400 blocks through a 128-slot pool: most of them spilled
            rig.store(keys[i:i + 100])
        assert wait_until(lambda: rig.disk()["spills"] >= 250, 30), rig.disk()
        on_disk = rig.disk()["resident_blocks"]

        def matches(s: EventSubscriber) -> bool:
            held = _by_medium(s.events())
            return len(held["STORAGE"]) == on_disk and held["CPU"] == rig.in_pool(keys)

        assert rig.sub.wait_for(matches, 30), (len(_by_medium(rig.sub.events())["STORAGE"]), on_disk)
        before = _by_medium(rig.sub.events())["STORAGE"]
        assert before <= {_h(k) for k in keys}
        rig.close()
    finally:
        d.stop(sig)
    d = start_daemon(f"ipc://{tmp_path}/b.sock", POOL, *_args(tmp_path))
    try:
        probe = d.client()
        ev = probe.stats()["daemon"]["kv_events"]
        early = EventSubscriber(ev["endpoint"], ev["replay_endpoint"])
        try:
            assert early.catch_up() == 0, "announced before the namespace's identity was known"
        finally:
            early.close()
        rig = Rig(d)  # REGISTER with the identity: the reopened blocks are announced, once
        assert rig.disk()["resident_blocks"] == len(before)
        assert rig.sub.wait_for(lambda s: _by_medium(s.events())["STORAGE"] == before, 30), \
            (len(_by_medium(rig.sub.events())["STORAGE"]), len(before))
        stored = [h for e in rig.sub.events() if e["type"] == "BlockStored" for h in e["block_hashes"]]
        assert len(stored) == len(set(stored)) == len(before)
        assert probe.stats()["daemon"]["kv_events"]["reopened_announced"] == len(before)
        rig.c.clear(NS)  # a CLEAR of the namespace: its disk blocks' removals
        assert rig.sub.wait_for(lambda s: not _by_medium(s.events())["STORAGE"], 30)
        rig.close()
    finally:
        d.stop()
