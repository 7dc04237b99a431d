"""What the worker tells the daemon so that it can publish KV events for this engine's blocks.

A KV-aware router indexes the block hashes vLLM shows in its KV events. The daemon only knows keys;
it can show a key as the engine's block hash exactly when the key *is* that hash: ``fold_key``
passes a 32-byte hash through (sha256, sha256_cbor: vLLM's default and its CBOR variant), and a
model with one KV-cache group keeps the plain key (several groups get ``group_key``, a one-way
hash). For those engines REGISTER's layout says so, once, with how this vLLM shows a hash
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``) and a block's tokens: no byte per block on the wire.
Any other engine says nothing, and the daemon publishes nothing for its namespace (docs/vllm.md,
"KV events for routers").
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any

from kvoffd_client.protocol import KEY_SIZE
from kvoffd_client.vllm.identity import CacheIdentity


def _hash_len(algo: str) -> int:
    try:
        from vllm.utils.hashing import get_hash_fn_by_name

        return len(get_hash_fn_by_name(algo)((b"kvoffd-probe", 0)))
    except Exception:  # an algorithm this vLLM lacks: the keys are not known to be the hashes
        return 0


def _int_hashes() -> bool:
    try:
        import vllm.envs as envs

        return bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    except Exception:
        return True  # vLLM's default


def kv_events_layout(identity: CacheIdentity) -> dict[str, Any]:
    """``{"kv_events": {...}}`` to merge into REGISTER's layout, or ``{}`` when keys are not hashes."""
    if identity.num_groups != 1 or _hash_len(str(identity.fields.get("hash_algo"))) != KEY_SIZE:
        return {}
    return {"kv_events": {"hash": "int64" if _int_hashes() else "bytes", "block_size": identity.block_size}}


#: STORE's ``parents`` entry of a block that starts its request (no parent).
NO_PARENT = bytes(KEY_SIZE)


def block_tokens(token_ids: Sequence[int], start: int, n: int) -> bytes:
    """A block's token ids as STORE's ``tokens`` carries them (little-endian uint32): what KV events show
    routers that index tokens (4 bytes a token, sent only to a daemon that publishes events)."""
    a = array("I", token_ids[start:start + n])
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()
