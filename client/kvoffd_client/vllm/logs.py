"""The connector's logging: its own lines through vLLM's logger (``log``), and the client library's
routed there too (``route_client_logs``). Standard library only."""

from __future__ import annotations

import logging

# A child of vLLM's logger, so our lines use vLLM's handler, format and level.
log = logging.getLogger("vllm.kvoffd")


class _ThroughVllm(logging.Handler):
    """Hands a record to vLLM's logger, to whatever handlers it has when the record is made (vLLM
    may configure its logging again after this module is imported)."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def route_client_logs() -> None:
    """The client library (kvoffd_client.client: link down, back, "kvoffd restarted") logs to its
    own ``kvoffd_client`` logger, since it cannot import vLLM. Without a handler those lines came
    out bare, without vLLM's timestamp, level and process. Inside vLLM they go through vLLM's
    logger, at its level. Called by the connector's constructor: vLLM configures its logging in
    each process before it builds the connector (not at import). Nothing changes where vLLM
    leaves logging alone (VLLM_CONFIGURE_LOGGING=0: no handlers): the lines propagate to the root
    logger unchanged."""
    vllm_log = logging.getLogger("vllm")
    client = logging.getLogger("kvoffd_client")
    if not vllm_log.handlers or any(isinstance(h, _ThroughVllm) for h in client.handlers):
        return
    client.addHandler(_ThroughVllm())
    client.setLevel(vllm_log.getEffectiveLevel())
    client.propagate = False
