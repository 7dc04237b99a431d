"""Bad input: every malformed frame gets an ERROR with a code, nothing is written, the daemon serves on."""

from __future__ import annotations

import os

import msgpack
import pytest
import zmq
from kvtest import chain_keys

from kvoffd_client import protocol as P


@pytest.fixture
def raw(daemon):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(daemon.address)

    def ask(frame: bytes | list[bytes], timeout_ms: int = 5000) -> dict:
        if isinstance(frame, list):
            s.send_multipart(frame)
        else:
            s.send(frame)
        assert s.poll(timeout_ms), "no reply: the daemon went silent"
        return msgpack.unpackb(s.recv())

    yield ask
    s.close(0)


def hello(ask) -> None:
    assert ask(P.encode(P.Hello(seq=1, pid=os.getpid())))["op"] == "hello_ok"


def test_messages_before_hello_are_refused(raw):
    r = raw(P.encode(P.Lookup(seq=5, namespace="x", keys=[])))
    assert r["op"] == "error" and r["code"] == "hello_required" and r["seq"] == 5


def test_version_mismatch_is_a_clear_error(raw):
    r = raw(P.encode(P.Hello(seq=2, version=99)))
    assert r["code"] == "version_mismatch" and f"v{P.PROTOCOL_VERSION}" in r["message"] and "v99" in r["message"]


@pytest.mark.parametrize("frame, code", [
    (os.urandom(64), None),  # random bytes: bad_frame, or a msgpack scalar by chance
    (msgpack.packb([1, 2, 3]), "bad_frame"),
    (msgpack.packb("hello"), "bad_frame"),
    (b"\xc1", "bad_frame"),  # a reserved msgpack byte
    (msgpack.packb({"op": "frobnicate", "seq": 3}), "unknown_op"),
    (msgpack.packb({"op": "notice", "seq": 3}), "unknown_op"),  # a reply type is not a request
    (msgpack.packb({"op": 7, "seq": 3}), "unknown_op"),
    (msgpack.packb({"op": "lookup", "seq": -1}), "bad_field"),
    (msgpack.packb({"op": "lookup", "seq": 4, "namespace": 5, "keys": []}), "bad_field"),
    (msgpack.packb({"op": "lookup", "seq": 4, "namespace": "n", "keys": "abc"}), "bad_key"),
    (msgpack.packb({"op": "lookup", "seq": 4, "namespace": "n", "keys": [b"short"]}), "bad_key"),
    (msgpack.packb({"op": "lookup", "seq": 4, "namespace": "n", "keys": b"k" * 33}), "bad_key"),
    (msgpack.packb({"op": "lookup", "seq": 4, "namespace": "n", "keys": b"k" * 32 * 70000}), "too_many"),
    (msgpack.packb({"op": "store", "seq": 4, "engine_id": "e", "job_id": 1, "keys": b"", "block_ids": [1]}),
     "bad_field"),
    (msgpack.packb({"op": "store", "seq": 4, "engine_id": "e", "job_id": 1, "keys": b"", "block_ids": b"abc"}),
     "bad_field"),
    (msgpack.packb({"op": "lookup", "seq": 4, "namespace": "n", "keys": [b"x" * 32, "y" * 32]}), "bad_key"),
    (msgpack.packb({"op": "lookup", "seq": 4, "namespace": "n", "keys": b"", "lease_ms": True}), "bad_field"),
    (msgpack.packb({"op": "store", "seq": 4, "engine_id": "nobody", "job_id": 1, "keys": b"", "block_ids": b""}),
     "not_registered"),
    (msgpack.packb({"op": "clear", "seq": 4, "namespace": ["all"]}), "bad_field"),
    (msgpack.packb({"op": "register", "seq": 4, "engine_id": "e", "namespace": "n", "memory": {},
                    "layout": {"num_blocks": 4, "segments": [[0, 8, 16]]}}), "bad_field"),
    (msgpack.packb({"op": "register", "seq": 4, "engine_id": "e", "namespace": "n", "memory": {"kind": "gpu9"},
                    "layout": {"num_blocks": 4, "segments": [[0, 16, 16]]}}), "memory_unreachable"),
    (msgpack.packb({"op": "register", "seq": 4, "engine_id": "e", "namespace": "n",
                    "memory": {"kind": "cpu_shm", "path": "/etc/passwd", "size": 10},
                    "layout": {"num_blocks": 4, "segments": [[0, 4096, 4096]]}}), "memory_unreachable"),
    (msgpack.packb({"op": "register", "seq": 4, "engine_id": "e", "namespace": "n",
                    "memory": {"kind": "cpu_fd", "token": "0" * 32, "size": 64},
                    "layout": {"num_blocks": 4, "segments": [[0, 4096, 4096]]}}), "memory_unreachable"),
    (msgpack.packb({"op": "register", "seq": 4, "engine_id": "e", "namespace": "n",
                    "memory": {"kind": "cpu_fd", "fd": 0, "size": 64},  # an fd number means nothing here
                    "layout": {"num_blocks": 4, "segments": [[0, 4096, 4096]]}}), "bad_field"),
    (msgpack.packb({"op": "register", "seq": 4, "engine_id": "e", "namespace": "n", "rank": 3, "world_size": 2,
                    "memory": {}, "layout": {}}), "bad_field"),
    (msgpack.packb({"op": "register", "seq": 4, "engine_id": "e", "namespace": "n", "rank": 0, "world_size": 2,
                    "replicas": 0,  # else memory_unreachable (unknown token)
                    "memory": {"kind": "cpu_fd", "token": "0" * 32, "size": 64},
                    "layout": {"num_blocks": 4, "segments": [[0, 4096, 4096]]}}), "bad_field"),
    (msgpack.packb({"op": "register", "seq": 4, "engine_id": "e", "namespace": "n", "rank": 0, "world_size": 2,
                    "replicas": 3,  # else memory_unreachable (unknown token)
                    "memory": {"kind": "cpu_fd", "token": "0" * 32, "size": 64},
                    "layout": {"num_blocks": 4, "segments": [[0, 4096, 4096]]}}), "bad_field"),
    # maps nested 100k deep: msgspec raises RecursionError, which must be an ordinary refusal
    (b"\x81\xa1a" * 100_000 + b"\xc0", "bad_frame"),
])
def test_malformed_frames_get_error_replies(raw, frame, code):
    hello(raw)
    r = raw(frame)
    assert r["op"] == "error"
    if code is None:
        assert r["code"] in ("bad_frame", "unknown_op"), r
    else:
        assert r["code"] == code, r
    assert r["message"]
    pong = raw(P.encode(P.Ping(seq=77)))  # and the next valid request is served
    assert pong["op"] == "pong" and pong["seq"] == 77


