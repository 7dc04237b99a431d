"""Same-step loads layer by layer (issue 32): the forward waits for each layer's KV, not the whole prefix.

A same-step load (kvoffd_client.vllm.syncload) goes to the daemon as a LOAD in parts, cut at layer
boundaries (``LayerParts``: a block's pool slot is the KV tensors' runs back to back in the order
vLLM lists them, so each layer's bytes are one range of it). vLLM calls ``wait_for_layer_load`` at
the start of every attention layer; it waits (on the host) until the parts holding that layer have
landed (the daemon's LANDED, sent once its copy's event fired, so every kernel launched after it
sees the bytes), and the GPU keeps running the layers already launched. The copy of layer k+1 thus
overlaps the compute of layer k, and a hit costs about the load plus one layer.

Rules (``StepLayers``):

* the step's deadline (``sync_load_timeout_ms`` from the submit) bounds every wait; a load still
  short then is reported failed, so vLLM drops the step's token for its request and recomputes it:
  nothing sampled from half-loaded KV is kept. It stays in flight (its blocks stay the request's)
  until its notice, as any late same-step load.
* the forward must have waited for every part: a step whose layers did not call the hook (a full
  CUDA graph replays without Python hooks) reports its layer-wise loads failed, and the worker waits
  for whole loads from then on (logged once). The bytes are never assumed in place unasked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvoffd_client.client import KvoffdClient

if TYPE_CHECKING:
    import torch

#: Most parts a load is cut into: the last layer alone, the others in groups. Each part costs one
#: LANDED message and one host wait, and on a block-contiguous layout one run per block (the H200's
#: sweep, docs/benchmarks.md: groups of 4 of 32 layers beat single layers, whose 64 KiB runs slow the DMA).
DEFAULT_MAX_PARTS = 8


@dataclass(frozen=True)
class LayerParts:
    """Where a block's slot is cut so that each part holds whole layers, and what each layer needs."""

    cuts: tuple[int, ...]
    need: dict[str, int]  # layer name -> leading parts that must have landed before it computes

    @property
    def parts(self) -> int:
        return len(self.cuts) + 1

    def needed(self, layer_name: str) -> int:
        """Parts the layer needs: its own and those before it (every part for a name not known)."""
        return self.need.get(layer_name, self.parts)

    @classmethod
    def of(cls, kv_caches: dict[str, torch.Tensor], num_blocks: int, block_bytes: int,
           max_parts: int = DEFAULT_MAX_PARTS) -> LayerParts | None:
        """The parts for vLLM's per-layer KV views, or None when they cannot be told apart (one view,
        or per-layer bytes that do not add up to the registered slot: the worker loads whole blocks)."""
        spans: list[tuple[int, int]] = []  # per distinct view, in registration order: slot [start, end)
        index: dict[str, int] = {}
        seen: dict[tuple, int] = {}
        pos = 0
        for name, t in kv_caches.items():
            sig = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if sig not in seen:  # an aliased layer (one view, two names) is described once
                n = (t.shape[0] // max(1, num_blocks)) * t[0].numel() * t.element_size()
                seen[sig] = len(spans)
                spans.append((pos, pos + n))
                pos += n
            index[name] = seen[sig]
        if len(spans) < 2 or pos != block_bytes or max_parts < 2:
            return None
        # The last layer is a part of its own: what is computed after the last byte lands is one layer.
        # The others are grouped evenly: fewer, larger parts keep each DMA batch large (a block-contiguous
        # layout has one run per block and part), and each costs a LANDED and a host wait.
        k = min(max_parts, len(spans))
        body = len(spans) - 1
        first = [round(g * body / (k - 1)) for g in range(k - 1)] + [body]  # the first view of each part
        cuts = tuple(spans[i][0] for i in first[1:])
        part_of = [0] * len(spans)
        for g, i in enumerate(first):
            for j in range(i, first[g + 1] if g + 1 < k else len(spans)):
                part_of[j] = g
        return cls(cuts=cuts, need={name: part_of[i] + 1 for name, i in index.items()})


@dataclass
class StepLayers:
    """This step's layer-wise loads: the jobs, the deadline, and how far the forward has waited."""

    parts: LayerParts
    jobs: set[int] = field(default_factory=set)
    deadline: float = 0.0
    waited: int = 0  # leading parts the forward confirmed before computing on them
    #: How long the forward was held up (its host waits): what the step's loads cost it, the measure
    #: the same-step budget learns from (a load hidden behind compute costs nothing).
    blocked_s: float = 0.0

    def begin(self, jobs: set[int], timeout_s: float) -> None:
        self.jobs = set(jobs)
        self.deadline = time.monotonic() + timeout_s
        self.waited = 0
        self.blocked_s = 0.0

    @property
    def active(self) -> bool:
        return bool(self.jobs)

    def wait(self, client: KvoffdClient, layer_name: str) -> set[int]:
        """Wait until the parts ``layer_name`` needs landed; returns the jobs that ran out of time (dropped
        from the step: they no longer hold up later layers)."""
        need = self.parts.needed(layer_name)
        if not self.jobs or need <= self.waited:
            return set()
        t0 = time.perf_counter()
        short = client.wait_landed(self.jobs, need, max(0.0, self.deadline - time.monotonic()))
        self.blocked_s += time.perf_counter() - t0
        self.jobs -= short
        self.waited = max(self.waited, need)
        return short

    def end(self) -> tuple[set[int], bool]:
        """The step's forward is over: the jobs still to settle, and whether it waited for every part."""
        jobs, complete = self.jobs, self.waited >= self.parts.parts
        self.jobs = set()
        return jobs, complete

    def left_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


#: Parts a layer-wise store is cut into: each takes one event of the engine's ring (64 by default)
#: while its job is in flight, so a few per step; the copy of the first starts a quarter into the forward.
STORE_PARTS = 4


class StepSaves:
    """This step's store in parts (CUDA): as the forward finishes each part's layers
    (``save_kv_layer``), an event of the engine's ring is recorded on its stream, and the STORE names
    one event per part, so the daemon copies a part once its layers are written, while the later
    layers still compute. A part whose layers did not all report (a full CUDA graph runs no hooks)
    waits for the step's final event, as a whole store does. Recording never waits: with the ring
    full, the part waits for the final event instead."""

    def __init__(self, parts: LayerParts, store_parts: int = STORE_PARTS):
        k = max(1, min(store_parts, parts.parts))
        # every (parts/k)-th load cut: whole layer groups again
        idx = sorted({round(g * parts.parts / k) for g in range(1, k)})
        self.cuts = tuple(parts.cuts[i - 1] for i in idx)
        bounds = [0, *idx, parts.parts]
        group = {}
        for g in range(len(bounds) - 1):
            for p in range(bounds[g], bounds[g + 1]):
                group[p] = g
        self.part_of = {name: group[need - 1] for name, need in parts.need.items()}
        self.members = [0] * (len(self.cuts) + 1)
        for g in self.part_of.values():
            self.members[g] += 1
        self.seen = [0] * len(self.members)
        self.events = [-1] * len(self.members)
        self.job = 0  # the store job the events are for: events of another step are never used

    def begin(self, job: int = 0) -> None:
        self.seen = [0] * len(self.members)
        self.events = [-1] * len(self.members)
        self.job = job

    def saved(self, layer_name: str, ring: Any, job: int) -> None:
        """A layer's forward was launched in the step of store ``job``: record the part's event once
        its last layer was."""
        g = self.part_of.get(layer_name)
        if g is None:
            return
        if job != self.job:  # a step whose store was never sent: its events are given back
            self.drop(ring)
            self.begin(job)
        self.seen[g] += 1
        if self.seen[g] == self.members[g] and self.events[g] < 0 and g + 1 < len(self.members):
            self.events[g] = ring.try_record()

    def finish(self, ring: Any, job: int) -> tuple[tuple[int, ...], list[int], list[int]]:
        """After the forward: (cuts, the STORE's per-part events, every ring slot the job holds). No
        part recorded early for ``job``: no cuts, one event (a whole store)."""
        if job != self.job:
            self.drop(ring)
        final = ring.record()
        early = [e for e in self.events[:-1] if e >= 0]
        if not early:
            self.begin()
            return (), [final], [final]
        events = [e if e >= 0 else final for e in self.events[:-1]] + [final]
        self.begin()
        return self.cuts, events, [*early, final]

    def drop(self, ring: Any) -> None:
        """The step's store is not sent: give back the events recorded for it."""
        for e in self.events:
            ring.release(e)
        self.begin()
