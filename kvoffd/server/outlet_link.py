"""The daemon's end of its KV-event outlet (kvoffd/server/outlet.py): it starts the outlet process, hands
it each numbered batch, reads its reports, and starts another when it dies.

Everything here but ``start`` (the daemon's bind, before serving) and ``close`` (after the publisher
thread has stopped) runs on the publisher thread (kvoffd/events/publisher.py), so a stuck or dying
outlet can delay only that thread: the loop never waits for it, and batches the thread cannot hand
over are dropped and counted as they always were (``kvoffd_kv_events_dropped_total``).

The outlet dies with the daemon: its end of the socketpair reads EOF when the daemon's closes, however
the daemon ends (SIGKILL included), and then it exits.
"""

from __future__ import annotations

import logging
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from kvoffd.events.channel import (
    CONTROL,
    Bound,
    BrokenChannel,
    Failed,
    FrameReader,
    Report,
    Setup,
    batch_frame,
    control_frame,
    decode_control,
)
from kvoffd.events.publisher import PUB_HWM, REPLAY_BATCHES, Endpoints

if TYPE_CHECKING:
    from kvoffd.config import Config
    from kvoffd.metrics import Metrics

log = logging.getLogger("kvoffd.events.outlet")

START_TIMEOUT_S = 30.0  # the outlet's interpreter start and bind (about 0.3 s)
WRITE_TIMEOUT_S = 5.0  # an outlet that takes no batch for this long is stuck: it is replaced
STOP_TIMEOUT_S = 5.0
RESTART_MIN_S = 0.5  # the first restart's delay, doubled at each failure in a row, up to:
RESTART_MAX_S = 30.0
STABLE_S = 60.0  # an outlet that lived this long resets the delay


