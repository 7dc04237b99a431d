"""What a namespace's keys are to the outside world: whether each key is the engine's own block hash
(and in which form, so that KV events can show it), and the medium names a block is announced under.

It lives beside the index because the index, the warm restart's records and the tiers all carry it;
kvoffd/events/ turns it into vLLM's wire format and nothing here depends on that format.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvoffd_client.protocol import KvEventsLayout

#: ``medium`` of the blocks in the DRAM pool; a disk tier says MEDIUM_STORAGE. vLLM's own names
#: (``vllm.distributed.kv_events``), so a router keyed on them takes both.
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
#: ``medium`` of the blocks this node published to the cluster tier (--remote): any node on that cluster
#: can fetch them. vLLM has no name for a store shared over the network (its field is free text); the
#: events of this medium also say ``locality`` "REMOTE" (not on the publishing node), vLLM's own word.
MEDIUM_REMOTE = "REMOTE"


class HashForm(str, enum.Enum):
    """How the engines' vLLM shows a block hash in its events (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""

    INT64 = "int64"  # the default: the hash's low 64 bits as an integer
    BYTES = "bytes"  # the hash itself


@dataclass(frozen=True)
class EventIdentity:
    """What REGISTER's ``layout.kv_events`` says about a namespace's keys: that each key *is* the
    engine's block hash (so the daemon can show it), in which form, and a block's tokens."""

    hash_form: HashForm
    block_size: int
    group_idx: int = 0


def parse_identity(layout: KvEventsLayout | None) -> EventIdentity | None:
    """REGISTER's optional ``layout.kv_events`` (typed and checked by the decoder: ``KvEventsLayout``).
    Absent: this namespace's keys are not its block hashes, and the daemon publishes nothing for it."""
    if layout is None:
        return None
    return EventIdentity(HashForm(layout.hash), layout.block_size)
