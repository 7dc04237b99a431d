"""How a worker's KV memory reaches the daemon (a mixin of ``KvoffdWorker``, over its state): shared
(a sealed memfd on CPU, a CUDA export on GPU), REGISTERed, and for vLLM's sleep mode unregistered
before the memory is freed and registered again after wake. A failure never takes the engine down:
the worker serves without offload."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvoffd_client.client import DaemonUnavailable, KvoffdError
from kvoffd_client.vllm.common import log
from kvoffd_client.vllm.events import kv_events_layout
from kvoffd_client.vllm.identity import CacheIdentity

if TYPE_CHECKING:
    import torch


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
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.client is None or self.identity is None or not kv_caches:
            return
        self._kv_caches = kv_caches  # restore_kv_caches registers them again after a sleep
        first = next(iter(kv_caches.values()))
        try:
            _log_group_coverage(kv_caches, self.identity, self.num_blocks)
            if first.device.type == "cpu":
                from kvoffd_client.memory.cpu_fd import share_cpu_kv_caches
                from kvoffd_client.memory.layout import describe_layout

                layout = describe_layout(kv_caches, self.num_blocks)
                self.memory = share_cpu_kv_caches(kv_caches, tag=self.engine_id, holders=self._layers())
            elif first.device.type == "cuda":
                from kvoffd_client.memory.cuda_ipc import export_kv_caches

                self._cuda = export_kv_caches(kv_caches, self.num_blocks)
                self.memory, layout = self._cuda.memory, self._cuda.layout
            else:
                raise ValueError(f"KV tensors on {first.device.type} are not supported")
        except Exception as e:  # never take the engine down: serve without offload
            log.error("kvoffd: cannot share this worker's KV cache (%s); offload disabled", e)
            self.refused = str(e)
            self._shutdown_client()
            return
        layout["desc"] = f"{self.identity.fields.get('layout')} {layout.get('desc', '')}"[:200]
        layout.update(kv_events_layout(self.identity))  # whether the daemon may publish KV events
        self._block_bytes = sum(int(seg[2]) for seg in layout.get("segments", ()))
        self._registered = True
        try:
            reg = self.client.register(self.engine_id, self.identity.namespace, self.rank,
                                       self.identity.world_size, self.memory, layout,
                                       timeout_s=self.s.connect_timeout_s if self.client.connected else 0.001,
                                       replicas=self.identity.replicas)
            r, k = self.rank, self.identity.replicas
            share = "" if k == 1 else (f"; stores one copy for ranks {r}-{r + k - 1}" if self.sends_stores
                                       else f"; loads rank {r - r % k}'s copy, stores nothing")
            log.info("kvoffd: worker %s registered in namespace %s (%d blocks, %d bytes per block, %s%s)",
                     self.engine_id, self.identity.namespace, self.num_blocks, reg.slot_bytes, reg.backend, share)
        except DaemonUnavailable:
            pass  # the client registers when the daemon appears (it replays registrations)
        except KvoffdError as e:
            log.error("kvoffd: the daemon refused this worker's registration (%s); offload disabled", e)
            self._shutdown_client()

    def _layers(self) -> list[Any]:
        """The attention layers vLLM bound the KV cache to: they may hold views of their own."""
        ctx = getattr(getattr(self.vllm_config, "compilation_config", None), "static_forward_context", None)
        return list((ctx or {}).values())

    # sleep mode (vLLM 0.33+: unregister_kv_caches before the KV memory is freed, restore after wake)

    def unregister_kv_caches(self) -> None:
        """Drain this worker's jobs, then UNREGISTER: the daemon answers once it has unmapped the
        memory, so vLLM may free it next. The exported descriptors (VMM) are closed so the memory is
        really given back. The cached blocks stay in the daemon."""
        client = self.client
        if client is None or not self._registered or self._cuda is None:
            return  # (CPU workers never sleep: vLLM's CPU worker ignores sleep, and its memfd stays)
        pending = set(self._stores) | set(self._loads)
        if pending:
            self._complete(client.wait_notices(pending, self.s.job_timeout_s))
        try:
            client.unregister(self.engine_id, timeout_s=self.s.job_timeout_s)
        except (DaemonUnavailable, KvoffdError) as e:
            log.warning("kvoffd: worker %s: unregister before sleep: %s", self.engine_id, e)
        self._registered = False
        if self._cuda is not None:
            self._cuda.close()
            self._cuda = None

    def restore_kv_caches(self) -> None:
        """After wake the KV tensors keep their addresses but are backed by new physical memory:
        export it again and register (a new mapping in the daemon)."""
        if self._kv_caches is not None and not self._registered and self.refused is None:
            self.register_kv_caches(self._kv_caches)

    def _shutdown_client(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        self._registered = False
