"""Facts about a process from /proc/PID/stat, read past the command name (which may hold spaces
and parentheses)."""

from __future__ import annotations

from kvoffd_client.protocol import start_ticks  # HELLO's identity field is defined there

__all__ = ["is_zombie", "start_ticks"]


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
