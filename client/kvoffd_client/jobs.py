"""The STORE and LOAD jobs a ``KvoffdClient`` has in flight (a mixin of it, over its lock, link and
state): submitted with a deadline the daemon honours, ended only by the daemon's notice or, once the
daemon that took them is provably gone, by a failed notice made up here (kvoffd_client.liveness)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvoffd_client import protocol as P
from kvoffd_client.errors import DaemonUnavailable, KvoffdError
from kvoffd_client.liveness import DaemonProcess


@dataclass(slots=True)
class Job:
    n: int
    deadline: float  # when the daemon stops starting it (its expires_ns); past it + grace: overdue
    daemon: DaemonProcess | None  # the daemon that took it: only its notice or its exit ends the job


def lost_job_notice(job_id: int, job: Job, code: str, message: str) -> P.Notice:
    """The failed NOTICE this client makes up for a job that will get none: every block failed."""
    return P.Notice(job_id=job_id, ok=False, failed=list(range(job.n)), code=code, message=message)


class JobQueue:
    def _reap_jobs(self, now: float) -> None:
        """Fail the jobs whose daemon is provably gone; log those overdue on a daemon that exists."""
        for job_id, code in self._daemons.lost_jobs(self._jobs, now, self._link.down_since):
            self._notices.append(lost_job_notice(job_id, self._jobs.pop(job_id), code,
                                                 "the daemon that took the job is gone; nothing more is copied"))
        self._daemons.log_overdue(self._jobs, now)

    def submit_store(self, engine_id: str, job_id: int, keys: Sequence[bytes] | bytes,
                     block_ids: Sequence[int] | bytes, event: int = -1, tokens: bytes = b"",
                     parents: bytes = b"") -> None:
        """``tokens``/``parents``: what KV events show of the blocks (P.Store); empty: nothing."""
        self._submit(P.Store(engine_id=engine_id, job_id=job_id, keys=keys, block_ids=block_ids, event=event,
                             tokens=tokens, parents=parents))

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
            if not self._link.ready:
                raise DaemonUnavailable()
            if msg.job_id in self._jobs:
                raise KvoffdError(P.ErrorCode.DUPLICATE_JOB.value, f"job {msg.job_id} is already in flight")
            msg.seq = next(self._seq)
            now = time.monotonic()
            # The daemon will not start the job (or any further part of it) after job_deadline_s; the
            # job still ends only with its notice, or once that daemon is gone (see _reap_jobs).
            deadline = now + min(self.job_deadline_s, self.job_deadline_s if deadline_s is None else deadline_s)
            msg.expires_ns = int(deadline * 1e9)
            if not self._link.send(msg):
                raise DaemonUnavailable("cannot send to kvoffd")
            self._jobs[msg.job_id] = Job(P.count_keys(msg.keys), deadline, self._daemons.current)

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
