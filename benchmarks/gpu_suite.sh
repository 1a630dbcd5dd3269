#!/usr/bin/env bash
# The GPU suite (`pytest -m gpu`) in PARTS processes at once on one GPU, for a device lease
# of minutes: each process takes one of PARTS contiguous runs of the collected GPU tests
# (FERROX_SHARD, tests/conftest.py: a file of a thousand tests, test_gpu_decode.py, is
# spread over several), each part's log in $LOGS (default ${OUT:-/tmp}/gpu_suite), then
# each part's summary line and the exit status of the worst. Run from the checkout:
#
#     PARTS=10 bash benchmarks/gpu_suite.sh [pytest args, e.g. -k verify]
#
# (FERROX_REQUIRE_GPU=1 is set: a GPU test that would skip fails.) The files in SERIAL,
# whose tests measure the whole machine's memory (free device memory, MemAvailable), and
# the tests marked `alone` elsewhere (one that reads the GPU's free memory) run after the
# parts, by themselves (their log: part_serial.log): beside other processes their
# readings move with those processes' allocations.
set -u
cd "$(dirname "$0")/.."
PARTS=${PARTS:-10}
LOGS=${LOGS:-${OUT:-/tmp}/gpu_suite}
SERIAL=(tests/driver/test_gpu_reliability.py tests/decode/test_gpu_growing.py
  tests/cache/test_gpu_graphs.py)
mkdir -p "$LOGS"
ignore=()
for f in "${SERIAL[@]}"; do ignore+=("--ignore=$f"); done
pids=()
for ((p = 0; p < PARTS; p++)); do
  FERROX_SHARD=$p/$PARTS PYTHONPATH=. FERROX_REQUIRE_GPU=1 python3 -m pytest -q \
    -m "gpu and not alone" -p no:cacheprovider tests "${ignore[@]}" "$@" \
    >"$LOGS/part$p.log" 2>&1 &
  pids+=("$!")
done
worst=0
for pid in "${pids[@]}"; do
  wait "$pid"
  rc=$?
  [ "$rc" -gt "$worst" ] && worst=$rc
done
PYTHONPATH=. FERROX_REQUIRE_GPU=1 python3 -m pytest -q -m gpu -p no:cacheprovider \
  "${SERIAL[@]}" "$@" >"$LOGS/part_serial.log" 2>&1
rc=$?
[ "$rc" -gt "$worst" ] && worst=$rc
PYTHONPATH=. FERROX_REQUIRE_GPU=1 python3 -m pytest -q -m "gpu and alone" \
  -p no:cacheprovider tests "${ignore[@]}" "$@" >"$LOGS/part_alone.log" 2>&1
rc=$?
[ "$rc" -gt "$worst" ] && worst=$rc
for log in "$LOGS"/part*.log; do
  echo "$(basename "$log"): $(tail -n 1 "$log")"
done
grep -h "^FAILED\|^ERROR" "$LOGS"/part*.log | head -50
exit "$worst"
