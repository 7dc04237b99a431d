"""The KV-event publisher: an index observer that tells routers what this node's pool holds.

It speaks vLLM's ZmqEventPublisher protocol, so a router that consumes vLLM's KV events needs only a
second endpoint (the sockets are the outlet's, a process of their own: kvoffd/server/outlet.py):

* a PUB socket sends ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian batch number from 0,
  ``payload`` a msgpack EventBatch (kvoffd/events/wire.py);
* a ROUTER socket answers a replay request ``[b"", start_seq]`` (8 bytes, big-endian) with every
  buffered batch from ``start_seq`` on, each as ``[b"", topic, seq, payload]``, then the end marker
  ``[b"", b"", -1 as 8 signed bytes, b""]``: a subscriber that joined late or saw a gap catches up
  (a window at a time, bounded per peer and in all: kvoffd/server/outlet.py).

Why it is shaped like this:

* It is an ``IndexObserver`` (kvoffd/cache/observer.py): the index calls ``committed``/``freeing`` on
  the loop thread inside its own callbacks; they only append the keys to a list (no encoding, no
  syscall). One flush per loop turn (``call_soon``)
  turns the turn's events into one batch and hands it to the publisher thread through a bounded
  queue; the thread encodes it and hands it to its ``EventSink`` (the outlet). When the thread is
  behind, or the outlet cannot take it, the batch is dropped and counted
  (``kvoffd_kv_events_dropped_total``): the loop never waits for a router. Batches are numbered on
  the loop, so a dropped one leaves a gap in ``seq`` that no replay fills: a subscriber can tell.
* Token ids are prompt content: a ``BlockStored`` carries them only when the operator asked
  (``--kv-events-token-ids``; HELLO_OK then lists the ``kv_events`` capability, and only then do
  connectors describe their blocks). Otherwise a description is checked and thrown away.
* A slow subscriber never slows the daemon or the other subscribers: PUB drops what exceeds its
  per-subscriber high-water mark; that subscriber sees a gap in ``seq`` and asks the replay socket.
* Only rank 0's table of a namespace is published: a block serves a lookup only once every rank
  holds it, and one event per block (not one per rank) is what a router counts.
* A namespace is published only if its engines said, at REGISTER, that their keys are their block
  hashes (``layout.kv_events``); the daemon cannot turn any other key back into a hash.
* A CLEAR of one namespace is its removals (``freeing``); a CLEAR of every namespace is one
  ``AllBlocksCleared`` (``all_cleared``, told by the CLEAR handler: the index's ``cleared`` moment
  names one namespace at a time, and a router needs "everything" once, not a removal per block).
* The blocks a warm restart adopted were committed by another daemon: ``adopted`` (told once, at
  start) announces them as ``BlockStored`` once their namespace's identity is known, in slices across
  loop turns (kvoffd/events/announce.py), so the stream matches the index after a restart too.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import queue
import sys
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from kvoffd.cache.identity import MEDIUM_CPU, MEDIUM_REMOTE, EventIdentity
from kvoffd.cache.index import IndexObserver
from kvoffd.events.announce import BACKOFF_S, Adopted, Reopened
from kvoffd.events.wire import (
    LOCALITY,
    LOCALITY_REMOTE,
    OWNERSHIP,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    external_hashes,
)
from kvoffd_client.protocol import KEY_SIZE, ErrorCode, ProtocolError

if TYPE_CHECKING:
    from kvoffd.cache.index import Entry
    from kvoffd.config import Config
    from kvoffd.metrics import Metrics

log = logging.getLogger(__name__)

QUEUE_BATCHES = 1024  # batches waiting for the publisher thread; beyond, a batch is dropped and counted
REPLAY_BATCHES = 10_000  # batches kept for replay (vLLM's default buffer_steps)
#: batches queued per subscriber before ZeroMQ drops for it: as many as replay keeps, so that one idle
#: subscriber pins no more than the replay buffer (vLLM's 100,000 let it pin ten times that); one that
#: far behind sees a gap in seq and replays
PUB_HWM = 10_000
MAX_NAMESPACES = 4096  # namespaces whose event identity is remembered (oldest forgotten first)
MAX_DESCRIBED = 1 << 20  # stored blocks whose tokens wait for their commit; beyond, they are not kept
_NO_PARENT = bytes(KEY_SIZE)
_IDLE_S = 0.05  # the thread looks at its sink (the outlet's reports, its health) at least this often


class EventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


@dataclass(slots=True)
class _Pending:
    """One event to be: built on the loop without encoding; the thread makes the wire event."""

    kind: EventKind
    identity: EventIdentity | None = None
    keys: list[bytes] = field(default_factory=list)
    medium: str = MEDIUM_CPU
    tokens: bytes = b""  # one described block: its token ids (uint32 LE) ...
    parent: bytes = b""  # ... and its parent's key (empty: none)


@dataclass(frozen=True)
class Endpoints:
    publish: str
    replay: str
    topic: str = ""


class EventSink(Protocol):
    """Where the publisher thread puts each encoded batch (kvoffd/server/outlet_link.py: the outlet)."""

    bound: Endpoints

    def start(self) -> Endpoints: ...

    def send(self, seq: int, payload: bytes) -> bool: ...

    def poll(self) -> None: ...

    def close(self) -> None: ...

    def describe(self) -> dict[str, Any]: ...


def replay_endpoint_for(endpoint: str) -> str:
    """The default replay endpoint: the next tcp port (port 0: any free one), or ``<path>.replay``."""
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[6:].rpartition(":")
        return f"tcp://{host}:{int(port) + 1 if int(port) else 0}"
    return endpoint + ".replay"


class KvEventPublisher(IndexObserver):
    """An index observer that publishes vLLM KV events; see the module doc. Of the index's moments it
    needs ``committed`` (BlockStored), ``freeing`` (BlockRemoved) and ``cleared`` (adopted blocks of a
    cleared namespace are not announced); the others stay no-ops."""

    def __init__(self, sink: EventSink, metrics: Metrics, queue_batches: int = QUEUE_BATCHES,
                 token_ids: bool = False):
        self.sink = sink
        self.metrics = metrics
        self.token_ids = token_ids  # --kv-events-token-ids: a BlockStored may carry its tokens
        self._identities: OrderedDict[str, EventIdentity] = OrderedDict()
        self._described: dict[Entry, tuple[bytes, bytes]] = {}  # pending entry -> (tokens, parent key)
        self._pending: list[_Pending] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: queue.Queue[tuple[int, list[_Pending]] | None] = queue.Queue(maxsize=queue_batches)
        self._next_seq = 0  # numbered on the loop: a dropped batch leaves a gap subscribers can see
        self._thread: threading.Thread | None = None
        self._bound = False
        self._adopted = Adopted()  # a warm restart's blocks, announced once their identity is known
        self._announcing: asyncio.Handle | None = None

    @property
    def bound(self) -> Endpoints:
        return self.sink.bound

    # --- life ---------------------------------------------------------------------------------------
    def bind(self) -> Endpoints:
        """Bind the endpoints (on the caller's thread, before ``start``). Raises OSError with the
        endpoints named, as the daemon's own bind does."""
        if not self._bound:
            self.sink.start()
            self._bound = True
        return self.bound

    def start(self) -> None:
        self.bind()
        self._thread = threading.Thread(target=self._run, name="kvoffd-kv-events", daemon=True)
        self._thread.start()
        log.info("KV events on %s (replay %s%s)%s", self.bound.publish, self.bound.replay,
                 f", topic {self.bound.topic!r}" if self.bound.topic else "",
                 ", with token ids" if self.token_ids else "")

    def close(self) -> None:
        """Send what is queued (the thread drains its queue first), then close the sink."""
        if self._announcing is not None:
            self._announcing.cancel()
            self._announcing = None
        if self._thread is not None:
            self._flush()
            self._queue.put(None)
            self._thread.join(5)
            self._thread = None
        self.sink.close()

    def describe(self) -> dict[str, object]:
        m = self.metrics
        return {"endpoint": self.bound.publish, "replay_endpoint": self.bound.replay, "topic": self.bound.topic,
                "token_ids": self.token_ids, "namespaces": len(self._identities),
                "published": m.kv_events_published.value,
                "dropped": m.kv_events_dropped.value, "adopted_announced": self._adopted.announced,
                "adopted_waiting": self._adopted.pending, "reopened_announced": self._adopted.announced_below,
                **self.sink.describe()}

    # --- what the server tells it ------------------------------------------------------------------
    def set_identity(self, namespace: str, identity: EventIdentity | None) -> None:
        """An engine registered in ``namespace``; ``identity`` None: its keys are not block hashes."""
        if identity is None:
            self._identities.pop(namespace, None)
            self._adopted.withdrawn(namespace)
            return
        self._identities[namespace] = identity
        self._identities.move_to_end(namespace)
        while len(self._identities) > MAX_NAMESPACES:
            self._adopted.withdrawn(self._identities.popitem(last=False)[0])
        if self._adopted.known(namespace):
            self._schedule_announce()

    def adopted(self, entries: Sequence[Entry], identities: dict[str, EventIdentity]) -> None:
        """A warm restart's adopted entries, and the identities the pool file kept for their namespaces
        (kvoffd/cache/restart/filekeeper.py): told once, on the loop, after ``start``. Rank 0's are announced as
        their namespace's identity becomes known (now, for those the file kept; else at REGISTER)."""
        for ns, ident in identities.items():
            if ns not in self._identities:  # an engine that registered already said it itself
                self._identities[ns] = ident
        self._adopted.add(entries)
        if self._adopted.backlog:
            self._schedule_announce()

    def reopened(self, tier: Reopened) -> None:
        """A tier below the pool found blocks at start (kvoffd/cache/tiers/disk.py): announced like the
        adopted ones, under its medium, once their namespace's identity is known. On the loop."""
        self._adopted.add_below(tier)
        for ns in tier.reopened_namespaces():
            if ns in self._identities and self._adopted.known(ns):
                self._schedule_announce()

    def _schedule_announce(self) -> None:
        if self._announcing is None:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            self._announcing = self._loop.call_soon(self._announce_turn)

    def _announce_turn(self) -> None:
        """One slice of adopted blocks per loop turn (and one slice of their sorting, first); later while
        the publisher thread is behind."""
        self._announcing = None
        if self._thread is None:
            return
        if self._queue.qsize() * 2 >= self._queue.maxsize:
            self._announcing = self._loop.call_later(BACKOFF_S, self._announce_turn)
            return
        adopted = self._adopted
        if adopted.backlog:  # sorting the adopted entries by namespace comes first, sliced as well
            for ns in adopted.sort_some():
                if ns in self._identities:
                    adopted.known(ns)
        a = adopted.next_slice()
        if a is not None:
            ident = self._identities.get(a.namespace)
            if ident is not None and a.keys:
                self._add(_Pending(EventKind.STORED, ident, a.keys, a.medium))
        if adopted.ready or adopted.backlog:
            self._schedule_announce()

    def tier_changed(self, medium: str, namespace: str, stored: list[bytes], removed: list[bytes]) -> None:
        """Another tier (a disk tier: ``MEDIUM_STORAGE``) now holds ``stored`` and no longer ``removed``,
        rank 0's keys of ``namespace``; published like the pool's own, under its ``medium``. Loop
        thread only, like the observer calls."""
        ident = self._identities.get(namespace)
        if ident is None:
            return
        if stored:
            self._add(_Pending(EventKind.STORED, ident, list(stored), medium))
        if removed:
            self._add(_Pending(EventKind.REMOVED, ident, list(removed), medium))

    def check_described(self, namespace: str, rank: int, n: int, tokens: bytes, parents: bytes) -> bool:
        """Whether a STORE's ``tokens``/``parents`` are to be kept for its events (rank 0 of a published
        namespace, token ids asked for); ProtocolError ``bad_field`` when their sizes do not fit ``n``
        keys (checked whether they are kept or not)."""
        ident = self._identities.get(namespace)
        want = 4 * n * ident.block_size if ident is not None else None
        if want is not None and (len(tokens) != want or len(parents) != n * KEY_SIZE):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"a STORE of {n} keys describes its blocks with "
                                f"{len(tokens)} bytes of tokens and {len(parents)} of parents; this namespace "
                                f"needs {want} ({ident.block_size} tokens per block, uint32) and {n * KEY_SIZE}")
        return self.token_ids and want is not None and rank == 0 and len(self._described) < MAX_DESCRIBED

    def note_described(self, entries: Sequence[Entry], idx: Sequence[int], tokens: bytes, parents: bytes,
                       block_size: int) -> None:
        """Keep the described blocks' tokens and parents until their entries commit (or are freed)."""
        step = 4 * block_size
        for e, i in zip(entries, idx, strict=True):
            self._described[e] = (tokens[i * step:(i + 1) * step], parents[i * KEY_SIZE:(i + 1) * KEY_SIZE])

    def identity(self, namespace: str) -> EventIdentity | None:
        return self._identities.get(namespace)

    # --- IndexObserver ------------------------------------------------------------------------------
    def committed(self, entries: Sequence[Entry]) -> None:
        t = entries[0].table  # a commit is one table's
        ident = self._identities.get(t.namespace) if t.rank == 0 else None
        if ident is None:
            return
        if not self._described:
            self._add(_Pending(EventKind.STORED, ident, [e.key for e in entries]))
            return
        plain: list[bytes] = []
        for e in entries:  # a described block is its own event (its parent and tokens are its own)
            d = self._described.pop(e, None)
            if d is None:
                plain.append(e.key)
            else:
                self._add(_Pending(EventKind.STORED, ident, [e.key], tokens=d[0], parent=d[1]))
        if plain:
            self._add(_Pending(EventKind.STORED, ident, plain))

    def freeing(self, slot_bytes: int, entries: Sequence[Entry]) -> None:
        if self._described:
            for e in entries:
                self._described.pop(e, None)
        by_ns: dict[str, list[bytes]] = {}
        for e in entries:
            if e.ready and e.table.rank == 0:
                by_ns.setdefault(e.table.namespace, []).append(e.key)
        for ns, keys in by_ns.items():
            ident = self._identities.get(ns)
            if ident is not None:
                self._add(_Pending(EventKind.REMOVED, ident, keys))

    def cleared(self, namespace: str) -> None:
        self._adopted.forget(namespace)  # its entries are dead: none would be announced; free them now

    # --- what the CLEAR handler tells it ----------------------------------------------------------
    def all_cleared(self) -> None:
        """A CLEAR of every namespace is done: one AllBlocksCleared instead of a removal per block (the
        turn's pending events, the removals its ``freeing`` calls just added included, describe blocks
        that are gone too). One namespace's CLEAR is its removals: nothing to do here."""
        self._pending.clear()
        self._adopted.forget()
        self._add(_Pending(EventKind.CLEARED))

    def _add(self, p: _Pending) -> None:
        if not self._pending:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            self._loop.call_soon(self._flush)
        self._pending.append(p)

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        if not batch or self._thread is None:
            return
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.metrics.kv_events_dropped.inc(len(batch))

    # --- the publisher thread -----------------------------------------------------------------------
    def _run(self) -> None:
        enc = msgspec.msgpack.Encoder()
        while True:
            try:
                item = self._queue.get(timeout=_IDLE_S)
            except queue.Empty:
                item = (0, [])
            if item is None:
                return
            seq, batch = item
            if batch:
                try:
                    self._send(enc, seq, batch)
                except Exception:  # never let one bad batch stop the stream
                    log.exception("KV events: a batch could not be published")
                    self.metrics.kv_events_dropped.inc(len(batch))
            try:
                self.sink.poll()
            except Exception:
                log.exception("KV events: the outlet's reports could not be read")

    def _send(self, enc: msgspec.msgpack.Encoder, seq: int, batch: list[_Pending]) -> None:
        events = [_wire(p) for p in batch]
        payload = enc.encode(EventBatch(ts=time.time(), events=events))
        if self.sink.send(seq, payload):
            self.metrics.kv_events_published.inc(len(events))
        else:
            self.metrics.kv_events_dropped.inc(len(events))


