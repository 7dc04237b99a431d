"""Whether the daemon process that took a job can still touch the engine's memory.

A job's blocks may be reused by the engine only once no copy of that job can still run. The daemon's
own notice says so; otherwise only the daemon process being *gone* does: a daemon that is slow,
swapping or frozen (SIGSTOP, cgroup freezer, ``docker pause``) resumes its copies when it thaws,
however late. So the client fails a job on its own only on proof of exit:

* a pidfd on the daemon's pid (HELLO_OK carries it) that reports the process exited. The pid is
  trusted only once it is shown to be the daemon: the process must hold the listening socket of the
  address this client connected to (its inode, from /proc/net/unix or /proc/net/tcp*, among the
  process's fds). That fails, and the pidfd is not used, when the daemon lives in another pid or
  network namespace, or runs as another user; then
* the connection dropping is the proof instead: a daemon closes its end of a client's connection
  only when its sockets close, i.e. when the process exits (every thread, copy threads included, has
  ended before the kernel closes a process's fds) or at the end of a clean shutdown, after its copy
  threads were joined.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
from collections.abc import Mapping
from typing import Protocol

from kvoffd_client import protocol as P

log = logging.getLogger("kvoffd_client")


def _listener_inodes(address: str) -> set[str]:
    """Inodes of the listening sockets serving ``address`` (ipc:// path or tcp://host:port)."""
    out: set[str] = set()
    try:
        if address.startswith("ipc://"):
            path = address[6:]
            with open("/proc/net/unix") as f:
                next(f, None)
                for line in f:
                    parts = line.split()
                    # Flags 00010000: __SO_ACCEPTCON, a listening socket
                    if len(parts) >= 8 and parts[7] == path and int(parts[3], 16) & 0x10000:
                        out.add(parts[6])
        elif address.startswith("tcp://"):
            port = int(address.rsplit(":", 1)[1])
            for name in ("/proc/net/tcp", "/proc/net/tcp6"):
                with contextlib.suppress(OSError), open(name) as f:
                    next(f, None)
                    for line in f:
                        parts = line.split()
                        if (len(parts) >= 10 and parts[3] == "0A"
                                and int(parts[1].rsplit(":", 1)[1], 16) == port):
                            out.add(parts[9])
    except (OSError, ValueError, IndexError):
        return set()
    return out


def _holds_socket(pid: int, inodes: set[str]) -> bool:
    want = {f"socket:[{i}]" for i in inodes}
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in want:
                    return True
    except OSError:
        pass
    return False


class DaemonProcess:
    """The daemon process one HELLO_OK named, as far as this process can observe it."""

    def __init__(self, daemon_id: str, pid: int, address: str):
        self.daemon_id = daemon_id
        self.pid = pid
        self._pidfd: int | None = None
        self._poll: select.poll | None = None
        self._exited = False
        self._open(address)

    def _open(self, address: str) -> None:
        if self.pid <= 0 or not hasattr(os, "pidfd_open"):
            return
        try:
            fd = os.pidfd_open(self.pid)
        except OSError:
            return  # no such process here (another pid namespace), or not allowed
        # Opened first, checked second: the pidfd pins one process, so a pid reused after the check
        # cannot be mistaken for the daemon.
        inodes = _listener_inodes(address)
        if not inodes or not _holds_socket(self.pid, inodes):
            os.close(fd)
            log.debug("pid %d does not hold the socket of %s: daemon exit is detected by the link instead",
                      self.pid, address)
            return
        self._pidfd = fd
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    @property
    def watched(self) -> bool:
        """Whether exit is observed directly (pidfd); else a dropped connection counts as exit."""
        return self._pidfd is not None

    def exited(self) -> bool:
        """True once the process has exited (never waits: one poll of the pidfd)."""
        if self._exited or self._poll is None:
            return self._exited
        if self._poll.poll(0):
            self._exited = True
            self.close()
        return self._exited

    def close(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None
            self._poll = None


class _HasDaemon(Protocol):
    daemon: DaemonProcess | None  # the daemon that took the job
    deadline: float  # time.monotonic() after which the daemon no longer starts it


#: a job still unanswered this long after its deadline is logged as overdue (it is never failed on
#: a timer: see DaemonWatch.lost_jobs)
EXPIRY_GRACE_S = 2.0
OVERDUE_LOG_EVERY_S = 10.0


class DaemonWatch:
    """The daemon processes that took a client's jobs: the one answering now, and the ones it replaced
    while jobs they took were still in flight. Says which jobs provably cannot be copied any more."""

    def __init__(self, address: str, link_grace_s: float):
        self.address = address
        self.link_grace_s = link_grace_s
        self.current: DaemonProcess | None = None
        self._replaced: list[DaemonProcess] = []  # a new daemon answered; these still have jobs
        self._next_overdue_check = 0.0
        self._overdue_logged = 0.0

    def met(self, daemon_id: str, pid: int, jobs: Mapping[int, _HasDaemon]) -> None:
        """A HELLO_OK: watch its daemon if it is new; keep watching the one it replaces while jobs it
        took are in flight (it may be frozen, not dead: the new one could only bind the address if the
        old socket file was removed)."""
        if self.current is not None and self.current.daemon_id == daemon_id:
            return
        old, self.current = self.current, DaemonProcess(daemon_id, pid, self.address)
        if old is not None:
            if any(j.daemon is old for j in jobs.values()):
                self._replaced.append(old)
            else:
                old.close()

    def gone(self, d: DaemonProcess | None, now: float, down_since: float | None) -> bool:
        """Proof that no copy of ``d`` can run any more (see the module docstring)."""
        if d is not None and d.exited():
            return True
        if d is not None and d.watched:
            return False  # the process exists: frozen or slow, it may still copy
        if d is not self.current:
            return True  # unwatched and replaced: its link went down before the new daemon answered
        return down_since is not None and now - down_since > self.link_grace_s

    def lost_jobs(self, jobs: Mapping[int, _HasDaemon], now: float, down_since: float | None
                  ) -> list[tuple[int, P.NoticeCode]]:
        """The jobs whose daemon is provably gone, with the code of their failed notice
        (``daemon_lost``: the current daemon; ``daemon_restarted``: one a new daemon replaced)."""
        out: list[tuple[int, P.NoticeCode]] = []
        if down_since is not None or self._replaced:
            for d in {id(j.daemon): j.daemon for j in jobs.values()}.values():
                if self.gone(d, now, down_since):
                    code = P.NoticeCode.DAEMON_LOST if d is self.current else P.NoticeCode.DAEMON_RESTARTED
                    out.extend((job_id, code) for job_id, j in jobs.items() if j.daemon is d)
            lost = {job_id for job_id, _ in out}
            for d in [d for d in self._replaced
                      if not any(j.daemon is d for job_id, j in jobs.items() if job_id not in lost)]:
                self._replaced.remove(d)
                d.close()
        return out

    def log_overdue(self, jobs: Mapping[int, _HasDaemon], now: float) -> None:
        """At most every OVERDUE_LOG_EVERY_S: the jobs unanswered EXPIRY_GRACE_S past their deadline
        on a daemon that still exists (their blocks stay reserved: a frozen daemon resumes copying)."""
        if not jobs or now < self._next_overdue_check:
            return
        self._next_overdue_check = now + 1.0
        late = [job for job in jobs.values() if job.deadline + EXPIRY_GRACE_S <= now]
        if late and now - self._overdue_logged >= OVERDUE_LOG_EVERY_S:
            self._overdue_logged = now
            d = late[0].daemon
            log.error("kvoffd: %d jobs unanswered %.1f s past their deadline, and daemon pid %s still "
                      "exists (frozen or stalled?): their blocks stay reserved until it answers or exits",
                      len(late), now - min(j.deadline for j in late), d.pid if d else "?")

    def close(self) -> None:
        for d in [self.current, *self._replaced]:
            if d is not None:
                d.close()
