"""The one ``--kv-transfer-config`` that points vLLM at kvoffd: every recipe and doc is this.

``kv_load_failure_policy: "recompute"`` is part of it because vLLM's default, ``"fail"``, turns a load
the daemon could not serve (a restart, a deadline) into a failed request; with ``"recompute"`` vLLM
computes the blocks instead. ``kvoffctl vllm-config`` prints it for the daemon's own address, and
``tests/test_docs_recipes.py`` holds the deploy recipes and the docs to it. Importing this module
loads nothing but the standard library (the API-server process and kvoffctl use it).
"""

from __future__ import annotations

import json
import shlex
from typing import Any

#: Where vLLM finds the connector: the package, whose attribute resolves the class on first use.
MODULE_PATH = "kvoffd_client.vllm"


def kv_transfer_config(address: str, **extra: Any) -> dict[str, Any]:
    """vLLM's KVTransferConfig for a daemon at ``address``, with more ``kvoffd_*`` connector settings."""
    for k in extra:
        if not k.startswith("kvoffd_"):
            raise ValueError(f"connector settings start with kvoffd_ (docs/vllm.md): {k!r}")
    return {
        "kv_connector": "KvoffdConnector",
        "kv_connector_module_path": MODULE_PATH,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvoffd_address": address, **extra},
    }


def kv_transfer_config_json(address: str, **extra: Any) -> str:
    """The same as one line of JSON (the value of ``vllm serve --kv-transfer-config``)."""
    return json.dumps(kv_transfer_config(address, **extra), separators=(",", ":"))


def vllm_serve_argument(address: str, **extra: Any) -> str:
    """``--kv-transfer-config '<json>'``, quoted for a POSIX shell, to paste after ``vllm serve MODEL``."""
    return f"--kv-transfer-config {shlex.quote(kv_transfer_config_json(address, **extra))}"
