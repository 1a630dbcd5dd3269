"""The 4-bit caches' decodes against our fp8 and bf16 (ferrox_driver/apps/bench/kv4_speed.py,
also run by ``python -m ferrox_driver bench --only kv4``).

    PYTHONPATH=. python benchmarks/kv4_speed.py [--shapes 32/8/128 28/4/128 8/1/256]
        [--seqs 4096 32768 131072] [--n-q 1] [--row-warps 1 4]
"""

from ferrox_driver.apps.bench.kv4_speed import main

if __name__ == "__main__":
    main()