def _wire(p: _Pending) -> BlockStored | BlockRemoved | AllBlocksCleared:
    if p.kind is EventKind.CLEARED:
        return AllBlocksCleared()
    hashes = external_hashes(p.keys, p.identity.hash_form)
    locality = LOCALITY_REMOTE if p.medium == MEDIUM_REMOTE else LOCALITY
    if p.kind is EventKind.STORED and p.tokens:
        parent = external_hashes([p.parent], p.identity.hash_form)[0] if p.parent != _NO_PARENT else None
        return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=_token_list(p.tokens),
                           block_size=p.identity.block_size, lora_id=None, medium=p.medium, lora_name=None,
                           group_idx=p.identity.group_idx, locality=locality, ownership=OWNERSHIP)
    if p.kind is EventKind.STORED:
        return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                           block_size=p.identity.block_size, lora_id=None, medium=p.medium, lora_name=None,
                           group_idx=p.identity.group_idx, locality=locality, ownership=OWNERSHIP)
    return BlockRemoved(block_hashes=hashes, medium=p.medium, group_idx=p.identity.group_idx, locality=locality,
                        ownership=OWNERSHIP)


def make_publisher(cfg: Config, metrics: Metrics,
                   sink: Callable[[Endpoints], EventSink]) -> KvEventPublisher | None:
    """The publisher ``--kv-events-address`` asks for (None when off), to be handed to the keyspace as
    its mirror (``Keyspace.add_events``: it then observes the index); ``sink`` makes where its batches
    go from the endpoints (the server's outlet: kvoffd/server/outlet_link.py)."""
    if not cfg.kv_events_address:
        return None
    replay = cfg.kv_events_replay_address or replay_endpoint_for(cfg.kv_events_address)
    pub = KvEventPublisher(sink(Endpoints(cfg.kv_events_address, replay, cfg.kv_events_topic)), metrics,
                           token_ids=cfg.kv_events_token_ids)
    return pub


def _token_list(tokens: bytes) -> list[int]:
    a = array("I")
    a.frombytes(tokens)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()
