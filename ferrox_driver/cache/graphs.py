"""Whole token steps over KV caches captured once as CUDA graphs and replayed per token.

``DecodeGraph`` captures one cache's step (copy q and the new rows in, append, decode,
copy out) once and replays it for every token, with no re-capture and no node update: the
length lives on the device. ``LayerDecodeGraph`` does the same for every layer of a model.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from ..decode.checks import check_dims, check_int
from ..decode.features import check_features
from ..decode.plan import check_algorithm
from ..decode.queries import check_tree_mask
from ..driver.calls import drv
from ..driver.graph import GraphExec
from ..driver.memory import DeviceArray, empty, pinned_empty, to_device
from ..driver.stream import Stream, stream_handle
from ..errors import ClosedError
from ..types import ArrayLike, DTypeLike
from .device_ops import gqa_decode_async, kv_append_async
from .kv_cache import KVCache, check_cache
from .layers import LayerKVCache
from .own_values import refuse

__all__ = ["DecodeGraph", "LayerDecodeGraph"]


def _staging(sizes: tuple[int, ...], dt: np.dtype, device: Any) -> tuple[list[int], Any, Any]:
    """Parts of ``sizes`` elements in one page-locked buffer and one device buffer, each
    part 256-byte aligned (a replay copies them in with one copy): the parts' starts and
    the two buffers."""
    step = 256 // dt.itemsize
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + -(-n // step) * step)
    total = starts[-1] + sizes[-1]
    return starts, pinned_empty((total,), dt), empty((total,), dt, device=device)


def _got(arr: Any) -> str:
    """What a graph step was given instead of its numpy staging's kind of array; a device
    array's message names the calls that take one."""
    if isinstance(arr, np.ndarray):
        return f"{arr.dtype} of size {arr.size}"
    what = f"{type(arr).__module__}.{type(arr).__name__}"
    if hasattr(arr, "__dlpack__") or hasattr(arr, "__cuda_array_interface__"):
        return (
            f"a device array ({what}): the graph copies numpy arrays in; device arrays go "
            f"to fd.kv_append_async and fd.gqa_decode_async, which a graph of your own "
            f"(torch.cuda.graph, Stream.capture) can capture"
        )
    return what


def _stage_mask(
    mask: np.ndarray | None, stage: np.ndarray, in_d: DeviceArray, starts: list[int], isz: int
) -> tuple[np.ndarray | None, DeviceArray | None]:
    """A graph's (n_q, n_q) bool mask staged with q (its page-locked ``stage``, element
    ``starts[3]`` of ``isz`` bytes on) and filled with ``mask``, and its device view in
    ``in_d``; (None, None) for a causal graph (whose ``starts`` stop at 3)."""
    if mask is None:
        return None, None
    n_q, at = mask.shape[0], starts[3] * isz
    host = stage.view(np.uint8)[at : at + n_q * n_q].view(np.bool_).reshape(n_q, n_q)
    host[...] = mask
    return host, in_d.view((n_q, n_q), np.bool_, offset=at)


def _step_mask(tree_mask: Any, staged: np.ndarray | None, n_q: int) -> np.ndarray | None:
    """A step's ``tree_mask`` checked (None: keep the staged one), before any staging.

    Raises:
        TypeError, ValueError: naming ``tree_mask``; also for a graph built causal.
    """
    if tree_mask is None:
        return None
    if staged is None:
        raise ValueError("tree_mask: this graph was built causal (no tree_mask)")
    return _host_mask(tree_mask, n_q)


def _host_mask(tree_mask: Any, n_q: int) -> np.ndarray:
    """A graph's tree mask, checked: bool ``(n_q, n_q)`` (a packed one unpacked).

    Raises:
        TypeError, ValueError: naming ``tree_mask``.
    """
    if n_q == 1:
        raise ValueError("tree_mask: only with several query tokens per step (n_q > 1)")
    if not isinstance(tree_mask, np.ndarray):
        raise TypeError(
            f"tree_mask: expected a numpy array (staged with q at each step), got {_got(tree_mask)}"
        )
    return check_tree_mask(tree_mask, n_q)


