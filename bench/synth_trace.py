"""Synthetic Mooncake-format traces with a reuse structure unlike the conversation trace's.

Two kinds (both chained like the real one: a request's ``hash_ids`` are its prefix blocks, a block id
always follows the same parent, 512 tokens per block):

* ``zipf-chat`` — 200 system prompts (2-24 blocks) chosen with Zipf(1.1) popularity; each starts a
  conversation whose turns append 1-12 blocks each; a request is a new conversation (30%) or the next
  turn of a recent one (chosen with a bias towards the newest). Heavily shared heads, short reuse.
* ``scan-heavy`` — the same chats for 35% of the requests, and 65% one-off documents of 20-200 fresh
  blocks behind one shared 2-block head, never asked for again: scans that flush an LRU cache.

    python bench/synth_trace.py KIND OUT.jsonl [--requests 8000] [--seed 1]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

BLOCK_TOKENS = 512
KINDS = ("zipf-chat", "scan-heavy")


class _Ids:
    def __init__(self) -> None:
        self.next = 0

    def fresh(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _zipf_index(rng: random.Random, weights: list[float]) -> int:
    return rng.choices(range(len(weights)), weights=weights)[0]


def generate(kind: str, requests: int = 8000, seed: int = 1) -> list[dict]:
    """The trace as a list of Mooncake records (``timestamp`` in ms, one request every 300 ms)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
    rng = random.Random(seed)
    ids = _Ids()
    systems = [ids.fresh(rng.randint(2, 24)) for _ in range(200)]
    weights = [1 / (i + 1) ** 1.1 for i in range(len(systems))]
    doc_head = ids.fresh(2)
    convs: list[list[int]] = []
    out = []
    for i in range(requests):
        if kind == "scan-heavy" and rng.random() < 0.65:
            chain = doc_head + ids.fresh(rng.randint(20, 200))
        else:
            if not convs or rng.random() < 0.30:
                convs.append(list(systems[_zipf_index(rng, weights)]))
                if len(convs) > 400:
                    convs.pop(0)
            back = min(len(convs), 1 + int(rng.expovariate(1 / 40)))
            conv = convs[-back]
            conv += ids.fresh(rng.randint(1, 12))
            chain = list(conv)
        tokens = len(chain) * BLOCK_TOKENS - rng.randint(0, BLOCK_TOKENS - 1)
        out.append({"timestamp": i * 300, "input_length": tokens, "output_length": 200, "hash_ids": chain})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kind", choices=KINDS)
    ap.add_argument("out", type=Path)
    ap.add_argument("--requests", type=int, default=8000)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    recs = generate(a.kind, a.requests, a.seed)
    a.out.write_text("".join(json.dumps(r) + "\n" for r in recs))
    print(f"{a.out}: {len(recs)} requests, {sum(len(r['hash_ids']) for r in recs)} blocks asked for")
    return 0


if __name__ == "__main__":
    sys.exit(main())
