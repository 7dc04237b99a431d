"""The STORE and LOAD jobs a ``KvoffdClient`` has in flight (``ClientJobs``, held by the client):
submitted with a deadline the daemon honours, ended only by the daemon's notice or, once the daemon
that took them is provably gone, by a failed notice made up here (kvoffd_client.liveness).

Threading: every method runs under the link's lock (the client's one lock); ``submit`` and the
notice takers take it themselves, the rest are called by the client with it held.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvoffd_client import protocol as P
from kvoffd_client.errors import DaemonUnavailable, KvoffdError
from kvoffd_client.link import Link
from kvoffd_client.liveness import DaemonProcess, DaemonWatch


@dataclass(slots=True)
class Job:
    n: int
    deadline: float  # when the daemon stops starting it (its expires_ns); past it + grace: overdue
    daemon: DaemonProcess | None  # the daemon that took it: only its notice or its exit ends the job
    landed: int = 0  # a LOAD in parts: how many of its leading parts are in place (LANDED)


def lost_job_notice(job_id: int, job: Job, code: str, message: str) -> P.Notice:
    """The failed NOTICE this client makes up for a job that will get none: every block failed."""
    return P.Notice(job_id=job_id, ok=False, failed=list(range(job.n)), code=code, message=message)


class ClientJobs:
    """Jobs in flight and the notices not yet taken. ``pump(timeout_ms)`` is the client's: it reads
    what arrived (handing notices to ``noticed``/``refused``) and reaps lost jobs (``reap``)."""

    def __init__(self, link: Link, daemons: DaemonWatch, pump: Callable[[int], None], job_deadline_s: float):
        self.job_deadline_s = job_deadline_s
        self._link = link
        self._lock = link.lock
        self._seq = link.seqs
        self._daemons = daemons  # which daemon took each job; is it gone
        self._pump = pump
        self.jobs: dict[int, Job] = {}
        self._notices: list[P.Notice] = []

    def __len__(self) -> int:
        return len(self.jobs)

    def met(self, daemon_id: str, pid: int) -> None:
        """HELLO_OK from ``daemon_id``: the jobs in flight are watched against it."""
        self._daemons.met(daemon_id, pid, self.jobs)

    def reap(self, now: float) -> None:
        """Fail the jobs whose daemon is provably gone; log those overdue on a daemon that exists."""
        for job_id, code in self._daemons.lost_jobs(self.jobs, now, self._link.down_since):
            self._notices.append(lost_job_notice(job_id, self.jobs.pop(job_id), code,
                                                 "the daemon that took the job is gone; nothing more is copied"))
        self._daemons.log_overdue(self.jobs, now)

    def noticed(self, msg: P.Notice) -> None:
        """The daemon's notice: the job is over (a notice for no job of ours is dropped)."""
        if self.jobs.pop(msg.job_id, None) is not None:
            self._notices.append(msg)

    def landed(self, msg: P.Landed) -> None:
        """LANDED: more of a LOAD in parts is in place (parts only ever grow; for no job of ours: dropped)."""
        job = self.jobs.get(msg.job_id)
        if job is not None and msg.parts > job.landed:
            job.landed = msg.parts

    def refused(self, msg: P.Error) -> bool:
        """An ERROR naming a job in flight: the daemon refused it, nothing was written; it is over."""
        job = self.jobs.pop(msg.job_id, None) if msg.job_id is not None else None
        if job is None:
            return False
        self._notices.append(lost_job_notice(msg.job_id, job, msg.code, msg.message))
        return True

    def submit(self, msg: P.Store | P.Load, deadline_s: float | None = None) -> None:
        with self._lock:
            self._pump(0)
            if not self._link.ready:
                raise DaemonUnavailable()
            if msg.job_id in self.jobs:
                raise KvoffdError(P.ErrorCode.DUPLICATE_JOB.value, f"job {msg.job_id} is already in flight")
            msg.seq = next(self._seq)
            now = time.monotonic()
            # The daemon will not start the job (or any further part of it) after job_deadline_s; the
            # job still ends only with its notice, or once that daemon is gone (see reap).
            deadline = now + min(self.job_deadline_s, self.job_deadline_s if deadline_s is None else deadline_s)
            msg.expires_ns = int(deadline * 1e9)
            if not self._link.send(msg):
                raise DaemonUnavailable("cannot send to kvoffd")
            self.jobs[msg.job_id] = Job(P.count_keys(msg.keys), deadline, self._daemons.current)

    def take_notices(self) -> list[P.Notice]:
        """Completion notices that arrived (real or synthesized for lost jobs). Never waits."""
        with self._lock:
            self._pump(0)
            out, self._notices = self._notices, []
            return out

    def wait_landed(self, job_ids: set[int], parts: int, timeout_s: float) -> set[int]:
        """Block (bounded) until every job in ``job_ids`` has ``parts`` leading parts in place or has
        ended (its notice, taken or not, says how); returns the jobs still short when the time ran out."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                self._pump(0)
                short = {j for j in job_ids if (job := self.jobs.get(j)) is not None and job.landed < parts}
                left = deadline - time.monotonic()
                if not short or left <= 0:
                    return short
                self._pump(int(min(left, 0.05) * 1000) + 1)

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
