"""ferrox_driver: single-sequence GQA attention decode on NVIDIA GPUs, over the raw CUDA
driver API (cuda.bindings), with kernels compiled at run time by NVRTC.

    import ferrox_driver as fd
    out = fd.gqa_decode(q, k, v, n_heads=32, n_kv_heads=8, head_dim=128)
"""

from __future__ import annotations

from ._version import __version__ as __version__
from .cache.device_ops import gqa_decode_async, kv_append_async, kv_truncate_async
from .cache.graphs import DecodeGraph, LayerDecodeGraph
from .cache.kv_cache import KVCache
from .cache.latent_cache import LatentCache
from .cache.layers import LayerKVCache
from .cache.resident import clear_layer_kv, ensure_layer_kv, gqa_decode_resident
from .decode.eager import gqa_decode
from .decode.fp8 import quantize_fp8
from .decode.kv4 import (
    dequantize_int4,
    dequantize_nvfp4,
    hadamard,
    quantize_int4,
    quantize_nvfp4,
)
from .decode.latent import mla_decode, reference_mla_decode
from .decode.merge import merge_states
from .decode.reference import reference_gqa_decode
from .driver.compiler import KernelResources, Program, compile_source
from .driver.device import Device, cuda_available, device_count
from .driver.graph import Graph, GraphExec
from .driver.launch import Kernel, Module
from .driver.memory import DeviceArray, empty, from_dlpack, pinned_empty, to_device, zeros
from .driver.module_cache import ensure_module_loaded
from .driver.stream import Event, Stream
from .errors import (
    ClosedError,
    CompileError,
    CudaError,
    FerroxError,
    KVCapacityError,
    NoDeviceError,
    UnsupportedDeviceError,
)
from .parallel.sharded import LocalGroup, ShardedDecoder, ShardedKVCache

__all__ = [
    "ClosedError",
    "CompileError",
    "CudaError",
    "DecodeGraph",
    "LayerDecodeGraph",
    "Device",
    "DeviceArray",
    "Event",
    "FerroxError",
    "Graph",
    "GraphExec",
    "KVCache",
    "KVCapacityError",
    "Kernel",
    "KernelResources",
    "LatentCache",
    "LayerKVCache",
    "LocalGroup",
    "Module",
    "NoDeviceError",
    "Program",
    "ShardedDecoder",
    "ShardedKVCache",
    "Stream",
    "UnsupportedDeviceError",
    "clear_layer_kv",
    "compile_source",
    "cuda_available",
    "device_count",
    "dequantize_int4",
    "dequantize_nvfp4",
    "empty",
    "ensure_layer_kv",
    "ensure_module_loaded",
    "from_dlpack",
    "gqa_decode",
    "hadamard",
    "gqa_decode_async",
    "gqa_decode_resident",
    "kv_append_async",
    "kv_truncate_async",
    "merge_states",
    "mla_decode",
    "quantize_fp8",
    "quantize_int4",
    "quantize_nvfp4",
    "pinned_empty",
    "reference_gqa_decode",
    "reference_mla_decode",
    "to_device",
    "zeros",
]
