"""Issue 6, drill 1 at the vLLM level: SIGKILL the daemon with >= 100 loads in flight from a real engine.

Every request completes with the output of an engine without kvoffd, no request waits past the
client's link grace, and a restarted daemon gets the worker back (re-registered by the client's own
heartbeat, no engine step needed) within 1 s, after which loads hit again.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import Daemon, close_llm, drain, external_hits, generate, greedy, make_llm

pytestmark = pytest.mark.vllm

N = 120  # requests, one loadable block each


def _prompts() -> list[list[int]]:
    # 40 tokens: one full 32-token block is loadable (a hit never covers the last token); each prompt
    # starts differently, so vLLM's own prefix cache cannot serve one from another.
    return [[3 + (7 * i + j * 13) % 500 for j in range(40)] for i in range(N)]


def test_daemon_sigkilled_with_100_loads_in_flight(tiny_model: str, tmp_path: Path) -> None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    prompts = _prompts()
    plain = make_llm(tiny_model, max_num_seqs=128, kv_bytes=64 << 20)
    try:
        reference = generate(plain, prompts, max_tokens=4)
    finally:
        close_llm(plain)

    d = Daemon(tmp_path).start()
    llm = make_llm(tiny_model, d.address, max_num_seqs=128, kv_bytes=64 << 20,
                   extra={"kvoffd_max_prefetch": 128})
    try:
        assert generate(llm, prompts, max_tokens=4) == reference  # stores one block per prompt
        drain(llm)
        assert llm.reset_prefix_cache()
        worker = get_kv_transfer_group()._worker
        real_start = worker.start_load_kv
        frozen: dict[str, Any] = {}

        def freeze_then_load(meta: Any, **kw: Any) -> None:
            # Freeze the daemon before it reads this step's LOADs: they are all in flight at the kill.
            if len(meta.loads) >= 100 and d.proc is not None and not frozen:
                os.kill(d.proc.pid, signal.SIGSTOP)
                frozen["loads"] = len(meta.loads)
            real_start(meta, **kw)

        worker.start_load_kv = freeze_then_load
        engine = llm.llm_engine
        for i, p in enumerate(prompts):
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), greedy(4))
        time.sleep(1.0)  # the arrival-time lookups are answered meanwhile: all admitted in one step
        outputs: dict[str, list[int]] = {}
        killed_at = done_at = None
        t0 = time.monotonic()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
            if killed_at is None and frozen:
                in_flight = len(worker._loads)
                d.kill()
                killed_at = time.monotonic()
            if killed_at is not None and done_at is None and not worker._loads:
                done_at = time.monotonic()
            assert time.monotonic() - t0 < 60, "requests hang after the daemon died"
        worker.start_load_kv = real_start
        assert frozen.get("loads", 0) >= 100, f"only {frozen} loads were issued in one step"
        assert killed_at is not None and in_flight >= 100, f"{in_flight} loads in flight at the kill"
        assert done_at is not None and done_at - killed_at < 5.0
        assert [outputs[str(i)] for i in range(N)] == reference, "an output differs from the run without kvoffd"
        assert worker.stats.lifetime.get("load_failed_jobs", 0) >= 100
        drain(llm)

        t_up = time.monotonic()
        d.start()
        up = time.monotonic()
        while not d.stats()["engines"]:
            assert time.monotonic() - up < 5, "the worker did not re-register"
            time.sleep(0.01)
        resumed = time.monotonic() - up
        assert resumed < 1.0, f"offloading resumed {resumed:.2f} s after the daemon came up"
        # offloading works again without restarting vLLM
        assert generate(llm, prompts[:8], max_tokens=4) == reference[:8]
        drain(llm)
        assert llm.reset_prefix_cache()
        h0 = external_hits(llm)
        assert generate(llm, prompts[:8], max_tokens=4) == reference[:8]
        assert external_hits(llm) - h0 == 8 * 32
        print(f"\nFIGURES loads_in_flight={in_flight} all_failed_within_s={done_at - killed_at:.3f} "
              f"daemon_start_s={up - t_up:.3f} reregistered_after_s={resumed:.3f}")
    finally:
        close_llm(llm)
        d.stop()
