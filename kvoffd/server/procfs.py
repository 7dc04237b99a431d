"""Facts about a process from /proc/PID/stat, read past the command name (which may hold spaces
and parentheses)."""

from __future__ import annotations

import os

from kvoffd_client.protocol import start_ticks  # HELLO's identity field is defined there

__all__ = ["cpu_seconds", "is_zombie", "major_faults", "start_ticks"]


def _fields(pid: int) -> list[bytes] | None:
    """The fields after the command name: [0] is the state (field 3)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2:].split()
    return fields if len(fields) > 19 else None


def is_zombie(pid: int) -> bool:
    """Exited but not yet reaped by its parent: its memory is gone, though the pid still answers kill(0)."""
    fields = _fields(pid)
    return fields is not None and fields[0] in (b"Z", b"X")


def cpu_seconds(pid: int) -> float:
    """User plus system time the process has used (fields 14 and 15); 0 where unreadable."""
    fields = _fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else 0.0


def minor_faults(pid: int) -> int:
    """Page faults served without storage (field 10): first touches, write faults on a file mapping's
    clean pages; 0 where unreadable."""
    fields = _fields(pid)
    return int(fields[7]) if fields else 0


def major_faults(pid: int) -> int:
    """Page faults that had to read from storage (field 12); 0 where unreadable."""
    fields = _fields(pid)
    return int(fields[9]) if fields else 0
