"""Drill: bad input. Hypothesis throws >= 10,000 generated frames at a live daemon.

Frames: random bytes, msgpack headers claiming huge lengths, non-map values, maps with unknown or
reply ops, every request with fields of the wrong type or out of range, jobs naming block ids
outside the engine, another connection's engine, unknown engines, mismatched lengths, events outside
the ring, replayed job ids, oversized key lists and frames, multi-frame messages, and everything again
on a connection that never said HELLO.

The oracle is exact. Each frame is first decoded here with the protocol's own ``decode``: a frame it
refuses must get an ERROR with the same code (and seq); one it accepts is judged by a model of the
daemon's checks (engine owner, lengths, ids, event) and must get the ERROR that model predicts, or
the ordinary reply for a harmless valid request (lookup, stats, ping, explain). Frames that would be
valid and change state (CLEAR, jobs that pass every check, touching the fuzzer's own engine's
registration) are not sent: they are not bad input. RELEASE has no reply by design.

Throughout, a valid client's lookups are served (checked after every batch); at the end the daemon is
up, an ``internal`` error never occurred, the stand-in engine's blocks, the fuzzer's own engine memory
and the pool's contents are unchanged, and ``kvoffd_errors_total`` rose by exactly the errors answered.
"""

from __future__ import annotations

import collections
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtest import chain_keys
from reliability_util import RawPeer, ShmEngine, record, wire_memory

from kvoffd_client import protocol as P

OWN, OWN_BLOCKS, FOREIGN = "fz-own", 16, "fz-target"
SEQ0 = 1 << 50  # seqs the fuzzer assigns start here: never confused with a daemon default

EDGE_INTS = [0, 1, -1, 2, 15, 16, 17, 255, 256, 2**15, 2**16, 2**16 + 1, 65536, 65537, 600_000, 600_001,
             2**20, 2**20 + 1, 2**31 - 1, 2**31, 2**32, 2**40, 2**40 + 1, 2**63 - 1, 2**63, 2**64 - 1, -(2**31),
             -(2**63)]
ints = st.sampled_from(EDGE_INTS) | st.integers(-(2**63), 2**64 - 1)
scalars = (st.none() | st.booleans() | ints | st.floats(allow_nan=True) | st.text(max_size=24)
           | st.binary(max_size=96) | st.sampled_from(["", "x" * 257, OWN, FOREIGN, "cpu_shm", "/dev/shm/x"]))
values = st.recursive(scalars, lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=8), ch,
                                                                                         max_size=4),
                      max_leaves=3)
REQUEST_OPS = sorted(op.value for op in P.REQUESTS)
ALL_OPS = sorted(op.value for op in P.Op)


def key_blobs(n_max: int = 20) -> st.SearchStrategy[bytes]:
    return (st.integers(0, n_max).map(lambda n: bytes(range(32)) * n)
            | st.binary(max_size=n_max * 32 + 7))


def id_blobs() -> st.SearchStrategy[bytes]:
    ids = st.lists(st.sampled_from([0, 1, OWN_BLOCKS - 1, OWN_BLOCKS, -1, 2**31 - 1, -(2**31)])
                   | st.integers(-(2**31), 2**31 - 1), max_size=20)
    return ids.map(P.pack_ids) | st.binary(max_size=83)


# --- the frames ---------------------------------------------------------------------------------------------


@st.composite
def job_frame(draw) -> dict[str, Any]:
    """A STORE or LOAD whose fields are drawn near the daemon's checks (types mostly right)."""
    op = draw(st.sampled_from(["store", "load"]))
    d: dict[str, Any] = {"op": op, "seq": 0,
                         "engine_id": draw(st.sampled_from([OWN, OWN, FOREIGN, "nobody", ""]) | st.text(max_size=8)),
                         "job_id": draw(st.integers(0, 8) | ints),  # small ids: replays of earlier frames
                         "keys": draw(key_blobs()), "block_ids": draw(id_blobs())}
    if draw(st.booleans()):
        d["ready_event"] = draw(st.sampled_from([-1, -1, 0, 1, 2**20, 2**20 + 1, -2]) | ints)
    if op == "load" and draw(st.booleans()):
        d["lease_id"] = draw(ints)
    return d


