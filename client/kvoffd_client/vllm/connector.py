"""KvoffdConnector: vLLM's KV-connector class for kvoffd. Role dispatch only.

vLLM builds this class twice: with role SCHEDULER in the EngineCore (lookups, planning:
kvoffd_client.vllm.scheduler) and with role WORKER in every worker (memory, jobs:
kvoffd_client.vllm.worker). Each instance builds only its own half.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvoffd_client.vllm.identity import UnsupportedConfig, cache_identity, worker_rank
from kvoffd_client.vllm.logs import log, route_client_logs
from kvoffd_client.vllm.metadata import KvoffdMetadata
from kvoffd_client.vllm.settings import Settings
from kvoffd_client.vllm.stats import KvoffdPromMetrics, KvoffdStats

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KvoffdConnector(KVConnectorBase_V1, SupportsHMA):
    """Offload vLLM's KV blocks to a kvoffd daemon shared by every engine on the host.

    A best-effort cache: misses, a dead daemon or a failed load only ever cost a recompute.
    ``SupportsHMA``: vLLM keeps its hybrid KV-cache manager on, so hybrid models start and sliding
    windows keep their memory; kvoffd offloads full-attention and sliding-window groups and refuses
    (serves without offload, one log line) models with a group it cannot restore, such as Mamba
    state (kvoffd_client.vllm.groups). A failed load is reported per request (``failed_recving``),
    never per block: vLLM refuses block-level load errors with more than one group.
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        route_client_logs()  # vLLM has configured its logging by now
        ktc = self._kv_transfer_config
        self.settings = Settings.from_extra(ktc.kv_connector_extra_config)
        if ktc.kv_load_failure_policy != "recompute":
            log.warning('kvoffd: kv_load_failure_policy is %r; with "fail" a daemon hiccup fails requests. '
                        'Set "kv_load_failure_policy":"recompute" in --kv-transfer-config.',
                        ktc.kv_load_failure_policy)
        #: Why this engine runs without offload (None: it offloads). Logged once, by the scheduler role.
        self.refused: str | None = None
        try:
            identity = cache_identity(vllm_config, kv_cache_config)
        except UnsupportedConfig as e:
            self.refused = str(e)
            if role == KVConnectorRole.SCHEDULER:
                log.error("kvoffd: %s", e)
            identity, self.refused = None, str(e)
        pc = vllm_config.parallel_config
        dp = int(getattr(pc, "data_parallel_rank", 0) or 0)
        base_id = f"{ktc.engine_id}-dp{dp}"
        self._scheduler = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from kvoffd_client.vllm.scheduler import KvoffdScheduler

            world = identity.world_size if identity else 1
            # What one rank copies per block: every KV tensor's share of one block.
            block_bytes = sum(int(t.size) for t in kv_cache_config.kv_cache_tensors) // max(1, kv_cache_config.num_blocks)
            device = str(getattr(vllm_config.device_config, "device_type", "cpu"))
            self._scheduler = KvoffdScheduler(self.settings, identity, world, base_id, block_bytes=block_bytes,
                                              device=device)
            if identity is not None:
                log.info("kvoffd: connector on %s, namespace %s (%s)", self.settings.address, identity.namespace,
                         ", ".join(f"{k}={v}" for k, v in identity.fields.items()))
        else:
            from kvoffd_client.vllm.worker import KvoffdWorker

            rank = worker_rank(vllm_config)
            self._worker = KvoffdWorker(self.settings, identity, f"{base_id}-r{rank}-p{os.getpid()}", rank,
                                        kv_cache_config.num_blocks, vllm_config)

    # ==============================================================================================
    # worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._worker is not None:
            self._worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, KvoffdMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, KvoffdMetadata):
            # A full CUDA graph replays without per-layer hooks: its same-step loads are waited for whole.
            mode = getattr(getattr(forward_context, "cudagraph_runtime_mode", None), "name", "")
            self._worker.start_load_kv(meta, hooks=mode != "FULL")

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before each attention layer: wait for the parts of this step's same-step loads that hold the
        layer (kvoffd_client.vllm.layerwise); nothing to wait for when the step has none."""
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """One STORE per step still (sent in ``wait_for_save``), but on CUDA cut in parts, each copied
        once its layers are written (an event per part, recorded here), behind the forward."""
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, KvoffdMetadata) and meta.store_job_id:
            self._worker.save_kv_layer(layer_name, meta.store_job_id)

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, KvoffdMetadata):
            self._worker.wait_for_save(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults(set(), set(), set())
        meta = self._connector_metadata
        return self._worker.get_transfer_results(meta if isinstance(meta, KvoffdMetadata) else None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of this step's same-step loads that failed or ran out of time: vLLM recomputes them."""
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def build_connector_worker_meta(self):  # -> KvoffdWorkerMeta | None
        return self._worker.build_worker_meta() if self._worker is not None else None

    # ==============================================================================================
    # scheduler side

    def on_new_request(self, request: Request) -> None:
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is None:
            return False, None
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """HMA's finish hook (one block list per KV-cache group); delays the free like request_finished."""
        if self._scheduler is None:
            return False, None
        return self._scheduler.request_finished(request, block_ids)

    def reset_cache(self) -> bool | None:
        return self._scheduler.reset_cache() if self._scheduler is not None else None

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache, not a hand-off: a store dropped by preemption is only a future miss."""
        return False

    # ==============================================================================================
    # both

    def get_kv_connector_stats(self) -> KvoffdStats | None:
        if self._scheduler is not None:
            return self._scheduler.get_kv_connector_stats()
        if self._worker is not None:
            return self._worker.get_stats()
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvoffdStats | None:
        return KvoffdStats(data=dict(data)) if data is not None else KvoffdStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvoffdPromMetrics:
        return KvoffdPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """vLLM 0.33+: sleep frees the KV memory after ``unregister_kv_caches`` (the daemon has unmapped
        it by then) and wake re-registers it in ``restore_kv_caches``; the cached blocks survive. Blocks
        are tied to the weights by ``kvoffd_weights_version`` (docs/vllm.md, sleep mode)."""
        return True

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33+, before sleep / ``discard(("kv_cache",))`` frees the KV memory."""
        if self._worker is not None:
            self._worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """vLLM 0.33+, after wake: the KV tensors are backed by new memory; register it again."""
        if self._worker is not None:
            self._worker.restore_kv_caches()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """None lets vLLM pick (LBHNC on CPU). ``kvoffd_kv_cache_layout`` may ask for e.g. BLNHC on CUDA."""
        ktc = vllm_config.kv_transfer_config
        extra = (ktc.kv_connector_extra_config if ktc is not None else None) or {}
        layout = extra.get("kvoffd_kv_cache_layout")
        return str(layout) if layout else None

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
