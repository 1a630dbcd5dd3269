"""Append + decode per token as device-only operations, and captured once as a CUDA graph.

``kv_append_async`` and ``gqa_decode_async`` take device inputs, do no host work and read
the cache's sequence length on the device, so they can sit inside any captured graph
(ours, PyTorch's or CuPy's). ``DecodeGraph`` captures a whole token step once and replays
it for every token, with no re-capture and no node update.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._driver import drv
from .attention import check_algorithm
from .errors import KVCapacityError
from .graph import GraphExec
from .kv_cache import KVCache, append_kernel
from .memory import DeviceArray, as_device_array, empty, pinned_empty
from .stream import Stream, stream_handle
from .validation import array_info, check_dims

__all__ = ["DecodeGraph", "gqa_decode_async", "kv_append_async"]

APPEND_THREADS = 256


def _check_device_operand(obj: Any, name: str, size: int, dtype: np.dtype) -> DeviceArray:
    info = array_info(obj, name)
    if not info.on_device:
        raise TypeError(f"{name}: expected a device array, got {type(obj).__name__}")
    if info.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype} (the cache's), got {info.dtype}")
    if int(np.prod(info.shape)) != size:
        raise ValueError(f"{name}: expected {size} elements, got shape {info.shape}")
    return as_device_array(obj, name)


def _check_cache(kv: Any) -> KVCache:
    if not isinstance(kv, KVCache):
        raise TypeError(f"kv: expected a ferrox_driver.KVCache, got {type(kv).__name__}")
    return kv


def kv_append_async(kv: KVCache, k_dev: Any, v_dev: Any, *, stream: Any) -> None:
    """Queue a device-side append of one token: rows ``k_dev``/``v_dev`` go to position
    ``seq_len`` (read on the device), which is then bumped. Capturable in a graph.

    A full cache is not written: the device sets an overflow flag and the host raises
    KVCapacityError at ``kv.synchronize()``.

    Args:
        kv: the cache.
        k_dev: device array of ``n_kv_heads*head_dim`` elements, cache dtype.
        v_dev: like ``k_dev``.
        stream: the stream (or a PyTorch/CuPy stream, or an int handle) to queue on.
    """
    kv = _check_cache(kv)
    k = _check_device_operand(k_dev, "k_dev", kv.row_elems, kv.dtype)
    v = _check_device_operand(v_dev, "v_dev", kv.row_elems, kv.dtype)
    append_kernel(kv.device).launch(
        1,
        APPEND_THREADS,
        (k, v, kv.k_buffer, kv.v_buffer, kv.state, np.int64(kv.row_bytes), np.int32(kv.capacity)),
        stream=stream,
    )
    kv.mark_device_appends()


def gqa_decode_async(
    q_dev: Any, kv: KVCache, out_dev: Any, *, n_heads: int, stream: Any, algorithm: str = "auto"
) -> None:
    """Queue a decode of ``q_dev`` against the cache, reading seq_len on the device.
    No host work: capturable in a graph, valid for every sequence length. Before the
    first capture call ``kv.prepare(n_heads)`` (or run it once eagerly): loading kernels
    and allocating its scratch cannot happen inside a capture.

    Args:
        q_dev: device array of ``n_heads*head_dim`` elements, cache dtype.
        kv: the cache.
        out_dev: device array like ``q_dev``, written with the result.
        n_heads: query heads, a multiple of ``kv.n_kv_heads``.
        stream: the stream to queue on.
        algorithm: ``"auto"``/``"split"`` or ``"parity"``.
    """
    kv = _check_cache(kv)
    n_heads, _, _ = check_dims(n_heads, kv.n_kv_heads, kv.head_dim)
    algorithm = check_algorithm(algorithm)
    q = _check_device_operand(q_dev, "q_dev", n_heads * kv.head_dim, kv.dtype)
    out = _check_device_operand(out_dev, "out_dev", n_heads * kv.head_dim, kv.dtype)
    kv.launch_decode(
        q, out, n_heads=n_heads, stream=stream, algorithm=algorithm, length_on_device=True
    )


class DecodeGraph:
    """One token step (copy in q/k/v, append, decode, copy out) captured once as a CUDA
    graph and replayed for every token.

    Args:
        kv: the cache to append to and decode against.
        n_heads: query heads, a multiple of ``kv.n_kv_heads``.
        stream: where the graph runs (default: the cache's stream, so it stays ordered
            with the cache's own appends).
        algorithm: ``"auto"`` or ``"parity"``.

    Attributes:
        q, k, v, out: page-locked staging arrays; fill ``q``/``k``/``v`` in place and call
            :meth:`launch` + :meth:`synchronize` to avoid even the staging copy.
    """

    def __init__(
        self, kv: KVCache, *, n_heads: int, stream: Stream | None = None, algorithm: str = "auto"
    ) -> None:
        self.kv = _check_cache(kv)
        self.n_heads, _, _ = check_dims(n_heads, kv.n_kv_heads, kv.head_dim)
        algorithm = check_algorithm(algorithm)
        if stream is not None and not isinstance(stream, Stream):
            raise TypeError(f"stream: expected a ferrox_driver.Stream, got {type(stream)}")
        self.stream = kv.stream if stream is None else stream
        dt, q_elems = kv.dtype, self.n_heads * kv.head_dim
        self.q = pinned_empty((self.n_heads, kv.head_dim), dt)
        self.k = pinned_empty((kv.n_kv_heads, kv.head_dim), dt)
        self.v = pinned_empty((kv.n_kv_heads, kv.head_dim), dt)
        self.out = pinned_empty((self.n_heads, kv.head_dim), dt)
        self._state = pinned_empty((2,), np.int32)
        self._q_d = empty((q_elems,), dt, device=kv.device)
        self._k_d = empty((kv.row_elems,), dt, device=kv.device)
        self._v_d = empty((kv.row_elems,), dt, device=kv.device)
        self._out_d = empty((q_elems,), dt, device=kv.device)
        kv.synchronize()  # earlier eager work is done; the host seq_len is exact
        self._exec = self._capture(algorithm)

    def _capture(self, algorithm: str) -> GraphExec:
        kv, s = self.kv, self.stream
        h = stream_handle(s)
        # Load kernels and allocate scratch first: neither is capturable.
        kv.prepare(self.n_heads, algorithm)
        with s.capture() as graph:
            for dev, host in ((self._q_d, self.q), (self._k_d, self.k), (self._v_d, self.v)):
                drv("cuMemcpyHtoDAsync", dev.ptr, host.ctypes.data, dev.nbytes, h)
            kv_append_async(kv, self._k_d, self._v_d, stream=s)
            gqa_decode_async(
                self._q_d, kv, self._out_d, n_heads=self.n_heads, stream=s, algorithm=algorithm
            )
            drv("cuMemcpyDtoHAsync", self.out.ctypes.data, self._out_d.ptr, self._out_d.nbytes, h)
            drv("cuMemcpyDtoHAsync", self._state.ctypes.data, kv.state.ptr, 8, h)
        graph.keep_alive(
            self.q,
            self.k,
            self.v,
            self.out,
            self._state,
            self._q_d,
            self._k_d,
            self._v_d,
            self._out_d,
            kv,
        )
        exec_ = graph.instantiate()
        graph.close()
        return exec_

    def launch(self) -> None:
        """Queue one replay with whatever the staging arrays hold (no waiting)."""
        self.kv.mark_device_appends()
        self._exec.launch(self.stream)

    def synchronize(self) -> None:
        """Wait for the last replay; then ``out`` holds its result.

        Raises:
            KVCapacityError: the replay found the cache full (nothing was appended, and
                ``out`` holds the decode over the unchanged cache).
        """
        self.stream.synchronize()
        seq, overflow = int(self._state[0]), int(self._state[1])
        if overflow:
            self.kv.synchronize()  # resets the flag and raises KVCapacityError
        self.kv._seq_len, self.kv._host_seq_valid = seq, True

    def __call__(self, q: np.ndarray, k_tok: np.ndarray, v_tok: np.ndarray) -> np.ndarray:
        """Append ``k_tok``/``v_tok`` and decode ``q``: one graph launch, one sync.

        Returns:
            A new numpy array of shape (n_heads, head_dim) in the cache dtype.

        Raises:
            KVCapacityError: the cache is full (checked on the host first: nothing runs).
            TypeError, ValueError: wrong shapes or dtypes.
        """
        kv = self.kv
        for arr, stage, name in (
            (q, self.q, "q"),
            (k_tok, self.k, "k_tok"),
            (v_tok, self.v, "v_tok"),
        ):
            if not isinstance(arr, np.ndarray) or arr.dtype != kv.dtype or arr.size != stage.size:
                got = (
                    f"{arr.dtype} of size {arr.size}" if isinstance(arr, np.ndarray) else type(arr)
                )
                raise TypeError(
                    f"{name}: expected a numpy array of {stage.size} {kv.dtype} elements, got {got}"
                )
        if kv.seq_len >= kv.capacity:
            raise KVCapacityError(kv.seq_len, kv.capacity)
        self.q.reshape(-1)[:] = q.reshape(-1)
        self.k.reshape(-1)[:] = k_tok.reshape(-1)
        self.v.reshape(-1)[:] = v_tok.reshape(-1)
        self.launch()
        self.synchronize()
        return self.out.copy()

    step = __call__

    def close(self) -> None:
        """Free the executable graph and the staging buffers."""
        self._exec.close()
        for arr in (self._q_d, self._k_d, self._v_d, self._out_d):
            arr.close()

    def __enter__(self) -> DecodeGraph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
