"""Build a tiny random Llama for trying kvoffd with `vllm serve` offline (docs/vllm.md, "A quick test").

    python bench/make_tiny_model.py /tmp/tiny-llama

The model is the one the vLLM tests use (bench/support/vllm_engines.py: 2 layers, head_dim 32, vocab
512, ~0.4 M random parameters, float32): nothing is downloaded, it builds in seconds on a CPU, and
vLLM's CPU build runs it. Its weights are random, so its text means nothing; it has no tokenizer,
so serve it with `--skip-tokenizer-init` and send token ids (`"prompt": [3, 14, ...]`,
`"return_token_ids": true`). Needs `torch` and `transformers` (vLLM brings both).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from support.vllm_engines import build_tiny_llama  # the vLLM tests' model too: one definition


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("path", type=Path, help="directory to write the model to (created)")
    p.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    args = p.parse_args(argv)
    build_tiny_llama(args.path, seed=args.seed)
    print(args.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
