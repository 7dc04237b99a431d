"""`vllm bench serve`, run many times by one process: vLLM's own client, imported once.

Used by test_bench_replay.py (each `vllm bench serve` command pays ~13 s of imports on a 2-core CI
box; six replays through one process pay it once). Each line on stdin is a JSON list, the
arguments that follow `vllm bench serve` on a command line; they go through the command's own parser
and ``main`` (what the command's ``cmd`` calls). Each replay is answered with one line on stdout,
``{"ok": true}`` or ``{"error": "<traceback>"}``; everything vLLM prints goes to stderr. The process
ends at the end of its input. The caller sets PYTHONHASHSEED: a timed trace's prompt tokens are
drawn with seeds from ``hash()``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

# answers on the original stdout; fd 1 (vLLM's prints, logging, tqdm) goes to stderr
answers = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)

from vllm.benchmarks.serve import add_cli_args, main  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402


def replay(argv: list[str]) -> None:
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(argv))


def serve_requests() -> None:
    for line in sys.stdin:
        try:
            replay(json.loads(line))
            answer = {"ok": True}
        except (Exception, SystemExit):  # SystemExit: the parser refused the arguments
            answer = {"error": traceback.format_exc()}
        sys.stdout.flush()
        answers.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    serve_requests()