class DecodeGraph:
    """One token step (copy in q/k/v, append, decode, copy out) captured once as a CUDA
    graph and replayed for every token.

    Args:
        kv: the cache to append to and decode against.
        n_heads: query heads, a multiple of ``kv.n_kv_heads``.
        stream: where the graph runs (default: the cache's stream, so it stays ordered
            with the cache's own appends).
        algorithm: ``"auto"`` or ``"parity"``.
        sliding_window: as `gqa_decode`; the window follows the cache's length.
        logits_soft_cap: as `gqa_decode`.
        sinks: as `gqa_decode`: a float32 device array (read at each step), or numpy,
            copied once into the device array ``sinks``.
        alibi_slopes: like ``sinks``.
        scale: as `gqa_decode`.
        return_lse: each step also writes the log-sum-exp per query head into ``lse``.
        q_dtype: an fp8 cache's dtype for q, the rows and the result (float16 or bfloat16;
            default bfloat16): the rows are quantized on the device at each step. Other
            caches take their own dtype.
        n_q: tokens per step (a speculative verify; one graph per n_q): each step appends
            n_q rows and decodes n_q queries, the cache's last n_q tokens, causal or under
            the tree mask. Then q, the rows, the result and the LSE take a leading n_q.
        tree_mask: with n_q > 1, a numpy mask (bool ``(n_q, n_q)`` or bit-packed, see
            `gqa_decode`): the graph reads a mask staged with q at each step (``tree_mask``),
            starting from this one; a step may pass another. None: causal.

    Calling it is thread-safe (it takes the cache's lock); ``launch`` + ``synchronize``
    as a pair are the caller's to order. Closing the cache or the stream makes it raise
    `ClosedError`, as does its own ``close()``.

    Attributes:
        dtype: the dtype of q, the rows and the result (the cache's, or an fp8 cache's
            ``q_dtype``).
        q: page-locked staging for the query, (n_heads, head_dim); fill it in place and
            call ``launch`` then ``synchronize`` to skip even the staging copy.
        k: page-locked staging for the new token's K row, (n_kv_heads, head_dim).
        v: like ``k``, for V.
        out: page-locked array the result lands in, (n_heads, head_dim).
        lse: with ``return_lse``, the page-locked (n_heads,) float32 LSE of the last step.
        tree_mask: with a tree mask, the page-locked bool (n_q, n_q) mask the next step
            reads (fill it in place with ``launch``, keeping its diagonal set); else None.
        sinks: the device array of sinks the graph reads (None without); write it in place
            to change them.
        alibi_slopes: like ``sinks``, for the slopes.
    """

    def __init__(
        self,
        kv: KVCache,
        *,
        n_heads: int,
        stream: Stream | None = None,
        algorithm: str = "auto",
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: ArrayLike = None,
        alibi_slopes: ArrayLike = None,
        scale: float | None = None,
        return_lse: bool = False,
        q_dtype: DTypeLike = None,
        n_q: int = 1,
        tree_mask: ArrayLike = None,
    ) -> None:
        self._closed = True  # until built
        self.kv = check_cache(kv)
        if kv.own_v is not None:  # (its decode reads the length on the host)
            refuse(kv, "DecodeGraph")
        self.n_heads, _, _ = check_dims(n_heads, kv.n_kv_heads, kv.head_dim)
        algorithm = check_algorithm(algorithm)
        self.n_q = n_q = check_int(n_q, "n_q", 1, kv.capacity)
        if n_q > 1 and algorithm == "parity":
            raise ValueError("algorithm: a decode of several queries needs the split kernels")
        mask = None if tree_mask is None else _host_mask(tree_mask, n_q)
        # q, the rows and the result: the cache's dtype, or an fp8 cache's q_dtype (its rows
        # quantized on the device by the graph's append)
        self.dtype = kv.q_dtype_for(q_dtype, algorithm)
        feats = check_features(
            self.n_heads, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
            sinks=sinks, alibi_slopes=alibi_slopes, scale=scale, return_lse=return_lse,
        )  # fmt: skip
        if algorithm == "parity" and (not feats.plain or scale is not None or return_lse):
            raise ValueError("algorithm: the features need the split kernels ('auto')")
        if stream is not None and not isinstance(stream, Stream):
            raise TypeError(f"stream: expected a ferrox_driver.Stream, got {type(stream)}")
        if stream is not None:
            stream._check_open()
        self.stream = kv.stream if stream is None else stream
        self._h = stream_handle(self.stream)
        dt, hd = self.dtype, kv.head_dim
        # q, k and v (and a tree mask's bytes) share one page-locked buffer and one device
        # buffer (each part 256-byte aligned), so a replay copies them in with one copy.
        lead = () if n_q == 1 else (n_q,)  # (one token: today's shapes)
        sizes: tuple[int, ...] = (n_q * self.n_heads * hd, n_q * kv.row_elems, n_q * kv.row_elems)
        if mask is not None:
            sizes += (-(-(n_q * n_q) // dt.itemsize),)
        starts, self._stage, self._in_d = _staging(sizes, dt, kv.device)
        parts = [self._stage[a : a + n] for a, n in zip(starts, sizes, strict=True)]
        self.q = parts[0].reshape(*lead, self.n_heads, hd)
        self.k = parts[1].reshape(*lead, kv.n_kv_heads, hd)
        self.v = parts[2].reshape(*lead, kv.n_kv_heads, hd)
        self._flat = parts[:3]
        self.out = pinned_empty((*lead, self.n_heads, hd), dt)
        shapes = ((*lead, self.n_heads, hd), (*lead, kv.n_kv_heads, hd)) if lead else (
            (sizes[0],), (sizes[1],))  # fmt: skip
        self._q_d, self._k_d, self._v_d = (
            self._in_d.view(shape, offset=a * dt.itemsize)
            for a, shape in zip(starts, (shapes[0], shapes[1], shapes[1]), strict=False)
        )
        self.tree_mask, self._mask_d = _stage_mask(
            mask, self._stage, self._in_d, starts, dt.itemsize
        )
        self._out_d = empty(shapes[0], dt, device=kv.device)
        # the features' per-head arrays on the device (numpy ones copied once into arrays
        # of this graph: ``sinks``/``alibi_slopes``, writable in place), and the LSE
        self._owned: list[DeviceArray] = []
        self.sinks = self._per_head(feats.sinks)
        self.alibi_slopes = self._per_head(feats.alibi_slopes)
        self._lse_d = None
        self.lse = None
        if feats.return_lse:
            self._lse_d = empty((n_q * self.n_heads,), np.float32, device=kv.device)
            self._owned.append(self._lse_d)
            self.lse = pinned_empty((*lead, self.n_heads), np.float32)
        self._features: dict[str, Any] = {
            "sliding_window": feats.sliding_window, "logits_soft_cap": feats.logits_soft_cap,
            "scale": feats.scale,
        }  # fmt: skip
        with kv.lock:
            kv.synchronize()  # earlier eager work is done; the host seq_len is exact
            self._exec = self._capture(algorithm)
        self._exec_handle = self._exec.handle
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def _check_open(self) -> None:
        """Raise ClosedError when this graph, its cache or its stream was closed."""
        if self._closed:
            raise ClosedError("DecodeGraph")
        self.kv.check_open("DecodeGraph")
        if self.stream._closed:
            raise ClosedError("DecodeGraph", "runs on a Stream that was closed")

    def _per_head(self, values: Any) -> Any:
        """A feature's per-head array on the device: a device array as given, numpy copied."""
        if values is None or not isinstance(values, np.ndarray):
            return values
        arr = to_device(np.ascontiguousarray(values, np.float32), device=self.kv.device)
        self._owned.append(arr)
        return arr

    def _capture(self, algorithm: str) -> GraphExec:
        kv, s, h = self.kv, self.stream, self._h
        feats: dict[str, Any] = {k: v for k, v in self._features.items() if v is not None}
        for name, arr in (("sinks", self.sinks), ("alibi_slopes", self.alibi_slopes)):
            if arr is not None:
                feats[name] = arr
        # Load kernels and allocate scratch first: neither is capturable. Each launch brings
        # the length up to date itself (appending_on_device).
        with kv.replays_update_length():
            kv.prepare(self.n_heads, algorithm, return_lse=self._lse_d is not None,
                       q_dtype=self.dtype if kv.fp8 else None, n_q=self.n_q,
                       **feats)  # fmt: skip
            with s.capture() as graph:
                drv("cuMemcpyHtoDAsync", self._in_d.ptr, self._stage.ctypes.data,
                    self._in_d.nbytes, h)  # fmt: skip
                kv_append_async(kv, self._k_d, self._v_d, stream=s)
                gqa_decode_async(
                    self._q_d, kv, self._out_d, n_heads=self.n_heads, stream=s,
                    algorithm=algorithm, out_lse=self._lse_d, tree_mask=self._mask_d, **feats,
                )  # fmt: skip
                drv("cuMemcpyDtoHAsync", self.out.ctypes.data, self._out_d.ptr,
                    self._out_d.nbytes, h)  # fmt: skip
                if self._lse_d is not None and self.lse is not None:
                    drv("cuMemcpyDtoHAsync", self.lse.ctypes.data, self._lse_d.ptr,
                        self._lse_d.nbytes, h)  # fmt: skip
        graph.keep_alive(self._stage, self.out, self._in_d, self._out_d, kv, *self._owned,
                         *((self.lse,) if self.lse is not None else ()))  # fmt: skip
        exec_ = graph.instantiate()
        graph.close()
        return exec_

    def launch(self) -> None:
        """Queue one replay with whatever the staging arrays hold (no waiting).

        Raises:
            ClosedError: this graph, its cache or its stream was closed.
        """
        kv = self.kv
        with kv.lock:
            self._check_open()
            kv.appending_on_device()
            kv.device.activate()
            drv("cuGraphLaunch", self._exec_handle, self._h)

    def synchronize(self) -> None:
        """Wait for the last replay; then ``out`` holds its result.

        Raises:
            KVCapacityError: the replay found the cache full (nothing was appended, and
                ``out`` holds the decode over the unchanged cache).
            ClosedError: this graph, its cache or its stream was closed.
        """
        self._check_open()
        if self.stream is not self.kv.stream:
            drv("cuStreamSynchronize", self._h)
        self.kv.synchronize()  # reads the device's length (and its overflow flag)

    def __call__(
        self, q: np.ndarray, k_tok: np.ndarray, v_tok: np.ndarray, tree_mask: ArrayLike = None
    ) -> np.ndarray:
        """Append ``k_tok``/``v_tok`` and decode ``q``: one graph launch, one sync.

        With ``n_q`` > 1: ``q`` is ``(n_q, n_heads, head_dim)``, the rows ``(n_q,
        n_kv_heads, head_dim)``; a graph built with a tree mask takes this step's
        ``tree_mask`` (None: the one staged, ``self.tree_mask``).

        Returns:
            A new numpy array of shape (n_heads, head_dim) (``(n_q, n_heads, head_dim)``)
                in ``dtype`` (built with ``return_lse``, the step's LSE is then in ``lse``).

        Raises:
            KVCapacityError: the tokens would not fit (checked on the host first: nothing
                runs).
            TypeError, ValueError: wrong shapes or dtypes.
            ClosedError: this graph, its cache or its stream was closed.
        """
        kv = self.kv
        dt = self.dtype
        fq, fk, fv = self._flat
        if not (
            type(q) is np.ndarray and type(k_tok) is np.ndarray and type(v_tok) is np.ndarray
            and q.dtype == dt and k_tok.dtype == dt and v_tok.dtype == dt
            and q.size == fq.size and k_tok.size == fk.size and v_tok.size == fv.size
        ):  # fmt: skip
            for arr, stage, name in ((q, fq, "q"), (k_tok, fk, "k_tok"), (v_tok, fv, "v_tok")):
                if not isinstance(arr, np.ndarray) or arr.dtype != dt or arr.size != stage.size:
                    raise TypeError(
                        f"{name}: expected a numpy array of {stage.size} {dt} elements, got "
                        f"{_got(arr)}"
                    )
        mask = _step_mask(tree_mask, self.tree_mask, self.n_q)
        with kv.lock:  # the staging and the result are this graph's: one step at a time
            if self._closed or self.stream._closed:
                self._check_open()
            seq = kv.length_for_step("DecodeGraph", self.n_q)  # (checks open, room)
            np.copyto(fq, q.reshape(-1))
            np.copyto(fk, k_tok.reshape(-1))
            np.copyto(fv, v_tok.reshape(-1))
            if mask is not None and self.tree_mask is not None:
                np.copyto(self.tree_mask, mask)
            kv.appending_on_device()  # (launch's body: the checks above are its own)
            kv.device.activate()
            drv("cuGraphLaunch", self._exec_handle, self._h)
            drv("cuStreamSynchronize", self._h)
            kv.replay_appended(seq, self.n_q)  # checked to fit: no overflow, length known
            return self.out.copy()

    step = __call__

    def close(self) -> None:
        """Free the executable graph and the staging buffers; closing again does nothing."""
        if self._closed:
            return
        with self.kv.lock:  # not while another thread runs a step
            self._closed = True
            self._exec.close()
            for arr in (self._in_d, self._out_d, *self._owned):
                arr.close()

    def __enter__(self) -> DecodeGraph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LayerDecodeGraph:
    """A whole token of a model, every layer's append and decode, captured once as one
    CUDA graph and replayed for every token: one copy in (every layer's q and new K and V
    rows), one launch, one copy out, one synchronize per token.

    Args:
        layers: the model's caches (a `LayerKVCache`; its layers share its stream).
        n_heads: query heads, a multiple of the caches' KV heads.
        sliding_window: as `DecodeGraph`, the same for every layer.
        logits_soft_cap: as `DecodeGraph`.
        sinks: as `DecodeGraph` (one array for every layer).
        alibi_slopes: as `DecodeGraph`.
        scale: as `DecodeGraph`.
        n_q: tokens per step, as `DecodeGraph`'s (one graph per n_q): q, the rows and the
            result then ``(n_layers, n_q, ...)``.
        tree_mask: as `DecodeGraph`'s, one mask for every layer.

    Calling it is thread-safe (it takes every layer's lock, in layer order).

    Attributes:
        dtype: the caches' dtype: q's, the rows' and the result's.
        q: page-locked staging, (n_layers, n_heads, head_dim) (``(n_layers, n_q, n_heads,
            head_dim)`` with n_q > 1, as the others).
        k: page-locked staging for the new token's K rows, (n_layers, n_kv_heads, head_dim).
        v: like ``k``, for V.
        out: page-locked array the results land in, (n_layers, n_heads, head_dim).
        tree_mask: as `DecodeGraph`'s.
    """

    def __init__(
        self,
        layers: LayerKVCache,
        *,
        n_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: ArrayLike = None,
        alibi_slopes: ArrayLike = None,
        scale: float | None = None,
        n_q: int = 1,
        tree_mask: ArrayLike = None,
    ) -> None:
        self._closed = True  # until built
        if not isinstance(layers, LayerKVCache):
            raise TypeError(
                f"layers: expected a ferrox_driver.LayerKVCache, got {type(layers).__name__}"
            )
        self.caches: list[KVCache] = list(layers)
        first = self.caches[0]
        self.n_heads, _, _ = check_dims(n_heads, first.n_kv_heads, first.head_dim)
        feats = check_features(
            self.n_heads, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
            sinks=sinks, alibi_slopes=alibi_slopes, scale=scale,
        )  # fmt: skip
        self.stream = layers.stream
        self._h = stream_handle(self.stream)
        n, dt, hd = len(self.caches), first.dtype, first.head_dim
        self.dtype = dt
        self.n_q = n_q = check_int(n_q, "n_q", 1, first.capacity)
        mask = None if tree_mask is None else _host_mask(tree_mask, n_q)
        lead = () if n_q == 1 else (n_q,)
        # every layer's q, then every layer's K rows, then V rows (then a tree mask's
        # bytes): one page-locked buffer and one device buffer (each part 256-byte
        # aligned), one copy in per token
        sizes: tuple[int, ...] = (n * n_q * self.n_heads * hd, n * n_q * first.row_elems,
                                  n * n_q * first.row_elems)  # fmt: skip
        if mask is not None:
            sizes += (-(-(n_q * n_q) // dt.itemsize),)
        starts, self._stage, self._in_d = _staging(sizes, dt, first.device)
        parts = [self._stage[a : a + size] for a, size in zip(starts, sizes, strict=True)]
        self.q = parts[0].reshape(n, *lead, self.n_heads, hd)
        self.k = parts[1].reshape(n, *lead, first.n_kv_heads, hd)
        self.v = parts[2].reshape(n, *lead, first.n_kv_heads, hd)
        self.out = pinned_empty((n, *lead, self.n_heads, hd), dt)
        self._out_d = empty((n * n_q * self.n_heads * hd,), dt, device=first.device)
        q_rows, kv_rows = n_q * self.n_heads * hd, n_q * first.row_elems
        q_shape = (*lead, self.n_heads, hd) if lead else (q_rows,)
        kv_shape = (*lead, first.n_kv_heads, hd) if lead else (kv_rows,)
        isz = dt.itemsize
        self._layer_views = [
            (
                self._in_d.view(q_shape, offset=(starts[0] + i * q_rows) * isz),
                self._in_d.view(kv_shape, offset=(starts[1] + i * kv_rows) * isz),
                self._in_d.view(kv_shape, offset=(starts[2] + i * kv_rows) * isz),
                self._out_d.view(q_shape, offset=i * q_rows * isz),
            )
            for i in range(n)
        ]
        self.tree_mask, self._mask_d = _stage_mask(mask, self._stage, self._in_d, starts, isz)
        self._owned: list[DeviceArray] = []
        self.sinks = self._per_head(feats.sinks, first)
        self.alibi_slopes = self._per_head(feats.alibi_slopes, first)
        self._features: dict[str, Any] = {
            k: v for k, v in (("sliding_window", feats.sliding_window),
                              ("logits_soft_cap", feats.logits_soft_cap), ("scale", feats.scale),
                              ("sinks", self.sinks), ("alibi_slopes", self.alibi_slopes))
            if v is not None
        }  # fmt: skip
        with contextlib.ExitStack() as locks:
            for kv in self.caches:
                locks.enter_context(kv.lock)
            for kv in self.caches:
                kv.synchronize()  # earlier eager work is done; the host lengths are exact
            self._exec = self._capture()
        self._exec_handle = self._exec.handle
        self._closed = False

    def _per_head(self, values: Any, kv: KVCache) -> Any:
        if values is None or not isinstance(values, np.ndarray):
            return values
        arr = to_device(np.ascontiguousarray(values, np.float32), device=kv.device)
        self._owned.append(arr)
        return arr

    def _capture(self) -> GraphExec:
        s, h = self.stream, self._h
        with contextlib.ExitStack() as modes:  # each replay brings the lengths up to date
            for kv in self.caches:
                modes.enter_context(kv.replays_update_length())
            for kv in self.caches:  # kernels and scratch first: neither is capturable
                kv.prepare(self.n_heads, n_q=self.n_q, **self._features)
            with s.capture() as graph:
                drv("cuMemcpyHtoDAsync", self._in_d.ptr, self._stage.ctypes.data,
                    self._in_d.nbytes, h)  # fmt: skip
                for kv, (q_d, k_d, v_d, out_d) in zip(self.caches, self._layer_views,
                                                      strict=True):  # fmt: skip
                    kv_append_async(kv, k_d, v_d, stream=s)
                    gqa_decode_async(q_d, kv, out_d, n_heads=self.n_heads, stream=s,
                                     tree_mask=self._mask_d, **self._features)  # fmt: skip
                drv("cuMemcpyDtoHAsync", self.out.ctypes.data, self._out_d.ptr,
                    self._out_d.nbytes, h)  # fmt: skip
        graph.keep_alive(self._stage, self.out, self._in_d, self._out_d, *self.caches,
                         *self._owned)  # fmt: skip
        exec_ = graph.instantiate()
        graph.close()
        return exec_

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("LayerDecodeGraph")
        for kv in self.caches:
            kv.check_open("LayerDecodeGraph")

    def __call__(
        self, q: np.ndarray, k_rows: np.ndarray, v_rows: np.ndarray, tree_mask: ArrayLike = None
    ) -> np.ndarray:
        """Append every layer's ``k_rows[i]``/``v_rows[i]`` and decode its ``q[i]``: one
        graph launch, one sync.

        Args:
            q: ``(n_layers, n_heads, head_dim)`` (or any shape of that size), the dtype's;
                ``(n_layers, n_q, n_heads, head_dim)`` with n_q > 1.
            k_rows: ``(n_layers, n_kv_heads, head_dim)``, the new token's K rows (``(n_layers,
                n_q, n_kv_heads, head_dim)``).
            v_rows: like ``k_rows``.
            tree_mask: as `DecodeGraph`'s step.

        Returns:
            A new numpy array of ``out``'s shape.

        Raises:
            KVCapacityError: a layer's cache is full (checked first: nothing runs).
            TypeError: wrong sizes or dtypes.
            ClosedError: this graph, a cache or the stream was closed.
        """
        for arr, stage, name in ((q, self.q, "q"), (k_rows, self.k, "k_rows"),
                                 (v_rows, self.v, "v_rows")):  # fmt: skip
            if not isinstance(arr, np.ndarray) or arr.dtype != self.dtype or arr.size != stage.size:
                raise TypeError(
                    f"{name}: expected a numpy array of {stage.size} {self.dtype} elements "
                    f"{stage.shape}, got {_got(arr)}"
                )
        mask = _step_mask(tree_mask, self.tree_mask, self.n_q)
        with contextlib.ExitStack() as locks:
            for kv in self.caches:
                locks.enter_context(kv.lock)
            self._check_open()
            seqs = [kv.length_for_step("LayerDecodeGraph", self.n_q) for kv in self.caches]
            np.copyto(self.q, q.reshape(self.q.shape))
            np.copyto(self.k, k_rows.reshape(self.k.shape))
            np.copyto(self.v, v_rows.reshape(self.v.shape))
            if mask is not None and self.tree_mask is not None:
                np.copyto(self.tree_mask, mask)
            for kv in self.caches:
                kv.appending_on_device()
            self.caches[0].device.activate()
            drv("cuGraphLaunch", self._exec_handle, self._h)
            drv("cuStreamSynchronize", self._h)
            for kv, seq in zip(self.caches, seqs, strict=True):  # checked to fit: no overflow
                kv.replay_appended(seq, self.n_q)
            return self.out.copy()

    step = __call__

    def close(self) -> None:
        """Free the executable graph and the buffers; closing again does nothing."""
        if self._closed:
            return
        with contextlib.ExitStack() as locks:
            for kv in self.caches:
                locks.enter_context(kv.lock)
            self._closed = True
            self._exec.close()
            for arr in (self._in_d, self._out_d, *self._owned):
                arr.close()

    def __enter__(self) -> LayerDecodeGraph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