@st.composite
def typed_job(draw) -> dict[str, Any]:
    """A STORE or LOAD with every type right: only ownership, lengths, ids, ready_event or a replayed job id
    can make it bad (the daemon's own checks, after decoding)."""
    n = draw(st.integers(0, 12))
    ids = draw(st.lists(st.integers(0, OWN_BLOCKS - 1) | st.sampled_from([OWN_BLOCKS, -1, 2**31 - 1, -(2**31)]),
                        min_size=max(0, n - 1), max_size=n + 1))
    d = {"op": draw(st.sampled_from(["store", "load"])), "seq": 0,
         "engine_id": draw(st.sampled_from([OWN, OWN, OWN, FOREIGN, "nobody"])),
         "job_id": draw(st.integers(0, 4)), "keys": bytes(range(32)) * n, "block_ids": P.pack_ids(ids),
         "ready_event": draw(st.sampled_from([-1, -1, -1, 0, 1, 2**20]))}
    if d["op"] == "load":
        d["lease_id"] = draw(st.integers(0, 3))
    return d


@st.composite
def mutated_request(draw) -> dict[str, Any]:
    """A well-formed request of any kind with one field replaced, dropped or added."""
    cls = P.MESSAGES[draw(st.sampled_from(REQUEST_OPS))]
    base = {"op": cls.op.value, "seq": 0}
    fields = sorted(set(cls.__struct_fields__) - {"seq"})
    for name in fields:
        base[name] = draw(values)
    how = draw(st.sampled_from(["replace", "drop", "add", "seq"]))
    if how == "replace" and fields:
        base[draw(st.sampled_from(fields))] = draw(values)
    elif how == "drop" and fields:
        base.pop(draw(st.sampled_from(fields)), None)
    elif how == "add":
        base[draw(st.text(max_size=8))] = draw(values)
    else:
        base["seq"] = draw(values)
    return base


@st.composite
def register_frame(draw) -> dict[str, Any]:
    """REGISTER with memory and layouts near the checks: paths (a kind no longer served), tokens never
    handed out, descriptor numbers, sizes, overflowing segments, another engine's id, huge num_blocks."""
    mem = draw(st.fixed_dictionaries({
        "kind": st.sampled_from(["cpu_fd", "cpu_shm", "cuda_ipc", "gpu9", ""]) | scalars,
        "path": st.sampled_from(["/etc/passwd", "/dev/shm/../etc/passwd", "/dev/shm/", "/dev/shm/nope",
                                 "/proc/self/mem", "relative"]) | scalars,
        "token": st.sampled_from(["0" * 32, "", "x" * 65]) | scalars,
        "fd": st.sampled_from([0, 1, 2, 3]) | scalars,
        "size": st.integers(1, 1 << 30) | ints}))
    small = st.integers(0, 1 << 20)
    seg = st.lists(st.tuples(small | ints, small | ints, small | ints).map(list) | values, min_size=0, max_size=3)
    layout = draw(st.fixed_dictionaries({"num_blocks": st.integers(1, 64) | ints, "segments": seg}) | values)
    return {"op": "register", "seq": 0,
            "engine_id": draw(st.sampled_from([FOREIGN, "fz-new", ""]) | st.text(max_size=8)),
            "namespace": draw(st.sampled_from(["fz", "fz-victim", "fz-reg"]) | scalars),
            "rank": draw(st.integers(0, 3)), "world_size": draw(st.integers(1, 3) | ints),
            "replicas": draw(st.integers(0, 4) | ints), "memory": mem, "layout": layout}


def _pack(d: dict[str, Any]) -> bytes:
    return msgpack.packb(d, use_bin_type=True)


HUGE_HEADERS = [b"\xc6\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xffab", b"\xdd\xff\xff\xff\xff\x01",
                b"\xdf\xff\xff\xff\xff\xa2op", b"\xc5\xff\xff", b"\xc4\xff", b"\xdc\xff\xff", b"\xde\xff\xff",
                b"\x81\xa2op\xdb\x7f\xff\xff\xff", b"\xcf", b"\xd3\x80", b"\x92\x01"]

frames = st.one_of(
    st.binary(max_size=160),
    st.sampled_from(HUGE_HEADERS).flatmap(lambda h: st.binary(max_size=16).map(lambda t: h + t)),
    values.filter(lambda v: not isinstance(v, dict)).map(lambda v: msgpack.packb(v, use_bin_type=True)),
    st.dictionaries(st.text(max_size=8) | ints | st.binary(max_size=4), values, max_size=5).map(
        lambda d: msgpack.packb(d, use_bin_type=True, strict_types=False)),
    st.fixed_dictionaries({"op": st.sampled_from(ALL_OPS) | st.text(max_size=10) | ints, "seq": ints}).map(_pack),
    mutated_request().map(_pack),
    job_frame().map(_pack),
    typed_job().map(_pack),
    typed_job().map(_pack),
    typed_job().map(_pack),
    register_frame().map(_pack),
    st.lists(st.binary(max_size=20), min_size=2, max_size=3),  # several frames in one message
)


