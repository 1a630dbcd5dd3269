#!/usr/bin/env bash
# Issue 49's owed GPU runs (docs/design.md, kv4_probe.py's docstring), the most telling
# first, in one device command of at most ten minutes; each part prints as it ends, so a
# cut-off run still says what it got. Run from the checkout:
#
#     bash benchmarks/kv4_owed.sh
#
# FX_Q4_PAIR (two ring steps a pass, one softmax for both; not yet run on a GPU) is not in
# the library: kv4_pair.patch adds it to split_mma_swapped.cuh (0 by default: the library's
# kernels as they were) for this run and takes it out again at the end.
#
# 1. FX_Q4_PAIR's correctness: the 4-bit GPU tests with it on (trait_tests.py);
# 2. the compute alone and the whole decode, each timing in a process of its own: the
#    library, FX_Q4_PAIR (4 and 6 ring steps), 16 warps of 3 steps;
# 3. the compute alone's stall reasons (ncu);
# 4. on an H200 only: every probe (its copies alone);
# 5. each read floor kernel apart against 16/4/256 (are 128-byte rows read at the floor?).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=.:benchmarks
git apply benchmarks/kv4_pair.patch || exit 1
trap 'git apply -R benchmarks/kv4_pair.patch' EXIT
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
echo "== 1. the 4-bit GPU tests with FX_Q4_PAIR=1"
FERROX_TEST_TRAITS=FX_Q4_PAIR=1 FERROX_REQUIRE_GPU=1 timeout 150 python3 -m pytest -q -m gpu \
  -p trait_tests -p no:cacheprovider tests/decode/test_gpu_kv4.py 2>&1 | tail -4
echo "== 2. 32/8/128 at 131072 tokens, us (each timing in a process of its own)"
timeout 220 python3 benchmarks/kv4_probe.py --apart --launches --variants \
  FX_Q4_PROBE=2 FX_Q4_PROBE=2,FX_Q4_PAIR=1 FX_Q4_PROBE=2,FX_WARPS4_D128=16,FX_STAGES4_D128=3 \
  base FX_Q4_PAIR=1 FX_Q4_PAIR=1,FX_STAGES4_D128=6 FX_WARPS4_D128=16,FX_STAGES4_D128=3 \
  --shapes 32/8/128 --seqs 131072 2>&1 | grep -v compiling
echo "== 3. the compute alone's stall reasons"
timeout 90 ncu --clock-control none -k regex:gqa_split_mma_.*q4 -c 1 \
  --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
  python3 benchmarks/kv4_probe.py --variants FX_Q4_PROBE=2 --shapes 32/8/128 --seqs 131072 \
  2>&1 | grep -v "compiling\|^==PROF==" | tail -40
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  echo "== 4. every probe (H200)"
  timeout 120 python3 benchmarks/kv4_probe.py --shapes 32/8/128 8/1/256 --seqs 131072 2>&1 |
    grep -v compiling
fi
echo "== 5. each read floor apart"
timeout 100 python3 benchmarks/kv4_probe.py --floors --variants base FX_Q4_PROBE=1 \
  --shapes 32/8/128 16/4/256 8/1/256 --seqs 131072 2>&1 | grep -v compiling
