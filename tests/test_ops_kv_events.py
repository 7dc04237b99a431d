"""KV events for routers (issue 16, point 3), against a real daemon with --kv-events-address.

A subscriber (tests/support/kvevents_sub.py, reading the payloads with plain msgpack: an independent
reader of vLLM's wire format) follows the stream while a stand-in engine stores, the pool evicts and
CLEARs run; the resident set rebuilt from the events alone must equal what LOOKUP finds, key by key.
A late subscriber gets the same events from the replay socket. tests/vllm/test_kv_events.py does
it with a real vLLM engine and vLLM's own decoder classes.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from kvevents_sub import END_SEQ, EventSubscriber, resident
from kvtest import chain_keys
from reliability_util import ShmEngine

from kvoffd.config import ConfigError, load_config
from kvoffd_client.client import KvoffdError

MiB = 1 << 20


def _start(make_daemon, pool: str = "32MiB", *extra: str):
    """A daemon whose stream is the private default (``--kv-events-address ipc``): beside its socket."""
    d = make_daemon(pool, "--kv-events-address", "ipc", "--eviction-policy", "lru", *extra, name="events")
    ev = d.client().stats()["daemon"]["kv_events"]
    assert ev["endpoint"] == d.address + ".events" and ev["replay_endpoint"] == d.address + ".events.replay", ev
    return d, ev


def _store(c, eng: ShmEngine, engine_id: str, job: int, keys: list[bytes], first: int = 0) -> None:
    ids = list(range(first, first + len(keys)))
    eng.fill(ids, keys)
    c.submit_store(engine_id, job, keys, ids)
    (n,) = c.wait_notices({job}, 30)
    assert n.ok and not n.failed, n



def _index_holds(c, ns: str, keys: list[bytes]) -> set[bytes]:
    return {k for k in keys if c.lookup(ns, [k]).hits == 1}


def test_events_follow_stores_evictions_and_clears_and_match_the_index(make_daemon):
    d, ev = _start(make_daemon)
    eng = ShmEngine(48, MiB, tag="events")  # 1 MiB blocks: the 32 MiB pool holds 32 of them
    plain = ShmEngine(4, MiB, tag="plain")
    sub = EventSubscriber(ev["endpoint"], ev["replay_endpoint"])
    try:
        c = d.client(job_deadline_s=30.0)
        c.register("ev-0", "evns", 0, 1, eng.memory, {**eng.layout, "kv_events": {"hash": "bytes", "block_size": 16}})
        c.register("plain-0", "plain", 0, 1, plain.memory, plain.layout)  # keys not block hashes: unpublished
        keys = chain_keys(48, b"events")
        _store(c, eng, "ev-0", 1, keys[:8])
        _store(c, plain, "plain-0", 2, chain_keys(4, b"plain"))
        assert sub.wait_for(lambda s: set(keys[:8]) <= resident(s.events()))
        first = sub.events()[0]
        assert first == {"type": "BlockStored", "block_hashes": keys[:8], "parent_block_hash": None, "token_ids": [],
                         "block_size": 16, "lora_id": None, "medium": "CPU", "lora_name": None, "group_idx": 0,
                         "locality": "LOCAL", "ownership": "kvoffd"}, first
        # 40 more: the pool evicts the oldest; the events say which, and agree with LOOKUP key by key
        for i in range(5):
            _store(c, eng, "ev-0", 10 + i, keys[8 + 8 * i:16 + 8 * i], first=8 + 8 * i)
        held = _index_holds(c, "evns", keys)
        assert 0 < len(held) < 48
        assert sub.wait_for(lambda s: resident(s.events()) == held), (len(resident(sub.events())), len(held))
        assert any(e["type"] == "BlockRemoved" for e in sub.events())
        # CLEAR of one namespace: its removals; of all: one AllBlocksCleared
        c.clear("evns")
        assert sub.wait_for(lambda s: not resident(s.events()))
        _store(c, eng, "ev-0", 20, keys[:4])
        assert sub.wait_for(lambda s: resident(s.events()) == set(keys[:4]))
        c.clear()
        assert sub.wait_for(lambda s: s.events()[-1]["type"] == "AllBlocksCleared")
        assert _index_holds(c, "evns", keys) == set()
        all_hashes = {h for e in sub.events() for h in e.get("block_hashes", [])}
        assert all_hashes <= set(keys), "an event named a block of the unpublished namespace"
        # a late subscriber gets the same stream, from the replay socket
        late = EventSubscriber(ev["endpoint"], ev["replay_endpoint"])
        try:
            assert late.catch_up() == len(sub.batches)
            assert late.events() == sub.events()
        finally:
            late.close()
        m = d.metrics()
        assert f"kvoffd_kv_events_published_total {float(len(sub.events()))}" in m, m
        assert "kvoffd_kv_events_dropped_total 0.0" in m
    finally:
        sub.close()
        eng.close()
        plain.close()


def test_int64_hashes_and_the_topic(make_daemon):
    """vLLM's default form (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): a hash's low 64 bits."""
    d, ev = _start(make_daemon, "32MiB", "--kv-events-topic", "kv@node-a@tiny")
    assert ev["topic"] == "kv@node-a@tiny"
    eng = ShmEngine(4, 4096, tag="int64")
    sub = EventSubscriber(ev["endpoint"], ev["replay_endpoint"], topic=b"kv@")
    try:
        c = d.client(job_deadline_s=30.0)
        c.register("i-0", "intns", 0, 1, eng.memory, {**eng.layout, "kv_events": {"hash": "int64", "block_size": 32}})
        keys = chain_keys(4, b"int64")
        _store(c, eng, "i-0", 1, keys)
        want = [int.from_bytes(k, "big") & ((1 << 64) - 1) for k in keys]
        assert sub.wait_for(lambda s: s.batches and s.events()[0]["block_hashes"] == want)
        assert sub.events()[0]["block_size"] == 32 and sub.topics == {b"kv@node-a@tiny"}
    finally:
        sub.close()
        eng.close()


def test_a_bad_kv_events_field_is_refused_and_the_daemon_keeps_serving(make_daemon):
    d, _ = _start(make_daemon)
    eng = ShmEngine(4, 4096, tag="bad")
    try:
        c = d.client()
        for bad in ({"hash": "md5", "block_size": 16}, {"hash": "int64", "block_size": 0}, ["int64"],
                    {"hash": "bytes", "block_size": True}):
            with pytest.raises(KvoffdError) as e:
                c.register("bad-0", "badns", 0, 1, eng.memory, {**eng.layout, "kv_events": bad})
            assert e.value.code == "bad_field" and "kv_events" in e.value.message
        assert c.ping() >= 0
        assert c.stats()["engines"] == []
    finally:
        eng.close()


def test_kvoffctl_status_shows_the_endpoints(make_daemon):
    d, ev = _start(make_daemon)
    r = subprocess.run([sys.executable, "-m", "kvoffd.ops.ctl", "--address", d.address, "status"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("kv events"))
    assert ev["endpoint"] in line and ev["replay_endpoint"] in line, line
    d2 = make_daemon("16MiB", name="no-events")
    r = subprocess.run([sys.executable, "-m", "kvoffd.ops.ctl", "--address", d2.address, "status"],
                       capture_output=True, text=True, timeout=60)
    assert next(ln for ln in r.stdout.splitlines() if ln.startswith("kv events")).split()[-1] == "off", r.stdout


def test_kv_events_config():
    cfg = load_config(["--kv-events-address", "tcp://*:5557"], environ={})
    assert cfg.kv_events_address == "tcp://127.0.0.1:5557"  # loopback unless --allow-remote
    assert load_config([], environ={"KVOFFD_KV_EVENTS_ADDRESS": "ipc:///tmp/x/ev.sock"}).kv_events_address \
        == "ipc:///tmp/x/ev.sock"
    assert load_config([], environ={}).kv_events_address == ""  # off by default
    assert load_config(["--kv-events-address", "tcp://*:5557", "--allow-remote"], environ={}).kv_events_address \
        == "tcp://*:5557"
    # the private default: beside the daemon's ipc socket, else in the runtime directory
    cfg = load_config(["--address", "ipc:///run/k/kvoffd.sock", "--kv-events-address", "ipc"], environ={})
    assert cfg.kv_events_address == "ipc:///run/k/kvoffd.sock.events"
    cfg = load_config(["--address", "tcp://127.0.0.1:5555", "--auth-token-file", "/run/k/tok",
                       "--kv-events-address", "ipc"], environ={})
    assert cfg.kv_events_address == "ipc:///run/k/kvoffd.sock.events"
    assert (cfg.kv_events_auth, cfg.kv_events_token_ids) == ("curve", False)  # tcp:// takes CURVE; no tokens
    assert load_config(["--kv-events-address", "tcp://127.0.0.1:5557", "--kv-events-token-ids"],
                       environ={}).kv_events_token_ids
    for argv, why in ((["--kv-events-address", "tcp://10.1.2.3:5557"], "--kv-events-address"),
                      (["--kv-events-replay-address", "tcp://127.0.0.1:5558"], "needs --kv-events-address"),
                      (["--kv-events-address", "http://x"], "--kv-events-address"),
                      (["--kv-events-address", "tcp://127.0.0.1:5557", "--kv-events-replay-address",
                        "tcp://127.0.0.1:5557"], "must differ"),
                      (["--kv-events-address", "tcp://127.0.0.1:5557", "--kv-events-auth", "token"], "curve or none"),
                      (["--kv-events-address", "tcp://127.0.0.1:5557", "--kv-events-replay-address",
                        "ipc:///tmp/x/r.sock"], "transport"),
                      (["--kv-events-address", "tcp://127.0.0.1:5557", "--kv-events-auth", "none",
                        "--kv-events-token-ids"], "anyone who can reach the port"),
                      (["--address", "ipc:///tmp/" + "x" * 84 + "/k.sock", "--kv-events-address", "ipc"],
                       "replay socket")):
        with pytest.raises(ConfigError, match=why):
            load_config(argv, environ={})


def test_malformed_replay_requests_are_ignored_and_the_stream_goes_on(make_daemon):
    """Any process that may connect (the daemon's user, on the default stream): bad requests (wrong
    sizes, extra frames, a 1 MiB frame) are dropped with a rate-limited warning, and a good request is
    still answered."""
    import zmq

    d, ev = _start(make_daemon)
    eng = ShmEngine(4, 4096, tag="replay-bad")
    ctx = zmq.Context()
    bad = ctx.socket(zmq.DEALER)
    bad.setsockopt(zmq.LINGER, 0)
    bad.connect(ev["replay_endpoint"])
    sub = EventSubscriber(ev["endpoint"], ev["replay_endpoint"])
    try:
        for frames in ([b"", b"xx"], [b"", b"12345678", b"extra"], [b"only-one"]):
            bad.send_multipart(frames)
        # a good request behind them on the same connection: one peer's requests are served in order,
        # so once it is answered the bad ones were read (and warned about): no race with the log
        bad.send_multipart([b"", (0).to_bytes(8, "big")])
        assert bad.poll(30_000), "the replay socket never answered behind the malformed requests"
        assert bad.recv_multipart() == [b"", b"", END_SEQ, b""]
        assert "ignoring a malformed replay request" in d.log()
        bad.send_multipart([b"", b"x" * MiB])  # past MAXMSGSIZE: ZeroMQ drops this connection
        c = d.client(job_deadline_s=30.0)
        c.register("rb-0", "rbns", 0, 1, eng.memory, {**eng.layout, "kv_events": {"hash": "bytes", "block_size": 16}})
        keys = chain_keys(4, b"replay-bad")
        _store(c, eng, "rb-0", 1, keys)
        assert sub.wait_for(lambda s: resident(s.events()) == set(keys))
        late = EventSubscriber(ev["endpoint"], ev["replay_endpoint"])  # replay still answers
        try:
            assert late.catch_up() == len(sub.batches) == 1
        finally:
            late.close()
        assert c.ping() >= 0
    finally:
        bad.close(0)
        ctx.term()
        sub.close()
        eng.close()


def test_described_blocks_carry_their_tokens_and_parents(make_daemon):
    """What the connector sends a daemon whose HELLO_OK lists `kv_events` (``--kv-events-token-ids``):
    each block's tokens and the key before it. Each such block is its own BlockStored, with its tokens
    and its parent's hash, as routers that index tokens (llm-d, Dynamo) need; sizes that do not fit are
    refused."""
    from kvoffd_client.vllm.events import NO_PARENT, block_tokens

    d, _ = _start(make_daemon, "32MiB", "--kv-events-token-ids")
    ev = d.client().stats()["daemon"]["kv_events"]
    eng = ShmEngine(8, 4096, tag="described")
    sub = EventSubscriber(ev["endpoint"], ev["replay_endpoint"])
    try:
        c = d.client(job_deadline_s=30.0)
        assert "kv_events" in c.hello.capabilities
        c.register("ds-0", "dsns", 0, 1, eng.memory, {**eng.layout, "kv_events": {"hash": "int64", "block_size": 4}})
        keys = chain_keys(3, b"described")
        toks = [[7, 8, 9, 10], [11, 12, 13, 14], [15, 16, 17, 18]]
        tokens = b"".join(block_tokens(t, 0, 4) for t in toks)
        parents = NO_PARENT + keys[0] + keys[1]
        eng.fill(range(3), keys)
        for job, (tk, pa) in enumerate(((tokens[:-4], parents), (tokens, parents[:-1])), start=1):
            c.submit_store("ds-0", job, keys, [0, 1, 2], tokens=tk, parents=pa)
            (n,) = c.wait_notices({job}, 30)
            assert not n.ok and n.code == "bad_field" and "describes its blocks" in n.message, n
        c.submit_store("ds-0", 3, keys, [0, 1, 2], tokens=tokens, parents=parents)
        (n,) = c.wait_notices({3}, 30)
        assert n.ok, n
        low = [int.from_bytes(k[-8:], "big") for k in keys]
        assert sub.wait_for(lambda s: len(s.events()) == 3)
        got = [(e["block_hashes"], e["parent_block_hash"], e["token_ids"], e["block_size"]) for e in sub.events()]
        assert got == [([low[0]], None, toks[0], 4), ([low[1]], low[0], toks[1], 4), ([low[2]], low[1], toks[2], 4)]
    finally:
        sub.close()
        eng.close()
