"""What every ``kvoffd doctor`` check is given and returns: the ``Context`` (what to check against,
and the GPU probe's findings once fetched: data only, it runs nothing) and one ``Result`` line with its
verdict word.

Kept free of the checks themselves so that the check modules (doctor_host, doctor_daemon,
doctor_gpu_checks, doctor_pool) and the GPU probe's child process (doctor_gpu) share it without
importing one another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"


@dataclass
class Result:
    name: str
    status: str
    detail: str
    fix: str = ""


@dataclass
class Context:
    pool_size: int
    pool_size_source: str
    address: str
    bandwidth_bytes: int
    ipc: bool
    gpu_timeout_s: float
    pool_path: str = ""  # "" : the daemon's default (kvoffd/pool/file.py)
    numa_map: str = "auto"  # the daemon's --numa-map (kvoffd/pool/topology.py)
    sysfs_root: str = "/sys"  # where the topology is read (the daemon's --sysfs-root)
    env_file: str = ""  # --env-file ("" none): the daemon's environment file
    sources: dict[str, str] = field(default_factory=dict)  # setting -> where it came from (doctor_settings)
    overruled: list[str] = field(default_factory=list)  # this shell's KVOFFD_* (and the like) not used, as text
    daemon: Any = None  # the running daemon's DaemonView (doctor_settings), None: none answered
    daemon_error: str | None = None  # why it did not answer ("" none to ask); None: not asked yet
    #: the GPU probe's findings once it ran (doctor_gpu_checks.gpu_findings runs it); None: not run
    gpu_probe: dict[str, Any] | None = None


def read_text(path: str) -> str:
    """A /proc or /sys file's text, stripped; "" when it cannot be read (the checks say "unknown")."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""
