"""KVCache's decodes: the host decode (numpy q in, numpy out), device q, the launch records
of a cache and what `prepare` loads before a capture. A mixin of `KVCache`."""

from __future__ import annotations

from typing import Any, Literal, overload

import numpy as np

from ..decode import plan as attention
from ..decode.checks import (
    ArrayInfo,
    check_dims,
    check_host_extent,
    check_int,
    check_q,
    q_heads,
)
from ..decode.features import check_features
from ..decode.fp8 import (
    ROW_DTYPES,
    quantize_kernel,
)
from ..decode.launches import allocate_scratch
from ..decode.pair import feature_key
from ..decode.plan import check_algorithm
from ..decode.records import DecodeRecord, assemble, planned
from ..driver.calls import (
    SUCCESS,
    check,
    graph_launch_raw,
    stream_sync_raw,
)
from ..driver.memory import DeviceArray, as_dtype, empty
from ..driver.stream import stream_handle, stream_key
from ..kernels import abi
from ..kernels.catalogue import split_kernel
from ..types import ArrayLike, DeviceArrayLike, DTypeLike, StreamLike
from .appends import append_kernel
from .host_decode import HostDecoder, check_q_dtype, decode_features
from .own_values import refuse
from .state import CacheState

_OK = SUCCESS
_graph_launch = graph_launch_raw
_stream_sync = stream_sync_raw

__all__ = ["Decodes"]


