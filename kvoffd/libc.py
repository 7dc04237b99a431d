"""libc, loaded once: the C calls the daemon makes that Python's ``os`` and ``mmap`` modules do not offer.

Each call is declared here once, with its prototype, so that no two modules give one function two
prototypes (ctypes keeps one function object per library handle: a second declaration elsewhere
silently changes the first's). ``mmap``/``munmap``: a mapping at a fixed address, or of a descriptor
that no Python object keeps open; ``mlock``, ``madvise``, ``mincore``, ``statfs``,
``process_vm_readv``, and ``syscall`` (variadic: its arguments are passed as ctypes values). A call
that this libc lacks is None; its caller says what it does without it. ``errno()`` is the error of
the last of these calls on this thread.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from ctypes import c_int, c_long, c_size_t, c_ssize_t, c_ulong, c_void_p
from typing import Any


def _load() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIB = _load()


def _declare(name: str, restype: Any, argtypes: Sequence[Any] | None) -> Any | None:
    """libc's ``name`` with this prototype (``argtypes`` None: unchecked, as a variadic call needs),
    or None where this libc lacks it."""
    if _LIB is None:
        return None
    try:
        fn = _LIB[name]  # a function object of its own, never shared with another declaration
    except AttributeError:
        return None
    fn.restype = restype
    if argtypes is not None:
        fn.argtypes = list(argtypes)
    return fn


mmap = _declare("mmap", c_void_p, [c_void_p, c_size_t, c_int, c_int, c_int, c_long])
munmap = _declare("munmap", c_int, [c_void_p, c_size_t])
mlock = _declare("mlock", c_int, [c_void_p, c_size_t])
madvise = _declare("madvise", c_int, [c_void_p, c_size_t, c_int])
mincore = _declare("mincore", c_int, [c_void_p, c_size_t, c_void_p])
statfs = _declare("statfs", c_int, None)  # (path: bytes, struct statfs *)
process_vm_readv = _declare("process_vm_readv", c_ssize_t,
                            [c_int, c_void_p, c_ulong, c_void_p, c_ulong, c_ulong])
syscall = _declare("syscall", c_long, None)
#: MAP_FAILED, as ``mmap`` returns it (restype c_void_p: an int, or None for address 0)
MAP_FAILED = ctypes.c_void_p(-1).value


def errno() -> int:
    """The errno of this thread's last call above."""
    return ctypes.get_errno()
