"""The connection under a KvoffdClient: one DEALER socket, its monitor, the HELLO handshake, heartbeats.

Why a layer of its own: whether a daemon is there, trusted and greeted is one state machine, and the
client's requests, jobs and notices only need its answer (``ready``) and its transitions (a ready
link went down; a HELLO_OK arrived). ZeroMQ reconnects by itself; the link notices through the
socket monitor, and says HELLO again (backing off while sends fail, and waiting ``REFUSED_RETRY_S``
after a refusal: an untrusted socket path, a wrong token, a version mismatch).

Threading: every method is called with ``lock`` held (the client's calls and the heartbeat thread
share it); the socket is used from one thread at a time.
"""

from __future__ import annotations

import enum
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvoffd_client import protocol as P
from kvoffd_client.fdpass import UntrustedSocket, check_socket_path
from kvoffd_client.paths import default_auth_token_file

log = logging.getLogger("kvoffd_client")

# plain ints: pyzmq's flag enums cost microseconds per ``&`` on the request path
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
#: a request's blocking receive wakes as soon as its reply arrives; this bounds how far it can
#: overshoot the request's deadline, and how often a quiet wait looks at the link
RECV_SLICE_MS = 2
#: largest frame this client accepts; libzmq drops a peer that sends more (the daemon's replies stay
#: far below: its own frame limit is 8 MiB, an EXPLAIN of 65,536 keys is ~6 MiB)
MAX_RECV_FRAME = 4 * P.MAX_FRAME_BYTES
#: how long a refused HELLO (untrusted socket path, wrong token) waits before it is tried again
REFUSED_RETRY_S = 1.0


class LinkState(enum.Enum):
    DOWN = "down"  # no daemon knows this link now; a HELLO goes out when the backoff allows
    GREETING = "greeting"  # a HELLO is out, its answer not yet here
    READY = "ready"  # the daemon answered HELLO: requests and jobs may go
    CLOSED = "closed"


def read_auth_token() -> str:
    """The token a tcp:// daemon asks for: $KVOFFD_AUTH_TOKEN, else the file $KVOFFD_AUTH_TOKEN_FILE,
    else <runtime dir>/auth-token (the daemon's default). Empty when none is readable."""
    token = os.environ.get("KVOFFD_AUTH_TOKEN", "")
    if token:
        return token.strip()
    path = os.environ.get("KVOFFD_AUTH_TOKEN_FILE") or default_auth_token_file()
    try:
        with open(path, encoding="ascii") as f:
            return f.read(4096).strip()
    except (OSError, ValueError):
        return ""


