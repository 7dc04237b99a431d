"""Jobs in parts (issue 32): a LOAD cut by layer groups lands part by part, announced in order.

Unit: ``Runs.cut`` against a byte map of the slot for random layouts and cuts (every slot byte in
exactly one part, at the engine address the whole-block copy uses). Daemon (real process, CPU
backend): parts land byte-exact and LANDED comes in order before the NOTICE, on a raw peer that
sees every frame; a STORE in parts is the same blocks as a whole one; cuts that do not cut the slot
are refused with a clear error and nothing is copied.
"""

from __future__ import annotations

import numpy as np
import pytest
from kvtest import chain_keys, start_daemon
from reliability_util import RawPeer, ShmEngine

from kvoffd.transfer.base import MappedMemory, Runs
from kvoffd_client import protocol as P
from kvoffd_client.protocol import Segment

SLOT = 64 << 10  # 4 layers of 16 KiB per block
LAYERS = 4
N = 24


def _byte_map(runs: Runs, block: int) -> dict[int, int]:
    """slot position -> engine address of block ``block``, byte by byte."""
    out: dict[int, int] = {}
    for off, stride, length, pos in zip(runs.offset, runs.stride, runs.length, runs.pos, strict=True):
        for i in range(int(length)):
            out[int(pos) + i] = int(off) + block * int(stride) + i
    return out


@pytest.mark.parametrize("seed", range(6))
def test_cut_covers_the_slot_once_at_the_same_addresses(seed):
    rng = np.random.default_rng(seed)
    nseg = int(rng.integers(1, 6))
    lens = rng.integers(1, 40, nseg)
    offs = np.cumsum(np.concatenate(([0], lens[:-1] + rng.integers(0, 9, nseg - 1)))) if nseg > 1 else np.zeros(1, int)
    stride = int(lens.sum() + offs[-1] + 7)
    segs = [Segment(int(o), stride, int(n)) for o, n in zip(offs, lens, strict=True)]
    m = MappedMemory(engine_id="e", kind="cpu_fd", size=stride * 4, num_blocks=4, segments=segs,
                     slot_bytes=int(lens.sum()))
    whole = _byte_map(m.runs, 3)
    k = int(rng.integers(1, min(8, m.slot_bytes)))
    cuts = sorted(int(c) for c in rng.choice(np.arange(1, m.slot_bytes), size=k, replace=False))
    parts = m.parts(cuts)
    assert len(parts) == len(cuts) + 1
    seen: dict[int, int] = {}
    edges = [0, *cuts, m.slot_bytes]
    for p, runs in enumerate(parts):
        got = _byte_map(runs, 3)
        assert set(got) == set(range(edges[p], edges[p + 1])), f"part {p} covers the wrong slot bytes"
        assert not set(got) & set(seen)
        seen.update(got)
    assert seen == whole
    assert m.parts(cuts) is parts  # kept for the next job with the same cuts


@pytest.mark.parametrize("cuts", [[0], [SLOT], [10, 10], [30, 20], [SLOT + 5]])
def test_cuts_outside_the_slot_are_refused(cuts):
    m = MappedMemory(engine_id="e", kind="cpu_fd", size=SLOT * 2, num_blocks=2,
                     segments=[Segment(0, SLOT, SLOT)], slot_bytes=SLOT)
    with pytest.raises(ValueError, match="cuts must increase strictly"):
        m.parts(cuts)


@pytest.fixture
def rig(tmp_path):
    d = start_daemon(f"ipc://{tmp_path}/d.sock", "64MiB")
    eng = ShmEngine(2 * N, SLOT, layers=LAYERS, tag="parts")
    peer = RawPeer(d.address)
    try:
        peer.hello()
        r = peer.ask(P.Register(engine_id="parts-0", namespace="parts", rank=0, world_size=1, memory=eng.memory,
                                layout=eng.layout))
        assert r["op"] == "registered", r
        yield d, eng, peer
    finally:
        peer.close()
        eng.close()
        d.stop()


