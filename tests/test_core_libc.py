"""kvoffd/libc.py is the daemon's one libc: every call declared there once, with its prototype.

A second ``ctypes.CDLL(None)`` elsewhere would declare its own prototypes again (and the function
objects of one handle are shared, so a second declaration on it changes the first's): the scan below
fails on one. The calls themselves are checked against the kernel: a memfd mapped and written
through ``libc.mmap``, and the errno of a call that fails.
"""

from __future__ import annotations

import ast
import ctypes
import errno
import mmap
import os
from pathlib import Path

from kvoffd import libc

KVOFFD = Path(__file__).resolve().parent.parent / "kvoffd"


def _loads_libc(node: ast.AST) -> bool:
    """``CDLL(None, ...)`` / ``ctypes.CDLL(None, ...)`` (or ``ctypes.cdll.LoadLibrary(None)``)."""
    if not isinstance(node, ast.Call) or not node.args:
        return False
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    first = node.args[0]
    return name in ("CDLL", "LoadLibrary") and isinstance(first, ast.Constant) and first.value is None


def test_only_kvoffd_libc_loads_libc():
    found = [f"{p.relative_to(KVOFFD.parent)}:{n.lineno}" for p in sorted(KVOFFD.rglob("*.py"))
             if p.name != "libc.py" for n in ast.walk(ast.parse(p.read_text())) if _loads_libc(n)]
    assert found == [], f"load libc through kvoffd/libc.py, not again in {found}"


def test_mmap_of_a_memfd_and_the_errno_of_a_failed_call():
    fd = os.memfd_create("kvoffd-test-libc")
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        addr = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, libc.MAP_FAILED)
        try:
            ctypes.memmove(addr, b"kvoffd", 6)
            assert os.pread(fd, 6, 0) == b"kvoffd"  # the mapping is the memfd's
        finally:
            assert libc.munmap(addr, mmap.PAGESIZE) == 0
        # an address that is not page-aligned: refused, and the errno says why
        assert libc.munmap(addr + 1, mmap.PAGESIZE) == -1 and libc.errno() == errno.EINVAL
    finally:
        os.close(fd)
