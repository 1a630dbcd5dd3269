"""KVCache.decode of a numpy q: the step (copy q in, decode reading the length on the
device, copy the result out) captured once per signature as a graph, so a decode is one
launch and one wait; and the checks of q that the decode entry points share."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..decode.checks import ArrayInfo, check_dims, check_host_extent, check_q
from ..decode.features import check_features
from ..decode.fp8 import ROW_DTYPES
from ..decode.plan import check_algorithm
from ..driver.calls import check, drv, graph_launch_raw, stream_sync_raw
from ..driver.memory import DeviceArray, empty, pinned_empty
from ..driver.stream import stream_handle
from ..kernels import abi

if TYPE_CHECKING:
    from .decoding import Decodes

__all__ = ["HostDecoder", "check_q_dtype", "check_q_dtype_of", "decode_features"]

_graph_launch = graph_launch_raw  # (the names the argument fuzz finds and fakes)
_stream_sync = stream_sync_raw


class HostDecoder:
    """What ``KVCache.decode`` needs for one (n_heads, algorithm), made once: page-locked
    staging for q and the result, their device copies, and the step (copy q in, decode
    reading the length on the device, copy the result out) captured as one graph, so a
    decode is one launch and one wait."""

    def __init__(
        self, kv: Decodes, n_heads: int, algorithm: str, feats: Any = None, q_dtype: Any = None
    ) -> None:
        shape = (n_heads * kv.head_dim,)
        self.shapes = {shape, (n_heads, kv.head_dim), (1, n_heads, 1, kv.head_dim)}
        self.q_dtype = qdt = kv.dtype if q_dtype is None else np.dtype(q_dtype)
        nbytes = shape[0] * qdt.itemsize
        self.q_stage = pinned_empty(shape, qdt)
        self.out_stage = pinned_empty(shape, qdt)
        self.q_dev = empty(shape, qdt, device=kv.device)
        self.out_dev = empty(shape, qdt, device=kv.device)
        # with features: page-locked staging and device copies of the per-head arrays (the
        # call's sinks, slopes in; the LSE out), copied by the graph too
        self.stages: dict[str, tuple[np.ndarray, DeviceArray]] = {}
        features = None
        if feats is not None:
            for role, wanted in (("sinks", feats.sinks is not None),
                                 ("alibi_slopes", feats.alibi_slopes is not None),
                                 ("lse", feats.return_lse)):  # fmt: skip
                if wanted:
                    host = pinned_empty((n_heads,), np.float32)
                    self.stages[role] = (host, empty((n_heads,), np.float32, device=kv.device))
            dev = {role: pair[1] for role, pair in self.stages.items()}
            features = abi.feature_args(
                feats, kv.head_dim, slopes=dev.get("alibi_slopes"), sinks=dev.get("sinks"),
                lse=dev.get("lse"),
            )  # fmt: skip
        record = kv.decode_record(
            self.q_dev, self.out_dev, n_heads, algorithm, kv.stream, length_on_device=True,
            features=features,
        )  # fmt: skip
        h = stream_handle(kv.stream)
        with kv.stream.capture() as graph:
            drv("cuMemcpyHtoDAsync", self.q_dev.ptr, self.q_stage.ctypes.data, nbytes, h)
            for role in ("sinks", "alibi_slopes"):
                if role in self.stages:
                    host, dev_arr = self.stages[role]
                    drv("cuMemcpyHtoDAsync", dev_arr.ptr, host.ctypes.data, host.nbytes, h)
            record.run((self.q_dev.ptr, kv.k_buffer.ptr, kv.v_buffer.ptr, self.out_dev.ptr, 0))
            drv("cuMemcpyDtoHAsync", self.out_stage.ctypes.data, self.out_dev.ptr, nbytes, h)
            if "lse" in self.stages:
                host, dev_arr = self.stages["lse"]
                drv("cuMemcpyDtoHAsync", host.ctypes.data, dev_arr.ptr, host.nbytes, h)
        graph.keep_alive(self.q_stage, self.out_stage, self.q_dev, self.out_dev, record,
                         *(x for pair in self.stages.values() for x in pair))  # fmt: skip
        self.exec = graph.instantiate()
        graph.close()
        self.launch_args = (self.exec.handle, h)

    def close(self) -> None:
        self.exec.close()
        self.q_dev.close()
        self.out_dev.close()
        for _, dev_arr in self.stages.values():
            dev_arr.close()


def check_q_dtype(kv: Decodes, q: Any, algorithm: str) -> None:
    """q for a decode of this cache: a numpy array of the cache's dtype (an fp8
    cache's: float16 or bfloat16; the split kernels only)."""
    if not isinstance(q, np.ndarray):
        raise TypeError(f"q: expected a numpy array, got {type(q).__name__}")
    check_host_extent(q, "q")
    check_q_dtype_of(kv, q.dtype, algorithm)


def check_q_dtype_of(kv: Decodes, dtype: np.dtype, algorithm: str) -> None:
    """``check_q_dtype`` of a q of ``dtype`` (any kind of array)."""
    if kv.fp8:
        if dtype not in ROW_DTYPES[1:]:
            raise TypeError(
                f"q: expected float16 or bfloat16 for the {kv.dtype} cache, got {dtype}"
            )
        if algorithm == "parity":
            raise ValueError("algorithm: fp8 caches decode with the split kernels ('auto')")
    elif dtype != kv.dtype:
        raise TypeError(f"q: expected dtype {kv.dtype} (the cache's), got {dtype}")


def decode_features(kv: Decodes, q: Any, n_heads: Any, algorithm: Any, kw: dict[str, Any]) -> Any:
    """KVCache.decode with features: checked, then one launch of a graph made once per
    (n_heads, algorithm, which features, their scalars) that copies q and the per-head
    arrays in, decodes and copies the result (and the LSE) out."""
    n_heads, _, _ = check_dims(n_heads, kv.n_kv_heads, kv.head_dim)
    algorithm = check_algorithm(algorithm)
    if algorithm == "parity":
        raise ValueError("algorithm: the features need the split kernels ('auto')")
    feats = check_features(n_heads, **kw, allow_device=False)
    check_q_dtype(kv, q, algorithm)
    check_q(ArrayInfo(q.shape, q.dtype, False), n_heads, kv.head_dim)
    key = (n_heads, algorithm, abi.feature_bits_of(feats), feats.sliding_window,
           feats.logits_soft_cap, feats.scale, q.dtype)  # fmt: skip
    with kv.lock:
        kv.check_open()
        dec = kv.feature_decoders.get(key)
        if dec is None:
            dec = HostDecoder(kv, n_heads, algorithm, feats, q_dtype=q.dtype)
            kv.feature_decoders[key] = dec
        kv.device.activate()
        np.copyto(dec.q_stage, q.reshape(-1))
        for role, values in (("sinks", feats.sinks), ("alibi_slopes", feats.alibi_slopes)):
            if values is not None:
                np.copyto(dec.stages[role][0], values)  # float64 -> float32
        kv.device_length()
        check(_graph_launch(*dec.launch_args), "cuGraphLaunch")
        check(_stream_sync(dec.launch_args[1]), "cuStreamSynchronize")
        out = dec.out_stage.reshape(q.shape).copy()
        return (out, dec.stages["lse"][0].copy()) if feats.return_lse else out
