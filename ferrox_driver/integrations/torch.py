"""ferrox as PyTorch custom ops: tensors in, tensors out, traced by ``torch.compile``.

    import ferrox_driver.integrations.torch as fxt

    state = fxt.new_state("cuda")                       # the cache's length (and overflow flag)
    fxt.kv_append(k_cache, v_cache, k, v, state)        # rows at state[0], then state[0] += n
    out = fxt.gqa_decode(q, k_cache, v_cache, state[:1])

Importing this module registers the ops ``torch.ops.ferrox.gqa_decode``, ``kv_append``,
``kv_append_4bit`` and ``merge_states`` (``import ferrox_driver`` alone imports no
torch). Each has a fake (meta) implementation, and the appends declare the tensors they
write, so ``torch.compile(...,
fullgraph=True)`` traces a decode layer that calls them with no graph break, and
``mode="reduce-overhead"`` captures them in its CUDA graphs. They run on PyTorch's current
stream and read every length on the device, so one captured graph serves every step.

- ``gqa_decode(q, k_cache, v_cache, seq_len, ...)``: attention of one query token over the
  first ``seq_len`` tokens of a static cache (``seq_len`` a one-element int32 CUDA tensor),
  token-major ``(capacity, n_kv_heads, head_dim)`` ("NHD") or head-major ``(n_kv_heads,
  capacity, head_dim)`` / ``(1, n_kv_heads, capacity, head_dim)`` ("HND", a transformers
  StaticCache layer's buffers); bf16, fp16, fp32, or fp8 bytes read with ``kv_scales``;
  every feature; the LSE with ``return_lse=True``. ``seq_len=None``: every token of
  ``k_cache`` (the eager form, for a cache that grows by concatenation). A ``v_cache``
  whose rows are narrower or wider than K's (DeepSeek V2/V3's expanded heads: K 192, V
  128) gives an output ``q.shape[:-1] + (v_cache.shape[-1],)``: values of their own width
  (``ferrox_driver.gqa_decode(..., head_dim_v=)``), over a ``seq_len`` tensor or all of
  ``k_cache``.
- ``kv_append(k_cache, v_cache, k, v, state, kv_scales=None)``: one token ``(n_kv_heads,
  head_dim)`` or several ``(n, n_kv_heads, head_dim)`` into a token-major cache at
  ``state[0]``, which is then bumped; an fp8 cache quantizes them with ``kv_scales``.
- 4-bit caches (``kv_format="int4"`` or ``"nvfp4"``): a ``KVCache``'s 4-bit storage as
  tensors, uint8 values with ``k_block_scales``/``v_block_scales`` (and nvfp4's
  ``kv_scales``), K rotated where ``rotate_k`` (see ``torch_kv4``): ``kv_append`` quantizes
  rows into them (``torch.ops.ferrox.kv_append_4bit``), ``gqa_decode`` reads them over a
  ``seq_len``; token-major ``(capacity, n_kv_heads, head_dim // 2)`` ("NHD") or
  head-major ``(n_kv_heads, capacity, head_dim // 2)`` ("HND", a 4-bit KVCache's
  layout), the block scales in the values' layout.
- ``merge_states(outs, lses)``: the exact combine of partial attention (LSE-weighted).

Needs PyTorch 2.4 or newer with CUDA.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..cache.pair_append import append_async_pair
from ..decode.eager import gqa_decode as _eager_decode
from ..decode.merge import merge_states as _merge
from ..decode.pair import decode_async_pair
from ..decode.queries import query_heads, single_query_only
from ..decode.values import VALUES_MAX_HEAD_DIM_V, VALUES_MAX_QUERIES, values_decode
from ..driver.device import device_for
from ..driver.graph import relaxed_capture, stream_capturing
from ..driver.pool import stream_buffer
from ..kernels.spec import LATENT_MAX_HEAD_DIM
from .torch_kv4 import check_rows, dequantize_4bit, four_bit_args, hadamard

__all__ = ["dequantize_4bit", "gqa_decode", "hadamard", "kv_append", "merge_states",
           "new_state"]  # fmt: skip

_LAYOUTS = ("NHD", "HND")


def new_state(device: Any = "cuda", length: int = 0) -> torch.Tensor:
    """A cache's state for ``kv_append``: two int32 on ``device``, the length and an
    overflow flag (set by an append that would pass the capacity; nothing is written then).
    ``state[:1]`` is the ``seq_len`` that ``gqa_decode`` reads."""
    return torch.tensor([length, 0], dtype=torch.int32, device=device)


def _dims(
    q: torch.Tensor, k_cache: torch.Tensor, kv_layout: str, kv_format: str | None = None
) -> tuple[int, int, int]:
    """(n_heads, n_kv_heads, head_dim) from the shapes (a 3-D q: ``(n_q, n_heads,
    head_dim)``; a 4-bit cache's bytes hold two elements each); the layout checked."""
    if kv_layout not in _LAYOUTS:
        raise ValueError(f"kv_layout: expected 'NHD' or 'HND', got {kv_layout!r}")
    if k_cache.dim() not in (3, 4):
        raise ValueError(f"k_cache: expected 3 or 4 dimensions, got shape {tuple(k_cache.shape)}")
    head_dim = k_cache.shape[-1] * (1 if kv_format is None else 2)
    n_kv = k_cache.shape[-2] if kv_layout == "NHD" else k_cache.shape[-3]
    if q.dim() == 3:  # (n_q, n_heads, head_dim): n_q query tokens
        return query_heads(tuple(q.shape), head_dim).n_heads, n_kv, head_dim
    single_query_only(tuple(q.shape))  # SDPA's (1, n_heads, n_q, head_dim), n_q > 1
    if head_dim < 1 or q.numel() % head_dim:
        raise ValueError(f"q: shape {tuple(q.shape)} holds no whole number of heads of "
                         f"head_dim {head_dim} (k_cache's last dimension)")  # fmt: skip
    return q.numel() // head_dim, n_kv, head_dim


def _lse_shape(q: torch.Tensor, n_heads: int, return_lse: bool) -> tuple[int, ...]:
    """The LSE output's shape: ``(n_heads,)``, ``(n_q, n_heads)`` for a 3-D q, or empty."""
    if not return_lse:
        return (0,)
    return (q.shape[0], n_heads) if q.dim() == 3 else (n_heads,)


_HALF = (torch.float16, torch.bfloat16)


def _own_width(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_len: torch.Tensor | None,
    kv_scales: torch.Tensor | None, alibi_slopes: torch.Tensor | None,
    tree_mask: torch.Tensor | None, kv_format: str | None,
) -> int | None:  # fmt: skip
    """V's width where it is not K's (values of their own width: ``head_dim_v``), checked
    against what their kernels take (decode/values.py), or None where the widths agree.
    Shapes and dtypes only: CPU and fake tensors alike.

    Raises:
        TypeError, ValueError: naming the argument.
    """
    if kv_format is not None or v_cache.dim() != k_cache.dim() or v_cache.dim() == 0:
        return None  # (a 4-bit cache's V is K's width, checked with it; the rest by _dims)
    d, dv = k_cache.shape[-1], v_cache.shape[-1]
    if d == dv:
        return None
    what = f"values of their own width (v_cache's {dv} against k_cache's {d})"
    if tuple(v_cache.shape[:-1]) != tuple(k_cache.shape[:-1]):
        raise ValueError(f"v_cache: expected k_cache's tokens and heads {tuple(k_cache.shape)[:-1]}"
                         f" with rows of its own width, got {tuple(v_cache.shape)}")  # fmt: skip
    if seq_len is not None and (seq_len.dtype != torch.int32 or seq_len.numel() != 1
                                or seq_len.device != q.device):  # fmt: skip
        raise ValueError(f"seq_len: with {what}, one int32 on q's device {q.device} (the "
                         f"tokens to read), got {seq_len.dtype} {tuple(seq_len.shape)} on "
                         f"{seq_len.device}")  # fmt: skip
    refused = (
        ("kv_scales", kv_scales, "are not read from fp8 caches"),
        ("alibi_slopes", alibi_slopes, "take no ALiBi (their kernels have none)"),
        ("tree_mask", tree_mask, "are causal only (their kernels take no tree mask)"),
    )  # fmt: skip
    for name, given, why in refused:
        if given is not None:
            raise ValueError(f"{name}: {what} {why}")
    if q.dtype not in _HALF:
        raise TypeError(f"q: {what} need float16 or bfloat16 (tensor-core kernels), got {q.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: expected q's dtype {q.dtype}, got {t.dtype}")
    if d % 64 or d > LATENT_MAX_HEAD_DIM:
        raise ValueError(f"k_cache: with {what}, head_dim must be a multiple of 64 up to "
                         f"{LATENT_MAX_HEAD_DIM}, got {d}")  # fmt: skip
    if dv % 128 or dv > VALUES_MAX_HEAD_DIM_V:
        raise ValueError(f"v_cache: its width (head_dim_v) must be a multiple of 128 up to "
                         f"{VALUES_MAX_HEAD_DIM_V}, got {dv}")  # fmt: skip
    if q.dim() == 0 or q.shape[-1] % d:
        raise ValueError(f"q: with {what}, q's last axis must hold whole heads of {d}, got "
                         f"shape {tuple(q.shape)}")  # fmt: skip
    if q.dim() == 3 and q.shape[0] > VALUES_MAX_QUERIES:
        raise ValueError(f"q: up to {VALUES_MAX_QUERIES} query tokens with {what}, got "
                         f"{q.shape[0]}")  # fmt: skip
    return int(dv)


def _out_shape(q: torch.Tensor, head_dim: int, head_dim_v: int | None) -> tuple[int, ...]:
    """The output's shape: q's, each head ``head_dim_v`` wide where given."""
    if head_dim_v is None:
        return tuple(q.shape)
    return (*q.shape[:-1], q.shape[-1] // head_dim * head_dim_v)


# Per-head float32 copies of feature tensors given in another dtype (a model's bf16 sinks):
# one per tensor while its values stay, so the kernels read the same array at every step
# (and a captured graph reads the copy made before it).
_FLOAT_COPIES: dict[tuple[int, int], tuple[torch.Tensor, int, torch.Tensor]] = {}


def float32_copy(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` as contiguous float32: itself if it is, else one copy per tensor, kept while its
    ``_version`` stays (see _FLOAT_COPIES)."""
    if t is None or (t.dtype == torch.float32 and t.is_contiguous()):
        return t
    key = (t.data_ptr(), t.numel())
    held = _FLOAT_COPIES.get(key)
    if held is None or held[0] is not t or held[1] != t._version:
        if len(_FLOAT_COPIES) > 1024:
            _FLOAT_COPIES.clear()
        held = _FLOAT_COPIES[key] = (t, t._version, t.reshape(-1).float().contiguous())
    return held[2]


def _lse_buffer(device: torch.device, stream: int, n_heads: int) -> tuple[Any, torch.Tensor]:
    """The kernels' LSE output on this stream (one array per stream and size, so a call's
    record stays the same) and its torch view; the op copies it into its own output."""
    dev = device_for(device.index if device.index is not None else torch.cuda.current_device())
    buf = stream_buffer(dev, stream, "torch_lse", n_heads)
    view = _LSE_VIEWS.get(id(buf))
    if view is None or view[0] is not buf:
        view = _LSE_VIEWS[id(buf)] = (buf, torch.from_dlpack(buf))
    return buf, view[1]


_LSE_VIEWS: dict[int, tuple[Any, torch.Tensor]] = {}


def _current_stream(device: torch.device) -> int:
    return int(torch.cuda.current_stream(device).cuda_stream)


def _relaxed_if_captured(stream: int) -> contextlib.AbstractContextManager[None]:
    return relaxed_capture() if stream_capturing(stream) else contextlib.nullcontext()


@torch.library.custom_op("ferrox::gqa_decode", mutates_args=())
def _decode_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_len: torch.Tensor | None,
    kv_scales: torch.Tensor | None,
    sinks: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    kv_layout: str,
    scale: float | None,
    logits_soft_cap: float | None,
    sliding_window: int | None,
    return_lse: bool,
    tree_mask: torch.Tensor | None = None,
    kv_format: str | None = None,
    k_block_scales: torch.Tensor | None = None,
    v_block_scales: torch.Tensor | None = None,
    rotate_k: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not q.is_cuda:
        raise ValueError(f"q: expected a CUDA tensor, got one on {q.device}")
    four = four_bit_args(kv_format, k_cache, v_cache, k_block_scales, v_block_scales, kv_scales,
                         kv_layout, rotate_k)  # fmt: skip
    n_heads, n_kv, head_dim = _dims(q, k_cache, kv_layout, kv_format)
    dv = _own_width(q, k_cache, v_cache, seq_len, kv_scales, alibi_slopes, tree_mask, kv_format)
    q = q.contiguous()
    out = torch.empty_like(q) if dv is None else q.new_empty(_out_shape(q, head_dim, dv))
    lse = torch.empty(_lse_shape(q, n_heads, return_lse), dtype=torch.float32, device=q.device)
    stream = _current_stream(q.device)
    features: dict[str, Any] = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                    sinks=float32_copy(sinks), alibi_slopes=float32_copy(alibi_slopes),
                    scale=scale)  # fmt: skip
    if dv is not None:  # values of their own width: over seq_len, or every token of k_cache
        qh = q if q.dim() == 3 else q.view(n_heads, head_dim)  # (n_q, H, D) or (H, D)
        qh = qh.clone() if qh.data_ptr() % 16 else qh  # (the kernels read 16-byte pieces)
        # (into the op's own out and lse: a captured call writes the graph's tensors; its
        # first call inside a capture plans, loads and makes its workspace relaxed)
        with _relaxed_if_captured(stream):
            values_decode(qh, k_cache, v_cache, dv, n_heads=n_heads, n_kv_heads=n_kv,
                          head_dim=head_dim, out=out.view(*qh.shape[:-1], dv), stream=stream,
                          kv_layout=kv_layout, seq_len=seq_len,
                          lse=lse.view(qh.shape[:-1]) if return_lse else None,
                          **features)  # fmt: skip
        return out, lse
    if seq_len is None:  # every token of k_cache: the eager decode (a record per length bucket)
        if kv_scales is not None or four is not None:
            what = "kv_scales: an fp8" if four is None else f"kv_format: a {kv_format}"
            raise ValueError(f"{what} cache is decoded over a seq_len tensor")
        with _relaxed_if_captured(stream):
            got: Any = _eager_decode(q, k_cache, v_cache, n_heads=n_heads, n_kv_heads=n_kv,
                                     head_dim=head_dim, out=out, stream=stream,
                                     kv_layout=kv_layout, return_lse=return_lse,  # type: ignore[call-overload]
                                     tree_mask=tree_mask, **features)  # fmt: skip
        if return_lse:
            lse.copy_(torch.from_dlpack(got[1]))
        return out, lse
    rows = lse.numel()
    lse_buf, lse_view = _lse_buffer(q.device, stream, rows) if return_lse else (None, None)
    decode_async_pair(q, (k_cache, v_cache), out, n_heads, stream, "auto", seq_len, kv_layout,
                      features, lse_buf, kv_scales, torch_owned=True,
                      tree_mask=tree_mask, four_bit=four)  # fmt: skip
    if lse_view is not None:
        lse.copy_(lse_view.view(lse.shape))
    return out, lse


@_decode_op.register_fake
def _decode_fake(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_len: torch.Tensor | None,
    kv_scales: torch.Tensor | None, sinks: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None, kv_layout: str, scale: float | None,
    logits_soft_cap: float | None, sliding_window: int | None, return_lse: bool,
    tree_mask: torch.Tensor | None = None, kv_format: str | None = None,
    k_block_scales: torch.Tensor | None = None, v_block_scales: torch.Tensor | None = None,
    rotate_k: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    # (checked while tracing, as the shapes are)
    four_bit_args(kv_format, k_cache, v_cache, k_block_scales, v_block_scales, kv_scales,
                  kv_layout, rotate_k)  # fmt: skip
    n_heads, _, head_dim = _dims(q, k_cache, kv_layout, kv_format)
    dv = _own_width(q, k_cache, v_cache, seq_len, kv_scales, alibi_slopes, tree_mask, kv_format)
    out = torch.empty(_out_shape(q, head_dim, dv), dtype=q.dtype, device=q.device)
    lse = q.new_empty(_lse_shape(q, n_heads, return_lse), dtype=torch.float32)
    return out, lse


def _no_gradient(ctx: Any, *grads: Any) -> Any:
    raise RuntimeError(
        "ferrox's ops compute attention for inference and have no gradient: call them under "
        "torch.no_grad() or torch.inference_mode()"
    )


_decode_op.register_autograd(_no_gradient)


@torch.library.custom_op("ferrox::kv_append", mutates_args=("k_cache", "v_cache", "state"))
def _append_op(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    kv_scales: torch.Tensor | None,
) -> None:
    if not k_cache.is_cuda:
        raise ValueError(f"k_cache: expected a CUDA tensor, got one on {k_cache.device}")
    stream = _current_stream(k_cache.device)
    append_async_pair((k_cache, v_cache), k.contiguous(), v.contiguous(), state, kv_scales,
                      stream, torch_owned=True)  # fmt: skip


@_append_op.register_fake
def _append_fake(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    state: torch.Tensor, kv_scales: torch.Tensor | None,
) -> None:  # fmt: skip
    return None


# A 4-bit cache's append: an op of its own, as every tensor it writes is given (PyTorch
# 2.11 fails to trace an op that declares an optional tensor written when it is None)
@torch.library.custom_op(
    "ferrox::kv_append_4bit",
    mutates_args=("k_cache", "v_cache", "state", "k_block_scales", "v_block_scales"),
)
def _append_4bit_op(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    k_block_scales: torch.Tensor,
    v_block_scales: torch.Tensor,
    kv_scales: torch.Tensor | None,
    kv_format: str,
    rotate_k: bool,
    kv_layout: str = "NHD",
) -> None:
    if not k_cache.is_cuda:
        raise ValueError(f"k_cache: expected a CUDA tensor, got one on {k_cache.device}")
    four = four_bit_args(kv_format, k_cache, v_cache, k_block_scales, v_block_scales, kv_scales,
                         kv_layout, rotate_k)  # fmt: skip
    check_rows(k, v, k_cache, kv_layout)
    stream = _current_stream(k_cache.device)
    append_async_pair((k_cache, v_cache), k.contiguous(), v.contiguous(), state, kv_scales,
                      stream, torch_owned=True, four_bit=four, kv_layout=kv_layout)  # fmt: skip


@_append_4bit_op.register_fake
def _append_4bit_fake(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    state: torch.Tensor, k_block_scales: torch.Tensor, v_block_scales: torch.Tensor,
    kv_scales: torch.Tensor | None, kv_format: str, rotate_k: bool, kv_layout: str = "NHD",
) -> None:  # fmt: skip
    four_bit_args(kv_format, k_cache, v_cache, k_block_scales, v_block_scales, kv_scales,
                  kv_layout, rotate_k)  # fmt: skip
    check_rows(k, v, k_cache, kv_layout)
    return None


@torch.library.custom_op("ferrox::merge_states", mutates_args=())
def _merge_op(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not outs.is_cuda:
        raise ValueError(f"outs: expected a CUDA tensor, got one on {outs.device}")
    n_heads = lses.shape[1]
    outs, lses = outs.contiguous(), lses.contiguous()
    out = outs.new_empty(outs.shape[1:])
    lse = lses.new_empty((n_heads,))
    stream = _current_stream(outs.device)
    with _relaxed_if_captured(stream):
        _merge(outs, lses, stream=stream, out=out, out_lse=lse)
    return out, lse


@_merge_op.register_fake
def _merge_fake(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return outs.new_empty(outs.shape[1:]), lses.new_empty((lses.shape[1],))


_merge_op.register_autograd(_no_gradient)


def gqa_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_len: torch.Tensor | None = None,
    *,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    head_dim: int | None = None,
    kv_layout: str = "NHD",
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    kv_scales: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
    kv_format: str | None = None,
    k_block_scales: torch.Tensor | None = None,
    v_block_scales: torch.Tensor | None = None,
    rotate_k: bool | None = None,
    head_dim_v: int | None = None,
) -> Any:
    """Attention of one query token, or of the last n_q tokens (a speculative verify), over
    the first ``seq_len`` tokens of a cache, on PyTorch's current stream
    (``torch.ops.ferrox.gqa_decode``; traceable, capturable).

    Args:
        q: ``(n_heads, head_dim)``, ``(1, n_heads, 1, head_dim)`` or any shape of whole
            heads: float16, bfloat16 or float32 (the cache's dtype; an fp8 cache's: 16-bit).
            ``(n_q, n_heads, head_dim)``: n_q query tokens, the cache's last n_q (query t
            at position ``seq_len - n_q + t``), causal or under ``tree_mask``.
        k_cache: ``(capacity, n_kv_heads, head_dim)`` ("NHD") or ``(n_kv_heads, capacity,
            head_dim)`` / ``(1, n_kv_heads, capacity, head_dim)`` ("HND", rows contiguous,
            heads any number of rows apart): float32, float16, bfloat16, or
            ``torch.float8_e4m3fn`` / ``float8_e5m2`` with ``kv_scales``, or a 4-bit cache's
            values with ``kv_format``, contiguous uint8 ``(capacity, n_kv_heads, head_dim
            // 2)`` ("NHD") or ``(n_kv_heads, capacity, head_dim // 2)`` ("HND").
        v_cache: like ``k_cache``; or, with rows of a width of their own (``head_dim_v``:
            DeepSeek V2/V3's expanded heads, K 192 and V 128), the same tokens and heads of
            q's dtype (float16 or bfloat16), each token's row contiguous and 16-byte
            aligned (views such as a ``torch.split`` of wider rows are read in place): K's
            width a multiple of 64 up to 576, V's a multiple of 128 up to 512, up to 16
            query tokens; every feature but ALiBi and ``tree_mask``; not fp8 or 4-bit
            caches; over a ``seq_len`` tensor (capturable) or all of their tokens.
        seq_len: a one-element int32 CUDA tensor, the tokens to read (``[0, capacity]``,
            read by the kernels at each run). None: all of ``k_cache``'s tokens (eager).
        n_heads, n_kv_heads, head_dim: optional, checked against the shapes.
        kv_layout: ``"NHD"`` or ``"HND"``.
        sliding_window, logits_soft_cap, scale: as ``ferrox_driver.gqa_decode``.
        sinks, alibi_slopes: ``n_heads`` values (any float dtype: a float32 copy is made
            once per tensor and kept while its values stay).
        return_lse: also return the log-sum-exp per query head (float32, natural log).
        kv_scales: an fp8 cache's scales: float32 ``(2, n_kv_heads)``, K's then V's.
        tree_mask: with a 3-D q, a CUDA tensor: bool ``(n_q, n_q)`` or bit-packed uint8
            ``(n_q, ceil(n_q / 8))`` (query t sees new token u where ``[t, u]``; its
            diagonal set), read on the device at each run.
        kv_format: ``"int4"`` or ``"nvfp4"``: the caches are 4-bit values (a 4-bit
            ``KVCache``'s storage, token-major or, ``kv_layout="HND"``, head-major as a
            KVCache holds it), read with their block scales (and nvfp4's ``kv_scales``,
            float32 ``(2, n_kv_heads)``); q float16 or bfloat16; a ``seq_len`` tensor.
            None: the caches' dtype says.
        k_block_scales, v_block_scales: a 4-bit cache's block scales, in the values'
            layout: int4 float16 ``(capacity, n_kv_heads, head_dim // 32)``, nvfp4 e4m3
            bytes (uint8 or ``torch.float8_e4m3fn``) ``(capacity, n_kv_heads, head_dim //
            16)``; head-major, ``(n_kv_heads, capacity, ...)``.
        rotate_k: whether the 4-bit K is Hadamard-rotated (q is rotated alike in the
            decode); None: the format's default, as ``KVCache(rotate=None)``'s (int4
            rotated, nvfp4 not).
        head_dim_v: optional, checked against ``v_cache``'s last dimension (which says
            the values' width).

    Returns:
        ``out`` of q's shape and dtype (each head ``head_dim_v`` wide where V's rows are
        not K's width: ``q.shape[:-1] + (head_dim_v,)``), or ``(out, lse)`` with
        ``return_lse`` (LSE ``(n_heads,)``, or ``(n_q, n_heads)`` for a 3-D q).

    Raises:
        ValueError, TypeError: naming the argument, before any device work.
    """
    four = four_bit_args(kv_format, k_cache, v_cache, k_block_scales, v_block_scales, kv_scales,
                         kv_layout, rotate_k)  # fmt: skip
    if four is not None:
        if seq_len is None:
            raise ValueError(f"seq_len: a {kv_format} cache is decoded over a seq_len tensor "
                             "(one int32 on the device)")  # fmt: skip
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"q: expected float16 or bfloat16 for a 4-bit cache, got {q.dtype}")
        rotate_k = four.rotate
    got = _dims(q, k_cache, kv_layout, kv_format)
    for name, given, have in zip(("n_heads", "n_kv_heads", "head_dim"),
                                 (n_heads, n_kv_heads, head_dim), got, strict=True):  # fmt: skip
        if given is not None and given != have:
            raise ValueError(f"{name}: {given} given, but the shapes say {have}")
    dv = _own_width(q, k_cache, v_cache, seq_len, kv_scales, alibi_slopes, tree_mask, kv_format)
    if head_dim_v is not None:
        if isinstance(head_dim_v, bool) or not isinstance(head_dim_v, int):
            raise TypeError(f"head_dim_v: expected an int, got {head_dim_v!r}")
        have = got[2] if dv is None else dv
        if head_dim_v != have:
            raise ValueError(f"head_dim_v: {head_dim_v} given, but v_cache's shape "
                             f"{tuple(v_cache.shape)} says {have}")  # fmt: skip
    if tree_mask is not None and q.dim() != 3:
        raise ValueError("tree_mask: only with several query tokens, q (n_q, n_heads, head_dim)")
    out, lse = torch.ops.ferrox.gqa_decode(
        q, k_cache, v_cache, seq_len, kv_scales, sinks, alibi_slopes, kv_layout, scale,
        logits_soft_cap, sliding_window, return_lse, tree_mask, kv_format, k_block_scales,
        v_block_scales, rotate_k,
    )  # fmt: skip
    return (out, lse) if return_lse else out


def kv_append(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    *,
    kv_scales: torch.Tensor | None = None,
    kv_format: str | None = None,
    k_block_scales: torch.Tensor | None = None,
    v_block_scales: torch.Tensor | None = None,
    rotate_k: bool | None = None,
    kv_layout: str = "NHD",
) -> None:
    """Append one token's K and V rows ``(n_kv_heads, head_dim)``, or several ``(n,
    n_kv_heads, head_dim)``, to a token-major cache ``(capacity, n_kv_heads, head_dim)`` at
    ``state[0]`` (``new_state``), which is then bumped by n, on PyTorch's current stream
    (``torch.ops.ferrox.kv_append``; traceable, capturable). Rows that would pass the
    capacity are not written; ``state[1]`` is set instead. An fp8 cache
    (``torch.float8_e4m3fn``/``float8_e5m2``) quantizes 16- or 32-bit rows with
    ``kv_scales`` (float32 ``(2, n_kv_heads)``: a value is stored as value / scale).

    A 4-bit cache (``kv_format="int4"`` or ``"nvfp4"``: uint8 values and
    ``k_block_scales``/``v_block_scales``, as ``gqa_decode`` takes them, token-major
    ``(capacity, n_kv_heads, head_dim // 2)`` or, ``kv_layout="HND"``, head-major
    ``(n_kv_heads, capacity, head_dim // 2)``) quantizes float32, float16 or bfloat16 rows
    on the device into the values and the block scales (nvfp4 with its ``kv_scales``; K
    rotated first where ``rotate_k``, None: the format's default), the bytes
    ``fd.quantize_int4`` / ``fd.quantize_nvfp4`` compute (of ``fd.hadamard(k)`` for a
    rotated K). The rows are token rows in either layout.

    Raises:
        ValueError, TypeError: naming the argument, before any device work.
    """
    four = four_bit_args(kv_format, k_cache, v_cache, k_block_scales, v_block_scales, kv_scales,
                         kv_layout, rotate_k)  # fmt: skip
    if four is None:
        if kv_layout != "NHD":
            raise ValueError(f"kv_layout: appends into a cache of k_cache's dtype "
                             f"{k_cache.dtype} are token-major ('NHD'); 'HND' is a 4-bit "
                             f"cache's (kv_format); got {kv_layout!r}")  # fmt: skip
        torch.ops.ferrox.kv_append(k_cache, v_cache, k, v, state, kv_scales)
        return
    check_rows(k, v, k_cache, kv_layout)
    torch.ops.ferrox.kv_append_4bit(k_cache, v_cache, k, v, state, k_block_scales,
                                    v_block_scales, kv_scales, kv_format, four.rotate,
                                    kv_layout)  # fmt: skip


def merge_states(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact combine of attention over disjoint parts of a sequence: ``outs`` ``(parts,
    n_heads, head_dim)``, ``lses`` float32 ``(parts, n_heads)`` -> ``(out, lse)``
    (``torch.ops.ferrox.merge_states``; see ``ferrox_driver.merge_states``)."""
    if lses.dim() != 2 or outs.dim() not in (2, 3):
        raise ValueError(f"outs, lses: expected (parts, n_heads, head_dim) and (parts, "
                         f"n_heads), got {tuple(outs.shape)} and {tuple(lses.shape)}")  # fmt: skip
    return torch.ops.ferrox.merge_states(outs, lses)