class OutletLink:
    """What the publisher sends through (``EventSink``, kvoffd/events/publisher.py)."""

    def __init__(self, endpoints: Endpoints, *, curve_dir: str = "", log_level: str = "info",
                 replay_batches: int = REPLAY_BATCHES, pub_hwm: int = PUB_HWM, metrics: Metrics | None = None):
        self.endpoints = endpoints
        self.curve_dir = curve_dir
        self.bound = Endpoints("", "", endpoints.topic)
        self.curve_public_key = ""
        self.report: Report | None = None
        self.restarts = 0
        self.sent = 0  # batches the current outlet took (its Report's ``batches`` catches up with it)
        self._log_level = log_level
        self._replay_batches = replay_batches
        self._pub_hwm = pub_hwm
        self._metrics = metrics
        self._proc: subprocess.Popen | None = None
        self._chan: socket.socket | None = None
        self._reader: FrameReader | None = None
        self._started_at = 0.0
        self._retry_at = 0.0
        self._delay = RESTART_MIN_S
        self._counted: dict[str, int] = {}  # the current outlet's totals already added to the metrics

    # --- life ---------------------------------------------------------------------------------------
    def start(self) -> Endpoints:
        """Start the outlet and bind its endpoints; OSError naming them if it cannot."""
        self._spawn(self.endpoints)
        return self.bound

    def close(self) -> None:
        """The outlet sends what it holds, closes its sockets (and socket files) and exits."""
        if self._chan is not None:
            self._chan.close()
            self._chan = None
        if self._proc is not None:
            try:
                self._proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None else 0

    def describe(self) -> dict[str, Any]:
        rep = self.report
        return {"outlet_pid": self.pid, "outlet_restarts": self.restarts, "batches_sent": self.sent,
                "auth": "curve" if self.curve_dir else ("ipc" if self.bound.publish.startswith("ipc://") else "none"),
                "curve_dir": self.curve_dir, "curve_public_key": self.curve_public_key,
                "connections": dict(rep.connections) if rep else {},
                "outlet": msgspec.structs.asdict(rep) if rep else {}}

    # --- the publisher thread -------------------------------------------------------------------------
    def send(self, seq: int, payload: bytes) -> bool:
        """Hand the outlet one batch. False: it could not (no outlet now, or it just died)."""
        if self._chan is None and not self._restart():
            return False
        try:
            _send_all(self._chan, batch_frame(seq, payload), WRITE_TIMEOUT_S)
        except (OSError, TimeoutError) as e:
            self._lost(f"a batch could not be handed over ({e})")
            return False
        self.sent += 1
        return True

    def poll(self) -> None:
        """Take the outlet's reports; notice its death; start another when it is time."""
        if self._chan is None:
            self._restart()
            return
        try:
            frames = self._reader.read()
        except BrokenChannel as e:
            self._lost(str(e))
            return
        for kind, body in frames:
            if kind == CONTROL:
                msg = decode_control(body)
                if isinstance(msg, Report):
                    self._take(msg)

    def _take(self, rep: Report) -> None:
        self.report = rep
        m = self._metrics
        if m is None:
            return
        for name in ("publish", "replay"):
            m.kv_events_connections.labels(name).set(rep.connections.get(name, 0))
        for key, counter in (("refused", m.kv_events_refused), ("denied", m.kv_events_denied),
                             ("replays_dropped", m.kv_events_replays_dropped)):
            now = getattr(rep, key)
            counter.inc(max(0, now - self._counted.get(key, 0)))
            self._counted[key] = now

    # --- the process ----------------------------------------------------------------------------------
    def _spawn(self, endpoints: Endpoints) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = subprocess.Popen([sys.executable, "-m", "kvoffd.server.outlet", str(child.fileno())],
                                    pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        except OSError:
            parent.close()
            raise
        finally:
            child.close()
        parent.setblocking(False)
        reader = FrameReader(parent)
        setup = Setup(endpoints.publish, endpoints.replay, endpoints.topic, self.curve_dir, self._replay_batches,
                      self._pub_hwm, self._log_level)
        try:
            _send_all(parent, control_frame(setup), START_TIMEOUT_S)
            reply = _wait_reply(parent, reader, proc)
        except (OSError, TimeoutError, BrokenChannel) as e:
            reply = Failed(f"the KV-event outlet did not start ({e}; exit {proc.poll()})")
        if not isinstance(reply, Bound):
            parent.close()
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            raise OSError(f"cannot bind the KV-event sockets ({endpoints.publish}, {endpoints.replay}): "
                          f"{reply.message}")
        self._proc, self._chan, self._reader = proc, parent, reader
        self.bound = Endpoints(reply.publish, reply.replay, endpoints.topic)
        self.curve_public_key = reply.curve_public_key
        self._started_at = time.monotonic()
        self._counted = {}
        self.sent = 0

    def _lost(self, why: str) -> None:
        """The outlet died or broke its channel: stop it for sure, and start another later."""
        proc, self._proc = self._proc, None
        if self._chan is not None:
            self._chan.close()
            self._chan = None
        code = None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            code = proc.wait()
        now = time.monotonic()
        if now - self._started_at >= STABLE_S:
            self._delay = RESTART_MIN_S
        self._retry_at = now + self._delay
        log.error("KV events: the outlet (pid %s) is gone (%s; exit %s); another starts in %.1f s on %s and %s; "
                  "subscribers see a gap in seq and replay", proc.pid if proc else "?", why, code, self._delay,
                  self.bound.publish, self.bound.replay)
        self._delay = min(RESTART_MAX_S, self._delay * 2)
        self.report = None

    def _restart(self) -> bool:
        if time.monotonic() < self._retry_at:
            return False
        try:
            self._spawn(self.bound)  # the same endpoints (and ports) subscribers know
        except OSError as e:
            self._retry_at = time.monotonic() + self._delay
            log.error("KV events: the outlet could not be started again (%s); next try in %.1f s", e, self._delay)
            self._delay = min(RESTART_MAX_S, self._delay * 2)
            return False
        self.restarts += 1
        if self._metrics is not None:
            self._metrics.kv_events_outlet_restarts.inc()
        log.warning("KV events: a new outlet (pid %d) serves %s and %s", self.pid, self.bound.publish,
                    self.bound.replay)
        return True


def _send_all(sock: socket.socket, data: bytes, timeout_s: float) -> None:
    view = memoryview(data)
    deadline = time.monotonic() + timeout_s
    while view:
        try:
            n = sock.send(view)
        except (BlockingIOError, InterruptedError):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [sock], [], left)[1]:
                raise TimeoutError(f"the outlet took nothing for {timeout_s:.0f} s") from None
            continue
        view = view[n:]


def _wait_reply(sock: socket.socket, reader: FrameReader, proc: subprocess.Popen) -> Bound | Failed:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        for kind, body in reader.read():
            msg = decode_control(body) if kind == CONTROL else None
            if isinstance(msg, (Bound, Failed)):
                return msg
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no answer within {START_TIMEOUT_S:.0f} s")
        select.select([sock], [], [], min(left, 0.5))
        if proc.poll() is not None and not select.select([sock], [], [], 0)[0]:
            raise BrokenChannel("it exited")


def outlet_for(cfg: Config, metrics: Metrics) -> Callable[[Endpoints], OutletLink]:
    """How the daemon's publisher gets its outlet: CURVE on a tcp:// stream unless ``--kv-events-auth
    none`` (an ipc:// stream's access is its private directory's)."""
    curve = cfg.kv_events_curve_dir if cfg.kv_events_address.startswith("tcp://") and cfg.kv_events_auth == "curve" \
        else ""
    return lambda endpoints: OutletLink(endpoints, curve_dir=curve, log_level=cfg.log_level, metrics=metrics)
