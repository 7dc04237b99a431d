"""Run fresh in-process vLLM engines in a new process; print one JSON line of results per engine.

Used by the cross-process test: ``python engine_child.py MODEL ADDRESS CONFIGS_JSON PROMPTS_JSON``,
where CONFIGS_JSON is a list of ``{"dtype": ..., "block_size": ..., "multiprocess": bool}`` (and optionally
``"model"``, overriding MODEL for that engine, and ``"one_by_one": true``, one prompt per generate call). A
multiprocess engine (EngineCore and worker in spawned processes, as ``vllm serve`` runs) checks that
the connector imports and pickles across processes; put it first (vLLM caches its env switches).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from vllm_engines import (  # noqa: E402
    close_llm,
    connector_of,
    drain,
    external_hits,
    generate_cached,
    make_llm,
    vllm_metric,
)

from kvoffd_client.vllm.stats import STAT_KEYS  # noqa: E402


def main() -> None:
    model, address, configs, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
    for cfg in configs:
        kw = dict(cfg)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if kw.pop("multiprocess", False) else "0"
        one_by_one = kw.pop("one_by_one", False)  # one prompt per generate call: every step's batch fixed
        llm = make_llm(kw.pop("model", model), address, **kw)
        try:
            if one_by_one:
                each = [generate_cached(llm, [p]) for p in prompts]
                outputs, cached = [o[0][0] for o in each], sum(o[1] for o in each)
            else:
                outputs, cached = generate_cached(llm, prompts)
            hits = external_hits(llm)
            refused = None
            loaded = vllm_metric(llm, "vllm:kvoffd_load_blocks")
            counters = {k: vllm_metric(llm, f"vllm:kvoffd_{k}") for k in STAT_KEYS}  # why, when hits fall short
            if hasattr(llm.llm_engine.engine_core, "engine_core"):  # in-process: step it ourselves
                drain(llm)
                refused = getattr(connector_of(llm), "refused", None)
        finally:
            close_llm(llm)
        print("RESULT " + json.dumps({"config": cfg, "outputs": outputs, "external_hits": hits,
                                      "refused": refused, "load_blocks": loaded, "kvoffd": counters,
                                      "cached_tokens": cached}), flush=True)


if __name__ == "__main__":
    main()
