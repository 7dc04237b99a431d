"""A KV-event subscriber for the tests, written the way a router's is (vLLM's ZmqEventPublisher protocol):
SUB for the live stream, a DEALER for replay, batches kept by sequence number so that a batch missed
live (a subscription is not active the moment it is made) is fetched from the replay socket.

``decode`` turns a payload into a batch: plain msgpack by default (an independent reader of the wire
format), or vLLM's own ``msgspec.msgpack.Decoder(KVEventBatch).decode`` in tests/vllm.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
import zmq.auth

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def router_keys(curve_dir: str) -> tuple[bytes, bytes, bytes]:
    """(server public, client public, client secret): what an allowed router holds of a daemon's
    --kv-events-curve-dir (its ``server.key`` and ``router.key_secret``)."""
    server, _ = zmq.auth.load_certificate(os.path.join(curve_dir, "server.key"))
    public, secret = zmq.auth.load_certificate(os.path.join(curve_dir, "router.key_secret"))
    return server, public, secret


def stream_keys(ev: dict) -> tuple[bytes, bytes, bytes] | None:
    """The router keys for the stream STATS describes (None: it takes no CURVE)."""
    return router_keys(ev["curve_dir"]) if ev.get("auth") == "curve" else None


class EventSubscriber:
    """``curve``: (server public, client public, client secret) for a CURVE stream (``router_keys``)."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: bytes = b"",
                 decode: Callable[[bytes], Any] | None = None, curve: tuple[bytes, bytes, bytes] | None = None):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.replay = self.ctx.socket(zmq.DEALER)
        self.replay.setsockopt(zmq.LINGER, 0)
        for s in (self.sub, self.replay):
            if curve is not None:
                s.curve_serverkey, s.curve_publickey, s.curve_secretkey = curve
        self.sub.connect(endpoint)
        self.replay.connect(replay_endpoint)
        self.decode = decode or (lambda b: msgpack.unpackb(b, raw=False))
        self.batches: dict[int, Any] = {}  # seq -> decoded batch
        self.topics: set[bytes] = set()
        self.replays = 0

    def _take(self, topic: bytes, seq: bytes, payload: bytes) -> None:
        self.topics.add(topic)
        self.batches.setdefault(int.from_bytes(seq, "big"), self.decode(payload))

    def poll_live(self, timeout_ms: int = 0) -> None:
        while self.sub.poll(timeout_ms):
            self._take(*self.sub.recv_multipart())
            timeout_ms = 0

    def catch_up(self, timeout_s: float = 30.0) -> int:
        """Ask the replay socket for every batch from the first one not held; returns how many came."""
        start = 0
        while start in self.batches:
            start += 1
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        self.replays += 1
        got, deadline = 0, time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.replay.poll(100):
                continue
            frames = self.replay.recv_multipart()
            assert frames[0] == b"" and len(frames) == 4, frames
            _, topic, seq, payload = frames
            if seq == END_SEQ:
                return got
            self._take(topic, seq, payload)
            got += 1
        raise TimeoutError("the replay socket never sent its end marker")

    def wait_for(self, pred: Callable[[EventSubscriber], bool], timeout_s: float = 60.0) -> bool:
        """Read the live stream (and replay, for what it missed) until ``pred(self)`` holds."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.poll_live(200)
            if pred(self):
                return True
            self.catch_up()
            if pred(self):
                return True
        return pred(self)

    def events(self) -> list[Any]:
        """Every event, in sequence order (the batches held must be contiguous from 0)."""
        seqs = sorted(self.batches)
        assert seqs == list(range(len(seqs))), f"missing batches: held {seqs[:20]}..."
        out = []
        for s in seqs:
            b = self.batches[s]
            out.extend(b.events if hasattr(b, "events") else b[1])
        return out

    def close(self) -> None:
        self.sub.close(0)
        self.replay.close(0)
        self.ctx.term()


def resident(events: list[dict], medium: str | None = None) -> set:
    """The node's content as a router would rebuild it from the decoded events alone; ``medium``: of
    that medium only (``CPU``, ``STORAGE``, ``REMOTE``: a router that tells the tiers apart)."""
    held: set = set()
    for e in events:
        if medium is not None and e.get("medium") != medium:
            continue
        if e["type"] == "BlockStored":
            held.update(e["block_hashes"])
        elif e["type"] == "BlockRemoved":
            held.difference_update(e["block_hashes"])
        elif e["type"] == "AllBlocksCleared":
            held.clear()
    return held
