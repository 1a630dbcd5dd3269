"""MLA decode as a PyTorch custom op: tensors in, tensors out, traced by ``torch.compile``.

    import ferrox_driver.integrations.torch_mla as fxm

    out = fxm.mla_decode(q, latent, seq_len)      # q (n_heads, 576), latent (capacity, 576)

Importing this module registers ``torch.ops.ferrox.mla_decode`` (and, through
``ferrox_driver.integrations.torch``, the GQA ops). It has a fake (meta) implementation,
so ``torch.compile(..., fullgraph=True)`` traces a layer that calls it with no graph break
and ``mode="reduce-overhead"`` captures it in its CUDA graphs: it runs on PyTorch's current
stream and reads ``seq_len`` on the device, so one captured graph serves every step.

The op is `ferrox_driver.mla_decode` over the caller's tensors: the absorbed queries
``(n_heads, 576)`` or ``(n_q, n_heads, 576)`` (q_nope W_UK, then q_rope) against a latent
cache ``(capacity, 576)`` whose first ``head_dim_v`` (512) columns are the values, bf16 or
fp16, or fp8 (``torch.float8_e4m3fn``/``float8_e5m2``, or uint8 e4m3 bytes) read with
``kv_scale``. The cache is the caller's to fill (``latent[n] = row`` or ``index_copy_`` at
the length, an fp8 one quantized as ``(row / kv_scale).to(torch.float8_e4m3fn)``), or a
`LatentCache`'s buffer and length seen through ``torch.from_dlpack``.

Needs PyTorch 2.4 or newer with CUDA.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..decode.features import check_features
from ..decode.latent import mla_decode as _mla_decode
from ..driver.graph import relaxed_capture, stream_capturing
from .torch import float32_copy

__all__ = ["mla_decode"]

_HALF = (torch.float16, torch.bfloat16)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8)  # (uint8: e4m3 bytes)


def _shapes(
    q: torch.Tensor, latent: torch.Tensor, seq_len: torch.Tensor | None,
    kv_scale: torch.Tensor | None, kv_scale_value: float | None, head_dim_v: int,
    return_lse: bool,
) -> tuple[tuple[int, ...], tuple[int, ...]]:  # fmt: skip
    """The output's and the LSE's shapes, the tensors checked by shape and dtype only (no
    device work: CPU, CUDA and fake tensors alike; ``mla_decode`` checks the rest).

    Raises:
        TypeError, ValueError: naming the argument.
    """
    if q.dtype not in _HALF:
        raise TypeError(f"q: expected float16 or bfloat16, got {q.dtype}")
    if q.dim() not in (2, 3):
        raise ValueError(f"q: expected (n_heads, head_dim) or (n_q, n_heads, head_dim), got "
                         f"{tuple(q.shape)}")  # fmt: skip
    if latent.dim() != 2 or latent.shape[1] != q.shape[-1]:
        raise ValueError(f"latent: expected (capacity, {q.shape[-1]}) (q's head_dim), got "
                         f"{tuple(latent.shape)}")  # fmt: skip
    if not latent.is_contiguous():
        raise ValueError(f"latent: expected a C-contiguous tensor, got a strided view of shape "
                         f"{tuple(latent.shape)}")  # fmt: skip
    fp8 = latent.dtype in _FP8
    if latent.dtype != q.dtype and not fp8:
        raise TypeError(f"latent: expected q's dtype {q.dtype} or fp8 (float8_e4m3fn, "
                        f"float8_e5m2, uint8 e4m3 bytes), got {latent.dtype}")  # fmt: skip
    if not fp8 and (kv_scale is not None or kv_scale_value is not None):
        raise ValueError("kv_scale: only for an fp8 latent (this one is of q's dtype)")
    if kv_scale is not None and (kv_scale.dtype != torch.float32 or kv_scale.numel() != 1):
        raise ValueError(f"kv_scale: expected a float or one float32 element, got shape "
                         f"{tuple(kv_scale.shape)} of {kv_scale.dtype}")  # fmt: skip
    if seq_len is not None and (seq_len.dtype != torch.int32 or seq_len.numel() != 1):
        raise ValueError(f"seq_len: expected one int32 element (on the device), got shape "
                         f"{tuple(seq_len.shape)} of {seq_len.dtype}")  # fmt: skip
    if isinstance(head_dim_v, bool) or not isinstance(head_dim_v, int):
        raise TypeError(f"head_dim_v: expected an int, got {head_dim_v!r}")
    if not (0 < head_dim_v <= q.shape[-1] and head_dim_v % 128 == 0):
        raise ValueError(f"head_dim_v: a multiple of 128 up to head_dim {q.shape[-1]}, got "
                         f"{head_dim_v}")  # fmt: skip
    lead = tuple(q.shape[:-1])
    return (*lead, head_dim_v), (lead if return_lse else (0,))


@torch.library.custom_op("ferrox::mla_decode", mutates_args=())
def _mla_op(
    q: torch.Tensor,
    latent: torch.Tensor,
    seq_len: torch.Tensor | None,
    kv_scale: torch.Tensor | None,
    kv_scale_value: float | None,
    sinks: torch.Tensor | None,
    scale: float | None,
    logits_soft_cap: float | None,
    sliding_window: int | None,
    head_dim_v: int,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not q.is_cuda:
        raise ValueError(f"q: expected a CUDA tensor, got one on {q.device}")
    out_shape, lse_shape = _shapes(q, latent, seq_len, kv_scale, kv_scale_value, head_dim_v,
                                   return_lse)  # fmt: skip
    q = q.contiguous()
    out = q.new_empty(out_shape)
    lse = q.new_empty(lse_shape, dtype=torch.float32)
    stream = int(torch.cuda.current_stream(q.device).cuda_stream)
    # inside a capture (reduce-overhead), a first use loads its kernels and makes its
    # workspace in relaxed mode: neither is captured
    relaxed = relaxed_capture() if stream_capturing(stream) else contextlib.nullcontext()
    with relaxed:
        _mla_decode(q, latent, seq_len, head_dim_v=head_dim_v, out=out,
                    lse=lse if return_lse else None, stream=stream,
                    kv_scale=kv_scale if kv_scale is not None else kv_scale_value,
                    sinks=float32_copy(sinks), scale=scale, logits_soft_cap=logits_soft_cap,
                    sliding_window=sliding_window)  # fmt: skip
    return out, lse


@_mla_op.register_fake
def _mla_fake(
    q: torch.Tensor, latent: torch.Tensor, seq_len: torch.Tensor | None,
    kv_scale: torch.Tensor | None, kv_scale_value: float | None, sinks: torch.Tensor | None,
    scale: float | None, logits_soft_cap: float | None, sliding_window: int | None,
    head_dim_v: int, return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    # (checked while tracing, as the shapes are)
    out_shape, lse_shape = _shapes(q, latent, seq_len, kv_scale, kv_scale_value, head_dim_v,
                                   return_lse)  # fmt: skip
    return q.new_empty(out_shape), q.new_empty(lse_shape, dtype=torch.float32)


def _no_gradient(ctx: Any, *grads: Any) -> Any:
    raise RuntimeError(
        "ferrox's ops compute attention for inference and have no gradient: call them under "
        "torch.no_grad() or torch.inference_mode()"
    )


_mla_op.register_autograd(_no_gradient)


def mla_decode(
    q: torch.Tensor,
    latent: torch.Tensor,
    seq_len: torch.Tensor | None = None,
    *,
    head_dim_v: int = 512,
    kv_scale: float | torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Multi-head latent attention of one query token (or of the last n_q) over the first
    ``seq_len`` rows of a latent cache, on PyTorch's current stream
    (``torch.ops.ferrox.mla_decode``; traceable, capturable).

    Args:
        q: ``(n_heads, head_dim)`` or ``(n_q, n_heads, head_dim)``, float16 or bfloat16:
            the absorbed queries (q_nope W_UK, then q_rope; DeepSeek: 512 + 64); 1 to 128
            heads. With n_q queries (up to 16), query t is the cache's token ``seq_len -
            n_q + t``, causal.
        latent: ``(capacity, head_dim)``, contiguous: of q's dtype, or fp8
            (``torch.float8_e4m3fn``, ``float8_e5m2``, or uint8 holding e4m3 bytes) read
            as ``byte * kv_scale``. Its first ``head_dim_v`` columns are the values.
        seq_len: one int32 CUDA element, the rows to read (read by the kernels at each
            run); None: every row of ``latent``.
        head_dim_v: the values' width, a multiple of 128 up to head_dim (default 512).
        kv_scale: an fp8 latent's scale: a positive float, or one float32 CUDA element
            (read at each run); refused for a 16-bit latent.
        sinks: one logit per query head in the softmax's denominator (any float dtype: a
            float32 copy is made once per tensor and kept while its values stay).
        scale: the score scale (default ``1/sqrt(head_dim)``).
        logits_soft_cap: scores become ``cap * tanh(score / cap)``.
        sliding_window: attend to the last ``sliding_window`` tokens.
        return_lse: also return the log-sum-exp of the scores per row (float32, natural
            log).

    Returns:
        ``out`` of shape ``q.shape[:-1] + (head_dim_v,)`` in q's dtype (the output in the
            latent space: apply W_UV after it), or ``(out, lse)`` with ``return_lse`` (LSE
            of shape ``q.shape[:-1]``). No rows give zeros (and an LSE of -inf).

    Raises:
        ValueError, TypeError: naming the argument, before any device work.
    """
    scale_t, scale_v = None, None
    if isinstance(kv_scale, torch.Tensor):
        scale_t = kv_scale
    elif isinstance(kv_scale, (int, float)) and not isinstance(kv_scale, bool):
        scale_v = float(kv_scale)
    elif kv_scale is not None:
        raise TypeError(f"kv_scale: expected a float or a float32 tensor, got {kv_scale!r}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool, got {return_lse!r}")
    if isinstance(head_dim_v, bool) or not isinstance(head_dim_v, int):
        raise TypeError(f"head_dim_v: expected an int, got {head_dim_v!r}")
    # (the scalars checked by name here: the op's schema would refuse them without one)
    check_features(max(q.shape[-2], 1) if q.dim() else 1, sliding_window=sliding_window,
                   logits_soft_cap=logits_soft_cap, scale=scale)  # fmt: skip
    out, lse = torch.ops.ferrox.mla_decode(q, latent, seq_len, scale_t, scale_v, sinks, scale,
                                           logits_soft_cap, sliding_window, head_dim_v,
                                           return_lse)  # fmt: skip
    return (out, lse) if return_lse else out
