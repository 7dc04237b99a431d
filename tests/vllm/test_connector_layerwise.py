"""Same-step loads layer by layer (issue 32) on real vLLM engines (CPU build, tiny random models).

For the Llama-, Mistral- (every layer a sliding window) and Gemma-3-style (sliding + full layers:
several KV groups) models: greedy outputs with layer-wise loads on equal those without kvoffd, cold,
after ``reset_prefix_cache()`` (the hits come from the daemon, loaded within their step, the forward
waiting per layer), with layer-wise loads off (the same hits waited for whole) and in a new engine
process. Each run shows what the worker did: layer-wise jobs where the model has one KV group, none
where it has several (vLLM takes block-level load errors, which a same-step load needs, only with
one group; those loads stay asynchronous). Then a daemon frozen (SIGSTOP) once the forward has
waited for the first layer: whatever of the load is still out then (on this tiny model usually
nothing: its two layers land within microseconds) is waited for at most until the step's deadline,
the outputs are identical and nothing hangs. A daemon frozen before it sees the load, where the
first layer's wait itself runs out, is test_connector_sync_load.py's frozen-daemon test (layer-wise
by default).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import (
    ENGINE_CHILD,
    Daemon,
    ThawWatchdog,
    build_tiny_gemma3,
    build_tiny_llama,
    build_tiny_mistral,
    close_llm,
    drain,
    external_hits,
    generate,
    make_llm,
    shared_prefix_prompts,
)

pytestmark = pytest.mark.vllm

PROMPTS = shared_prefix_prompts(n=4, prefix=200)
SAME_STEP = {"kvoffd_sync_load_bytes": -1}  # the connector's default budget (make_llm's is 0: asynchronous)


@dataclass(frozen=True)
class Arch:
    build: Callable[[Path], Path]
    single_group: bool  # one KV-cache group: same-step (and so layer-wise) loads apply


ARCHS = {
    "llama": Arch(build_tiny_llama, True),
    "mistral": Arch(build_tiny_mistral, True),
    "gemma3": Arch(build_tiny_gemma3, False),
}


def _worker() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker


@dataclass
class Run:
    model: str
    reference: list[list[int]]
    cold: list[list[int]] = field(default_factory=list)
    loaded: dict[bool, list[list[int]]] = field(default_factory=dict)  # layerwise -> outputs after reset
    hits: dict[bool, float] = field(default_factory=dict)
    counters: dict[bool, dict[str, int]] = field(default_factory=dict)
    fresh: dict[str, Any] = field(default_factory=dict)


def _engine(run: Run, daemon: Any, layerwise: bool, cold: bool) -> None:
    llm = make_llm(run.model, daemon.address, extra={**SAME_STEP, "kvoffd_layerwise": layerwise})
    try:
        if cold:
            run.cold = generate(llm, PROMPTS)
            drain(llm)
        assert llm.reset_prefix_cache()
        h0 = external_hits(llm)
        w = _worker()
        before = dict(w.stats.lifetime)
        run.loaded[layerwise] = generate(llm, PROMPTS)
        drain(llm)
        run.hits[layerwise] = external_hits(llm) - h0
        run.counters[layerwise] = {k: w.stats.lifetime.get(k, 0) - before.get(k, 0) for k in
                                   ("sync_load_jobs", "layerwise_load_jobs", "layerwise_unwaited",
                                    "sync_load_timeouts", "load_failed_jobs")}
        assert not w._late and not (w.layers is not None and w.layers.active)
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, daemon: Any) -> dict[str, Run]:
    out: dict[str, Run] = {}
    for name, arch in ARCHS.items():
        model = str(arch.build(tmp_path_factory.mktemp(f"lw-{name}")))
        llm = make_llm(model)
        try:
            run = Run(model, generate(llm, PROMPTS))
        finally:
            close_llm(llm)
        _engine(run, daemon, layerwise=True, cold=True)
        _engine(run, daemon, layerwise=False, cold=False)
        out[name] = run
    cfgs = [{"model": r.model, "extra": {**SAME_STEP}} for r in out.values()]
    proc = subprocess.run([sys.executable, str(ENGINE_CHILD), "-", daemon.address, json.dumps(cfgs),
                           json.dumps(PROMPTS)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    fresh = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    for run, res in zip(out.values(), fresh, strict=True):
        run.fresh = res
    return out


@pytest.mark.parametrize("name", list(ARCHS))
def test_layerwise_on_and_off_give_the_same_tokens(name: str, runs: dict[str, Run]) -> None:
    arch, run = ARCHS[name], runs[name]
    on, off = run.counters[True], run.counters[False]
    print(f"{name}: hits on={run.hits[True]} off={run.hits[False]} counters on={on} off={off} "
          f"new process layerwise={run.fresh['kvoffd'].get('layerwise_load_jobs')}")
    assert run.cold == run.reference
    assert run.loaded[True] == run.reference
    assert run.loaded[False] == run.reference
    assert run.fresh["outputs"] == run.reference
    assert run.hits[True] > 0 and run.hits[False] > 0 and run.fresh["external_hits"] > 0
    for c in (on, off):
        assert c["sync_load_timeouts"] == 0 and c["load_failed_jobs"] == 0 and c["layerwise_unwaited"] == 0
    assert off["layerwise_load_jobs"] == 0
    if arch.single_group:
        # every same-step load of the layer-wise engine went by layers; the other waited for them whole
        assert on["sync_load_jobs"] > 0 and on["layerwise_load_jobs"] == on["sync_load_jobs"]
        assert off["sync_load_jobs"] > 0
        assert run.fresh["kvoffd"]["layerwise_load_jobs"] > 0
    else:
        assert on["sync_load_jobs"] == 0 and on["layerwise_load_jobs"] == 0
        assert run.fresh["kvoffd"]["layerwise_load_jobs"] == 0


def test_daemon_frozen_after_the_first_layer_recomputes(tiny_model: str, reference: list[list[int]],
                                                        tmp_path: Path) -> None:
    """SIGSTOP once the forward's first layer-wise wait has returned: the later layers' waits end at
    the step's deadline at the latest (the parts still out are recomputed through vLLM's load-error
    path), generate returns while the daemon is frozen, and every token is the reference's."""
    from engine_helpers import PROMPTS as SMALL

    d = Daemon(tmp_path).start()
    llm = make_llm(tiny_model, d.address, extra={**SAME_STEP, "kvoffd_sync_load_timeout_ms": 300,
                                                 "kvoffd_lookup_timeout_ms": 1000})
    frozen: list[int] = []
    try:
        assert generate(llm, SMALL) == reference
        drain(llm)
        worker = _worker()
        assert worker.layers is not None and worker.layers.parts.parts == 2  # the tiny Llama's 2 layers
        real_wait = worker.wait_for_layer_load
        waits: list[str] = []

        def wait_then_freeze(layer_name: str) -> None:
            real_wait(layer_name)
            if worker.layers is not None and worker.layers.active:
                waits.append(layer_name)
                if not frozen and d.proc is not None:
                    os.kill(d.proc.pid, signal.SIGSTOP)
                    frozen.append(d.proc.pid)

        worker.wait_for_layer_load = wait_then_freeze
        try:
            with ThawWatchdog(frozen) as watchdog:
                assert llm.reset_prefix_cache()
                out = generate(llm, SMALL)  # returns while the daemon is still frozen
                assert not watchdog.stop(), "generate waited for the frozen daemon (thawed after 60 s)"
        finally:
            worker.wait_for_layer_load = real_wait
            if frozen:
                os.kill(frozen[0], signal.SIGCONT)
        assert frozen and waits, "no layer-wise load was waited for"
        assert out == reference
        print(f"frozen after {len(waits)} layer waits; timeouts {worker.stats.lifetime.get('sync_load_timeouts', 0)}")
        drain(llm)
        assert not worker._late and worker.stats.lifetime.get("layerwise_unwaited", 0) == 0
    finally:
        close_llm(llm)
        d.stop()
