"""The KV-event outlet: the process that holds the KV-event endpoints (the PUB stream and its replay
ROUTER) for the daemon. ``python -m kvoffd.server.outlet FD``, started by the daemon
(kvoffd/server/outlet_link.py) with one end of a socketpair as FD; it exits when the daemon's end closes.

Why a process. libzmq accepts on its own I/O thread, so the daemon cannot refuse a
connection to a ZeroMQ endpoint before its descriptor exists: it learns of each accept afterwards
(the socket monitor) and can only stop further accepts (kvoffd/server/fdbudget.py's ListenerGuard).
That reaction has a delay, and a full-speed flood fills the descriptor table within it; once the
table is full, libzmq's ipc listener aborts the whole process at its next accept, whether it is
paused or not (the kernel says EMFILE before it looks at the socket: ``Too many open files
(src/ipc_listener.cpp:297)``, seen with the KV-event port flooded by another uid while an engine
connected to the control socket). A stream that routers on other hosts must reach is exactly such
an endpoint. So it lives in a process of its own: its descriptor table is not the daemon's, and no
flood of it can take a descriptor from the daemon or abort it. The daemon keeps what matters: the
stream's numbering, the loop that never waits for it (kvoffd/events/publisher.py), its counters.

Inside, the outlet applies the daemon's own descriptor budget to its two sockets (FdBudget and a
ListenerGuard per socket: counted at every accept and disconnect, accepting stopped before the
reserve), and it takes one transport only (both ipc:// or both tcp://, kvoffd/config.py), so that a
tcp:// flood from another user cannot make an ipc:// listener of its own abort either: ipc:// lives in
the private socket directory, where no other user can connect at all, and libzmq's tcp listener
survives EMFILE. Should it die all the same, the daemon starts another on the same endpoints
(``kvoffd_kv_events_outlet_restarts_total``); subscribers see a gap in ``seq`` and replay.

Who may subscribe: ipc:// is the socket directory's (0700) and the socket's (0600) rule, the daemon's
user only; tcp:// takes CURVE clients whose public key is in the allowed directory
(kvoffd/server/curve_keys.py, a ZAP handler here), unless the operator said ``--kv-events-auth none``.

Replay: a request is answered a window at a time (``Replays``), never all at once:
at most REPLAY_WINDOW_BYTES of one peer's replay and REPLAY_TOTAL_BYTES of all are handed to libzmq
and not yet written; REPLAY_ACTIVE replays run at once, REPLAY_WAITING more wait their turn, and beyond
that a request is dropped and counted, as is a replay that cannot go on for REPLAY_STALL_S (its peer
reads nothing, or the total is held by peers that read nothing). Payloads go out zero-copy: a replayed
batch still in the ring costs its message, not a second copy of its bytes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import signal
import socket
import sys
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

from kvoffd.events.channel import (
    BATCH,
    CONTROL,
    REPORT_EVERY_S,
    Bound,
    BrokenChannel,
    Failed,
    FrameReader,
    Report,
    Setup,
    control_frame,
    decode_control,
)
from kvoffd.runtime import UnsafePath
from kvoffd.server import curve_keys
from kvoffd.server.endpoint import AddressInUse, prepare_ipc_path, unlink_if_ours
from kvoffd.server.fdbudget import (
    HANDSHAKE_IVL_MS,
    LISTEN_BACKLOG,
    FdBudget,
    ListenerGuard,
    open_listener,
    raise_nofile_limit,
)

log = logging.getLogger("kvoffd.events.outlet")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_INBOUND = 4096  # bytes of any frame a subscriber sends (a bigger one drops its connection)
REPLAY_ACTIVE = 16  # replays being sent at once
REPLAY_WAITING = 256  # requests waiting for their turn; beyond, dropped (the subscriber asks again)
REPLAY_WINDOW_BYTES = 4 << 20  # of one peer's replay, bytes libzmq holds and has not written
REPLAY_TOTAL_BYTES = 64 << 20  # ...of all replays (a peer that reads nothing keeps its share until it leaves)
MESSAGE_COST = 1024  # counted per replayed message beside its payload: libzmq's and pyzmq's objects for it
REPLAY_HWM = 1024  # messages queued per replay peer
REPLAY_STALL_S = 10.0  # a replay whose peer took nothing for this long is dropped
REQUESTS_PER_TURN = 256
TICK_S = 0.1  # timers: descriptor calibration (each second), reports, stalled replays
PUMP_S = 0.005  # while a replay waits for libzmq to write its window
CALIBRATE_S = 1.0
SETUP_TIMEOUT_S = 30.0
ZAP_DOMAIN = b"kvoffd-events"

_POLLIN, _EVENTS = int(zmq.POLLIN), int(zmq.EVENTS)


class Ring:
    """The last ``capacity`` batches, by absolute index (``start`` <= i < ``end``): a replay keeps its
    place as an index, so finding its next batch is O(1) while new ones arrive."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: list[tuple[int, bytes] | None] = [None] * capacity
        self.end = 0

    @property
    def start(self) -> int:
        return max(0, self.end - self.capacity)

    def append(self, seq: int, payload: bytes) -> None:
        self._items[self.end % self.capacity] = (seq, payload)
        self.end += 1

    def get(self, i: int) -> tuple[int, bytes]:
        item = self._items[i % self.capacity]
        assert item is not None and self.start <= i < self.end
        return item

    def find(self, seq: int) -> int:
        """The index of the first batch numbered ``seq`` or later (``end``: none)."""
        lo, hi = self.start, self.end
        while lo < hi:
            mid = (lo + hi) // 2
            if self.get(mid)[0] < seq:
                lo = mid + 1
            else:
                hi = mid
        return lo


