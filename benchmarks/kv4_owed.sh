#!/usr/bin/env bash
# Issue 49's owed GPU runs (docs/design.md), the most telling first, in one device command
# of at most ten minutes; each part prints as it ends, so a cut-off run still says what it
# got. Run from the checkout:
#
#     bash benchmarks/kv4_owed.sh
#
# 1. the 4-bit GPU tests over both layouts (head-major, kv_layout="HND", the default since
#    they passed on an H100 and read 14-18% faster there);
# 2. 32/8/128, 28/4/128 and 8/1/256 at 131072 tokens, each timing in a process of its own:
#    token-major against head-major buffers, and FX_Q4_PAIR (two ring steps a pass, one
#    softmax for both; kv4_pair.patch, applied for this part and taken out again) on
#    head-major ones, whose compute alone was 11% faster (H100) and which the token-major
#    decode's copies hid;
# 3. on an H200 only: bench --only kv4's table in both layouts.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=. FERROX_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
echo "== 1. the 4-bit GPU tests (both layouts)"
P="timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider"
$P tests/cache/test_gpu_kv4_cache.py >/tmp/owed_a.log 2>&1 &
$P tests/decode/test_gpu_kv4.py tests/cache/test_gpu_kv_mixed.py >/tmp/owed_b.log 2>&1 &
$P tests/integrations/test_gpu_torch_kv4.py tests/apps/test_gpu_toy_llama.py \
  tests/integrations/test_gpu_transformers.py -k "kv4 or int4 or nvfp4 or four or toy" \
  >/tmp/owed_c.log 2>&1 &
wait
for f in /tmp/owed_[abc].log; do echo "$f: $(tail -1 "$f")"; grep "^FAILED" "$f" | head -5; done
echo "== 2. us at 131072 tokens (each timing in a process of its own)"
git apply benchmarks/kv4_pair.patch || exit 1
PYTHONPATH=.:benchmarks timeout 200 python3 benchmarks/kv4_probe.py --apart --variants NHD HND \
  FX_Q4_PAIR=1,HND FX_Q4_PROBE=2 FX_Q4_PROBE=2,FX_Q4_PAIR=1 \
  --shapes 32/8/128 28/4/128 8/1/256 --seqs 131072 2>&1 | grep -v compiling
git apply -R benchmarks/kv4_pair.patch
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  echo "== 3. the kv4 speed table, each layout"
  for layout in NHD HND; do
    timeout 60 python3 benchmarks/kv4_speed.py --layout $layout --seqs 32768 131072 \
      2>&1 | grep -v compiling
  done
fi