class Decodes(CacheState):
    """The decode half of `KVCache` (its methods take the cache's state as ``self``)."""

    @overload
    def decode(
        self,
        q: np.ndarray,
        *,
        n_heads: int | None = None,
        stream: StreamLike = None,
        algorithm: str = "auto",
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: ArrayLike = None,
        alibi_slopes: ArrayLike = None,
        scale: float | None = None,
        return_lse: Literal[False] = False,
        tree_mask: ArrayLike = None,
    ) -> np.ndarray: ...

    @overload
    def decode(
        self,
        q: np.ndarray,
        *,
        n_heads: int | None = None,
        stream: StreamLike = None,
        algorithm: str = "auto",
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: ArrayLike = None,
        alibi_slopes: ArrayLike = None,
        scale: float | None = None,
        return_lse: Literal[True],
        tree_mask: ArrayLike = None,
    ) -> tuple[np.ndarray, np.ndarray]: ...

    @overload
    def decode(
        self,
        q: DeviceArrayLike,
        *,
        n_heads: int | None = None,
        stream: StreamLike = None,
        algorithm: str = "auto",
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: ArrayLike = None,
        alibi_slopes: ArrayLike = None,
        scale: float | None = None,
        return_lse: Literal[False] = False,
        tree_mask: ArrayLike = None,
    ) -> DeviceArray: ...

    @overload
    def decode(
        self,
        q: DeviceArrayLike,
        *,
        n_heads: int | None = None,
        stream: StreamLike = None,
        algorithm: str = "auto",
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: ArrayLike = None,
        alibi_slopes: ArrayLike = None,
        scale: float | None = None,
        return_lse: Literal[True],
        tree_mask: ArrayLike = None,
    ) -> tuple[DeviceArray, DeviceArray]: ...

    def decode(
        self,
        q: ArrayLike,
        *,
        n_heads: int | None = None,
        stream: StreamLike = None,
        algorithm: str = "auto",
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: ArrayLike = None,
        alibi_slopes: ArrayLike = None,
        scale: float | None = None,
        return_lse: bool = False,
        tree_mask: ArrayLike = None,
    ) -> np.ndarray | DeviceArray | tuple[np.ndarray, np.ndarray] | tuple[DeviceArray, DeviceArray]:
        """Decode one query (or several: a speculative verify) against the resident cache.

        numpy in, numpy out (copied in and back, complete: one graph launch, one wait);
        device arrays in (a PyTorch CUDA tensor, DeviceArray, CuPy...), a DeviceArray out
        (``torch.from_dlpack`` takes it without a copy), queued with no host round trip
        on the cache's stream, ordered after the work queued so far on ``stream``, whose
        later work then waits for the result. Not capturable (a graph decodes with
        `gqa_decode_async`).

        Args:
            q: ``(n_heads*head_dim,)``, ``(n_heads, head_dim)`` or PyTorch SDPA's ``(1,
                n_heads, 1, head_dim)``, cache dtype (an fp8 cache: float16 or bfloat16);
                the result has q's shape. Or ``(n_q, n_heads, head_dim)``: n_q queries,
                the cache's last n_q tokens (append them first), as `gqa_decode` takes
                them; the result ``(n_q, n_heads, head_dim)``, the LSE ``(n_q, n_heads)``.
                A cache with ``head_dim_v`` apart: fp16/bf16 q, results ``head_dim_v``
                wide (``q.shape[:-1] + (head_dim_v,)``; flat q, ``(n_heads*head_dim_v,)``),
                through ``gqa_decode(..., head_dim_v=)`` over the host's length.
            n_heads: query heads, a multiple of ``n_kv_heads`` (default: read from q's
                shape; given, checked against it).
            stream: with a device q, the stream it was written on and the result is
                wanted on (None: PyTorch's current stream for a PyTorch tensor, else the
                legacy default stream); a numpy q ignores it.
            algorithm: ``"auto"`` or ``"parity"``.
            sliding_window: as `gqa_decode`.
            logits_soft_cap: as `gqa_decode`.
            sinks: as `gqa_decode` (numpy: copied in with q; with a device q, a float32
                device array too).
            alibi_slopes: like ``sinks``.
            scale: as `gqa_decode`.
            return_lse: also return the log-sum-exp per query head (float32, numpy or a
                device array like the result).
            tree_mask: with several queries, as `gqa_decode` (None: causal).

        Returns:
            An array of q's shape and dtype (numpy or a DeviceArray, as q); with
                ``return_lse``, ``(out, lse)``, lse float32 of shape (n_heads,).

        Raises:
            TypeError, ValueError: bad q, n_heads or features, naming them.
            ClosedError: the cache or its stream was closed.
            FerroxError: a device q with ``stream`` being captured into a graph.
        """
        if self.own_v is not None:  # V rows head_dim_v wide: gqa_decode(..., head_dim_v=)
            return self.own_v.decode(
                self, q, n_heads, stream, algorithm,
                dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                     sinks=sinks, alibi_slopes=alibi_slopes, scale=scale, return_lse=return_lse),
                tree_mask,
            )  # fmt: skip
        qs: tuple[int, ...] = tuple(getattr(q, "shape", ()))
        if tree_mask is not None or len(qs) == 3:  # (n_q, n_heads, head_dim)
            from .device_ops import decode_many  # (device_ops imports this module)

            return decode_many(
                self, q, n_heads, stream, algorithm,
                dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                     sinks=sinks, alibi_slopes=alibi_slopes, scale=scale, return_lse=return_lse),
                tree_mask,
            )  # fmt: skip
        if not isinstance(q, np.ndarray):
            from .device_ops import decode_device  # (device_ops imports this module)

            return decode_device(
                self, q, n_heads, stream, algorithm,
                dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                     sinks=sinks, alibi_slopes=alibi_slopes, scale=scale, return_lse=return_lse),
            )  # fmt: skip
        if n_heads is None:
            n_heads = q_heads(q.shape, self.head_dim)
        if not (
            sliding_window is None and logits_soft_cap is None and sinks is None
            and alibi_slopes is None and scale is None and return_lse is False
        ):  # fmt: skip
            return decode_features(
                self, q, n_heads, algorithm,
                dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                     sinks=sinks, alibi_slopes=alibi_slopes, scale=scale, return_lse=return_lse),
            )  # fmt: skip
        with self.lock:  # the staging and the result are the cache's: one decode at a time
            if self._closed or self.stream._closed:
                self.check_open()
            qdt = q.dtype if self.fp8 and type(q) is np.ndarray else self.dtype
            try:
                dec = self._decoders.get((n_heads, algorithm, qdt))
            except TypeError:  # an unhashable argument, which the checks name
                dec = None
            if dec is None:
                n_heads, _, _ = check_dims(n_heads, self.n_kv_heads, self.head_dim)
                algorithm = check_algorithm(algorithm)
                check_q_dtype(self, q, algorithm)
                check_q(ArrayInfo(q.shape, q.dtype, False), n_heads, self.head_dim)
                dec = HostDecoder(self, n_heads, algorithm, q_dtype=qdt)
                self._decoders[n_heads, algorithm, qdt] = dec
            if not (type(q) is np.ndarray and q.dtype == dec.q_dtype and q.shape in dec.shapes):
                check_q_dtype(self, q, algorithm)
                check_q(ArrayInfo(q.shape, q.dtype, False), n_heads, self.head_dim)
            check_host_extent(q, "q")
            seq = self._seq_len if self._host_seq_valid else self.seq_len
            if seq == 0:
                return np.zeros(q.shape, q.dtype)
            self.device.activate()
            np.copyto(dec.q_stage, q.reshape(-1))
            if not self._device_seq_current:
                self.device_length()
            result = _graph_launch(*dec.launch_args)
            if result[0] is not _OK:
                check(result, "cuGraphLaunch")
            result = _stream_sync(self._h)
            if result[0] is not _OK:
                check(result, "cuStreamSynchronize")
            return dec.out_stage.reshape(q.shape).copy()

    def decode_record(
        self,
        q_dev: DeviceArray,
        out_dev: DeviceArray,
        n_heads: int,
        algorithm: str,
        stream: Any,
        *,
        length_on_device: bool,
        features: tuple[int, Any] | None = None,
        queries: tuple[int, DeviceArray | None, int] = (1, None, 0),
    ) -> DecodeRecord:
        """The launch record of decodes of ``n_heads`` query heads against this cache on
        ``stream`` (made once per signature): the length read on the device
        (``length_on_device``, for graphs and ``gqa_decode_async``) or written per call.

        Every decode of a cache is planned for its capacity (with a window, for at most the
        window), so the eager path and graphs captured once chunk the sequence identically
        and agree bit for bit. ``features``: (F_* bits, abi.FeatureArgs), whose values
        the record keeps (a key of their own). ``queries``: a verify's (n_q, its tree mask
        on the device or None, the mask's mode), q and out then (n_q, n_heads, head_dim)."""
        self.check_open()
        aligned = ((q_dev.ptr | out_dev.ptr) & 15) == 0
        sid = stream_key(stream)
        bits, fargs = features if features is not None else (0, None)
        fkey = None if fargs is None else feature_key(fargs)
        n_q, mask, mask_mode = queries
        key = (n_heads, algorithm, aligned, sid, length_on_device, attention.OVERRIDES, bits, fkey,
               q_dev.dtype, n_q, 0 if mask is None else mask.ptr, mask_mode)  # fmt: skip
        record = self._records.get(key)
        if record is None:
            record = self._records.keep(key, assemble(
                q_dev, self._k, self._v, out_dev, stream=stream_handle(sid), keep_workspace=False,
                n_heads=n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
                seq_len=self.capacity if length_on_device else 0,
                seq_len_dev=self.state if length_on_device else None,
                plan_seq=self._plan_seq(fargs), aligned=aligned, algorithm=algorithm,
                dtype=q_dev.dtype if self.fp8 else self.dtype, bits=bits, fp8=self.fp8,
                features=fargs, kv_scales=self.kv_scales, n_q=n_q, mask=mask, mask_mode=mask_mode,
                workspace=lambda floats: self.split_workspace(n_q * n_heads, floats),
                **self.four_bit_args(),
            ))  # fmt: skip
        return record

    def four_bit_args(self) -> dict[str, Any]:
        """`launches_for`'s arguments for a 4-bit cache (its block scales, its rotation);
        none for other caches."""
        four = self.four_bit
        if four is None:
            return {}
        return {
            "q4_scales": (four.k_scales, four.v_scales),
            "rotate": four.rotate,
            "q4_head_stride": four.head_stride,
        }

    def launch_decode(
        self,
        q_dev: DeviceArray,
        out_dev: DeviceArray,
        *,
        n_heads: int,
        stream: Any,
        algorithm: str = "auto",
        length_on_device: bool = False,
    ) -> None:
        """Queue a decode of validated device arrays against this cache (no checks)."""
        with self.lock:
            record = self.decode_record(
                q_dev, out_dev, n_heads, algorithm, stream, length_on_device=length_on_device
            )
            if length_on_device:
                self.device_length()
            record.run((q_dev.ptr, self._k_ptr, self._v_ptr, out_dev.ptr, self._seq_len))

    def prepare(
        self,
        n_heads: int,
        algorithm: str = "auto",
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: DeviceArrayLike = None,
        alibi_slopes: DeviceArrayLike = None,
        scale: float | None = None,
        return_lse: bool = False,
        q_dtype: DTypeLike = None,
        n_q: int = 1,
    ) -> None:
        """Load the kernels and allocate the scratch that decodes of ``n_heads`` query heads
        (with the features given, as `gqa_decode_async` takes them; ``return_lse`` for its
        ``out_lse``) need, so that they can then be captured into a graph (allocation and
        module loading are not capturable), and bring the device's copy of the length up
        to date, keeping it so after every host append. DecodeGraph does this itself.
        ``q_dtype``: an fp8 cache's q (float16 or bfloat16; default bfloat16); others
        take their own dtype. ``n_q``: the queries of a verify's q ``(n_q, n_heads,
        head_dim)`` (with or without a tree mask: the kernels are the same).

        Raises:
            ClosedError: the cache or its stream was closed.
            FerroxError: a cache with ``head_dim_v`` apart (it has no graph path).
        """
        if self.own_v is not None:
            refuse(self, "prepare")
        n_heads, _, _ = check_dims(n_heads, self.n_kv_heads, self.head_dim)
        algorithm = check_algorithm(algorithm)
        feats = check_features(
            n_heads, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
            sinks=sinks, alibi_slopes=alibi_slopes, scale=scale, return_lse=return_lse,
        )  # fmt: skip
        bits = abi.feature_bits_of(feats)
        qdt = self.q_dtype_for(q_dtype, algorithm)
        n_q = check_int(n_q, "n_q", 1, self.capacity)
        if n_q > 1 and algorithm == "parity":
            raise ValueError("algorithm: a decode of several queries needs the split kernels")
        with self.lock:
            self._prepare(n_heads, algorithm, bits, feats.sliding_window, qdt)
            if n_q > 1 or self.four_bit is not None:  # the rows kernels' record and scratch
                # (made, never run; a 4-bit cache's one-query decodes are rows decodes too)
                with empty((n_q * n_heads * self.head_dim,), qdt, device=self.device) as probe:
                    self.decode_record(
                        probe, probe, n_heads, algorithm, self.stream, length_on_device=True,
                        features=abi.feature_args(feats, self.head_dim), queries=(n_q, None, 0),
                    )  # fmt: skip

    def q_dtype_for(self, q_dtype: DTypeLike, algorithm: str) -> np.dtype:
        """The q dtype of this cache's decodes: its own, or an fp8 cache's ``q_dtype``
        (float16 or bfloat16, default bfloat16; the split kernels only)."""
        if not self.fp8:
            if q_dtype is not None and as_dtype(q_dtype, "q_dtype") != self.dtype:
                raise TypeError(f"q_dtype: the {self.dtype} cache decodes {self.dtype} q")
            return self.dtype
        qdt = ROW_DTYPES[2] if q_dtype is None else as_dtype(q_dtype, "q_dtype")
        if qdt not in ROW_DTYPES[1:]:
            raise TypeError(f"q_dtype: expected float16 or bfloat16 for an fp8 cache, got {qdt}")
        if algorithm == "parity":
            raise ValueError("algorithm: fp8 caches decode with the split kernels ('auto')")
        return qdt

    def _plan_seq(self, fargs: Any) -> int:
        """The length decodes of this cache are planned for: its capacity, or the window."""
        if fargs is None or not fargs.window:
            return self.capacity
        return min(self.capacity, fargs.window)

    def _prepare(
        self, n_heads: int, algorithm: str, bits: int = 0, window: int | None = None,
        q_dtype: np.dtype | None = None,
    ) -> None:  # fmt: skip
        self.check_open()
        qdt = self.dtype if q_dtype is None else q_dtype
        if self.four_bit is None:  # (a 4-bit cache's were loaded with it)
            if self.fp8:
                quantize_kernel(self.fp8, self.device)  # (one module: every row dtype's)
            else:
                append_kernel(self.device)
        self.device_length()
        self._eager_seq = True  # a graph will read the length: host appends keep it current
        if not bits:
            with empty((n_heads * self.head_dim,), qdt, device=self.device) as probe:
                self.decode_record(probe, probe, n_heads, algorithm, self.stream,
                                   length_on_device=True)  # fmt: skip
        if algorithm != "parity" and self.four_bit is None:  # (4-bit: the rows plan above)
            aligned = ((self._k_ptr | self._v_ptr) & 15) == 0
            plan_seq = self.capacity if window is None else min(self.capacity, window)
            plan, _ = planned(
                self.device, qdt, n_heads, self.n_kv_heads, self.head_dim, plan_seq, aligned,
                bits, self.fp8, lambda floats: self.split_workspace(n_heads, floats),
            )  # fmt: skip
            combine = plan.combine_spec(qdt)
            if combine is not None:  # a cluster plan has none
                split_kernel(combine, self.device)

    def split_workspace(self, n_heads: int, floats: int) -> DeviceArray | None:
        """Scratch for decodes of ``n_heads`` query heads (None where the plan needs none:
        ``floats`` 0). Graphs bake its address in, so it lives as long as the cache; a plan
        that needs more (arrays not 16-byte aligned take other kernels) grows it, and the
        outgrown buffer too stays until the cache is closed."""
        if floats <= 0:
            return None
        ws = self._workspaces.get(n_heads)
        if ws is None or ws.size < floats:
            grown = allocate_scratch(
                floats,
                self.device,
                f"n_heads: the decode scratch for {n_heads} heads must exist before a capture "
                f"starts: call kv.prepare(n_heads={n_heads}) (or decode once) before capturing",
            )
            if ws is not None:
                self._outgrown.append(ws)
            ws = self._workspaces[n_heads] = grown
        return ws