@dataclass
class _Replay:
    peer: bytes
    at: int  # the ring index of the next batch to send
    end: int  # the ring's end when asked: what came later reaches the peer live
    moved: float  # when it last sent something
    done: bool = False  # the end marker is sent


@dataclass
class _Ledger:
    """One peer's replayed payloads libzmq still holds (trackers: done once written or dropped)."""

    sent: deque[tuple[zmq.MessageTracker, int]] = field(default_factory=deque)
    nbytes: int = 0


class Replays:
    """Replay requests answered a window at a time; see the module doc."""

    def __init__(self, sock: zmq.Socket, ring: Ring, topic: bytes, *, active: int = REPLAY_ACTIVE,
                 waiting: int = REPLAY_WAITING, window: int = REPLAY_WINDOW_BYTES,
                 total: int = REPLAY_TOTAL_BYTES, stall_s: float = REPLAY_STALL_S) -> None:
        self._sock = sock
        self._ring = ring
        self._topic = topic
        self.max_active, self.max_waiting, self.window, self.total_max, self.stall_s = (
            active, waiting, window, total, stall_s)
        self.active: OrderedDict[bytes, _Replay] = OrderedDict()
        self.waiting: OrderedDict[bytes, int] = OrderedDict()  # peer -> start seq
        self._ledgers: dict[bytes, _Ledger] = {}
        self.in_flight = 0  # bytes over every ledger
        self.served = 0
        self.dropped = 0
        self.bad = 0

    def request(self, peer: bytes, start_seq: int, now: float) -> None:
        """A peer asks for every kept batch from ``start_seq`` on. A peer has one replay at a time: a
        new request starts it again from there."""
        self.served += 1
        if peer in self.active or len(self.active) < self.max_active:
            self.waiting.pop(peer, None)
            self.active[peer] = _Replay(peer, self._ring.find(start_seq), self._ring.end, now)
        elif peer in self.waiting or len(self.waiting) < self.max_waiting:
            self.waiting[peer] = start_seq
        else:
            self._drop(f"too many replay requests wait ({len(self.waiting)}); dropped one")

    def _drop(self, why: str) -> None:
        self.dropped += 1
        if self.dropped in (1, 10, 100) or self.dropped % 1000 == 0:
            log.warning("KV events: %s (%d dropped so far)", why, self.dropped)

    def pump(self, now: float) -> bool:
        """Send what the windows allow. True while a replay is still going."""
        for peer in list(self._ledgers):
            self._reclaim(peer)
        for r in list(self.active.values()):
            self._send_some(r, now)
            if r.done:
                del self.active[r.peer]
            elif now - r.moved > self.stall_s:
                del self.active[r.peer]
                self._drop(f"a replay peer read nothing for {self.stall_s:.0f} s; its replay was dropped")
        while self.waiting and len(self.active) < self.max_active:
            peer, start = self.waiting.popitem(last=False)
            self.active[peer] = _Replay(peer, self._ring.find(start), self._ring.end, now)
            self._send_some(self.active[peer], now)
            if self.active[peer].done:
                del self.active[peer]
        return bool(self.active)

    def _send_some(self, r: _Replay, now: float) -> None:
        ring, sock = self._ring, self._sock
        ledger = self._ledgers.get(r.peer)
        while True:
            held = ledger.nbytes if ledger is not None else 0
            r.at = max(r.at, ring.start)  # overwritten meanwhile: a gap the subscriber sees
            try:
                if r.at >= min(r.end, ring.end):  # the end marker: a few bytes, outside the bounds
                    sock.send(r.peer, zmq.SNDMORE | zmq.NOBLOCK)
                    sock.send_multipart((b"", b"", END_SEQ, b""), zmq.NOBLOCK)
                    r.done = True
                    return
                seq, payload = ring.get(r.at)
                cost = MESSAGE_COST + len(payload)
                # within both bounds (a batch bigger than a bound goes alone)
                if (held and held + cost > self.window) or (self.in_flight and self.in_flight + cost > self.total_max):
                    return
                sock.send(r.peer, zmq.SNDMORE | zmq.NOBLOCK)  # ROUTER_MANDATORY: full or gone says so here
                sock.send_multipart((b"", self._topic, seq.to_bytes(8, "big")), zmq.SNDMORE | zmq.NOBLOCK)
                tracker = sock.send(payload, zmq.NOBLOCK, copy=False, track=True)
            except zmq.Again:
                return  # its queue is full: later (REPLAY_STALL_S if it never reads)
            except zmq.ZMQError:  # EHOSTUNREACH: the peer left
                r.done = True
                return
            r.at += 1
            r.moved = now
            if ledger is None:
                ledger = self._ledgers[r.peer] = _Ledger()
            ledger.sent.append((tracker, cost))
            ledger.nbytes += cost
            self.in_flight += cost

    def _reclaim(self, peer: bytes) -> None:
        ledger = self._ledgers[peer]
        while ledger.sent and ledger.sent[0][0].done:
            n = ledger.sent.popleft()[1]
            ledger.nbytes -= n
            self.in_flight -= n
        if not ledger.sent:
            del self._ledgers[peer]


