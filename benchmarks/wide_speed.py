"""head_dim 512 GQA decode against head_dim 128 on equal bytes and SDPA
(ferrox_driver/apps/bench/wide_speed.py).

PYTHONPATH=. python benchmarks/wide_speed.py [--kv 4] [--groups 1 2 4 8]
    [--seqs 4096 32768 131072] [--dtype bf16] [--n-q 1] [--no-sdpa]
"""

from ferrox_driver.apps.bench.wide_speed import main

if __name__ == "__main__":
    main()