class Link:
    """A DEALER connection to ``address`` and its handshake state (``state``).

    ``down_since``: when the link last went down (None once a HELLO_OK came back, and before it first
    went down): the client's grace periods count from it. ``seqs`` numbers every message that wants
    an answer, HELLO included, so a reply's seq says which one it answers.
    """

    def __init__(self, address: str, *, name: str, timeout_s: float, auth_token: str | None):
        self.address = address
        self.name = name
        self.timeout_s = timeout_s
        # ipc://: HELLO goes out only while the socket's directory and the socket are this user's (or
        # root's); tcp://: HELLO carries the daemon's token (docs/security.md)
        self._ipc_path = address[6:] if address.startswith("ipc://") else None
        self._tcp = address.startswith("tcp://")
        self._auth_token = auth_token  # None: read at each HELLO (the daemon may create it after us)
        self.state = LinkState.DOWN
        self.lock = threading.RLock()
        self.seqs = itertools.count(1)
        self.hello: P.HelloOk | None = None
        self.down_since: float | None = None
        self.last_send = 0.0
        self.refusal = ""  # the last reason HELLO was not sent or was refused (logged once)
        self.refusals = 0  # how many times: KvoffdClient.connect() returns at once on a new one
        self._announce_return = False  # a ready link went down: its return is logged once
        self._hello_seqs: set[int] = set()  # every HELLO of ours not yet answered (each is answered)
        self._hello_sent = 0.0
        self._backoff = 0.05
        self._next_try = 0.0
        self._hb: threading.Thread | None = None
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_RECV_FRAME)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing to a daemon that is not there
        # A restarted daemon is found within 50 ms of its bind (the engines' gap is the restart, not our
        # backoff: at 100-250 ms a warm restart's first hit came ~0.25 s after the daemon served);
        # a connect attempt to an absent socket is one failed system call.
        self._sock.setsockopt(zmq.RECONNECT_IVL, 10)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 50)
        self._sock.setsockopt(zmq.SNDHWM, 10_000)
        self._sock.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)  # stable across reconnects
        self._sock.setsockopt(zmq.RCVTIMEO, RECV_SLICE_MS)  # blocking receives only (recv_slice)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._sock.connect(address)

    @property
    def ready(self) -> bool:
        return self.state is LinkState.READY

    @property
    def closed(self) -> bool:
        return self.state is LinkState.CLOSED

    # --- transitions -----------------------------------------------------------------------------------
    def watch(self, now: float) -> bool:
        """Take the socket monitor's events. True when a ready link went down (the caller says so)."""
        went_down = False
        while self._monitor.getsockopt(_EVENTS) & _POLLIN:  # no system call, unlike poll()
            ev = recv_monitor_message(self._monitor)
            if ev["event"] == zmq.EVENT_DISCONNECTED:
                if self.state is LinkState.READY:
                    went_down = self._announce_return = True
                self.down_since = self.down_since or now
                self.state = LinkState.DOWN
            elif ev["event"] == zmq.EVENT_CONNECTED:
                self._next_try = 0.0
        return went_down

    def lost(self) -> bool:
        """The daemon does not know this link (HELLO_REQUIRED): greet again. True if it was ready."""
        was_ready = self.state is LinkState.READY
        if was_ready:
            self._announce_return = True
        if self.state is not LinkState.CLOSED:
            self.state = LinkState.DOWN
        return was_ready

    def answers_hello(self, seq: int) -> bool:
        return seq in self._hello_seqs

    def accept(self, msg: P.HelloOk) -> bool:
        """A HELLO_OK to one of our HELLOs: the link is ready. True if it had gone down while ready
        (its return is worth a line)."""
        self._hello_seqs.clear()
        self.refusal = ""
        came_back, self._announce_return = self._announce_return, False
        self.hello = msg
        self.state = LinkState.READY
        self.down_since = None
        return came_back

    def refuse(self, msg: P.Error, now: float) -> None:
        """An ERROR to one of our HELLOs (unauthorized, version_mismatch, too_many)."""
        self._hello_seqs.discard(msg.seq)
        why = msg.message
        if msg.code == P.ErrorCode.VERSION_MISMATCH.value:
            why = f"protocol version mismatch (this client speaks v{P.PROTOCOL_VERSION}): {why}"
        self._refused(f"the daemon refused HELLO: {why}", now)

    def retry_now(self) -> None:
        """Let the next greet() send a HELLO at once (no backoff)."""
        self._next_try = 0.0

    def greet(self, now: float) -> None:
        """Send a HELLO if none is out (or the last one went unanswered) and the backoff allows."""
        if self.state is LinkState.GREETING and now - self._hello_sent < max(self.timeout_s, 0.5):
            return  # one HELLO at a time
        if now < self._next_try or self.state is LinkState.CLOSED:
            return
        if self._ipc_path is not None:
            try:
                check_socket_path(self._ipc_path, must_exist=False)
            except UntrustedSocket as e:
                self._refused(str(e), now)
                return
        seq = next(self.seqs)
        msg = P.Hello(seq=seq, client=self.name, pid=os.getpid(), start_ticks=P.start_ticks(),
                      capabilities=["lease"], token=self._token())
        if self.send(msg):
            self.state, self._hello_sent = LinkState.GREETING, now
            self._hello_seqs.add(seq)
            self._backoff = 0.05
        else:
            self._next_try = now + self._backoff
            self._backoff = min(self._backoff * 2, 0.25)

    def _token(self) -> str:
        if self._auth_token is not None:
            return self._auth_token
        return read_auth_token() if self._tcp else ""

    def _refused(self, why: str, now: float) -> None:
        """No HELLO now (untrusted socket path) or a refused one: retry later, quietly."""
        if why != self.refusal:
            log.error("kvoffd: not connecting to %s: %s", self.address, why)
            self.refusal = why
        self.refusals += 1
        if self.state is LinkState.GREETING:
            self.state = LinkState.DOWN
        self._next_try = now + REFUSED_RETRY_S

    # --- I/O ------------------------------------------------------------------------------------------
    def send(self, msg: P.Message) -> bool:
        try:
            self._sock.send(P.encode(msg), _NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            log.debug("send failed: %s", e)
            return False
        self.last_send = time.monotonic()
        return True

    def recv_nowait(self) -> bytes | None:
        """A frame that has arrived, or None (never waits)."""
        if not self._sock.getsockopt(_EVENTS) & _POLLIN:
            return None
        try:
            return self._sock.recv(_NOBLOCK)
        except zmq.Again:
            return None

    def recv_slice(self) -> bytes | None:
        """A frame, waiting at most RECV_SLICE_MS for it (a plain blocking receive: cheaper than
        poll(), which builds a Poller per call)."""
        try:
            return self._sock.recv()
        except zmq.Again:
            return None

    def wait(self, timeout_ms: int) -> bool:
        """Wait up to ``timeout_ms`` for a frame; True if one is there."""
        return bool(self._sock.poll(timeout_ms, zmq.POLLIN))

    # --- heartbeat and close --------------------------------------------------------------------------
    def start_heartbeat(self, pump: Callable[[], None]) -> None:
        """A thread that calls ``pump`` (with ``lock`` held) so link events are seen while the engine
        is idle, and sends a PING when nothing was sent for half the daemon's heartbeat interval (so
        an idle engine is not taken for a dead one)."""
        self._hb = threading.Thread(target=self._heartbeat, args=(pump,), name="kvoffd-heartbeat", daemon=True)
        self._hb.start()

    def _heartbeat(self, pump: Callable[[], None]) -> None:
        while not self.closed:
            time.sleep(0.5 if self.ready else 0.05)  # while the link is down, notice its return quickly
            with self.lock:
                if self.closed:
                    return
                pump()
                interval = self.hello.heartbeat_s if self.hello else 2.0
                if self.ready and time.monotonic() - self.last_send >= interval / 2:
                    self.send(P.Ping(seq=0))

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.state = LinkState.CLOSED
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._sock.close(0)
