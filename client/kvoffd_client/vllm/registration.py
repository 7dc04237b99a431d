"""How a worker's KV memory reaches the daemon (``KvRegistration``, held by ``KvoffdWorker``): shared
(a sealed memfd on CPU, a CUDA export on GPU), REGISTERed, and for vLLM's sleep mode unregistered
before the memory is freed and registered again after wake. A failure never takes the engine down:
the worker serves without offload."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvoffd_client import protocol as P
from kvoffd_client.client import DaemonUnavailable, KvoffdClient, KvoffdError
from kvoffd_client.memory.local import LocalMemory
from kvoffd_client.vllm.events import kv_events_layout
from kvoffd_client.vllm.identity import CacheIdentity
from kvoffd_client.vllm.logs import log
from kvoffd_client.vllm.settings import Settings

if TYPE_CHECKING:
    import torch

    from kvoffd_client.memory.cuda_ipc import CudaExport


def _log_group_coverage(kv_caches: dict[str, torch.Tensor], identity: CacheIdentity, num_blocks: int) -> None:
    """With several KV-cache groups, one layout (block ``b``'s page in every KV tensor) serves them all.

    vLLM's HMA shares one block pool among the groups and lays each group's layers over the same pages
    (tensor ``j`` holds the ``j``-th layer of every group), so block ``b`` belongs to one group at a time
    and a page no layer of the owning group uses is unused while it owns ``b``. Storing or loading that
    page moves bytes nobody reads: correct, only wasteful. Groups with fewer layers than the others
    (52 sliding + 10 full layers in groups of 10, say) store that waste; say so once.
    """
    if identity.num_groups < 2:
        return
    from kvoffd_client.memory.layout import describe_layout

    def nbytes(tensors: dict[str, torch.Tensor]) -> int:
        return sum(length for _, _, length in describe_layout(tensors, num_blocks)["segments"]) if tensors else 0

    whole = nbytes(kv_caches)
    short = {g.index: nbytes({n: kv_caches[n] for n in g.layer_names if n in kv_caches}) for g in identity.groups}
    short = {i: n for i, n in short.items() if n < whole}
    if short:
        log.info("kvoffd: KV-cache groups %s use fewer bytes per block than the %d stored per block (%s); "
                 "the rest of their blocks' pages is stored unused", sorted(short), whole,
                 ", ".join(f"group {i}: {n}" for i, n in sorted(short.items())))


class KvRegistration:
    """One worker's KV memory as the daemon knows it: shared once (``memory``; ``cuda`` on GPUs, with
    the event ring the worker records into), REGISTERed through the worker's client, unregistered for
    sleep and registered again after wake. ``refused``: why nothing could be shared (then never again)."""

    def __init__(self, settings: Settings, identity: CacheIdentity, engine_id: str, rank: int, num_blocks: int,
                 *, sends_stores: bool, vllm_config: Any = None):
        self.s = settings
        self.identity = identity
        self.engine_id = engine_id
        self.rank = rank
        self.num_blocks = num_blocks
        self.sends_stores = sends_stores
        self.vllm_config = vllm_config
        self.refused: str | None = None
        self.memory: LocalMemory | None = None
        self.cuda: CudaExport | None = None
        self.kv_caches: dict[str, torch.Tensor] | None = None  # registered again after a sleep
        self.registered = False  # REGISTER was sent (or is remembered by the client for replay on connect)
        self.block_bytes = 0  # bytes this rank copies per block (measures same-step loads)

    def register(self, client: KvoffdClient, kv_caches: dict[str, torch.Tensor]) -> bool:
        """Share and REGISTER ``kv_caches``. False: offload is off for this worker (the memory could not
        be shared, or the daemon refused it): the worker closes its client."""
        self.kv_caches = kv_caches
        try:
            layout = self._share(kv_caches)
        except Exception as e:  # never take the engine down: serve without offload
            log.error("kvoffd: cannot share this worker's KV cache (%s); offload disabled", e)
            self.refused = str(e)
            return False
        assert self.memory is not None
        identity = self.identity
        layout["desc"] = f"{identity.fields.get('layout')} {layout.get('desc', '')}"[:200]
        layout.update(kv_events_layout(identity))  # whether the daemon may publish KV events
        self.block_bytes = sum(int(seg[2]) for seg in layout.get("segments", ()))
        self.registered = True
        try:
            reg = client.register(self.engine_id, identity.namespace, self.rank, identity.world_size, self.memory,
                                  layout, timeout_s=self.s.connect_timeout_s if client.connected else 0.001,
                                  replicas=identity.replicas)
            r, k = self.rank, identity.replicas
            share = "" if k == 1 else (f"; stores one copy for ranks {r}-{r + k - 1}" if self.sends_stores
                                       else f"; loads rank {r - r % k}'s copy, stores nothing")
            log.info("kvoffd: worker %s registered in namespace %s (%d blocks, %d bytes per block, %s%s)",
                     self.engine_id, identity.namespace, self.num_blocks, reg.slot_bytes, reg.backend, share)
        except DaemonUnavailable:
            pass  # the client registers when the daemon appears (it replays registrations)
        except KvoffdError as e:
            log.error("kvoffd: the daemon refused this worker's registration (%s); offload disabled", e)
            return False
        return True

    def _share(self, kv_caches: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Share the KV memory (``memory``, and ``cuda`` on GPUs); returns REGISTER's layout."""
        first = next(iter(kv_caches.values()))
        _log_group_coverage(kv_caches, self.identity, self.num_blocks)
        if first.device.type == "cpu":
            from kvoffd_client.memory.cpu_fd import share_cpu_kv_caches
            from kvoffd_client.memory.layout import describe_layout

            layout = describe_layout(kv_caches, self.num_blocks)
            self.memory = share_cpu_kv_caches(kv_caches, tag=self.engine_id, holders=self._layers())
            return layout
        if first.device.type == "cuda":
            from kvoffd_client.memory.cuda_ipc import export_kv_caches

            self.cuda = export_kv_caches(kv_caches, self.num_blocks)
            self.memory = self.cuda.memory
            return self.cuda.layout
        raise ValueError(f"KV tensors on {first.device.type} are not supported")

    def _layers(self) -> list[Any]:
        """The attention layers vLLM bound the KV cache to: they may hold views of their own."""
        ctx = getattr(getattr(self.vllm_config, "compilation_config", None), "static_forward_context", None)
        return list((ctx or {}).values())

    # sleep mode (vLLM 0.33+: unregister_kv_caches before the KV memory is freed, restore after wake)

    @property
    def sleeps(self) -> bool:
        """Whether the memory is to be unregistered before a sleep. (CPU workers never sleep: vLLM's
        CPU worker ignores sleep, and its memfd stays.)"""
        return self.registered and self.cuda is not None

    def unregister(self, client: KvoffdClient) -> None:
        """UNREGISTER (the worker drained its jobs first): the daemon answers once it has unmapped the
        memory, so vLLM may free it next. The exported descriptors (VMM) are closed so the memory is
        really given back. The cached blocks stay in the daemon."""
        try:
            client.unregister(self.engine_id, timeout_s=self.s.job_timeout_s)
        except (DaemonUnavailable, KvoffdError) as e:
            log.warning("kvoffd: worker %s: unregister before sleep: %s", self.engine_id, e)
        self.registered = False
        if self.cuda is not None:
            self.cuda.close()
            self.cuda = None

    def to_restore(self) -> dict[str, torch.Tensor] | None:
        """After wake: the KV tensors to export again and register (a new mapping in the daemon), if any."""
        if self.kv_caches is not None and not self.registered and self.refused is None:
            return self.kv_caches
        return None

    def release(self) -> None:
        """At shutdown: close this process's descriptors of the memory (it lives on while mapped)."""
        if self.memory is not None and isinstance(self.memory.spec, P.CpuFd):
            self.memory.close()
            self.memory = None