# --- the oracle ------------------------------------------------------------------------------------------------


@dataclass
class Expect:
    kind: str  # an op ("error", "pong", ...); "none": no reply
    code: str | None = None  # for errors: the exact code, or "*" for any but internal


def _judge_job(m: P.Store | P.Load, hello_done: bool) -> Expect | None:
    """The daemon's job checks, in its order. None: the job would be accepted (not bad input)."""
    if m.engine_id == FOREIGN:
        return Expect("error", "foreign_engine")
    if m.engine_id != OWN:
        return Expect("error", "not_registered")
    ids = array("i", m.block_ids)  # (packed as they travel: little-endian int32, as this host)
    if P.count_keys(m.keys) != len(ids):
        return Expect("error", "bad_field")
    if ids and (min(ids) < 0 or max(ids) >= OWN_BLOCKS):
        return Expect("error", "bad_block_id")
    if m.ready_event >= 0:  # a CPU engine has no CUDA event ring
        return Expect("error", "bad_field")
    return None


def judge(frame: bytes | list[bytes], hello_done: bool) -> tuple[int, Expect] | None:
    """(the seq the reply carries, what it must be); None: do not send (a valid state change)."""
    if isinstance(frame, list):
        return 0, Expect("error", "bad_frame")
    try:
        m = P.decode(frame, requests_only=True)
    except P.ProtocolError as e:
        return e.seq, Expect("error", e.code.value)
    if m.op is P.Op.HELLO:
        if not hello_done:
            return None
        return m.seq, Expect("hello_ok") if m.version == P.PROTOCOL_VERSION else Expect("error", "version_mismatch")
    if not hello_done:
        return m.seq, Expect("error", "hello_required")
    if m.op is P.Op.RELEASE:
        return m.seq, Expect("none")
    if m.op is P.Op.CLEAR:
        return None
    if m.op in (P.Op.LOOKUP, P.Op.STATS, P.Op.PING, P.Op.EXPLAIN):
        return m.seq, Expect({P.Op.LOOKUP: "lookup_result", P.Op.STATS: "stats_result", P.Op.PING: "pong",
                              P.Op.EXPLAIN: "explained"}[m.op])
    if m.op is P.Op.UNREGISTER:
        if m.engine_id == OWN:
            return None
        return m.seq, Expect("error", "foreign_engine" if m.engine_id == FOREIGN else "not_registered")
    if m.op is P.Op.REGISTER:
        if m.engine_id == OWN:
            return None
        return m.seq, Expect("error", "*")
    if m.op in (P.Op.STORE, P.Op.LOAD):
        ex = _judge_job(m, hello_done)
        return None if ex is None else (m.seq, ex)
    raise AssertionError(f"unexpected request {m.op}")


def _with_seq(frame: bytes | list[bytes], seq: int) -> bytes | list[bytes]:
    """Give a frame that is a msgpack map with an integer seq field our own unique seq."""
    if isinstance(frame, list):
        return frame
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception:
        return frame
    if isinstance(obj, dict) and "seq" in obj and type(obj["seq"]) is int and 0 <= obj["seq"] < 1 << 63:
        obj["seq"] = seq
        try:
            return msgpack.packb(obj, use_bin_type=True)
        except Exception:
            return frame
    return frame


