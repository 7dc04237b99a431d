#!/usr/bin/env bash
# One device call on an H200 (the device tool): install the carried wheels, run the CUDA tests, and the
# daemon transfer bench on this tree and, when .old/ holds an older tree (git archive REV | tar -x -C
# .old/tree; ln -s ../tree/client .old/py/kvoffd_client), on that tree too, alternating, so that the A/B
# is measured in one run on one machine. Logs and JSON go to $OUT; a short table is printed last.
#
#   bash bench/h200_check.sh [tests|transfer|all] [extra pytest args...]
set -u
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONUNBUFFERED=1 KVOFFD_POOL_PATH=${KVOFFD_POOL_PATH:-none}
new_pp="/tmp/site:$PWD:$PWD/client"
summary="$OUT/summary.txt"; : > "$summary"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> "$summary" 2>&1

if [ "$what" = tests ] || [ "$what" = all ]; then
  PYTHONPATH=$new_pp timeout 420 python3 -m pytest -q -p no:cacheprovider tests/gpu "$@" > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests (rc $?): $(tail -n 1 "$OUT/gpu_tests.log")" >> "$summary"
fi

bench() {  # name pythonpath dir
  (cd "$3" && PYTHONPATH=$2 timeout 240 python3 bench/transfer.py --daemon --layouts blocks --skip-matmul \
     --pin-configs none --iters 5 --json "$OUT/transfer_$1.json" > "$OUT/transfer_$1.log" 2>&1)
  echo "transfer $1 (rc $?): $(grep -E 'ceiling|steady state|byte-exact|pinned' "$OUT/transfer_$1.log" | sed -E 's/ +/ /g' | head -n 8 | tr '\n' ' ')" >> "$summary"
}
if [ "$what" = transfer ] || [ "$what" = all ]; then
  bench new1 "$new_pp" "$PWD"
  [ -d .old/tree ] && bench old1 "/tmp/site:$PWD/.old/tree:$PWD/.old/py" "$PWD/.old/tree"
  bench new2 "$new_pp" "$PWD"
  [ -d .old/tree ] && bench old2 "/tmp/site:$PWD/.old/tree:$PWD/.old/py" "$PWD/.old/tree"
fi
cat "$summary"
