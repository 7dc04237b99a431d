"""STORE and LOAD in parts: a job's blocks copied a group of layers at a time, in order.

Why: a prefix hit is worth most when the engine's first layers can run while later ones are still
on their way (issue 32). The engine cuts a block's slot at layer boundaries (``cuts``); the daemon
queues part 0 of every block, then part 1, ... (one backend submit per part, so one DMA batch per
part, never per block), and tells the engine as each part of a LOAD lands (LANDED) so that it waits
for one layer group at a time. A STORE in parts gates part p on the engine's event ``ready_events[p]``
(the forward wrote those layers), so its copy runs behind the forward instead of after it.

The rules of a whole job hold for the whole job: its NOTICE goes out only once every part it queued
is done (a part that failed fails the job, but the notice waits for the parts still moving: the
engine may reuse the blocks once told), the deadline is checked where each part starts, and a STORE
commits nothing until every part landed (the job's notice and commit are the caller's, as for any job).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import numpy as np

from kvoffd.transfer.base import Direction, MappedMemory, Runs, TransferBackend, first_failure
from kvoffd_client import protocol as P


def check_parts(msg: P.Store | P.Load, mapped: MappedMemory) -> list[Runs] | None:
    """The parts a job asks for (None: a whole job), or ValueError saying why they are not valid
    for this engine's blocks: cuts that do not cut its slot, or a STORE's ``ready_events`` that are
    not one per part in its event ring."""
    events = getattr(msg, "ready_events", None) or []
    if not msg.cuts:
        if events:
            raise ValueError("ready_events without cuts: a job in parts names its cuts")
        return None
    parts = mapped.parts(msg.cuts)
    if events:
        if len(events) != len(parts):
            raise ValueError(f"{len(events)} ready_events for {len(parts)} parts")
        if max(events) >= mapped.num_events:
            raise ValueError(f"ready_events name event {max(events)}, outside this engine's ring of "
                             f"{mapped.num_events}")
    return parts


def submit_parts(backend: TransferBackend, direction: Direction, mapped: MappedMemory, block_ids: np.ndarray,
                 slots: np.ndarray, msg: P.Store | P.Load, parts: list[Runs],
                 landed: Callable[[int], None] | None = None) -> Awaitable[None]:
    """Queue every part now, in order, and return what completes once all are done (raising the
    first failure, an expiry last). ``landed(n)``: parts 0..n-1 are in place (a LOAD's LANDED); not
    called for the last part, whose news is the job's notice."""
    events = list(getattr(msg, "ready_events", None) or []) or [msg.ready_event] * len(parts)
    futures = backend.submit_parts(direction, mapped, block_ids, slots, parts, events, msg.expires_ns)
    return asyncio.ensure_future(_in_order(futures, landed, len(parts)))


async def _in_order(futures: list[Awaitable[None]], landed: Callable[[int], None] | None, total: int) -> None:
    errors: list[BaseException] = []
    for p, fut in enumerate(futures):
        try:
            await fut
        except Exception as e:  # noqa: BLE001 - kept; raised once every part is done
            errors.append(e)
            continue
        if not errors and landed is not None and p + 1 < total:
            landed(p + 1)
    if errors:
        raise first_failure(errors)

