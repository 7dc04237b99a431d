"""KV events for routers: what the pool holds, as vLLM's own KV-event stream (docs/vllm.md)."""