@dataclass
class Fuzzer:
    peer: RawPeer  # said HELLO, owns engine OWN
    fresh: RawPeer  # never says HELLO
    valid: Any  # a KvoffdClient: must be served throughout
    valid_keys: list[bytes]
    batch: int = 250
    pending: list[tuple[RawPeer, bytes | list[bytes], int, Expect]] = field(default_factory=list)
    sent: collections.Counter = field(default_factory=collections.Counter)
    codes: collections.Counter = field(default_factory=collections.Counter)
    errors_answered: int = 0
    skipped: int = 0
    seq: int = SEQ0
    valid_lookups: int = 0
    valid_worst_s: float = 0.0

    def feed(self, frame: bytes | list[bytes]) -> None:
        self.seq += 1
        frame = _with_seq(frame, self.seq)
        to_fresh = self.seq % 7 == 0
        j = judge(frame, hello_done=not to_fresh)
        if j is None:
            self.skipped += 1
            return
        seq, ex = j
        self.pending.append((self.fresh if to_fresh else self.peer, frame, seq, ex))
        if len(self.pending) >= self.batch:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        batch, self.pending = self.pending, []
        want: dict[RawPeer, collections.Counter] = {self.peer: collections.Counter(),
                                                    self.fresh: collections.Counter()}
        by_seq: dict[tuple[RawPeer, int], list[tuple[bytes | list[bytes], Expect]]] = collections.defaultdict(list)
        for peer, frame, seq, ex in batch:
            peer.send(frame)
            self.sent["bad" if ex.kind == "error" else "valid" if ex.kind != "none" else "release"] += 1
            if ex.kind != "none":
                want[peer][seq] += 1
                by_seq[(peer, seq)].append((frame, ex))
        for peer in (self.peer, self.fresh):
            got, barrier = self._collect(peer, want[peer])
            if barrier["op"] == "error":  # the PING barrier on the connection without HELLO
                self.errors_answered += 1
            for r in got:
                cands = by_seq[(peer, r.get("seq", 0))]
                assert cands, f"unexpected reply {r}"
                i = next((i for i, (_, ex) in enumerate(cands) if _matches(r, ex)), None)
                assert i is not None, f"reply {r} matches none of the frames sent with its seq: " \
                                      f"{[(_short(f), ex) for f, ex in cands]}"
                cands.pop(i)
                if r["op"] == "error":
                    self.errors_answered += 1
                    self.codes[r["code"]] += 1
        t0 = time.monotonic()
        assert self.valid.lookup("fz-victim", self.valid_keys, timeout_s=10).hits == len(self.valid_keys)
        self.valid_worst_s = max(self.valid_worst_s, time.monotonic() - t0)
        self.valid_lookups += 1

    @staticmethod
    def _collect(peer: RawPeer, want: collections.Counter) -> tuple[list[dict], dict]:
        """Replies until every expected seq is answered and the barrier PING's answer came back (a PONG,
        or hello_required on the connection without HELLO). Async REGISTER errors may trail it."""
        out: list[dict] = []
        left = collections.Counter(want)
        barrier = peer.send_msg(P.Ping())
        answered: dict = {}
        deadline = time.monotonic() + 30
        while not answered or +left:
            r = peer.recv(max(0.0, deadline - time.monotonic()))
            assert r is not None, f"no reply for seqs {dict(+left)} within 30 s: the daemon went silent"
            if r.get("op") == "notice":
                raise AssertionError(f"a bad job was accepted: {r}")
            if r.get("seq") == barrier:
                assert r["op"] == "pong" or r.get("code") == "hello_required", r
                answered = r
                continue
            left[r.get("seq", 0)] -= 1
            out.append(r)
        return out, answered


def _matches(r: dict, ex: Expect) -> bool:
    if r.get("op") != ex.kind:
        return False
    if ex.kind != "error":
        return True
    ok_msg = isinstance(r.get("message"), str) and r["message"]
    return bool(ok_msg) and r.get("code") != "internal" and (ex.code == "*" or r.get("code") == ex.code)


def _short(f: bytes | list[bytes]) -> str:
    return repr(f)[:120]


# --- the drill ---------------------------------------------------------------------------------------------