class Outlet:
    """The two sockets, their guards, the replay ring and the daemon's channel; see the module doc."""

    def __init__(self, setup: Setup, chan: socket.socket) -> None:
        self.setup = setup
        self._chan = chan
        self._reader = FrameReader(chan)
        self._out = bytearray()  # reports the daemon has not taken yet
        self._ctx = zmq.Context()
        self._topic = setup.topic.encode()
        self._ring = Ring(setup.replay_batches)
        self.budget: FdBudget | None = None
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self._zap: zmq.Socket | None = None
        self._allowed: curve_keys.AllowedKeys | None = None
        self._listeners: list[socket.socket] = []
        self._zmq_fds: list[int] = []
        self._ipc: list[tuple[str, int]] = []  # socket files made here: (path, inode)
        self._guards: dict[str, ListenerGuard] = {}
        self.replays: Replays | None = None
        self.denied = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Event | None = None
        self._last_report: Report | None = None
        self._reported_at = 0.0
        self._calibrated_at = 0.0
        self._pumping: asyncio.TimerHandle | None = None

    # --- binding ------------------------------------------------------------------------------------
    def bind(self) -> Bound:
        s = self.setup
        public = b""
        keys: curve_keys.KeyPair | None = None
        if s.curve_dir:
            keys = curve_keys.load_or_create(s.curve_dir)
            self._allowed = curve_keys.AllowedKeys(s.curve_dir)
            self._zap = self._ctx.socket(zmq.REP)  # before any CURVE socket: libzmq asks it at each handshake
            self._zap.setsockopt(zmq.LINGER, 0)
            self._zap.bind("inproc://zeromq.zap.01")
            public = keys.public
        self._pub = self._socket(zmq.PUB, keys)
        self._pub.setsockopt(zmq.SNDHWM, s.pub_hwm)
        self._replay = self._socket(zmq.ROUTER, keys)
        self._replay.setsockopt(zmq.SNDHWM, REPLAY_HWM)
        self._replay.setsockopt(zmq.RCVHWM, 64)
        self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or departed peer is told, not dropped silently
        self._replay.copy_threshold = 1 << 10  # replayed payloads are sent zero-copy and tracked; frames below, copied
        publish = self._bind(self._pub, s.publish)
        replay = self._bind(self._replay, s.replay)
        self.replays = Replays(self._replay, self._ring, self._topic)
        return Bound(publish, replay, public.decode())

    def _socket(self, kind: int, keys: curve_keys.KeyPair | None) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND)  # subscriptions and replay requests are a few bytes
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
        if keys is not None:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
            sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        return sock

    def _bind(self, sock: zmq.Socket, addr: str) -> str:
        """Bind on a listener this process owns (ZMQ_USE_FD), as the daemon's control socket does, so
        that its guard can stop libzmq accepting."""
        if addr.startswith("ipc://"):
            prepare_ipc_path(addr[6:])
        elif addr.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        listener = open_listener(addr, LISTEN_BACKLOG)
        if listener is not None:
            self._listeners.append(listener)
            if addr.startswith("ipc://"):
                self._ipc.append((addr[6:], os.lstat(addr[6:]).st_ino))
            zmq_fd = os.dup(listener.fileno())
            self._zmq_fds.append(zmq_fd)
            sock.setsockopt(zmq.USE_FD, zmq_fd)
            if addr.startswith("tcp://"):
                addr = f"{addr.rpartition(':')[0]}:{listener.getsockname()[1]}"
        sock.bind(addr)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    # --- serving ------------------------------------------------------------------------------------
    async def run(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._done = asyncio.Event()
        self.budget = FdBudget()
        for name, sock, i in (("publish", self._pub, 0), ("replay", self._replay, 1)):
            if i < len(self._listeners):
                g = self._guards[name] = ListenerGuard(self._ctx, sock, self._listeners[i], self._zmq_fds[i],
                                                       self.budget)
                loop.add_reader(g.fd, self._on_monitor, g)
        self._chan.setblocking(False)
        loop.add_reader(self._chan.fileno(), self._on_chan)
        loop.add_reader(self._replay.getsockopt(zmq.FD), self._on_replay)
        if self._zap is not None:
            loop.add_reader(self._zap.getsockopt(zmq.FD), self._on_zap)
        for g in self._guards.values():  # edge-triggered: take what is queued already
            self._on_monitor(g)
        self._on_replay()
        self._on_zap()
        tick = asyncio.create_task(self._ticks())
        try:
            await self._done.wait()
        finally:
            tick.cancel()
            self.close()

    def close(self) -> None:
        loop = self._loop
        for g in self._guards.values():
            if loop is not None:
                loop.remove_reader(g.fd)
            g.close()
        self._guards.clear()
        for s in (self._pub, self._replay, self._zap):
            if s is not None:
                s.close(0)
        for fd in self._listeners:
            fd.close()
        for path, ino in self._ipc:
            unlink_if_ours(path, ino)
        self._ctx.term()

    async def _ticks(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self._tick(time.monotonic())
            except Exception:
                log.exception("KV events: the outlet's housekeeping failed")

    def _tick(self, now: float) -> None:
        if now - self._calibrated_at >= CALIBRATE_S:
            self.budget.calibrate()
            self._calibrated_at = now
        for g in self._guards.values():
            g.check()
        self._pump()
        self._report(now)
        self._flush_out()

    def _on_chan(self) -> None:
        try:
            frames = self._reader.read()
        except BrokenChannel:
            self._done.set()  # the daemon is gone (or stopping): so is its outlet
            self._loop.remove_reader(self._chan.fileno())
            return
        for kind, body in frames:
            if kind == BATCH:
                seq = int.from_bytes(body[:8], "big")
                payload = body[8:]
                try:  # (zero-copy above copy_threshold: the ring's bytes, shared by every subscriber)
                    self._pub.send_multipart((self._topic, body[:8], payload), zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    pass  # PUB drops per subscriber itself; a subscriber that misses it replays
                self._ring.append(seq, payload)
            elif kind == CONTROL:
                log.warning("KV events: unexpected %s from the daemon", type(decode_control(body)).__name__)

    def _on_monitor(self, g: ListenerGuard) -> None:
        if g.drain():
            self._loop.call_soon(self._on_monitor, g)

    def _on_replay(self) -> None:
        sock, now = self._replay, time.monotonic()
        for _ in range(REQUESTS_PER_TURN):
            if not sock.getsockopt(_EVENTS) & _POLLIN:
                break
            frames = sock.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self.replays.bad += 1
                n = self.replays.bad
                if n in (1, 10, 100) or n % 1000 == 0:
                    log.warning("KV events: ignoring a malformed replay request (%d frames; %d so far)",
                                len(frames), n)
                continue
            self.replays.request(frames[0], int.from_bytes(frames[2], "big"), now)
        else:
            self._loop.call_soon(self._on_replay)
        self._pump()

    def _pump(self) -> None:
        if self._pumping is not None:
            self._pumping.cancel()
            self._pumping = None
        if self.replays.pump(time.monotonic()):
            self._pumping = self._loop.call_later(PUMP_S, self._pump)
        if self._replay.getsockopt(_EVENTS) & _POLLIN:  # a send can consume the fd's edge
            self._loop.call_soon(self._on_replay)

    def _on_zap(self) -> None:
        zap = self._zap
        if zap is None:
            return
        while zap.getsockopt(_EVENTS) & _POLLIN:
            frames = zap.recv_multipart(zmq.NOBLOCK)
            if len(frames) < 6:
                continue  # not a ZAP request; a REP socket must still answer to take the next one
            version, request_id, _domain, address, _identity, mechanism = frames[:6]
            key = z85.encode(frames[6]) if mechanism == b"CURVE" and len(frames) > 6 else b""
            ok = version == b"1.0" and bool(key) and key in self._allowed
            if not ok:
                self.denied += 1
                if self.denied in (1, 10, 100) or self.denied % 1000 == 0:
                    log.warning("KV events: refused a %s subscriber from %s: its key is not in %s (%d refused)",
                                mechanism.decode(errors="replace"), address.decode(errors="replace"),
                                self._allowed.path, self.denied)
            zap.send_multipart((b"1.0", request_id, b"200" if ok else b"400",
                                b"OK" if ok else b"key not allowed", b"", b""))

    # --- telling the daemon -------------------------------------------------------------------------
    def report(self) -> Report:
        b, r, gs = self.budget, self.replays, self._guards.values()
        return Report(connections={n: g.connections for n, g in self._guards.items()}, batches=self._ring.end,
                      limit=b.limit if b else 0, in_use=b.in_use() if b else 0,
                      paused=any(g.paused for g in gs), refused=sum(g.refused for g in gs),
                      pauses=sum(g.pauses for g in gs), replays=r.served, replays_active=len(r.active),
                      replays_waiting=len(r.waiting), replays_dropped=r.dropped, replay_bytes_in_flight=r.in_flight,
                      denied=self.denied)

    def _report(self, now: float) -> None:
        rep = self.report()
        if rep == self._last_report or now - self._reported_at < REPORT_EVERY_S or self._out:
            return
        self._last_report, self._reported_at = rep, now
        self._out += control_frame(rep)

    def _flush_out(self) -> None:
        while self._out:
            try:
                n = self._chan.send(self._out)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._out.clear()
                return
            del self._out[:n]


def _read_setup(chan: socket.socket) -> Setup:
    chan.settimeout(SETUP_TIMEOUT_S)
    reader = FrameReader(chan)
    deadline = time.monotonic() + SETUP_TIMEOUT_S
    while time.monotonic() < deadline:
        for kind, body in reader.read():
            msg = decode_control(body) if kind == CONTROL else None
            if isinstance(msg, Setup):
                return msg
            raise BrokenChannel("the first frame is not a setup")
        r, _, _ = select.select([chan], [], [], max(0.0, deadline - time.monotonic()))
        if not r:
            break
    raise BrokenChannel("no setup from the daemon")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The daemon decides when the outlet ends (by closing the channel): a Ctrl-C to the terminal's
    # process group or systemd's SIGTERM to the unit's processes must not take the stream away while
    # the daemon drains, nor make it start another outlet.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    chan = socket.socket(fileno=int(argv[0]))
    try:
        setup = _read_setup(chan)
    except (BrokenChannel, OSError) as e:
        print(f"kvoffd outlet: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=setup.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raise_nofile_limit()
    outlet = Outlet(setup, chan)
    try:
        bound = outlet.bind()
    except (OSError, zmq.ZMQError, UnsafePath, AddressInUse, ValueError) as e:
        chan.sendall(control_frame(Failed(str(e))))
        outlet.close()
        return 1
    chan.sendall(control_frame(bound))
    try:
        import uvloop
    except ImportError:
        uvloop = None
    (uvloop.run if uvloop is not None else asyncio.run)(outlet.run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
