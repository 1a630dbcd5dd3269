"""Floor 1: CUDA and nothing about attention. The only importer of cuda.bindings (`_bindings`)."""
