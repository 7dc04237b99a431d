"""systemd readiness and watchdog notifications without libsystemd.

The shipped unit (deploy/systemd/kvoffd.service) is ``Type=notify``: systemd holds ``systemctl start``
and every unit ordered ``After=kvoffd`` until the daemon says ``READY=1``. Without it, vLLM units
started right after kvoffd would race the socket bind. The protocol is one datagram of
newline-separated ``KEY=VALUE`` lines to the UNIX socket named by ``$NOTIFY_SOCKET`` (a path, or an
abstract name written with a leading ``@``), so a few lines of ``socket`` replace a dependency.

Everything here is best effort and never raises: outside systemd (a container, a terminal, tests)
``NOTIFY_SOCKET`` is unset and every call is a cheap no-op returning False.

What the daemon sends, and when:

* ``ready(status)`` once the ROUTER socket is bound and the HTTP listener is up (engines can connect,
  ``/healthz`` answers). The pool need not be pinned yet: pinning progresses behind readiness. The
  status is what ``systemctl status kvoffd`` prints on its "Status:" line.
* ``stopping(text)`` as soon as SIGTERM/SIGINT is handled, before draining in-flight jobs.
* ``watchdog()`` every ``watchdog_interval()`` seconds from the event loop itself, when the unit sets
  ``WatchdogSec=``; a stalled loop then stops pinging and systemd restarts the daemon.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def _socket_address() -> str | None:
    addr = os.environ.get("NOTIFY_SOCKET", "")
    if addr.startswith("@"):  # abstract namespace
        return "\0" + addr[1:]
    if addr.startswith("/"):
        return addr
    return None  # unset, or a transport we do not speak (vsock:...)


def notify(state: str) -> bool:
    """Send one notification (``"READY=1\\nSTATUS=..."``). True when it was handed to systemd."""
    addr = _socket_address()
    if addr is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            # Never block the event loop: if systemd's queue is full the message is dropped, which only
            # delays a status line (READY is sent once, early, when the queue is empty).
            s.setblocking(False)
            s.connect(addr)
            s.sendall(state.encode("utf-8", "replace"))
        return True
    except OSError as e:
        log.debug("sd_notify %r failed: %s", state.split("\n", 1)[0], e)
        return False


def _one_line(text: str) -> str:
    return " ".join(text.split())


def ready(status: str = "") -> bool:
    """The daemon accepts engines. Also reports the main pid, which ``NotifyAccess=main`` checks."""
    msg = f"READY=1\nMAINPID={os.getpid()}"
    if status:
        msg += f"\nSTATUS={_one_line(status)}"
    return notify(msg)


def stopping(text: str = "") -> bool:
    msg = "STOPPING=1"
    if text:
        msg += f"\nSTATUS={_one_line(text)}"
    return notify(msg)


def watchdog() -> bool:
    return notify("WATCHDOG=1")


def watchdog_interval() -> float | None:
    """Seconds between ``watchdog()`` pings, or None when the unit has no ``WatchdogSec=``.

    systemd sets ``WATCHDOG_USEC`` (and ``WATCHDOG_PID``, which must be us); pinging at half the
    timeout leaves room for one late tick.
    """
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None
    return int(usec) / 2e6
