"""KV events after a warm restart (issues 14 and 16): the stream announces the blocks a new daemon adopted.

Real daemons on one pool file (tmpfs), a real engine (this process, memory in a sealed memfd), real
ZeroMQ SUB/DEALER sockets (tests/support/kvevents_sub.py). The daemon is stopped (SIGTERM) or killed
(SIGKILL) and a new one adopts the file; a subscriber of the new daemon, replaying from seq 0, rebuilds
the pool's content from the events alone, and that set must equal what LOOKUP finds key by key:

* the namespace's event identity was kept in the pool file: the adopted blocks are announced at start,
  before any engine registers again, and not a second time when one does;
* the file has no identity for it (the engine that stored them did not say its keys are hashes): the
  blocks are announced at the REGISTER that says so; a block evicted before that is never announced.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections import Counter

import pytest
from kvevents_sub import EventSubscriber, resident
from kvtest import chain_keys, wait_until
from reliability_util import ShmEngine

from kvoffd_client.client import KvoffdClient

NB, SLOT = 128, 256 << 10  # 32 MiB of blocks in a 64 MiB pool (256 slots)
NS = "warm-ev"
IDENTITY = {"hash": "bytes", "block_size": 16}


def _start(make_daemon, pool_path: str):
    d = make_daemon("64MiB", "--pool-path", pool_path, "--copy-threads", "1", "--eviction-policy", "lru",
                    "--kv-events-address", "ipc", name="warm-ev")
    return d, d.client().stats()["daemon"]["kv_events"]


class Engine:
    """One stand-in engine (its memory here) registered in ``namespace`` with ``kv_events`` or without."""

    def __init__(self, address: str, engine_id: str, namespace: str, kv_events: dict | None, tag: str):
        self.engine_id, self.job = engine_id, 0
        self.mem = ShmEngine(NB, SLOT, layers=2, tag=tag)
        self.c = KvoffdClient(address, timeout_s=5.0, job_deadline_s=30.0, link_grace_s=0.5)
        assert self.c.connect(10)
        layout = {**self.mem.layout, **({"kv_events": kv_events} if kv_events else {})}
        self.c.register(engine_id, namespace, 0, 1, self.mem.memory, layout)

    def store(self, keys: list[bytes]) -> None:
        for i in range(0, len(keys), NB):
            part = keys[i:i + NB]
            self.job += 1
            self.mem.fill(range(len(part)), part)
            self.c.submit_store(self.engine_id, self.job, part, range(len(part)))
            (n,) = self.c.wait_notices({self.job}, 30)
            assert n.ok, n

    def close(self) -> None:
        self.c.close()
        self.mem.close()



def _stored(events: list[dict]) -> Counter:
    """How many times each hash was announced."""
    return Counter(h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"])


def _index_holds(c, keys: list[bytes]) -> set[bytes]:
    return {k for k in keys if c.lookup(NS, [k]).hits == 1}


def _stop(d, sig: int, sealed: int) -> None:
    if sig == signal.SIGKILL:  # durable once sealed (milliseconds after the store); SIGTERM seals the rest
        c = d.client()
        assert wait_until(lambda: c.stats()["persistence"]["sealed_blocks"] >= sealed, 10)
    d.proc.send_signal(sig)
    assert d.proc.wait(15) is not None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_adopted_blocks_are_announced_at_start_and_match_the_index(make_daemon, pool_path, sig):
    d, _ = _start(make_daemon, pool_path)
    keys = chain_keys(NB, b"adopted")
    eng = Engine(d.address, "ev-0", NS, IDENTITY, "warm-ev")
    eng.store(keys)
    eng.close()  # no engine comes back by itself: the announcement cannot wait for one
    _stop(d, sig, NB)
    d, ev = _start(make_daemon, pool_path)
    watcher = d.client()
    st = watcher.stats()
    assert st["persistence"]["adopted_blocks"] >= 0.99 * NB and st["engines"] == [], st["persistence"]
    held = _index_holds(watcher, keys)
    assert len(held) == st["persistence"]["adopted_blocks"]
    sub = EventSubscriber(ev["endpoint"], ev["replay_endpoint"])  # joins late: replays from seq 0
    again = None
    try:
        assert sub.wait_for(lambda s: resident(s.events()) == held, 30), (len(resident(sub.events())), len(held))
        assert {e["medium"] for e in sub.events()} == {"CPU"}
        assert sub.events()[0]["token_ids"] == [] and sub.events()[0]["parent_block_hash"] is None
        # the engine comes back: no second announcement; its new blocks follow as usual
        again = Engine(d.address, "ev-0", NS, IDENTITY, "warm-ev2")
        more = chain_keys(8, b"after")
        again.store(more)
        assert sub.wait_for(lambda s: resident(s.events()) == held | set(more), 30)
        assert max(_stored(sub.events()).values()) == 1, "an adopted block was announced twice"
        info = watcher.stats()["daemon"]["kv_events"]
        assert info["adopted_announced"] == len(held) and info["adopted_waiting"] == 0, info
        late = EventSubscriber(ev["endpoint"], ev["replay_endpoint"])  # a replay request gives the same view
        try:
            assert late.catch_up() == len(sub.batches)
            assert resident(late.events()) == _index_holds(watcher, keys + more)
        finally:
            late.close()
    finally:
        sub.close()
        if again is not None:
            again.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_without_a_kept_identity_they_are_announced_at_register_and_evicted_ones_never(make_daemon, pool_path,
                                                                                        sig):
    d, _ = _start(make_daemon, pool_path)
    keys = chain_keys(NB, b"unsaid")
    eng = Engine(d.address, "plain-0", NS, None, "warm-plain")  # keys not said to be block hashes
    eng.store(keys)
    eng.close()
    _stop(d, sig, NB)
    d, ev = _start(make_daemon, pool_path)
    watcher = d.client()
    assert watcher.stats()["persistence"]["adopted_blocks"] >= 0.99 * NB
    sub = EventSubscriber(ev["endpoint"], ev["replay_endpoint"])
    filler = late = None
    try:
        # the pool holds 256 slots: 160 blocks of another namespace evict the 32 oldest adopted ones
        filler = Engine(d.address, "fill-0", "filler", None, "warm-fill")
        filler.store(chain_keys(160, b"filler"))
        held = _index_holds(watcher, keys)
        evicted = set(keys) - held
        assert len(evicted) >= 32, len(evicted)
        assert sub.catch_up() == 0, "published before the namespace's identity was known"
        waiting = watcher.stats()["daemon"]["kv_events"]["adopted_waiting"]
        assert waiting >= len(held)
        r = subprocess.run([sys.executable, "-m", "kvoffd.ops.ctl", "--address", d.address, "status"],
                           capture_output=True, text=True, timeout=60)
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith("kv events"))
        assert f"0 announced, {waiting:,} waiting for a REGISTER" in line, line
        # an engine of the namespace registers saying its keys are its block hashes: announced now
        late = Engine(d.address, "ev-1", NS, IDENTITY, "warm-late")
        assert sub.wait_for(lambda s: resident(s.events()) == held, 30), (len(resident(sub.events())), len(held))
        assert not evicted & set(_stored(sub.events())), "a block evicted before its announcement was announced"
        # later evictions of adopted blocks are ordinary removals
        filler.store(chain_keys(64, b"filler-2"))
        now = _index_holds(watcher, keys)
        assert now < held
        assert sub.wait_for(lambda s: resident(s.events()) == now, 30)
        assert max(_stored(sub.events()).values()) == 1
        fresh = EventSubscriber(ev["endpoint"], ev["replay_endpoint"])
        try:
            fresh.catch_up()
            assert resident(fresh.events()) == now
        finally:
            fresh.close()
    finally:
        sub.close()
        for e in (filler, late):
            if e is not None:
                e.close()
