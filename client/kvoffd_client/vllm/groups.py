"""KV-cache groups of a hybrid model (vLLM's hybrid memory allocator, HMA): which ones kvoffd can offload.

With HMA, vLLM splits a model's layers into KV-cache groups of one attention type each (a Gemma-3
model with 5 sliding-window layers per full-attention layer gets several sliding groups and one full
group; a Qwen3-Next model gets Mamba/linear-attention groups and a full-attention group). Every group
has its own block table, but the block pool and the page memory are shared: block id ``b`` is the same
page of the same tensors whichever group holds it.

What each kind needs for a prefix hit of ``n`` blocks:
  * full attention: the KV of all ``n`` blocks;
  * sliding window: only the blocks inside the window before the prefix end (vLLM keeps the others as
    the null block, id 0). kvoffd stores every block of the group (each is the window tail of some
    future prefix) and loads only the blocks vLLM allocated;
  * Mamba / linear attention: not KV per block but a running state per request. vLLM's own prefix
    caching keeps it only at aligned block boundaries it chose itself; restoring it from bytes stored
    under a block hash would need the state *after* exactly that block, which the engine does not
    promise to hold when the connector stores. kvoffd does not offload it, and since a hit that skips
    the tokens without restoring the state would be wrong, a model with such a group is not offloaded
    at all (the connector says so once and vLLM serves without it).

Keys: block ``i`` of group ``g`` is stored under ``group_key(key_i, g)``. A single-group model keeps the
plain block key, so its cache is unchanged by this module.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvoffd_client.protocol import KEY_SIZE

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

#: vLLM's null block: the placeholder in a sliding-window group's table for a block outside the window.
NULL_BLOCK_ID = 0


class GroupKind(enum.Enum):
    FULL = "full"
    SLIDING = "sliding"


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group as the connector sees it."""

    index: int
    kind: GroupKind
    window: int  # sliding window in tokens; 0 for full attention
    layer_names: tuple[str, ...]

    def describe(self) -> str:
        return f"{self.kind.value}:{self.window}:{len(self.layer_names)}"


class UnsupportedGroups(Exception):
    """A group kvoffd cannot offload correctly; the message says which and why."""


#: Specs whose blocks do not hold "the KV of these block_size tokens" (or that hold no KV at all).
_REFUSED = ("Mamba", "ChunkedLocal", "CrossAttention", "EncoderOnly", "CircularBuffer", "RSWA", "HiSparse",
            "Sink")


def kv_groups(kv_cache_config: KVCacheConfig) -> tuple[KVGroup, ...]:
    """Classify every KV-cache group; raise UnsupportedGroups when any cannot be offloaded correctly.

    A single group keeps the connector's old behaviour (any attention spec but the refused ones is
    offloaded block by block). With several groups only the specs whose block contents are known are
    accepted: plain full attention (and MLA) and plain sliding windows; anything else refuses the whole
    model, because offloading some groups while vLLM recomputes nothing for the others would be wrong.
    """
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    groups = list(kv_cache_config.kv_cache_groups)
    out: list[KVGroup] = []
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        name = type(spec).__name__
        n = len(g.layer_names)
        layers = tuple(g.layer_names)
        if any(r in name for r in _REFUSED):
            why = ("a Mamba / linear-attention state is a per-request running state, not KV per block; "
                   "kvoffd cannot restore it, and a hit that skipped those tokens would be wrong"
                   if "Mamba" in name else "its blocks do not hold plain per-token KV")
            raise UnsupportedGroups(f"KV-cache group {i} ({name}, {n} layers): {why}")
        if isinstance(spec, SlidingWindowSpec):
            if len(groups) > 1 and name != "SlidingWindowSpec":
                raise UnsupportedGroups(f"KV-cache group {i} ({name}) is not a plain sliding window")
            if int(getattr(spec, "extra_retained_tokens", 0) or 0):
                raise UnsupportedGroups(f"KV-cache group {i} is a sliding window that retains extra tokens "
                                        "(multi-token speculative decoding)")
            out.append(KVGroup(i, GroupKind.SLIDING, int(spec.sliding_window), layers))
        elif len(groups) == 1 or name in ("FullAttentionSpec", "MLAAttentionSpec"):
            out.append(KVGroup(i, GroupKind.FULL, 0, layers))
        else:
            raise UnsupportedGroups(f"KV-cache group {i} ({name}): kvoffd does not know how this spec lays "
                                    "tokens out in a block")
    if len({int(g.kv_cache_spec.block_size) for g in groups}) > 1:
        raise UnsupportedGroups("the KV-cache groups have different block sizes")
    return tuple(out)


def group_key(key: bytes, group: int) -> bytes:
    """The daemon key of one block of one group (a multi-group model; see the module docstring)."""
    return hashlib.blake2b(key + b"kvoffd-group" + group.to_bytes(2, "little"), digest_size=KEY_SIZE).digest()
