"""A Llama-shaped model with random weights, one whole token captured as one PyTorch CUDA
graph, with its attention on ferrox (a KVCache per layer, or SDPA's static cache in place)
or on SDPA over its static cache (``ferrox_driver.apps.toy_llama`` says how): ms per token (the
median of 5 rounds), tokens/s, and how far each one's first-step logits are from the same
model's with its attention in float32.

    python3 benchmarks/toy_llama.py [--layers 32] [--contexts 4096,32768] [--steps 64] [--small]

Exit status 1 when ferrox's first-step logits are further from float32 attention's than
SDPA's are (twice, or 1e-2).
"""

from __future__ import annotations

import argparse
import sys

import torch

from ferrox_driver.apps import toy_llama


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--small", action="store_true", help="narrow layers (a quick check)")
    args = ap.parse_args(argv)
    shape = toy_llama.SMALL if args.small else toy_llama.LLAMA_3_8B
    model = toy_llama.ToyLlama(args.layers, **shape)
    print(f"Llama-3-8B-shaped random model, {args.layers} layers, bf16, one CUDA graph per "
          f"token ({torch.cuda.get_device_name()}, PyTorch {torch.__version__})")  # fmt: skip
    print(toy_llama.table_header())
    failed = False
    for context in (int(c) for c in args.contexts.split(",")):
        result = toy_llama.compare(model, context, args.steps)
        failed |= not result.ok
        print(toy_llama.table_row(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
