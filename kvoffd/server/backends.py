"""Which transfer backends a daemon runs (``--backend``), and which serves each kind of engine memory."""

from __future__ import annotations

from kvoffd.config import Config
from kvoffd.pool.allocator import Pool
from kvoffd.transfer.base import TransferBackend
from kvoffd.transfer.cpu import CpuBackend


def make_backends(cfg: Config, pool: Pool) -> list[TransferBackend]:
    """The backends ``--backend`` asks for: CUDA first when it loads and sees a device (``auto``), then
    the CPU one; ``--backend cuda`` without either is an error (RuntimeError), never a silent CPU."""
    backends: list[TransferBackend] = []
    if cfg.backend in ("auto", "cuda"):
        try:
            from kvoffd.transfer.cuda import CudaBackend, cuda_available
        except ImportError as e:
            if cfg.backend == "cuda":
                raise RuntimeError(f"--backend cuda: the CUDA backend cannot load ({e})") from None
        else:
            if cuda_available():
                backends.append(CudaBackend(pool))
            elif cfg.backend == "cuda":
                raise RuntimeError("--backend cuda: no CUDA device is visible")
    if cfg.backend in ("auto", "cpu"):
        backends.append(CpuBackend(pool, cfg.copy_threads))
    return backends


def by_kind(backends: list[TransferBackend]) -> dict[str, TransferBackend]:
    """Memory kind (``cpu_fd``, ``cuda_ipc``, ...) -> the first backend that takes it."""
    out: dict[str, TransferBackend] = {}
    for b in backends:
        for k in b.kinds():
            out.setdefault(k, b)
    return out
