"""LayerKVCache: one KVCache per layer of a model, sharing one stream."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..decode.checks import MAX_TOKENS, check_dtype, check_int
from ..decode.fp8 import FP8_DTYPES
from ..driver.device import resolve
from ..driver.memory import as_dtype
from ..driver.stream import Stream
from ..errors import ClosedError
from ..types import DeviceLike, DTypeLike, HostArrayLike
from .four_bit import check_four_bit_layout, check_mixed, four_bit_format
from .kv_cache import KVCache, check_kv_shape
from .own_values import check_head_dim_v

__all__ = ["LayerKVCache"]


class LayerKVCache:
    """One `KVCache` per layer, sharing one stream; memory allocated once.

    Args:
        n_layers: number of layers.
        n_kv_heads: as `KVCache`.
        head_dim: as `KVCache`.
        capacity: as `KVCache`, per layer.
        dtype: as `KVCache`: float32, float16, bfloat16, an fp8 dtype, ``"int4"`` or
            ``"nvfp4"``.
        device: as `KVCache`.
        stream: the stream every layer uses (default: a stream of its own).
        k_scale: as `KVCache` (an fp8 or nvfp4 cache's K scales), every layer's.
        v_scale: as `KVCache`, every layer's.
        v_dtype: as `KVCache` (V's format where it is not K's).
        rotate: as `KVCache` (a 4-bit K's Hadamard rotation).
        head_dim_v: as `KVCache` (V rows of their own width, every layer's).
        kv_layout: as `KVCache` (a 4-bit cache's storage, every layer's).

    Raises:
        TypeError, ValueError: an argument `KVCache` refuses, named (nothing is left
            allocated).
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        *,
        dtype: DTypeLike = np.float32,
        device: DeviceLike = None,
        stream: Stream | None = None,
        k_scale: HostArrayLike = None,
        v_scale: HostArrayLike = None,
        v_dtype: DTypeLike = None,
        rotate: bool | None = None,
        head_dim_v: int | None = None,
        kv_layout: str | None = None,
    ) -> None:
        n_layers = check_int(n_layers, "n_layers", 1)
        _, head_dim = check_kv_shape(n_kv_heads, head_dim)
        check_int(capacity, "capacity", 1, MAX_TOKENS)
        # (all checked before any stream)
        mixed = check_mixed(dtype, v_dtype, head_dim, rotate, k_scale, v_scale)
        check_head_dim_v(head_dim_v, head_dim, dtype, v_dtype, rotate)
        check_four_bit_layout(kv_layout, four_bit_format(dtype), mixed is not None)
        if not four_bit_format(dtype) and not FP8_DTYPES.get(as_dtype(dtype, "dtype")):
            dtype = check_dtype(dtype, "dtype")
        self.device = resolve(device)
        self._owns_stream = stream is None
        self.stream = Stream(self.device) if stream is None else stream
        self.layers: list[KVCache] = []
        try:
            for _ in range(n_layers):
                self.layers.append(
                    KVCache(
                        n_kv_heads,
                        head_dim,
                        capacity,
                        dtype=dtype,
                        device=self.device,
                        stream=self.stream,
                        k_scale=k_scale,
                        v_scale=v_scale,
                        v_dtype=v_dtype,
                        rotate=rotate,
                        head_dim_v=head_dim_v,
                        kv_layout=kv_layout,
                    )
                )
        except BaseException:
            self.close()
            raise
        self.n_kv_heads, self.head_dim, self.capacity = n_kv_heads, head_dim, capacity
        self.dtype = self.layers[0].dtype  # (a 4-bit cache's: its ml_dtypes name)
        self.v_dtype = self.layers[0].v_dtype
        self.head_dim_v = self.layers[0].head_dim_v

    _closed = False

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("LayerKVCache")

    def __getitem__(self, layer: int) -> KVCache:
        self._check_open()
        return self.layers[layer]

    def __len__(self) -> int:
        self._check_open()
        return len(self.layers)

    def __iter__(self) -> Any:
        self._check_open()
        return iter(self.layers)

    def clear(self) -> None:
        """Clear every layer (a new sequence)."""
        self._check_open()
        for layer in self.layers:
            layer.clear()

    def close(self) -> None:
        """Free every layer's memory (see `KVCache.close`); closing again does nothing."""
        self._closed = True
        for layer in self.layers:
            layer.close()
        self.layers = []
        if self._owns_stream:
            self.stream.close()

    def __enter__(self) -> LayerKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
