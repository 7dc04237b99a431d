"""Which hits are loaded within their step (scheduler side): a byte budget per engine step.

An asynchronous load parks the request in WAITING_FOR_REMOTE_KVS until every worker has seen the
daemon's notice, so even a one-block hit costs the request at least one extra engine step (two
with async scheduling). Where the copy takes less time than that, it is cheaper to load it inside
the step that computes the rest of the prompt: the scheduler answers ``load_async=False``, vLLM
schedules the request at once, and the worker waits for the load before the forward (bounded by
``kvoffd_sync_load_timeout_ms``; past it, the blocks go through vLLM's load-error path and are
recomputed). The wait stalls the whole batch's step, so the bytes waited for per step are capped:

- ``kvoffd_sync_load_bytes`` > 0: that many bytes per rank and step; 0: never (every load async);
- -1 (the default): ``link speed x kvoffd_sync_step_ms``. The link speed is ``kvoffd_link_gbps``
  when set; otherwise it starts from a conservative prior for the device and follows what the
  same-step loads measure (bytes over submit-to-notice time, so the daemon's fixed latency counts:
  a budget whose loads take longer than the target shrinks, one whose loads take less grows).

Only single-group models qualify: vLLM takes block-level load errors (``invalid_block_ids``) only
with one KV-cache group, and request-level errors only for asynchronous loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffd_client.vllm.settings import Settings

#: Prior link speeds (bytes/s) before anything is measured: far below what the daemon's copies
#: reach (docs/benchmarks.md), so a first guess errs towards the asynchronous path.
PRIOR_RATE = {"cuda": 8e9, "cpu": 2e9}
#: After a same-step wait ran out, every load is asynchronous for this long: a daemon that stalls
#: once (frozen, swapping) would otherwise stall the next steps too.
COOLDOWN_S = 10.0
#: Weight of a new measurement in the moving average of the link speed.
EMA = 0.2


@dataclass
class SyncLoadBudget:
    block_bytes: int  # bytes one block occupies on one rank (what every rank copies per block)
    fixed_bytes: int  # the configured budget: > 0 bytes, 0 off, -1 derived
    step_s: float
    rate: float  # bytes per second
    measured: bool  # the rate follows measurements (no configured link speed)
    left: int = 0  # budget left in the step being scheduled
    cooldown_until: float = 0.0

    @classmethod
    def from_settings(cls, s: Settings, block_bytes: int, device: str, single_group: bool) -> SyncLoadBudget:
        fixed = s.sync_load_bytes if single_group and block_bytes > 0 else 0
        rate = s.link_gbps * 1e9 if s.link_gbps > 0 else PRIOR_RATE.get(device, PRIOR_RATE["cpu"])
        b = cls(block_bytes=block_bytes, fixed_bytes=fixed, step_s=max(s.sync_step_ms, 0.0) / 1000,
                rate=rate, measured=s.link_gbps <= 0)
        b.new_step()
        return b

    @property
    def enabled(self) -> bool:
        return self.fixed_bytes != 0

    def per_step(self) -> int:
        """Bytes per rank that the coming step may wait for."""
        if self.fixed_bytes >= 0:
            return self.fixed_bytes
        return int(self.rate * self.step_s)

    def new_step(self) -> None:
        """Called when a step's schedule is complete: the next answers draw on a fresh budget."""
        self.left = self.per_step()

    def take(self, n_blocks: int, now: float) -> bool:
        """Whether a hit of ``n_blocks`` is loaded within the step; if so, its bytes are spent.

        An answer vLLM then does not schedule (no room) keeps its bytes spent for this step: the
        budget errs towards fewer waits, never more."""
        if not self.enabled or n_blocks <= 0 or now < self.cooldown_until:
            return False
        need = n_blocks * self.block_bytes
        if need > self.left:
            return False
        self.left -= need
        return True

    def observe(self, nbytes: int, us: int, timeouts: int, now: float) -> None:
        """Fold in what the workers reported for one step (summed over ranks)."""
        if timeouts:
            self.cooldown_until = now + COOLDOWN_S
        if self.measured and nbytes > 0 and us > 0:
            self.rate = (1 - EMA) * self.rate + EMA * (nbytes / (us / 1e6))