def _fuzz(make_daemon, engines, n_frames: int, name: str) -> None:
    # a 64 MiB chunk per slot size; the engine timeout outlasts Hypothesis's shrinking, during which
    # the fuzzing peer says nothing (on a loaded machine that passed the 10 s default: hello_required)
    d = make_daemon("256MiB", "--log-level", "warning", "--engine-timeout", "3600", name=name)
    target = engines(d.address, FOREIGN, namespace="fz-victim", blocks=32)
    vkeys = chain_keys(16, b"fz-victim")
    target("fill", ids=list(range(32)), seed=3)
    assert target.store(1, vkeys, list(range(16)))["ok"]
    target_digest = target("digest", ids=list(range(32)))
    own = ShmEngine(OWN_BLOCKS, 4096, tag=name)
    peer, fresh = RawPeer(d.address), RawPeer(d.address)
    try:
        peer.hello()
        assert peer.ask(P.Register(engine_id=OWN, namespace="fz", memory=own.memory,
                                   layout=own.layout))["op"] == "registered"
        okeys = chain_keys(OWN_BLOCKS, b"fz-own")
        own.fill(range(OWN_BLOCKS), okeys)
        peer.send_msg(P.Store(engine_id=OWN, job_id=1, keys=okeys, block_ids=list(range(OWN_BLOCKS))))
        assert peer.recv_until(lambda r: r["op"] == "notice")[-1]["ok"]
        own_digest = own.digest()
        valid = d.client()
        before = valid.stats()
        fz = Fuzzer(peer, fresh, valid, vkeys)
        t0 = time.monotonic()
        # a few frames too large for hypothesis to bother with: 65,537 keys / ids, 8 MiB + 1
        big = [_pack({"op": "lookup", "seq": 1, "namespace": "fz", "keys": b"k" * 32 * (P.MAX_KEYS + 1)}),
               _pack({"op": "store", "seq": 2, "engine_id": OWN, "job_id": 5, "keys": b"k" * 32 * (P.MAX_KEYS + 1),
                      "block_ids": b"\0" * 4 * (P.MAX_KEYS + 1)}),
               _pack({"op": "load", "seq": 3, "engine_id": OWN, "job_id": 5, "keys": b"",
                      "block_ids": b"\0" * 4 * (P.MAX_KEYS + 1)}),
               _pack({"op": "explain", "seq": 4, "namespace": "fz", "keys": b"k" * 32 * (P.MAX_KEYS + 1)}),
               _pack({"op": "ping", "seq": 5, "pad": b"x" * P.MAX_FRAME_BYTES}),
               _pack({"op": "register", "seq": 6, "engine_id": "fz-x", "namespace": "fz-x",
                      "memory": wire_memory(peer.fd_socket, own.memory),
                      "layout": {"num_blocks": OWN_BLOCKS + 1, "segments": [[0, 4096, 4096]]}}),
               _pack({"op": "register", "seq": 7, "engine_id": "fz-x", "namespace": "fz-x",
                      "memory": wire_memory(peer.fd_socket, own.memory),
                      "layout": {"num_blocks": 1 << 40, "segments": [[0, 1 << 20, 4096]]}}),
               _pack({"op": "register", "seq": 8, "engine_id": "fz-x", "namespace": "fz-x",
                      "memory": {**wire_memory(peer.fd_socket, own.memory), "size": own.size * 2},
                      "layout": {"num_blocks": 2, "segments": [[0, 4096, 4096]]}})]
        for f in big:
            fz.feed(f)
        fz.flush()

        while (left := n_frames - sum(fz.sent.values())) > 0:  # skipped frames are made up for

            @settings(max_examples=-(-left // 25), deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(batch=st.lists(frames, min_size=25, max_size=25))  # 25 a draw: hypothesis's overhead
            def feed(batch: list[bytes | list[bytes]]) -> None:
                for frame in batch:
                    fz.feed(frame)

            feed()
        fz.flush()
        elapsed = time.monotonic() - t0

        # the daemon is up, wrote nothing it should not, counted every error it answered
        assert d.proc.poll() is None
        assert target("digest", ids=list(range(32))) == target_digest, "the stand-in engine's blocks changed"
        assert own.digest() == own_digest, "the fuzzer's own engine memory was written"
        assert target.load(2, vkeys, list(range(16, 32)))["ok"]
        assert target("digest", ids=list(range(16, 32))) == target_digest[:16], "pool contents changed"
        after = valid.stats()
        assert after["pool"]["used_bytes"] == before["pool"]["used_bytes"]
        assert after["resident_blocks"] == before["resident_blocks"]
        assert {e["engine_id"] for e in after["engines"]} == {FOREIGN, OWN}
        assert after["counters"]["errors"] - before["counters"]["errors"] == fz.errors_answered
        assert "internal" not in fz.codes
        assert fz.sent["bad"] >= n_frames * 0.9
        assert peer.ask(P.Ping())["op"] == "pong"
        record(name, frames_sent=sum(fz.sent.values()), bad_frames=fz.sent["bad"],
               valid_harmless=fz.sent["valid"], releases=fz.sent["release"], skipped_valid_state_changes=fz.skipped,
               errors_answered=fz.errors_answered, codes=dict(fz.codes), seconds=round(elapsed, 1),
               frames_per_s=round(sum(fz.sent.values()) / elapsed), valid_lookups=fz.valid_lookups,
               valid_lookup_worst_ms=round(fz.valid_worst_s * 1000, 1), daemon_rss_kb=_rss(d.proc.pid))
    finally:
        peer.close()
        fresh.close()
        own.close()


def _rss(pid: int) -> int:
    from reliability_util import rss_kb

    return rss_kb(pid)


def test_fuzz_ten_thousand_frames(make_daemon, engines):
    _fuzz(make_daemon, engines, 10_000, "fuzz")


@pytest.mark.slow
def test_fuzz_one_hundred_thousand_frames(make_daemon, engines):
    _fuzz(make_daemon, engines, 100_000, "fuzz-long")
