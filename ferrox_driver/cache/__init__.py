"""Floor 4: resident state (KV caches) and what runs against it.

Appends, the length protocol, graphs over caches, the ferrox-cuda compatible API; the MLA
flavour, `LatentCache`, is built on the same machinery (latent_cache.py)."""
