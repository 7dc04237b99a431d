"""A stand-in vLLM worker process: CPU KV tensors shaped and allocated the way vLLM's CPU backend does.

One int8 backing allocation; per-layer views ``[num_blocks, kv_heads, block_size, 2*head_dim]``
(layout LBHNC). It shares its memory with the daemon exactly as the connector does, registers, and
then obeys JSON commands on stdin, one per line, answering one JSON line each:

  {"op": "fill", "ids": [...], "seed": 7}           random bytes into those blocks
  {"op": "digest", "ids": [...]}                    sha256 of each block's bytes (all layers)
  {"op": "store"|"load", "job": 1, "keys": [hex], "ids": [...], "lease": 0}  -> the job's notice
  {"op": "submit_store"|"submit_load", ...}         same, without waiting for the notice
  {"op": "wait", "jobs": [...]}                     -> notices for those jobs
  {"op": "lookup", "keys": [hex], "lease_ms": 0}
  {"op": "exit"}
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import torch

from kvoffd_client.client import KvoffdClient
from kvoffd_client.memory.cpu_fd import share_cpu_kv_caches
from kvoffd_client.memory.layout import describe_layout


def allocate(num_blocks: int, layers: int, heads: int, block_size: int, head_dim: int, dtype: torch.dtype
             ) -> dict[str, torch.Tensor]:
    per_layer = num_blocks * heads * block_size * 2 * head_dim * torch.tensor([], dtype=dtype).element_size()
    raw = torch.zeros(per_layer * layers, dtype=torch.int8)
    return {f"model.layers.{i}.self_attn.attn": raw[i * per_layer:(i + 1) * per_layer].view(dtype).view(
        num_blocks, heads, block_size, 2 * head_dim) for i in range(layers)}


def block_bytes(kv: dict[str, torch.Tensor], b: int) -> bytes:
    return b"".join(t[b].contiguous().view(torch.int8).numpy().tobytes() for t in kv.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--namespace", default="ns")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--replicas", type=int, default=1)  # consecutive ranks sharing one copy (MLA at TP > 1)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=32)
    a = ap.parse_args()
    kv = allocate(a.blocks, a.layers, a.heads, a.block_size, a.head_dim, torch.float32)
    memory = share_cpu_kv_caches(kv, a.engine_id)
    layout = describe_layout(kv, a.blocks)
    client = KvoffdClient(a.address, timeout_s=5.0)
    if not client.connect(10):
        raise SystemExit("daemon not reachable")
    reg = client.register(a.engine_id, a.namespace, a.rank, a.world_size, memory, layout, replicas=a.replicas)
    out = sys.stdout
    out.write(json.dumps({"registered": reg.engine_id, "slot_bytes": reg.slot_bytes}) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        res: object
        if op == "fill":
            g = torch.Generator().manual_seed(cmd["seed"])
            for t in kv.values():
                for b in cmd["ids"]:
                    t[b].view(torch.int8).copy_(torch.randint(-128, 128, t[b].view(torch.int8).shape,
                                                              dtype=torch.int8, generator=g))
            res = "ok"
        elif op == "digest":
            res = [hashlib.sha256(block_bytes(kv, b)).hexdigest() for b in cmd["ids"]]
        elif op in ("store", "load", "submit_store", "submit_load"):
            keys = [bytes.fromhex(k) for k in cmd["keys"]]
            if op.endswith("store"):
                client.submit_store(a.engine_id, cmd["job"], keys, cmd["ids"])
            else:
                client.submit_load(a.engine_id, cmd["job"], keys, cmd["ids"], lease_id=cmd.get("lease", 0))
            if op.startswith("submit"):
                res = "submitted"
            else:
                res = [n.to_wire() for n in client.wait_notices({cmd["job"]}, 30)]
        elif op == "wait":
            res = [n.to_wire() for n in client.wait_notices(set(cmd["jobs"]), 30)]
        elif op == "lookup":
            r = client.lookup(a.namespace, [bytes.fromhex(k) for k in cmd["keys"]], cmd.get("lease_ms", 0))
            res = r.to_wire()
        elif op == "exit":
            break
        else:
            res = f"unknown op {op}"
        out.write(json.dumps({"result": res}) + "\n")
        out.flush()
    client.close()


if __name__ == "__main__":
    main()
