"""A small synchronous client for kvoffd, safe to use inside vLLM's processes.

Nothing here blocks forever: blocking calls take a timeout; the calls the engine makes every step
(``send_lookup``/``take_reply``, ``submit_*``, ``take_notices``) never wait at all. The connection
heals itself (``kvoffd_client.link``: ZeroMQ reconnects, the link says HELLO again); this module
keeps what rides on it: requests and their replies, jobs and their notices, and, if the daemon
restarted, failing the jobs the old daemon took with it and registering the engines again.

Threading: one lock (the link's) guards the socket and this state. The link's heartbeat thread only
pumps (so link events are seen while the engine is idle) and pings.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from kvoffd_client import protocol as P
from kvoffd_client.errors import UNAVAILABLE, DaemonUnavailable, KvoffdError, answer
from kvoffd_client.fdpass import FdRefused, wire_memory
from kvoffd_client.jobs import ClientJobs
from kvoffd_client.link import Link, LinkState, read_auth_token
from kvoffd_client.liveness import EXPIRY_GRACE_S, DaemonWatch
from kvoffd_client.memory.local import LocalMemory

__all__ = ["EXPIRY_GRACE_S", "DaemonUnavailable", "KvoffdClient", "KvoffdError", "LinkState", "read_auth_token"]

log = logging.getLogger("kvoffd_client")

_UNSOLICITED = (P.Notice, P.Landed, P.HelloOk)  # never the answer a request() waits for


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
        self.name = name
        self.timeout_s = timeout_s
        self.job_deadline_s = job_deadline_s
        self.link_grace_s = link_grace_s
        self.daemon_id: str | None = None
        self._link = Link(address, name=name, timeout_s=timeout_s, auth_token=auth_token)
        self._lock = self._link.lock
        self._seq = self._link.seqs
        self._last_pump = 0.0
        self._replies: dict[int, P.Message] = {}
        self._wanted: set[int] = set()
        self._daemons = DaemonWatch(address, link_grace_s)  # which daemon took each job; is it gone
        self._jobs = ClientJobs(self._link, self._daemons, self._pump, job_deadline_s)
        # engine id -> REGISTER (its memory as the Struct, no token yet) and the memory's descriptors
        self._registrations: dict[str, tuple[P.Register, LocalMemory]] = {}
        self._register_seqs: dict[int, str] = {}
        if heartbeat:
            self._link.start_heartbeat(lambda: self._pump(0))

    # ------------------------------------------------------------------------------------------------
    # connection state

    @property
    def connected(self) -> bool:
        """Whether the daemon is reachable now (processes pending link events first; never waits)."""
        link = self._link
        if link.closed or time.monotonic() - self._last_pump < 0.01:
            return link.ready  # the engine asks per request per step: at most one pump per 10 ms
        with self._lock:
            if not link.closed:
                self._pump(0)
            return link.ready

    @property
    def link_state(self) -> LinkState:
        """The handshake's state (``down``, ``greeting``, ``ready``, ``closed``), without pumping."""
        return self._link.state

    @property
    def hello(self) -> P.HelloOk | None:
        """The daemon's last HELLO_OK (its id, pid, limits, fd socket); None before the first."""
        return self._link.hello

    def connect(self, timeout_s: float | None = None) -> bool:
        """Handshake now, waiting up to ``timeout_s``. False (never an exception) when unreachable."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        link = self._link
        with self._lock:
            if link.closed:
                return False
            link.retry_now()
            refusals = link.refusals
            while True:
                self._pump(0)
                if link.ready:
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or link.refusals != refusals:  # refused: ``refusal`` says why
                    return False
                self._pump(int(min(left, 0.05) * 1000) + 1)

    def poll(self, timeout_ms: int = 0) -> None:
        """Process what arrived (replies, notices, link events, lost jobs), waiting up to ``timeout_ms``
        for a frame; what it finds is then returned by ``take_reply``/``take_notices``."""
        with self._lock:
            self._pump(timeout_ms)

    @property
    def refusal(self) -> str:
        """Why the last HELLO was refused or not sent (version mismatch, untrusted socket, bad token);
        empty once a HELLO succeeds."""
        return self._link.refusal

    def _unreachable(self) -> DaemonUnavailable:
        refusal = self._link.refusal
        why = f" ({refusal})" if refusal else ""
        return DaemonUnavailable(f"no kvoffd answering at {self.address}{why}")

    def _on_hello(self, msg: P.HelloOk) -> None:
        came_back = self._link.accept(msg)
        restarted = self.daemon_id is not None and msg.daemon_id != self.daemon_id
        if came_back and not restarted:
            log.warning("kvoffd at %s is back (same daemon %s)", self.address, msg.daemon_id)
        if restarted:
            log.warning("kvoffd restarted (daemon %s -> %s): %d jobs in flight end once the old daemon is "
                        "gone, re-registering %d engines", self.daemon_id, msg.daemon_id, len(self._jobs),
                        len(self._registrations))
            self._fail_requests("the daemon restarted; the request was lost")
        elif self.daemon_id is None:
            log.info("connected to kvoffd at %s (daemon %s)", self.address, msg.daemon_id)
        self._jobs.met(msg.daemon_id, msg.pid)
        self.daemon_id = msg.daemon_id
        if restarted or not self._register_seqs:
            for reg, memory in self._registrations.values():
                try:
                    wire = _wire_register(reg, memory, self.hello, self.timeout_s)
                except KvoffdError as e:
                    log.error("kvoffd: cannot re-register engine %s: %s", reg.engine_id, e)
                    continue
                wire.seq = next(self._seq)
                if self._link.send(wire):
                    self._register_seqs[wire.seq] = reg.engine_id

    def _lost(self, why: str) -> None:
        """The daemon does not know this client (restarted, or dropped the connection as silent): say
        HELLO again. Jobs stay in flight: HELLO_OK tells whether the daemon that took them is still
        the one answering (then their notices still come), and ClientJobs.reap fails them once it is gone."""
        if self._link.lost():
            log.warning("kvoffd link lost (%s)", why)
        self._fail_requests(why)

    def _fail_requests(self, why: str) -> None:
        """Requests in flight get an ``unavailable`` reply (a lookup sent to a daemon that died is a
        miss now, not after the engine's lookup timeout). They touch no engine memory."""
        for seq in self._wanted:
            self._replies[seq] = P.Error(seq=seq, code=UNAVAILABLE, message=why)
        self._wanted.clear()

    # ------------------------------------------------------------------------------------------------
    # incoming

    def _pump(self, timeout_ms: int = 0) -> None:
        """Process link events, incoming messages, reconnection and deadlines. Never blocks past timeout."""
        link = self._link
        if link.closed:
            return  # close()d: nothing to take, no socket to ask
        now = self._last_pump = time.monotonic()
        if link.watch(now):
            log.warning("kvoffd at %s went away (link down): %d jobs in flight wait for it or its exit; "
                        "until it is back its calls fail fast (in vLLM lookups miss and prompts are "
                        "recomputed: no inference request fails)", self.address, len(self._jobs))
        if link.down_since is not None and self._wanted and now - link.down_since > self.link_grace_s:
            self._fail_requests("the connection to the daemon broke")
        self._read_all()  # first: a HELLO_OK already here must be seen before another HELLO goes out
        if not link.ready:
            link.greet(now)
        if timeout_ms and link.wait(timeout_ms):
            self._read_all()
        if self._jobs:
            self._jobs.reap(now)

    def _read_all(self) -> None:
        recv = self._link.recv_nowait
        while (frame := recv()) is not None:
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
            self._jobs.noticed(msg)
            return
        if isinstance(msg, P.Landed):
            self._jobs.landed(msg)
            return
        if isinstance(msg, P.HelloOk):
            if self._link.answers_hello(msg.seq):  # any HELLO of ours answered (the daemon answers each)
                self._on_hello(msg)
            return
        if isinstance(msg, P.Error):
            if msg.code == P.ErrorCode.HELLO_REQUIRED.value:
                self._lost(f"the daemon does not know this client: {msg.message}")
                return
            if self._link.answers_hello(msg.seq):  # unauthorized, version_mismatch, too_many
                self._link.refuse(msg, time.monotonic())
                return
            if self._jobs.refused(msg):  # the daemon refused the job: it is over, nothing was written
                return
        engine = self._register_seqs.pop(msg.seq, None)
        if engine is not None and msg.seq not in self._wanted:
            if isinstance(msg, P.Error):
                log.error("kvoffd refused to re-register engine %s: %s", engine, msg.message)
            return
        if msg.seq in self._wanted:
            self._wanted.discard(msg.seq)
            self._replies[msg.seq] = msg

    # ------------------------------------------------------------------------------------------------
    # requests

    def send_request(self, msg: P.Message) -> int | None:
        """Send without waiting; returns the seq to collect the reply with, or None when not connected."""
        with self._lock:
            self._pump(0)
            if not self._link.ready:
                return None
            msg.seq = next(self._seq)
            if not self._link.send(msg):
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
        link = self._link
        with self._lock:
            if not link.ready and not self.connect(timeout):
                raise self._unreachable()
            # fast path: no full _pump per round trip (the heartbeat thread watches the link)
            msg.seq = seq = next(self._seq)
            if not link.send(msg):
                raise DaemonUnavailable(f"cannot send to kvoffd at {self.address}")
            self._wanted.add(seq)
            while True:
                reply = self._replies.pop(seq, None)
                if reply is not None:
                    return answer(reply)
                left = deadline - time.monotonic()
                if left <= 0 or not link.ready:
                    self._wanted.discard(seq)
                    if left > 0:
                        raise DaemonUnavailable(f"the link to kvoffd broke before it answered {msg.op.value}")
                    raise DaemonUnavailable(f"kvoffd did not answer {msg.op.value} within {timeout} s")
                frame = link.recv_slice()
                if frame is None:
                    self._pump(0)  # quiet for RECV_SLICE_MS: look at the link
                    continue
                try:
                    got = P.decode(frame)
                except P.ProtocolError as e:
                    log.warning("undecodable message from the daemon: %s", e)
                    continue
                if got.seq == seq and type(got) not in _UNSOLICITED:  # the answer: skip the general dispatch
                    self._wanted.discard(seq)
                    if isinstance(got, P.Error) and got.code == P.ErrorCode.HELLO_REQUIRED.value:
                        self._dispatch_msg(got)  # says HELLO again
                        raise DaemonUnavailable(f"kvoffd did not do the {msg.op.value}: it does not know "
                                                f"this connection ({got.message})")
                    return answer(got)
                self._dispatch_msg(got)

    # --- engine registration ------------------------------------------------------------------------

    def register(self, engine_id: str, namespace: str, rank: int, world_size: int, memory: LocalMemory | P.Memory,
                 layout: dict[str, Any], timeout_s: float | None = None, replicas: int = 1) -> P.Registered:
        """Register (and remember, to register again after a daemon restart). ``memory``: as
        ``kvoffd_client.memory`` shares it (the Struct and this process's descriptors), or a Struct
        that travels as it is."""
        local = memory if isinstance(memory, LocalMemory) else LocalMemory(memory)
        msg = P.Register(engine_id=engine_id, namespace=namespace, rank=rank, world_size=world_size,
                         memory=local.spec, layout=layout, replicas=replicas)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            self._registrations[engine_id] = (msg, local)
            if not self._link.ready and not self.connect(timeout):
                raise self._unreachable()
            reply = self.request(_wire_register(msg, local, self.hello, timeout), timeout_s)
        assert isinstance(reply, P.Registered)
        return reply

    def unregister(self, engine_id: str, timeout_s: float | None = None) -> None:
        with self._lock:
            self._registrations.pop(engine_id, None)
            if self._link.ready:
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
                if self._link.ready:
                    self._link.send(P.Release(seq=0, lease_id=lease_id))

    # --- jobs: kvoffd_client.jobs.ClientJobs ----------------------------------------------------------

    def submit_store(self, engine_id: str, job_id: int, keys: Sequence[bytes] | bytes,
                     block_ids: Sequence[int] | bytes, event: int = -1, tokens: bytes = b"",
                     parents: bytes = b"", cuts: Sequence[int] = (), events: Sequence[int] = ()) -> None:
        """``tokens``/``parents``: what KV events show of the blocks (P.Store); empty: nothing.
        ``cuts``/``events``: a store in parts, part p copied once event ``events[p]`` fired (P.Store;
        only where ``supports_parts``)."""
        self._jobs.submit(P.Store(engine_id=engine_id, job_id=job_id, keys=keys, block_ids=block_ids,
                                  ready_event=event, tokens=tokens, parents=parents, cuts=list(cuts),
                                  ready_events=list(events)))

    def submit_load(self, engine_id: str, job_id: int, keys: Sequence[bytes] | bytes,
                    block_ids: Sequence[int] | bytes, lease_id: int = 0, event: int = -1,
                    deadline_s: float | None = None, cuts: Sequence[int] = ()) -> None:
        """``deadline_s``: this job's own deadline, when shorter than ``job_deadline_s`` (a load the
        engine waits for within its step is not worth starting after the engine gave up on it).
        ``cuts``: a load in parts, announced as they land (``wait_landed``; only where ``supports_parts``)."""
        self._jobs.submit(P.Load(engine_id=engine_id, job_id=job_id, keys=keys, block_ids=block_ids,
                                 lease_id=lease_id, ready_event=event, cuts=list(cuts)), deadline_s)

    def wait_landed(self, job_ids: set[int], parts: int, timeout_s: float) -> set[int]:
        """Block (bounded) until every LOAD in ``job_ids`` has its first ``parts`` parts in place or
        has ended (its notice says how); returns those still short when ``timeout_s`` ran out."""
        return self._jobs.wait_landed(job_ids, parts, timeout_s)

    @property
    def supports_parts(self) -> bool:
        """Whether the daemon takes jobs in parts (its HELLO_OK lists ``parts``)."""
        hello = self.hello
        return hello is not None and "parts" in hello.capabilities

    def take_notices(self) -> list[P.Notice]:
        """Completion notices that arrived (real or synthesized for lost jobs). Never waits."""
        return self._jobs.take_notices()

    def wait_notices(self, job_ids: set[int], timeout_s: float) -> list[P.Notice]:
        """Block (bounded) until every job in ``job_ids`` has a notice; returns the ones received."""
        return self._jobs.wait_notices(job_ids, timeout_s)

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
            if self._link.closed:
                return
            self._link.close()
            self._daemons.close()

    def __enter__(self) -> KvoffdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _wire_register(reg: P.Register, memory: LocalMemory, hello: P.HelloOk | None, timeout_s: float) -> P.Register:
    """REGISTER as it travels. Memory that comes as this process's descriptors (``cpu_fd``,
    ``cuda_vmm``): hand them to the daemon's fd socket (``hello.fd_socket``) now (each REGISTER needs
    a fresh one-time token) and send the token."""
    if not memory.fds:
        return msgspec.structs.replace(reg)
    path = hello.fd_socket if hello is not None else ""
    if not path:
        raise KvoffdError(P.ErrorCode.MEMORY_UNREACHABLE.value, f"the daemon takes no {memory.spec.KIND} memory")
    try:
        wire = wire_memory(path, memory, timeout_s=max(min(timeout_s, 5.0), 0.5))
    except FdRefused as e:
        raise KvoffdError(e.code, f"the daemon refused the memory descriptor: {e.message}") from None
    except OSError as e:
        raise KvoffdError(P.ErrorCode.MEMORY_UNREACHABLE.value, f"cannot hand memory to {path}: {e}") from None
    return msgspec.structs.replace(reg, memory=wire)
