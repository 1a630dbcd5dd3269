#!/bin/sh
# compute-sanitizer over the GPU test suite: memcheck over all of it, racecheck and
# initcheck over the kernel-heavy files (decode, KV cache, graphs), side by side.
# Left out everywhere: the tests that measure device/host memory across cycles (another
# process allocating at the same time disturbs them; they launch no kernels of ours beyond
# memsets). API errors are not reported: the tests provoke some on purpose (OOM, a bad
# launch, a refused graph update) and cuda-bindings probes driver entry points.
# Usage: sh docs/perf-history/sanitize.sh OUT_DIR [TIMEOUT_S]
out=${1:?output directory}; limit=${2:-480}
skip="not leave_device_and_host and not do_not_leak and not freed_by_their_finalizers"
skip="$skip and not sees_a_pinned_leak and not do_not_grow and not free_device_memory"
kernels="tests/test_gpu_decode.py tests/test_gpu_kv_cache.py tests/test_gpu_graphs.py"
run() {
  tool=$1; shift
  PYTHONPATH=. FERROX_REQUIRE_GPU=1 FERROX_LEAK_CYCLES=100 timeout "$limit" \
    compute-sanitizer --tool "$tool" --report-api-errors no --target-processes all \
    --error-exitcode 9 python3 -m pytest -q -m gpu -k "$skip" -p no:cacheprovider "$@" \
    > "$out/sanitizer-$tool.log" 2>&1
  echo "$tool exit $?" >> "$out/sanitizer-$tool.log"
}
run memcheck tests &
run racecheck $kernels &
run initcheck $kernels &
wait
for tool in memcheck racecheck initcheck; do
  echo "== $tool"
  grep -a -E "passed|failed|ERROR SUMMARY|RACECHECK SUMMARY|exit" "$out/sanitizer-$tool.log" | tail -4
done
