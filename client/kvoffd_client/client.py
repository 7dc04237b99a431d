"""A small synchronous client for kvoffd, safe to use inside vLLM's processes.

Nothing here blocks forever: blocking calls take a timeout; the calls the engine makes every step
(``send_lookup``/``take_reply``, ``submit_*``, ``take_notices``) never wait at all. The connection
heals itself: ZeroMQ reconnects, the client says HELLO again and, if the daemon restarted, fails the
jobs the old daemon took with it and registers its engines again.

Threading: one lock guards the socket. A background thread only sends heartbeats (so an idle engine
is not mistaken for a dead one) and does nothing else.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvoffd_client import protocol as P
from kvoffd_client.fdpass import FdRefused, UntrustedSocket, check_socket_path, send_fd
from kvoffd_client.liveness import DaemonProcess
from kvoffd_client.paths import default_auth_token_file

log = logging.getLogger("kvoffd_client")

# plain ints: pyzmq's flag enums cost microseconds per ``&`` on the request path
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
#: a request's blocking receive wakes as soon as its reply arrives; this bounds how far it can
#: overshoot the request's deadline, and how often a quiet wait looks at the link
RECV_SLICE_MS = 2
_UNSOLICITED = (P.Notice, P.HelloOk)  # never the answer a request() waits for
_UNAVAILABLE = "unavailable"  # the code of replies this client makes up for requests a lost daemon took


#: a job still unanswered this long after its deadline is logged as overdue (it is never failed on
#: a timer: see _reap_jobs)
EXPIRY_GRACE_S = 2.0
OVERDUE_LOG_EVERY_S = 10.0
#: largest frame this client accepts; libzmq drops a peer that sends more (the daemon's replies stay
#: far below: its own frame limit is 8 MiB, an EXPLAIN of 65,536 keys is ~6 MiB)
MAX_RECV_FRAME = 4 * P.MAX_FRAME_BYTES
#: how long a refused HELLO (untrusted socket path, wrong token) waits before it is tried again
REFUSED_RETRY_S = 1.0


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


class KvoffdError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class DaemonUnavailable(KvoffdError):
    def __init__(self, message: str = "the kvoffd daemon is not reachable"):
        super().__init__(_UNAVAILABLE, message)


def _start_ticks() -> int:
    try:
        with open("/proc/self/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


@dataclass(slots=True)
class _Job:
    n: int
    deadline: float  # when the daemon stops starting it (its expires_ns); past it + grace: overdue
    daemon: DaemonProcess | None  # the daemon that took it: only its notice or its exit ends the job


class KvoffdClient:
    """One DEALER connection to the daemon.

    ``job_deadline_s``: the daemon never starts (any further part of) a job after this long, and
    answers it ``expired``. The client itself never fails a job on a timer: while the daemon that
    took a job may still copy, the engine must not reuse the job's blocks, so a job ends only with
    the daemon's notice or once that daemon is provably gone (kvoffd_client.liveness): its pidfd
    reports exit, or, where no pidfd can be trusted, the link has been down ``link_grace_s``.
    Requests (lookups...) touch no engine memory: they fail after ``link_grace_s`` of broken link.
    """

    def __init__(self, address: str, *, name: str = "kvoffd_client", timeout_s: float = 2.0,
                 job_deadline_s: float = 30.0, link_grace_s: float = 0.5, heartbeat: bool = True,
                 auth_token: str | None = None):
        self.address = address
        # ipc://: HELLO goes out only while the socket's directory and the socket are this user's (or
        # root's); tcp://: HELLO carries the daemon's token (docs/security.md)
        self._ipc_path = address[6:] if address.startswith("ipc://") else None
        self._tcp = address.startswith("tcp://")
        self._auth_token = auth_token  # None: read at each HELLO (the daemon may create it after us)
        self._refusal = ""  # the last reason HELLO was not sent or was refused (logged once)
        self._refusals = 0  # how many times: connect() returns at once on a new one
        self._down_logged = False  # "link down" was logged; HELLO_OK logs its return once
        self.name = name
        self.timeout_s = timeout_s
        self.job_deadline_s = job_deadline_s
        self.link_grace_s = link_grace_s
        self.daemon_id: str | None = None
        self.hello: P.HelloOk | None = None
        self._lock = threading.RLock()
        self._ctx = zmq.Context.instance()
        self._seq = itertools.count(1)
        self._ready = False
        self._hello_seq = 0
        self._hello_seqs: set[int] = set()
        self._hello_sent = 0.0
        self._backoff = 0.05
        self._next_try = 0.0
        self._link_down_since: float | None = None
        self._last_send = 0.0
        self._last_pump = 0.0
        self._replies: dict[int, P.Message] = {}
        self._wanted: set[int] = set()
        self._notices: list[P.Notice] = []
        self._jobs: dict[int, _Job] = {}
        self._daemon: DaemonProcess | None = None
        self._old_daemons: list[DaemonProcess] = []  # replaced (a new daemon answered) with jobs left
        self._next_overdue_check = 0.0
        self._overdue_logged = 0.0
        self._registrations: dict[str, P.Register] = {}
        self._register_seqs: dict[int, str] = {}
        self._closed = False
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_RECV_FRAME)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing to a daemon that is not there
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 250)  # a restarted daemon is found within ~0.3 s
        self._sock.setsockopt(zmq.SNDHWM, 10_000)
        self._sock.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)  # stable across reconnects
        self._sock.setsockopt(zmq.RCVTIMEO, RECV_SLICE_MS)  # blocking receives only (request())
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._sock.connect(address)
        self._hb: threading.Thread | None = None
        if heartbeat:
            self._hb = threading.Thread(target=self._heartbeat, name="kvoffd-heartbeat", daemon=True)
            self._hb.start()

    # ------------------------------------------------------------------------------------------------
    # connection state

    @property
    def connected(self) -> bool:
        """Whether the daemon is reachable now (processes pending link events first; never waits)."""
        if self._closed or time.monotonic() - self._last_pump < 0.01:
            return self._ready  # the engine asks per request per step: at most one pump per 10 ms
        with self._lock:
            if not self._closed:
                self._pump(0)
            return self._ready

    def connect(self, timeout_s: float | None = None) -> bool:
        """Handshake now, waiting up to ``timeout_s``. False (never an exception) when unreachable."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        with self._lock:
            self._next_try = 0.0
            refusals = self._refusals
            while True:
                self._pump(0)
                if self._ready:
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or self._refusals != refusals:  # refused: ``refusal`` says why
                    return False
                self._pump(int(min(left, 0.05) * 1000) + 1)

    @property
    def refusal(self) -> str:
        """Why the last HELLO was refused or not sent (version mismatch, untrusted socket, bad token);
        empty once a HELLO succeeds."""
        return self._refusal

    def _unreachable(self) -> DaemonUnavailable:
        why = f" ({self._refusal})" if self._refusal else ""
        return DaemonUnavailable(f"no kvoffd answering at {self.address}{why}")

    def _try_hello(self, now: float) -> None:
        if self._hello_seq and now - self._hello_sent < max(self.timeout_s, 0.5):
            return  # one HELLO at a time
        if now < self._next_try:
            return
        if self._ipc_path is not None:
            try:
                check_socket_path(self._ipc_path, must_exist=False)
            except UntrustedSocket as e:
                self._refused(str(e), now)
                return
        seq = next(self._seq)
        msg = P.Hello(seq=seq, client=self.name, pid=os.getpid(), start_ticks=_start_ticks(),
                      capabilities=["lease"], token=self._token())
        if self._send(msg):
            self._hello_seq, self._hello_sent = seq, now
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
        """No HELLO now (untrusted socket path) or a refused one (unauthorized): retry later, quietly."""
        if why != self._refusal:
            log.error("kvoffd: not connecting to %s: %s", self.address, why)
            self._refusal = why
        self._refusals += 1
        self._hello_seq = 0
        self._next_try = now + REFUSED_RETRY_S

    def _on_hello(self, msg: P.HelloOk) -> None:
        self._hello_seq = 0
        self._hello_seqs.clear()
        self._refusal = ""
        restarted = self.daemon_id is not None and msg.daemon_id != self.daemon_id
        if self._down_logged and not restarted:
            log.warning("kvoffd at %s is back (same daemon %s)", self.address, msg.daemon_id)
        self._down_logged = False
        if restarted:
            log.warning("kvoffd restarted (daemon %s -> %s): %d jobs in flight end once the old daemon is "
                        "gone, re-registering %d engines", self.daemon_id, msg.daemon_id, len(self._jobs),
                        len(self._registrations))
            self._fail_requests("the daemon restarted; the request was lost")
        elif self.daemon_id is None:
            log.info("connected to kvoffd at %s (daemon %s)", self.address, msg.daemon_id)
        if self._daemon is None or self._daemon.daemon_id != msg.daemon_id:
            self._track_daemon(DaemonProcess(msg.daemon_id, msg.pid, self.address))
        self.daemon_id, self.hello = msg.daemon_id, msg
        self._ready = True
        self._link_down_since = None
        if restarted or not self._register_seqs:
            for reg in self._registrations.values():
                try:
                    wire = self._wire_register(reg, self.timeout_s)
                except KvoffdError as e:
                    log.error("kvoffd: cannot re-register engine %s: %s", reg.engine_id, e)
                    continue
                wire.seq = next(self._seq)
                if self._send(wire):
                    self._register_seqs[wire.seq] = reg.engine_id

    def _wire_register(self, reg: P.Register, timeout_s: float) -> P.Register:
        """REGISTER as it travels. ``cpu_fd`` memory holds this process's descriptor: hand it to the
        daemon's fd socket now (each REGISTER needs a fresh one-time token) and send the token."""
        mem = reg.memory
        if mem.get("kind") != "cpu_fd" or "fd" not in mem:
            return msgspec.structs.replace(reg)
        path = self.hello.fd_socket if self.hello is not None else ""
        if not path:
            raise KvoffdError(P.ErrorCode.MEMORY_UNREACHABLE.value, "the daemon takes no cpu_fd memory")
        try:
            token = send_fd(path, mem["fd"], mem["size"], timeout_s=max(min(timeout_s, 5.0), 0.5))
        except FdRefused as e:
            raise KvoffdError(e.code, f"the daemon refused the memory descriptor: {e.message}") from None
        except OSError as e:
            raise KvoffdError(P.ErrorCode.MEMORY_UNREACHABLE.value, f"cannot hand memory to {path}: {e}") from None
        return msgspec.structs.replace(reg, memory={"kind": "cpu_fd", "token": token, "size": mem["size"]})

    def _track_daemon(self, new: DaemonProcess) -> None:
        """A HELLO_OK named a daemon this client did not know: watch it; keep watching the one it
        replaces while jobs it took are in flight (it may be frozen, not dead: the new one could
        only bind the address if the old socket file was removed)."""
        old = self._daemon
        self._daemon = new
        if old is not None:
            if any(j.daemon is old for j in self._jobs.values()):
                self._old_daemons.append(old)
            else:
                old.close()

    def _daemon_gone(self, d: DaemonProcess | None, now: float) -> bool:
        """Proof that no copy of ``d`` can run any more (see kvoffd_client.liveness)."""
        if d is not None and d.exited():
            return True
        if d is not None and d.watched:
            return False  # the process exists: frozen or slow, it may still copy
        if d is not self._daemon:
            return True  # unwatched and replaced: its link went down before the new daemon answered
        return self._link_down_since is not None and now - self._link_down_since > self.link_grace_s

    def _reap_jobs(self, now: float) -> None:
        """Fail the jobs whose daemon is provably gone; log those overdue on a daemon that exists."""
        if self._link_down_since is not None or self._old_daemons:
            for d in {id(j.daemon): j.daemon for j in self._jobs.values()}.values():
                if self._daemon_gone(d, now):
                    code = "daemon_lost" if d is self._daemon else "daemon_restarted"
                    self._fail_jobs_of(d, code, "the daemon that took the job is gone; nothing more is copied")
            for d in [d for d in self._old_daemons if not any(j.daemon is d for j in self._jobs.values())]:
                self._old_daemons.remove(d)
                d.close()
        if self._jobs and now >= self._next_overdue_check:
            self._next_overdue_check = now + 1.0
            late = [job for job in self._jobs.values() if job.deadline + EXPIRY_GRACE_S <= now]
            if late and now - self._overdue_logged >= OVERDUE_LOG_EVERY_S:
                self._overdue_logged = now
                d = late[0].daemon
                log.error("kvoffd: %d jobs unanswered %.1f s past their deadline, and daemon pid %s still "
                          "exists (frozen or stalled?): their blocks stay reserved until it answers or exits",
                          len(late), now - min(j.deadline for j in late), d.pid if d else "?")

    def _lost(self, why: str) -> None:
        """The daemon does not know this client (restarted, or dropped the connection as silent): say
        HELLO again. Jobs stay in flight: HELLO_OK tells whether the daemon that took them is still
        the one answering (then their notices still come), and _reap_jobs fails them once it is gone."""
        if self._ready:
            log.warning("kvoffd link lost (%s)", why)
            self._down_logged = True
        self._ready = False
        self._hello_seq = 0
        self._fail_requests(why)

    def _fail_jobs_of(self, daemon: DaemonProcess | None, code: str, why: str) -> None:
        """The daemon that took these jobs is gone: they get failed notices (the engine recomputes)."""
        for job_id in [j for j, job in self._jobs.items() if job.daemon is daemon]:
            job = self._jobs.pop(job_id)
            self._notices.append(P.Notice(job_id=job_id, ok=False, failed=list(range(job.n)), code=code,
                                          message=why))

    def _fail_requests(self, why: str) -> None:
        """Requests in flight get an ``unavailable`` reply (a lookup sent to a daemon that died is a
        miss now, not after the engine's lookup timeout). They touch no engine memory."""
        for seq in self._wanted:
            self._replies[seq] = P.Error(seq=seq, code=_UNAVAILABLE, message=why)
        self._wanted.clear()

    # ------------------------------------------------------------------------------------------------
    # I/O

    def _send(self, msg: P.Message) -> bool:
        try:
            self._sock.send(P.encode(msg), _NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            log.debug("send failed: %s", e)
            return False
        self._last_send = time.monotonic()
        return True

    def _pump(self, timeout_ms: int = 0) -> None:
        """Process link events, incoming messages, reconnection and deadlines. Never blocks past timeout."""
        now = self._last_pump = time.monotonic()
        while self._monitor.getsockopt(_EVENTS) & _POLLIN:  # no system call, unlike poll()
            ev = recv_monitor_message(self._monitor)
            if ev["event"] == zmq.EVENT_DISCONNECTED:
                if self._ready:
                    log.warning("kvoffd at %s went away (link down): %d jobs in flight wait for it or its exit; "
                                "requests fail until it is back", self.address, len(self._jobs))
                    self._down_logged = True
                self._link_down_since = self._link_down_since or now
                self._ready = False
                self._hello_seq = 0
            elif ev["event"] == zmq.EVENT_CONNECTED:
                self._next_try = 0.0
        if (self._link_down_since is not None and self._wanted
                and now - self._link_down_since > self.link_grace_s):
            self._fail_requests("the connection to the daemon broke")
        self._read_all()  # first: a HELLO_OK already here must be seen before another HELLO goes out
        if not self._ready:
            self._try_hello(now)
        if timeout_ms and self._sock.poll(timeout_ms, zmq.POLLIN):
            self._read_all()
        if self._jobs:
            self._reap_jobs(now)

    def _read_all(self) -> None:
        while self._sock.getsockopt(_EVENTS) & _POLLIN:
            try:
                frame = self._sock.recv(_NOBLOCK)
            except zmq.Again:
                break
            self._dispatch(frame)

    def _dispatch(self, frame: bytes) -> None:
        try:
            msg = P.decode(frame)
        except P.ProtocolError as e:
            log.warning("undecodable message from the daemon: %s", e)
            return
        self._dispatch_msg(msg)

    def _dispatch_msg(self, msg: P.Message) -> None:
        if isinstance(msg, P.Notice):
            if self._jobs.pop(msg.job_id, None) is not None:
                self._notices.append(msg)
            return
        if isinstance(msg, P.HelloOk):
            if msg.seq in self._hello_seqs:  # any HELLO of ours answered (the daemon answers each one)
                self._on_hello(msg)
            return
        if isinstance(msg, P.Error):
            if msg.code == P.ErrorCode.HELLO_REQUIRED.value:
                self._lost(f"the daemon does not know this client: {msg.message}")
                return
            if msg.seq in self._hello_seqs:  # unauthorized, version_mismatch, too_many
                self._hello_seqs.discard(msg.seq)
                why = msg.message
                if msg.code == P.ErrorCode.VERSION_MISMATCH.value:
                    why = f"protocol version mismatch (this client speaks v{P.PROTOCOL_VERSION}): {why}"
                self._refused(f"the daemon refused HELLO: {why}", time.monotonic())
                return
            job = self._jobs.pop(msg.job_id, None) if msg.job_id is not None else None
            if job is not None:  # the daemon refused the job: it is over, nothing was written
                self._notices.append(P.Notice(job_id=msg.job_id, ok=False, failed=list(range(job.n)),
                                              code=msg.code, message=msg.message))
                return
        engine = self._register_seqs.pop(msg.seq, None)
        if engine is not None and msg.seq not in self._wanted:
            if isinstance(msg, P.Error):
                log.error("kvoffd refused to re-register engine %s: %s", engine, msg.message)
            return
        if msg.seq in self._wanted:
            self._wanted.discard(msg.seq)
            self._replies[msg.seq] = msg

    def _heartbeat(self) -> None:
        while not self._closed:
            time.sleep(0.5 if self._ready else 0.05)  # while the link is down, notice its return quickly
            with self._lock:
                if self._closed:
                    return
                self._pump(0)  # notices the link going down or up even while the engine is idle
                interval = self.hello.heartbeat_s if self.hello else 2.0
                if self._ready and time.monotonic() - self._last_send >= interval / 2:
                    self._send(P.Ping(seq=0))

    # ------------------------------------------------------------------------------------------------
    # requests

    def send_request(self, msg: P.Message) -> int | None:
        """Send without waiting; returns the seq to collect the reply with, or None when not connected."""
        with self._lock:
            self._pump(0)
            if not self._ready:
                return None
            msg.seq = next(self._seq)
            if not self._send(msg):
                return None
            self._wanted.add(msg.seq)
            return msg.seq

    def take_reply(self, seq: int) -> P.Message | None:
        """The reply to ``seq`` if it has arrived (never waits). Once the link has been down for
        ``link_grace_s`` every request still in flight gets an ERROR reply with code ``unavailable``."""
        with self._lock:
            self._pump(0)
            return self._replies.pop(seq, None)

    def forget(self, seq: int) -> None:
        with self._lock:
            self._wanted.discard(seq)
            self._replies.pop(seq, None)

    def request(self, msg: P.Message, timeout_s: float | None = None) -> P.Message:
        """Send and wait (bounded) for the reply. Raises DaemonUnavailable or KvoffdError (ERROR reply)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        with self._lock:
            if not self._ready and not self.connect(timeout):
                raise self._unreachable()
            # fast path: no full _pump per round trip (the heartbeat thread watches the link)
            msg.seq = seq = next(self._seq)
            if not self._send(msg):
                raise DaemonUnavailable(f"cannot send to kvoffd at {self.address}")
            self._wanted.add(seq)
            sock = self._sock
            while True:
                reply = self._replies.pop(seq, None)
                if reply is not None:
                    if isinstance(reply, P.Error):
                        if reply.code == _UNAVAILABLE:
                            raise DaemonUnavailable(reply.message)
                        raise KvoffdError(reply.code, reply.message)
                    return reply
                left = deadline - time.monotonic()
                if left <= 0 or not self._ready:
                    self._wanted.discard(seq)
                    if left > 0:
                        raise DaemonUnavailable(f"the link to kvoffd broke before it answered {msg.op.value}")
                    raise DaemonUnavailable(f"kvoffd did not answer {msg.op.value} within {timeout} s")
                try:  # a plain blocking receive: cheaper than poll(), which builds a Poller per call
                    frame = sock.recv()
                except zmq.Again:
                    self._pump(0)  # quiet for RECV_SLICE_MS: look at the link
                    continue
                try:
                    got = P.decode(frame)
                except P.ProtocolError as e:
                    log.warning("undecodable message from the daemon: %s", e)
                    continue
                if got.seq == seq and type(got) not in _UNSOLICITED:  # the answer: skip the general dispatch
                    self._wanted.discard(seq)
                    if isinstance(got, P.Error):
                        if got.code == P.ErrorCode.HELLO_REQUIRED.value:
                            self._dispatch_msg(got)  # says HELLO again
                            raise DaemonUnavailable(f"kvoffd did not do the {msg.op.value}: it does not know "
                                                    f"this connection ({got.message})")
                        raise KvoffdError(got.code, got.message)
                    return got
                self._dispatch_msg(got)

    # --- engine registration ------------------------------------------------------------------------

    def register(self, engine_id: str, namespace: str, rank: int, world_size: int, memory: dict[str, Any],
                 layout: dict[str, Any], timeout_s: float | None = None) -> P.Registered:
        """Register (and remember, to register again after a daemon restart)."""
        msg = P.Register(engine_id=engine_id, namespace=namespace, rank=rank, world_size=world_size,
                         memory=memory, layout=layout)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            self._registrations[engine_id] = msg
            if not self._ready and not self.connect(timeout):
                raise self._unreachable()
            reply = self.request(self._wire_register(msg, timeout), timeout_s)
        assert isinstance(reply, P.Registered)
        return reply

    def unregister(self, engine_id: str, timeout_s: float | None = None) -> None:
        with self._lock:
            self._registrations.pop(engine_id, None)
            if self._ready:
                self.request(P.Unregister(engine_id=engine_id), timeout_s)

    # --- lookups -------------------------------------------------------------------------------------

    # ``keys``: a sequence of keys, or one binary of them back to back (the cheapest: nothing to
    # join). It is encoded before these return, so it is not copied.
    def send_lookup(self, namespace: str, keys: Sequence[bytes] | bytes, lease_ms: int = 0) -> int | None:
        return self.send_request(P.Lookup(namespace=namespace, keys=keys, lease_ms=lease_ms))

    def lookup(self, namespace: str, keys: Sequence[bytes] | bytes, lease_ms: int = 0,
               timeout_s: float | None = None) -> P.LookupResult:
        reply = self.request(P.Lookup(namespace=namespace, keys=keys, lease_ms=lease_ms), timeout_s)
        assert isinstance(reply, P.LookupResult)
        return reply

    def release(self, lease_id: int) -> None:
        if lease_id:
            with self._lock:
                if self._ready:
                    self._send(P.Release(seq=0, lease_id=lease_id))

    # --- jobs ----------------------------------------------------------------------------------------

    def submit_store(self, engine_id: str, job_id: int, keys: Sequence[bytes] | bytes,
                     block_ids: Sequence[int] | bytes, event: int = -1) -> None:
        self._submit(P.Store(engine_id=engine_id, job_id=job_id, keys=keys, block_ids=block_ids, event=event))

    def submit_load(self, engine_id: str, job_id: int, keys: Sequence[bytes] | bytes,
                    block_ids: Sequence[int] | bytes, lease_id: int = 0, event: int = -1,
                    deadline_s: float | None = None) -> None:
        """``deadline_s``: this job's own deadline, when shorter than ``job_deadline_s`` (a load the
        engine waits for within its step is not worth starting after the engine gave up on it)."""
        self._submit(P.Load(engine_id=engine_id, job_id=job_id, keys=keys, block_ids=block_ids, lease_id=lease_id,
                            event=event), deadline_s)

    def _submit(self, msg: P.Store | P.Load, deadline_s: float | None = None) -> None:
        with self._lock:
            self._pump(0)
            if not self._ready:
                raise DaemonUnavailable()
            if msg.job_id in self._jobs:
                raise KvoffdError(P.ErrorCode.DUPLICATE_JOB.value, f"job {msg.job_id} is already in flight")
            msg.seq = next(self._seq)
            now = time.monotonic()
            # The daemon will not start the job (or any further part of it) after job_deadline_s; the
            # job still ends only with its notice, or once that daemon is gone (see _reap_jobs).
            deadline = now + min(self.job_deadline_s, self.job_deadline_s if deadline_s is None else deadline_s)
            msg.expires_ns = int(deadline * 1e9)
            if not self._send(msg):
                raise DaemonUnavailable("cannot send to kvoffd")
            self._jobs[msg.job_id] = _Job(P.count_keys(msg.keys), deadline, self._daemon)

    def take_notices(self) -> list[P.Notice]:
        """Completion notices that arrived (real or synthesized for lost jobs). Never waits."""
        with self._lock:
            self._pump(0)
            out, self._notices = self._notices, []
            return out

    def wait_notices(self, job_ids: set[int], timeout_s: float) -> list[P.Notice]:
        """Block (bounded) until every job in ``job_ids`` has a notice; returns the ones received."""
        deadline = time.monotonic() + timeout_s
        got: list[P.Notice] = []
        pending = set(job_ids)
        with self._lock:
            while pending:
                self._pump(0)
                keep = []
                for n in self._notices:
                    if n.job_id in pending:
                        pending.discard(n.job_id)
                        got.append(n)
                    else:
                        keep.append(n)
                self._notices = keep
                left = deadline - time.monotonic()
                if not pending or left <= 0:
                    break
                self._pump(int(min(left, 0.05) * 1000) + 1)
        return got

    @property
    def jobs_in_flight(self) -> int:
        return len(self._jobs)

    # --- admin ---------------------------------------------------------------------------------------

    def stats(self, detail: bool = False, timeout_s: float | None = None) -> dict[str, Any]:
        reply = self.request(P.Stats(detail=detail), timeout_s)
        assert isinstance(reply, P.StatsResult)
        return reply.stats

    def clear(self, namespace: str = "", timeout_s: float | None = None) -> P.Cleared:
        reply = self.request(P.Clear(namespace=namespace), timeout_s)
        assert isinstance(reply, P.Cleared)
        return reply

    def explain(self, namespace: str, keys: Sequence[bytes], timeout_s: float | None = None) -> list[dict]:
        reply = self.request(P.Explain(namespace=namespace, keys=keys), timeout_s)
        assert isinstance(reply, P.Explained)
        return reply.entries

    def ping(self, timeout_s: float | None = None) -> float:
        t0 = time.perf_counter()
        self.request(P.Ping(), timeout_s)
        return time.perf_counter() - t0

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._sock.close(0)
            for d in [self._daemon, *self._old_daemons]:
                if d is not None:
                    d.close()

    def __enter__(self) -> KvoffdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
