"""The connector's settings: ``kv_connector_extra_config``'s ``kvoffd_*`` keys (docs/vllm.md lists
them), read once per process. Standard library only: nothing of vLLM is needed to read them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvoffd_client.vllm.logs import log


@dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config`` keys (docs/vllm.md lists them). Only the address is required."""

    address: str
    lease_ms: int = 30_000  # how long a lookup's hits stay pinned waiting for their LOAD
    lookup_timeout_ms: int = 500  # an unanswered lookup becomes a miss after this
    # An engine with nothing else to run waits up to this long (per step) for a lookup's reply rather
    # than run an empty step for it (kvoffd_client.vllm.sched_lookup); 0: never waits.
    lookup_wait_ms: float = 2.0
    job_timeout_s: float = 10.0  # the daemon never starts a LOAD/STORE (or its rest) later than this
    fence_timeout_s: float = 10.0  # a preemption fence still waiting logs an error this often
    connect_timeout_s: float = 0.5  # handshake wait at engine start (absent daemon: serve without)
    store_decode: bool = True  # also offload blocks filled by generated tokens, not only the prompt
    prefetch_lookups: bool = True  # send the lookup when the request arrives, not when it is scheduled
    max_prefetch: int = 64  # most arrival-time lookups (and so leases) outstanding at once
    known_ttl_s: float = 30.0  # a block the daemon confirmed holding is not re-sent for this long
    negative_ttl_s: float = 60.0  # keys whose load failed are misses this long (or until stored again)
    reset_clears_namespace: bool = False  # reset_prefix_cache(reset_connector=True) also empties the namespace
    kv_cache_layout: str | None = None  # ask vLLM for this KV layout (CUDA; ignored where unsupported)
    weights_version: str | None = None  # names the weights in the namespace: blocks of other weights never hit
    # Same-step loads (kvoffd_client.vllm.syncload): hits of at most this many bytes per rank and step
    # are loaded within the step that computes the rest of the prompt. -1: link speed x sync_step_ms.
    sync_load_bytes: int = -1  # 0: every load asynchronous (one extra engine step per hit)
    sync_step_ms: float = 2.0  # the step time a same-step load may add (for the derived budget)
    link_gbps: float = 0.0  # GB/s for the derived budget; 0: measured from same-step loads
    sync_load_timeout_ms: int = 200  # a same-step load not done by then is recomputed (vLLM's load-error path)
    # Same-step loads layer by layer (kvoffd_client.vllm.layerwise): the forward waits per layer group.
    layerwise: bool = True
    layer_parts: int = 8  # most parts a layer-wise load is cut into (the last layer alone, the rest grouped)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> Settings:
        extra = dict(extra or {})
        address = extra.get("kvoffd_address")
        if not address or not isinstance(address, str):
            raise ValueError(
                "KvoffdConnector needs kv_connector_extra_config.kvoffd_address, e.g. "
                '{"kvoffd_address": "ipc:///run/kvoffd/kvoffd.sock"}'
            )
        kw: dict[str, Any] = {}
        for f in cls.__dataclass_fields__.values():
            if f.name == "address":
                continue
            key = f"kvoffd_{f.name}"
            if key in extra:
                default = getattr(cls, f.name)
                v = extra[key]
                if isinstance(default, bool):
                    v = v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes", "on")
                elif isinstance(default, int):
                    v = int(v)
                elif isinstance(default, float):
                    v = float(v)
                kw[f.name] = v
        unknown = sorted(k for k in extra if k.startswith("kvoffd_") and k[7:] not in cls.__dataclass_fields__)
        if unknown:
            log.warning("kvoffd: ignoring unknown kv_connector_extra_config keys %s", unknown)
        return cls(address=address, **kw)