def _store(peer: RawPeer, eng: ShmEngine, job: int, keys: list[bytes], ids: list[int], **kw) -> dict:
    eng.fill(ids, keys)
    peer.send_msg(P.Store(engine_id="parts-0", job_id=job, keys=keys, block_ids=ids, **kw))
    return peer.recv_until(lambda r: r.get("op") in ("notice", "error"))[-1]


def test_load_in_parts_lands_in_order_then_the_notice(rig):
    d, eng, peer = rig
    keys = chain_keys(N, b"parts-load")
    n = _store(peer, eng, 1, keys, list(range(N)))
    assert n["op"] == "notice" and n["ok"], n
    layer = SLOT // LAYERS
    cuts = [layer, 2 * layer + 100, 3 * layer]  # one cut inside a layer's run: runs are split too
    ids = list(range(N, 2 * N))
    eng.poison(ids)
    peer.send_msg(P.Load(engine_id="parts-0", job_id=2, keys=keys, block_ids=ids, cuts=cuts))
    got = peer.recv_until(lambda r: r.get("op") in ("notice", "error"))
    landed = [r["parts"] for r in got if r.get("op") == "landed" and r.get("job_id") == 2]
    assert got[-1]["op"] == "notice" and got[-1]["ok"], got[-1]
    assert landed == sorted(landed) and landed and landed[-1] == len(cuts), landed
    assert len(set(landed)) == len(landed)
    assert eng.matches(ids, keys).all()


def test_store_in_parts_is_the_whole_block(rig):
    d, eng, peer = rig
    keys = chain_keys(N, b"parts-store")
    layer = SLOT // LAYERS
    n = _store(peer, eng, 3, keys, list(range(N)), cuts=[layer, 3 * layer - 1])
    assert n["op"] == "notice" and n["ok"], n
    ids = list(range(N, 2 * N))
    eng.poison(ids)
    r = peer.ask(P.Lookup(namespace="parts", keys=keys))
    assert r["hits"] == N, r
    peer.send_msg(P.Load(engine_id="parts-0", job_id=4, keys=keys, block_ids=ids))
    n = peer.recv_until(lambda r: r.get("op") in ("notice", "error"))[-1]
    assert n["op"] == "notice" and n["ok"], n
    assert eng.matches(ids, keys).all()


@pytest.mark.parametrize("fields", [{"cuts": [SLOT]}, {"cuts": [8, 4]}, {"ready_events": [0]},
                                    {"cuts": [SLOT // 2], "ready_events": [0, 1, 2]}])
def test_bad_parts_are_refused_and_nothing_is_copied(rig, fields):
    d, eng, peer = rig
    keys = chain_keys(4, b"parts-bad-%d" % len(str(fields)))
    eng.fill(range(4), keys)
    peer.send_msg(P.Store(engine_id="parts-0", job_id=5, keys=keys, block_ids=list(range(4)), **fields))
    r = peer.recv_until(lambda r: r.get("op") in ("notice", "error"))[-1]
    assert r["op"] == "error" and r["code"] == "bad_field" and r.get("job_id") == 5, r
    assert peer.ask(P.Lookup(namespace="parts", keys=keys))["hits"] == 0


def test_client_waits_for_parts(tmp_path):
    """KvoffdClient: ``supports_parts``, ``wait_landed`` until the job's parts are in, then its notice."""
    d = start_daemon(f"ipc://{tmp_path}/d.sock", "64MiB")
    eng = ShmEngine(2 * N, SLOT, layers=LAYERS, tag="parts-c")
    c = d.client()
    try:
        assert c.supports_parts
        c.register("parts-c", "parts-c", 0, 1, eng.memory, eng.layout)
        keys = chain_keys(N, b"parts-client")
        eng.fill(range(N), keys)
        c.submit_store("parts-c", 1, keys, range(N))
        assert c.wait_notices({1}, 30)[0].ok
        ids = list(range(N, 2 * N))
        eng.poison(ids)
        layer = SLOT // LAYERS
        c.submit_load("parts-c", 2, keys, ids, cuts=[layer, 2 * layer, 3 * layer])
        assert c.wait_landed({2}, 4, 30) == set()
        (n,) = c.wait_notices({2}, 30)
        assert n.ok, n
        assert eng.matches(ids, keys).all()
    finally:
        c.close()
        eng.close()
        d.stop()
