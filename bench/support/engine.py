"""An engine's KV memory without torch, block contents that are a function of their key, and the
daemon's memory as /proc reports it: what the CPU benches and the reliability tests
(tests/support/reliability_util.py) share.

Engine memory here is a numpy view of a sealed memfd made the way the connector makes it
(``kvoffd_client.memory.cpu_fd.create_sealed_memfd``), so a process starts in well under a second and
fills and checks blocks at memory speed. Block contents are a pure function of the block's key
(:func:`block_content`): any process can check any block it loads without asking who stored it, and a
stale block (an old key's bytes in a reused slot) or a misplaced one (another key's bytes) never passes.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvoffd_client import protocol as P
from kvoffd_client.memory.cpu_fd import create_sealed_memfd
from kvoffd_client.memory.local import LocalMemory


def chain_keys(n: int, salt: bytes = b"", parent: bytes = b"root") -> list[bytes]:
    """Keys chained like vLLM's block hashes: each hashes its parent and its block's tokens."""
    keys, h = [], hashlib.sha256(parent).digest()
    for i in range(n):
        h = hashlib.sha256(h + salt + i.to_bytes(4, "little")).digest()
        keys.append(h)
    return keys


def proc_status(pid: int) -> dict[str, int]:
    """The kB fields of /proc/PID/status (VmRSS, RssAnon, RssShmem, ...)."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[name] = int(parts[0])
    return out


def rss_kb(pid: int) -> int:
    return proc_status(pid)["VmRSS"]


_POS_CACHE: dict[int, np.ndarray] = {}


def _positions(slot_bytes: int) -> np.ndarray:
    pos = _POS_CACHE.get(slot_bytes)
    if pos is None:
        i = np.arange(slot_bytes, dtype=np.uint64)
        pos = _POS_CACHE[slot_bytes] = ((i * 2654435761) >> 11).astype(np.uint8)
    return pos


def block_content(keys: Sequence[bytes], slot_bytes: int) -> np.ndarray:
    """(len(keys), slot_bytes) uint8: each key's bytes tiled, XOR a position pattern.

    Distinct per key and per position, so neither another key's block nor a shifted copy matches.
    """
    k = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), P.KEY_SIZE)
    tiled = np.tile(k, (1, slot_bytes // P.KEY_SIZE))
    return tiled ^ _positions(slot_bytes)[None, :]


class ShmEngine:
    """KV memory of one engine: ``layers`` per-layer regions of ``num_blocks`` blocks in one sealed memfd.

    Made the way the connector makes it (kvoffd_client.memory.cpu_fd.create_sealed_memfd); ``memory`` is the
    connector's form (with the descriptor): KvoffdClient.register and RawPeer hand the descriptor to the
    daemon's fd socket and send the token. A block occupies one run per layer (like vLLM's per-layer LBHNC
    views), so the daemon handles a multi-segment layout; its pool slot is the layers' runs back to back.
    """

    def __init__(self, num_blocks: int, slot_bytes: int, layers: int = 2, tag: str = "rel"):
        assert slot_bytes % (layers * P.KEY_SIZE) == 0
        self.num_blocks, self.slot_bytes, self.layers = num_blocks, slot_bytes, layers
        self.half = slot_bytes // layers
        self.size = num_blocks * slot_bytes
        self.tag = f"{tag[:40]}-{uuid.uuid4().hex[:8]}"  # the memfd's name: /memfd:kvoffd-<tag> in maps
        self.fd = create_sealed_memfd(self.size, self.tag)
        self._mm = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED)
        self.mem = np.frombuffer(self._mm, dtype=np.uint8).reshape(layers, num_blocks, self.half)

    @property
    def memory(self) -> LocalMemory:
        return LocalMemory(P.CpuFd(token="", size=self.size), [self.fd])

    @property
    def layout(self) -> dict[str, Any]:
        seg = [[layer * self.num_blocks * self.half, self.half, self.half] for layer in range(self.layers)]
        return {"num_blocks": self.num_blocks, "segments": seg, "desc": f"reliability {self.layers} layers"}

    def write(self, ids: Sequence[int], data: np.ndarray) -> None:
        self.mem[:, list(ids), :] = data.reshape(len(ids), self.layers, self.half).transpose(1, 0, 2)

    def read(self, ids: Sequence[int]) -> np.ndarray:
        return self.mem[:, list(ids), :].transpose(1, 0, 2).reshape(len(ids), self.slot_bytes)

    def fill(self, ids: Sequence[int], keys: Sequence[bytes]) -> None:
        self.write(ids, block_content(keys, self.slot_bytes))

    def poison(self, ids: Sequence[int], value: int = 0xA5) -> None:
        self.mem[:, list(ids), :] = value

    def matches(self, ids: Sequence[int], keys: Sequence[bytes]) -> np.ndarray:
        """Per block: whether it holds exactly ``keys[i]``'s content."""
        if not len(ids):
            return np.zeros(0, dtype=bool)
        return (self.read(ids) == block_content(keys, self.slot_bytes)).all(axis=1)

    def digest(self) -> str:
        return hashlib.sha256(self._mm).hexdigest()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
