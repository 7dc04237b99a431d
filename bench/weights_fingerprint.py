"""What the weights fingerprint costs at engine start (kvoffd_client.vllm.weights, issue 27).

Two synthetic checkpoints in safetensors format, Llama-70B-like (80 layers, 9 tensors each, spread
over the shards), fingerprinted cold (every file's pages dropped from the page cache first with
posix_fadvise, so each sample is a real read) and warm:

- ``sparse``: SHARDS files of SHARD_GB each (default 20 x 7 GB = 140 GB), sparse: only the headers
  hold data, so it costs no disk, and its cold figure is the walk, the stats and the header reads;
- ``dense``: DENSE_SHARDS files of DENSE_MB each of random bytes on the disk under --dir, cold
  samples read from the device (the per-read latency that dominates on a real disk).

Prints one table; leaves nothing behind.

    python bench/weights_fingerprint.py [--dir /path/on/the/disk/to/measure]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))

from kvoffd_client.vllm.weights import fingerprint_checkpoint  # noqa: E402

LAYERS = 80
TENSORS_PER_LAYER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                     "input_layernorm", "post_attention_layernorm")


def _header(names: list[str], shard_bytes: int) -> bytes:
    """A safetensors header dividing ``shard_bytes`` evenly among ``names`` (bf16, 1-D)."""
    per = (shard_bytes // max(1, len(names))) // 2 * 2
    meta = {n: {"dtype": "BF16", "shape": [per // 2], "data_offsets": [i * per, (i + 1) * per]}
            for i, n in enumerate(names)}
    blob = json.dumps(meta).encode()
    return struct.pack("<Q", len(blob)) + blob


def _names(shards: int) -> list[list[str]]:
    every = [f"model.layers.{i}.{t}.weight" for i in range(LAYERS) for t in TENSORS_PER_LAYER]
    return [every[s::shards] for s in range(shards)]


def make_checkpoint(root: Path, shards: int, shard_bytes: int, dense: bool) -> None:
    root.mkdir(parents=True)
    for s, names in enumerate(_names(shards)):
        header = _header(names, shard_bytes)
        with open(root / f"model-{s + 1:05d}-of-{shards:05d}.safetensors", "wb") as f:
            f.write(header)
            if dense:
                left = shard_bytes
                while left:
                    n = min(left, 8 << 20)
                    f.write(os.urandom(n))
                    left -= n
            else:
                f.truncate(len(header) + shard_bytes)


def drop_cache(root: Path) -> None:
    for p in root.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(root: Path, repeats: int = 3) -> tuple[float, float, object]:
    colds, warms = [], []
    fp = None
    for _ in range(repeats):
        drop_cache(root)
        t = time.perf_counter()
        fp = fingerprint_checkpoint(root)
        colds.append(time.perf_counter() - t)
        t = time.perf_counter()
        fingerprint_checkpoint(root)
        warms.append(time.perf_counter() - t)
    return sorted(colds)[len(colds) // 2], sorted(warms)[len(warms) // 2], fp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp dir)")
    ap.add_argument("--shards", type=int, default=int(os.environ.get("SHARDS", 20)))
    ap.add_argument("--shard-gb", type=float, default=float(os.environ.get("SHARD_GB", 7)))
    ap.add_argument("--dense-shards", type=int, default=int(os.environ.get("DENSE_SHARDS", 8)))
    ap.add_argument("--dense-mb", type=int, default=int(os.environ.get("DENSE_MB", 256)))
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvoffd-fp-", dir=a.dir))
    rows = []
    try:
        cases = [("sparse", a.shards, int(a.shard_gb * 1e9), False),
                 ("dense", a.dense_shards, a.dense_mb << 20, True)]
        for label, shards, size, dense in cases:
            root = work / label
            make_checkpoint(root, shards, size, dense)
            cold, warm, fp = measure(root)
            rows.append((label, fp.files, fp.bytes_on_disk / 1e9, fp.sampled_bytes / 1e6, cold * 1e3, warm * 1e3))
            shutil.rmtree(root)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'checkpoint':<10} {'files':>5} {'GB':>7} {'sampled MB':>10} {'cold ms':>8} {'warm ms':>8}")
    for r in rows:
        print(f"{r[0]:<10} {r[1]:>5} {r[2]:>7.1f} {r[3]:>10.2f} {r[4]:>8.1f} {r[5]:>8.1f}")


if __name__ == "__main__":
    main()
