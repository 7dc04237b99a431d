"""REGISTER's memory as this process holds it (``LocalMemory``): the protocol Struct the daemon is
sent (``P.CpuFd``, ``P.CudaIpc`` or ``P.CudaVmm``) and, beside it, the descriptors only this process
has. The descriptors never travel in REGISTER: ``kvoffd_client.fdpass.wire_memory`` hands them to
the daemon's fd socket at each registration and puts the one-time token it answers into the Struct.

Standard library and msgspec only: imported in vLLM's processes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvoffd_client import protocol as P


@dataclass
class LocalMemory:
    """``spec``: the Struct, its ``token`` empty until it travels (each REGISTER gets a fresh one).
    ``fds``: the descriptors the token will name, in order (``cpu_fd``: the memfd; ``cuda_vmm``: one
    per piece; ``cuda_ipc``: none, the IPC handle is in the Struct)."""

    spec: P.Memory
    fds: list[int] = field(default_factory=list)

    @property
    def sizes(self) -> list[int]:
        """The size declared with each descriptor (the daemon checks each against the Struct)."""
        spec = self.spec
        if isinstance(spec, P.CudaVmm):
            return [p.size for p in spec.pieces]
        return [spec.size] * len(self.fds)

    def close(self) -> None:
        """Close this process's descriptors (the memory lives on while the tensors, or the daemon, map
        it; VMM pieces are given back only once these are closed)."""
        fds, self.fds = self.fds, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
