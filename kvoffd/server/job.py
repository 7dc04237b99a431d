"""``Job``: one accepted STORE or LOAD, from its checks to its notice (kvoffd/server/jobs.py)."""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass

import numpy as np

from kvoffd.cache.keyspace import Entry, StorePlan
from kvoffd.server.sessions import Conn, Engine
from kvoffd.transfer.base import Direction
from kvoffd_client import protocol as P


@dataclass(eq=False)
class Job:
    """An accepted STORE or LOAD. Its ``entries`` hold a ref each until the job ends."""

    conn: Conn
    engine: Engine
    msg: P.Store | P.Load
    direction: Direction
    started: float  # monotonic: when it was accepted (in-flight age)
    entries: list[Entry]
    idx: list[int]  # the job's key indices being copied, one per entry
    block_ids: np.ndarray  # engine blocks being copied, one per entry
    slots: np.ndarray  # their pool slots (byte offsets)
    failed: list[int]  # indices reported failed whatever the copy does (dropped, refused, absent)
    code: str  # the notice code for ``failed`` when the copy succeeds
    future: Awaitable[None] | None  # the copy (None: a LOAD that checks its checksums first submits after)
    plan: StorePlan | None = None  # a STORE's plan, completed when the copy ends
    answered: bool = False  # its notice went out (``Jobs._notice``): a failure later sends no second one

    @property
    def job_id(self) -> int:
        return self.msg.job_id
