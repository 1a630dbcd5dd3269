"""MLA decode against the read floor and SDPA (ferrox_driver/apps/bench/mla_speed.py).

PYTHONPATH=. python benchmarks/mla_speed.py [--heads 16 64 128] [--n-q 1 2]
    [--seqs 4096 32768 131072] [--formats bf16 e4m3] [--no-sdpa]
"""

from ferrox_driver.apps.bench.mla_speed import main

if __name__ == "__main__":
    main()
