"""Kernel sources of ferrox_driver, compiled at run time by NVRTC (no Python here)."""
