"""kvoffd's vLLM KV connector. Use it with

    --kv-transfer-config '{"kv_connector":"KvoffdConnector","kv_connector_module_path":"kvoffd_client.vllm",
                           "kv_role":"kv_both","kv_load_failure_policy":"recompute",
                           "kv_connector_extra_config":{"kvoffd_address":"ipc:///run/kvoffd/kvoffd.sock"}}'

vLLM imports this module in its API-server process too, so importing it loads nothing beyond what
vLLM already has; the class (and vLLM's base class) is resolved on first attribute access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvoffd_client.vllm.connector import KvoffdConnector

__all__ = ["KvoffdConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvoffdConnector":
        from kvoffd_client.vllm.connector import KvoffdConnector

        return KvoffdConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
