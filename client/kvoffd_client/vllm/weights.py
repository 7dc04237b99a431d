"""Which weights the engine computes KV with: a cheap fingerprint of the checkpoint on disk.

vLLM's block hashes cover tokens, never weights, and kvoffd's cache outlives the engine: an engine
restarted on new weights written to the same path (a redeploy to ``/models/current``, a fine-tuned
checkpoint copied over the old one) must not find the old weights' KV. So the namespace digests the
checkpoint itself, without reading it (a 140 GB checkpoint must cost well under a second):

- a file the Hugging Face hub cache keeps as a link to ``blobs/<content hash>`` is named by that
  hash (the hub's own content address), with its size: a snapshot costs a stat per file;
- any other weight file by its name, its size and samples of its bytes: for safetensors the whole
  header (every tensor's name, dtype, shape and offsets) and 64 bytes from inside every tensor, at
  an offset drawn from the tensor's name; for every format 16 pages spread over the file.

Rewriting every tensor in place (same names, same sizes) changes the samples; so does any change of
a tensor's shape, dtype or position. A change confined to bytes no sample reads (a few elements of
one tensor) is not seen: that is the cost of not reading the checkpoint, and ``kvoffd_weights_version``
names weights exactly where that matters. Metadata that a copy of the same bytes changes (mtime,
inode, path of a hub snapshot) is left out, so the same checkpoint on another disk, node or pod
keeps its cache warm.

The engine loads its weights before the connector is built, and a file could change in between.
A weight file (other than a hub blob) whose status changed after the engine began loading
(``st_ctime`` later than ``loaded_after``) was rewritten while the engine was loading or running: the
bytes it computes with are not provably the ones sampled, so the engine is refused offload
(``WeightsChanged``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: Files vLLM's loaders read weights from (``load_format`` auto, pt, safetensors, gguf, mistral,
#: bitsandbytes, sharded_state, tensorizer, npcache), searched at the top of the model directory.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".tensors", ".npy", ".msgpack")
#: Index files name which shards hold which tensors; a renamed or regrouped shard changes them.
INDEX_SUFFIXES = (".safetensors.index.json", ".bin.index.json")

SAMPLE_BYTES = 64  # read from inside every safetensors tensor
PAGES_PER_FILE = 16  # spread over every weight file, whatever its format
PAGE_BYTES = 4096
MAX_HEADER_BYTES = 100 << 20  # safetensors caps its header at 100 MB
_HUB_BLOB = re.compile(r"^[0-9a-f]{40}([0-9a-f]{24})?$")


class WeightsUnknown(Exception):
    """The checkpoint cannot be fingerprinted (not on a local file system): name it explicitly."""


class WeightsChanged(Exception):
    """A weight file changed after this engine started: what it loaded is not what is on disk."""


@dataclass(frozen=True)
class WeightsFingerprint:
    """The digest of a checkpoint and what it was taken from (for the log line and the docs)."""

    digest: str
    files: int
    bytes_on_disk: int
    sampled_bytes: int
    seconds: float


def fingerprint_checkpoint(path: str | os.PathLike[str], *, loaded_after: float | None = None) -> WeightsFingerprint:
    """Fingerprint the weight files at ``path`` (a model directory or a single weight file).

    ``loaded_after`` (epoch seconds): a time before the engine began loading its weights. A file
    that is not content-addressed and changed after it raises ``WeightsChanged``; None skips the check.
    """
    t0 = time.perf_counter()
    root = Path(path)
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(p for p in root.iterdir() if _is_weight_file(p.name) and p.is_file())
    else:
        raise WeightsUnknown(f"{path} is not a local file or directory")
    if not any(not p.name.endswith(INDEX_SUFFIXES) for p in files):
        raise WeightsUnknown(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {path}")
    h = hashlib.sha256(b"kvoffd-weights-1")
    total = sampled = 0
    for p in files:
        st = p.stat()
        total += st.st_size
        h.update(f"{p.name}\0{st.st_size}\0".encode())
        blob = _hub_blob_name(p)
        if blob is not None:  # the hub names a blob by its content: it cannot change under the name
            h.update(b"blob\0" + blob.encode())
            continue
        if loaded_after is not None and st.st_ctime > loaded_after:
            raise WeightsChanged(
                f"{p} changed {st.st_ctime - loaded_after:.1f} s after this engine started, so the weights "
                "it loaded may not be the ones on disk now. Restart the engine once the checkpoint is "
                "complete, or name the weights with kvoffd_weights_version")
        with open(p, "rb", buffering=0) as f:
            parts = _samples(f.fileno(), p.name, st.st_size)
        for part in parts:
            h.update(len(part).to_bytes(4, "little"))
            h.update(part)
            sampled += len(part)
    return WeightsFingerprint(h.hexdigest()[:32], len(files), total, sampled, time.perf_counter() - t0)


def _is_weight_file(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES) or name.endswith(INDEX_SUFFIXES)


def _hub_blob_name(p: Path) -> str | None:
    """The content hash a hub-cache snapshot file links to (``../../blobs/<sha>``), else None."""
    if not p.is_symlink():
        return None
    target = Path(os.readlink(p))
    if target.parent.name == "blobs" and _HUB_BLOB.match(target.name):
        return target.name
    return None


def _samples(fd: int, name: str, size: int) -> list[bytes]:
    """The bytes that stand for one file: header and per-tensor samples (safetensors), spread pages."""
    parts: list[bytes] = []
    reads: list[tuple[int, int]] = []  # (offset, length)
    if name.endswith(".safetensors") and size >= 8:
        header_len = struct.unpack("<Q", os.pread(fd, 8, 0))[0]
        if 0 < header_len <= min(MAX_HEADER_BYTES, size - 8):
            header = os.pread(fd, header_len, 8)
            parts.append(header)
            reads.extend((off, SAMPLE_BYTES) for off in _tensor_sample_offsets(header, 8 + header_len, size))
    if size > 0:
        step = max(1, size // PAGES_PER_FILE)
        reads.extend((min(i * step, max(0, size - PAGE_BYTES)), PAGE_BYTES) for i in range(PAGES_PER_FILE))
    parts.extend(os.pread(fd, length, off) for off, length in reads)
    return parts


def _tensor_sample_offsets(header: bytes, data_start: int, size: int) -> list[int]:
    """One offset inside every tensor's bytes, drawn from its name (so a re-save keeps them)."""
    try:
        meta: dict[str, Any] = json.loads(header)
    except (ValueError, UnicodeDecodeError):
        return []
    out = []
    for tname, info in sorted(meta.items()):
        if tname == "__metadata__" or not isinstance(info, dict):
            continue
        begin, end = (info.get("data_offsets") or (0, 0))[:2]
        if not (isinstance(begin, int) and isinstance(end, int)) or end <= begin:
            continue
        span = end - begin
        draw = int.from_bytes(hashlib.blake2b(tname.encode(), digest_size=8).digest(), "little")
        off = data_start + begin + (draw % max(1, span - SAMPLE_BYTES) if span > SAMPLE_BYTES else 0)
        if off < size:
            out.append(off)
    return out


def process_start_time() -> float:
    """When this process started, in epoch seconds, never later than the truth (Linux /proc).

    /proc/stat's btime is whole seconds (rounded down), so the estimate may be up to a second early:
    a file changed in the engine's first second counts as changed after the start (a false refusal,
    never a missed change). Without /proc: now, so no file on disk is judged changed.
    """
    try:
        with open("/proc/self/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/stat", "rb") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()
