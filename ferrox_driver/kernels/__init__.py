"""Floor 2: what the host must agree on with cuda_src/.

Traits, typed kernel specs, the catalogue of kernel files, argument layouts. Nothing here
needs a GPU except `catalogue.get_kernel`."""
