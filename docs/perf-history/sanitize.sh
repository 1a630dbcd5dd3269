#!/bin/sh
# compute-sanitizer (memcheck, racecheck, initcheck, side by side) over the GPU test suite.
# Left out: the tests that measure device/host memory across cycles (a second process
# allocating at the same time would disturb them; they launch no kernels of ours beyond a
# memset). Usage: sh docs/perf-history/sanitize.sh OUT_DIR [TIMEOUT_S]
out=${1:?output directory}; limit=${2:-480}
skip="not leave_device_and_host and not do_not_leak and not freed_by_their_finalizers and not sees_a_pinned_leak"
for tool in memcheck racecheck initcheck; do
  PYTHONPATH=. FERROX_REQUIRE_GPU=1 FERROX_LEAK_CYCLES=100 timeout "$limit" \
    compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 9 \
    python3 -m pytest -q -m gpu -k "$skip" -p no:cacheprovider > "$out/sanitizer-$tool.log" 2>&1 &
done
wait
for tool in memcheck racecheck initcheck; do
  echo "== $tool"; grep -E "passed|failed|ERROR SUMMARY|RACECHECK SUMMARY|hazard" "$out/sanitizer-$tool.log" | tail -4
done