def test_extra_frames_and_oversized_frames(raw):
    hello(raw)
    r = raw([b"a", b"b"])
    assert r["code"] == "bad_frame" and "got 2" in r["message"]
    r = raw([P.encode(P.Ping(seq=3)), b"b", b"c"])  # a valid body does not make the rest acceptable
    assert r["code"] == "bad_frame" and "got 3" in r["message"]
    big = msgpack.packb({"op": "ping", "seq": 1, "pad": b"x" * (P.MAX_FRAME_BYTES + 1)})
    r = raw(big)
    assert r["code"] == "frame_too_large"
    assert raw(P.encode(P.Ping(seq=9)))["op"] == "pong"


def test_bad_jobs_write_nothing(daemon, engines):
    """Out-of-range ids, mismatched lengths, foreign engines, duplicate jobs: refused before any copy."""
    eng = engines(daemon.address, "val-0", namespace="val", blocks=16)
    other = engines(daemon.address, "val-1", namespace="val", blocks=16)
    keys = chain_keys(4, b"val")
    eng("fill", ids=list(range(16)), seed=8)
    assert eng.store(1, keys, [0, 1, 2, 3])["ok"]
    before = eng("digest", ids=list(range(16)))
    cases = [
        (dict(job=2, keys=keys, ids=[0, 1, 2, 16]), "bad_block_id"),
        (dict(job=3, keys=keys, ids=[-1, 0, 1, 2]), "bad_block_id"),
        (dict(job=4, keys=keys, ids=[0, 1, 2]), "bad_field"),
        (dict(job=5, keys=keys, ids=[0, 1, 2, 2 ** 31 - 1]), "bad_block_id"),
    ]
    for args, code in cases:
        r = eng("load", keys=[k.hex() for k in args["keys"]], ids=args["ids"], job=args["job"])[0]
        assert not r["ok"] and r["code"] == code, (args, r)
    assert eng("digest", ids=list(range(16))) == before
    # another connection naming this engine is refused
    c = daemon.client()
    with pytest.raises(Exception) as e:
        c.request(P.Load(engine_id="val-0", job_id=9, keys=keys, block_ids=[0, 1, 2, 3]))
    assert "foreign_engine" in str(e.value)
    assert other.load(1, keys, [4, 5, 6, 7])["ok"]  # the legitimate engine keeps working
    assert eng("digest", ids=list(range(16))) == before


def test_errors_are_counted_by_code(daemon, raw):
    hello(raw)
    before = daemon.metrics()
    raw(msgpack.packb({"op": "frobnicate", "seq": 1}))
    after = daemon.metrics()

    def val(text: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith('kvoffd_errors_total{code="unknown_op"}'))
        return float(line.split()[-1])

    assert val(after) == val(before) + 1


def test_a_senders_keys_are_packed_or_refused_before_sending():
    """Keys may be given as a list or any bytes-like blob; each key must be exactly KEY_SIZE bytes
    (a list of a short and a long key adds up to whole keys, and is still refused)."""
    keys = chain_keys(3, b"pack")
    blob = b"".join(keys)
    for given in (keys, blob, bytearray(blob), memoryview(blob)):
        msg = P.Lookup(namespace="n", keys=given)
        assert type(msg.keys) is bytes and msg.keys == blob
        assert P.decode(P.encode(msg), requests_only=True) == msg
    for bad in ([keys[0][:31], keys[1] + b"x"], blob[:-1], [1, 2], ["x" * 32]):
        with pytest.raises(P.ProtocolError) as e:
            P.Store(engine_id="e", job_id=1, keys=bad, block_ids=[0, 1])
        assert e.value.code is P.ErrorCode.BAD_KEY, bad
    assert P.Store(engine_id="e", keys=keys, block_ids=range(3)).block_ids == P.pack_ids([0, 1, 2])
    with pytest.raises(P.ProtocolError) as e:
        P.Store(engine_id="e", keys=keys, block_ids=[0, 1, 2 ** 31])
    assert e.value.code is P.ErrorCode.BAD_FIELD
