#!/usr/bin/env bash
# The tables issues 49 and 50 still owe from an H200 (docs/design.md), in one device command
# of at most ten minutes, each part in a time limit of its own so that a slow one leaves the
# rest their time; the GPU suite is a command of its own (PARTS=14 bash
# benchmarks/gpu_suite.sh, about 470 s on an H100). Run from the checkout:
#
#     bash benchmarks/h200_tables.sh
#
# 1. bench --only kv4's table (head-major, the default, then token-major) at 32768 and
#    131072 tokens, and 32/8/128 at one million (head-major);
# 2. issue 50: head_dim 512 against 128 on equal bytes and SDPA (wide_speed.py), and MLA
#    against its read floor and SDPA (mla_speed.py);
# 3. kv4_pair.patch applied (the swapped kernel's loop over NP ring steps a pass: with
#    FX_Q4_PAIR=0 the kernels' code as the library's, compared on the CPU; applied for this
#    part and taken out again): FX_Q4_PAIR=1 (two steps a pass for a 4-bit cache) against
#    the library on head-major rows, each timing in a process of its own (the H200's 4-bit
#    decode is bound by its compute, which PAIR cut by 11% on an H100), then its tests
#    (benchmarks/trait_tests.py) where the time is left.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1 FERROX_REQUIRE_GPU=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
T0=$SECONDS
echo "== 1. kv4 speed, each layout"
for layout in HND NHD; do
  timeout 80 python3 benchmarks/kv4_speed.py --layout $layout --seqs 32768 131072 2>&1 \
    | grep -v compiling
done
echo "== 1. one million tokens of 32/8/128, head-major ($((SECONDS - T0)) s)"
timeout 60 python3 benchmarks/kv4_speed.py --shapes 32/8/128 --seqs 1048576 2>&1 | grep -v compiling
echo "== 2. head_dim 512 ($((SECONDS - T0)) s)"
timeout 100 python3 benchmarks/wide_speed.py 2>&1 | grep -v compiling
echo "== 2. MLA ($((SECONDS - T0)) s)"
timeout 150 python3 benchmarks/mla_speed.py 2>&1 | grep -v compiling
echo "== 3. FX_Q4_PAIR on head-major rows, us ($((SECONDS - T0)) s)"
git apply benchmarks/kv4_pair.patch && {
  PYTHONPATH=.:benchmarks timeout 150 python3 benchmarks/kv4_probe.py --apart \
    --variants HND FX_Q4_PAIR=1,HND --shapes 32/8/128 28/4/128 8/1/256 --seqs 131072 2>&1 \
    | grep -v compiling
  echo "== 3. FX_Q4_PAIR's tests ($((SECONDS - T0)) s)"
  left=$((590 - SECONDS + T0))  # (where the parts above took the time: no tests)
  [ "$left" -gt 30 ] && FERROX_TEST_TRAITS=FX_Q4_PAIR=1 PYTHONPATH=.:benchmarks timeout "$left" \
    python3 -m pytest -q -m gpu -p trait_tests -p no:cacheprovider \
    tests/decode/test_gpu_kv4.py tests/cache/test_gpu_kv4_cache.py \
    tests/integrations/test_gpu_torch_kv4.py 2>&1 | tail -3
  git apply -R benchmarks/kv4_pair.patch
}
echo "== end ($((SECONDS - T0)) s)"
