"""vLLM's KV-event wire format, written without importing vLLM (the daemon does not depend on it).

The format is vLLM's (``vllm/distributed/kv_events.py``, 0.32 and 0.33): a batch is a msgpack array
``[ts, events]`` (vLLM's ``EventBatch`` is ``array_like``; its trailing ``data_parallel_rank`` is left
out, as msgspec's ``omit_defaults`` does for None), and each event is a map tagged by its class name
in ``"type"``. The fields vLLM declares without a default are always written, None or not: vLLM's
decoder refuses an event that lacks one. A test decodes these bytes with vLLM's own classes
(tests/vllm/test_kv_events.py), so a drift in vLLM's format shows there.

A ``BlockStored`` carries the block hashes; its token ids and parent only with
``--kv-events-token-ids`` (prompt content). Without them it has ``token_ids=[]`` and no parent, as
vLLM's own OffloadingConnector does for a block whose request it no longer knows.
"""

from __future__ import annotations

from typing import Union

import msgspec

from kvoffd.cache.identity import HashForm
from kvoffd_client.protocol import KEY_SIZE

#: ``locality``: the daemon publishes what its own node holds; the cluster tier's blocks
#: (``MEDIUM_REMOTE``) are held off the node, vLLM's "REMOTE relative to the publisher".
LOCALITY = "LOCAL"
LOCALITY_REMOTE = "REMOTE"
#: ``ownership`` ("secondary offloading tier identifier" in vLLM): tells kvoffd's events from vLLM's.
OWNERSHIP = "kvoffd"

ExternalHash = Union[int, bytes]  # noqa: UP007 - msgspec reads the annotation at runtime on 3.10


class _Event(msgspec.Struct, omit_defaults=True, tag=True, gc=False):
    pass


class BlockStored(_Event, tag="BlockStored"):
    block_hashes: list[ExternalHash]
    parent_block_hash: ExternalHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class BlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[ExternalHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]  # noqa: UP007


def external_hashes(keys: list[bytes], form: HashForm) -> list[ExternalHash]:
    """Keys as the engine's events show its block hashes (vLLM's ``maybe_convert_block_hash``)."""
    if form is HashForm.BYTES:
        return list(keys)
    return [int.from_bytes(k[KEY_SIZE - 8:], "big") for k in keys]
