"""Floor 5: sharded caches, the NCCL group, the rank launcher."""
