"""ferrox as a Hugging Face transformers attention implementation, ``"ferrox"``.

    import ferrox_driver.integrations.transformers as fx_transformers

    fx_transformers.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="ferrox")
    model.generate(ids, max_new_tokens=64, cache_implementation="static")

Which attention computes each call:

- ferrox: single-token decode steps of a batch of one on CUDA, reading the cache's K and V
  in place (head-major, ``gqa_decode(..., kv_layout="HND")``), with the layer's scale,
  sliding window (from the attention mask), soft-cap (Gemma 2) and sinks (gpt-oss).
- eager attention, every other call (prefill, batches, padding, dropout, CPU tensors) of a
  layer with a feature that SDPA cannot express: a soft-cap, sinks, ``output_attentions``,
  another keyword that SDPA does not read, or a model whose ``_supports_sdpa`` is False.
  The model's own: its module's ``eager_attention_forward`` (gpt-oss's has the sinks,
  Gemma 2's the soft-cap), else ``eager_attention`` here (transformers has no generic
  one); the mask made additive (0 and the dtype's min), as eager attention adds it.
- transformers' SDPA attention (``sdpa_attention_forward``): every other call.

A call that does not run on ferrox says why and where it runs in a debug log line of
logger ``ferrox_driver.integrations.transformers``: never silently wrong. Tested with
transformers 5.17 and 5.24 (the ``[transformers]`` extra's range).

Needs transformers (5.x) and PyTorch; ferrox itself imports neither.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

NAME = "ferrox"
logger = logging.getLogger(__name__)
_REGISTERED: Any = None  # ferrox_attention_forward as registered (not traced by torch.compile)

__all__ = ["NAME", "DecodeCall", "decode_call", "eager_attention", "ferrox_attention_forward",
           "register"]  # fmt: skip


def register(name: str = NAME) -> None:
    """Register ferrox's attention under ``name`` with transformers, with SDPA's boolean
    mask function (a decode step reads the mask for the tokens it attends to; a call that
    falls back to eager attention gets it as an additive mask). Idempotent."""
    from functools import partial

    import torch
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    global _REGISTERED
    if _REGISTERED is None:
        # generate() compiles a static cache's decode steps (torch.compile): ferrox runs
        # outside the compiled graph (a graph break), its launches and the mask's host
        # read as they are, never traced
        _REGISTERED = torch.compiler.disable(ferrox_attention_forward)
    AttentionInterface.register(name, _REGISTERED)
    # allow_is_causal_skip=False: a decode step's mask always says which tokens it reads
    AttentionMaskInterface.register(name, partial(sdpa_mask, allow_is_causal_skip=False))


@dataclass(frozen=True)
class DecodeCall:
    """How one attention call runs on ferrox: the first ``length`` tokens of the cache,
    the window (None: all of them) and the features."""

    length: int
    sliding_window: int | None
    scale: float | None
    logits_soft_cap: float | None
    sinks: Any  # a float32 torch tensor of n_heads, or None


_DTYPES = ("torch.float16", "torch.bfloat16", "torch.float32")


def decode_call(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    s_aux: Any = None,
    require_cuda: bool = True,
    **kwargs: Any,
) -> DecodeCall | str:
    """The ferrox decode of a transformers attention call, or why there is none (a
    sentence for the debug log). ``query`` is ``[batch, n_heads, q_len, head_dim]``, ``key``
    and ``value`` ``[batch, n_kv_heads, kv_len, head_dim]`` (a static cache's whole buffer,
    or a dynamic cache's tokens); the mask, where given, says which of kv_len are read.
    Reads the mask's last row on the host (one small copy). ``require_cuda=False``: the
    plan of CPU tensors too (for tests)."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "query, key and value are not 4-D [batch, heads, tokens, head_dim]"
    batch, n_heads, q_len, head_dim = query.shape
    if batch != 1:
        return f"a batch of {batch} (ferrox decodes one sequence)"
    if q_len != 1:
        return f"{q_len} query tokens (prefill; ferrox decodes one token)"
    if dropout:
        return f"dropout {dropout}"
    if kwargs.get("output_attentions"):
        return "output_attentions (ferrox does not return the weights)"
    unread = _unread(kwargs, ("softcap", "s_aux"))
    if unread:
        return f"{unread} (not a feature of ferrox's)"
    if str(query.dtype) not in _DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return f"dtypes {query.dtype}, {key.dtype}, {value.dtype}"
    n_kv, kv_len = key.shape[1], key.shape[2]
    if tuple(value.shape) != tuple(key.shape) or key.shape[3] != head_dim or key.shape[0] != 1:
        return f"key {tuple(key.shape)} and value {tuple(value.shape)} do not match the query"
    if head_dim > 256 or n_heads % n_kv:
        return f"{n_heads} query heads of {head_dim} over {n_kv} KV heads"
    if key.stride(-1) != 1 or key.stride(-2) != head_dim or value.stride() != key.stride():
        return f"K/V rows not contiguous (strides {key.stride()}, {value.stride()})"
    if (
        key.device != query.device
        or value.device != query.device
        or (require_cuda and query.device.type != "cuda")
    ):
        return f"tensors on {query.device}, {key.device}, {value.device} (ferrox: one CUDA device)"
    length, window = kv_len, None
    if attention_mask is not None:
        span = _mask_span(attention_mask, kv_len)
        if isinstance(span, str):
            return span
        first, length = span
        window = length - first if first else None
    sinks = None if s_aux is None else _float_sinks(s_aux)
    if sinks is not None and sinks.numel() != n_heads:
        return f"{sinks.numel()} sinks for {n_heads} query heads"
    cap = float(softcap) if softcap else None
    scale = None if scaling is None else float(scaling)
    return DecodeCall(length, window, scale, cap, sinks)


def _mask_span(mask: Any, kv_len: int) -> tuple[int, int] | str:
    """The tokens [first, end) that a decode step's mask lets it read (a boolean mask, or
    an additive one of 0 and -inf), or why it is not one run of them."""
    if mask.dim() != 4 or mask.shape[-1] != kv_len:
        return f"an attention mask of shape {tuple(mask.shape)}"
    import torch

    row = mask[0, 0, -1]
    keep = row if row.dtype == torch.bool else row == 0
    n = int(keep.sum())  # (copies to the host: waits for the queued work)
    if n == 0:
        return "a mask that hides every token"
    first = int(keep.int().argmax())
    if not bool(keep[first : first + n].all()):
        return "a mask that is not one run of tokens (padding)"
    return first, first + n


def ferrox_attention_forward(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """transformers' attention function for ``attn_implementation="ferrox"``: a decode
    step on ferrox (see ``decode_call``), anything else on the model's eager attention
    where SDPA cannot express the layer (soft-cap, sinks, ...), else on SDPA. Returns
    ``(attn_output [batch, q_len, n_heads, head_dim], weights or None)``."""
    call = decode_call(module, query, key, value, attention_mask, dropout=dropout,
                       scaling=scaling, **kwargs)  # fmt: skip
    if isinstance(call, str):
        return _fallback(call, module, query, key, value, attention_mask, dropout, scaling,
                         **kwargs)  # fmt: skip
    import torch

    import ferrox_driver as fd

    _, n_heads, _, head_dim = query.shape
    n = call.length
    out = torch.empty((1, 1, n_heads, head_dim), dtype=query.dtype, device=query.device)
    stream = torch.cuda.current_stream(query.device)
    q = query.reshape(n_heads, head_dim)
    features = dict(sliding_window=call.sliding_window, logits_soft_cap=call.logits_soft_cap,
                    scale=call.scale, sinks=call.sinks)  # fmt: skip
    if n < key.shape[2]:  # a static cache: its whole buffer, the length on the device
        length = _length_on(query.device, stream)
        length.fill_(n)
        fd.gqa_decode_async(q, (key, value), out, n_heads=n_heads, stream=stream,
                            seq_len=length, kv_layout="HND", **features)  # fmt: skip
    else:  # (a dynamic cache: a new shape at every step)
        fd.gqa_decode(q, key, value, n_heads=n_heads, n_kv_heads=key.shape[1],
                      head_dim=head_dim, out=out, kv_layout="HND", stream=stream,
                      **features)  # fmt: skip
    return out, None


# Keywords that leave an attention's function to its mask, scale and dropout: the mask
# carries the sliding window and causality; the rest steer other backends (flash's packed
# sequences) or the model's outputs. Any other keyword with a value is a feature: a call
# with one that ferrox (decode_call) or SDPA (_why_eager) does not read runs elsewhere.
_CARRIED = frozenset(
    ("sliding_window", "is_causal", "position_ids", "cache_position", "use_cache",
     "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx",
     "num_items_in_batch", "output_hidden_states", "output_router_logits", "return_dict")
)  # fmt: skip


def _unread(kwargs: dict[str, Any], read: tuple[str, ...]) -> str | None:
    """The first keyword with a value (not None or False) that is neither carried nor read."""
    for name, value in kwargs.items():
        if value is not None and value is not False and name not in _CARRIED and name not in read:
            return name
    return None


def _why_eager(module: Any, kwargs: dict[str, Any]) -> str | None:
    """Why SDPA cannot compute this layer's attention (the feature it lacks), or None."""
    if kwargs.get("softcap") is not None:
        return f"a soft-cap of {kwargs['softcap']}, which SDPA lacks"
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        return "sinks, which SDPA lacks"
    if kwargs.get("output_attentions"):
        return "output_attentions: SDPA returns no weights"
    unread = _unread(kwargs, ("position_bias",))
    if unread:
        return f"{unread}, which SDPA does not read"
    if not _eager_of(module)[1]:
        return f"{type(module).__module__} does not support SDPA"
    return None


def _fallback(
    why: str,
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float,
    scaling: float | None,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """A call ferrox does not decode (``why``), on eager attention or SDPA."""
    feature = _why_eager(module, kwargs)
    if feature is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        logger.debug("ferrox: %s: SDPA instead", why)
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)  # fmt: skip
    logger.debug("ferrox: %s: eager attention instead (%s)", why, feature)
    mask = _additive_mask(module, query, key, attention_mask, kwargs.get("is_causal"))
    eager = _eager_of(module)[0]
    return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


# Per attention class: its model's eager attention function and whether the model
# supports SDPA (its module's _supports_sdpa).
_EAGER: dict[type, tuple[Callable[..., Any], bool]] = {}


def _eager_of(module: Any) -> tuple[Callable[..., Any], bool]:
    """The eager attention of ``module``'s model (its module's ``eager_attention_forward``,
    else ``eager_attention``) and whether the model supports SDPA, looked up once a class."""
    cls = type(module)
    held = _EAGER.get(cls)
    if held is None:
        space = vars(sys.modules[cls.__module__]) if cls.__module__ in sys.modules else {}
        own = space.get("eager_attention_forward")
        from transformers import PreTrainedModel

        models = [c for c in space.values() if isinstance(c, type) and
                  issubclass(c, PreTrainedModel) and c.__module__ == cls.__module__]  # fmt: skip
        sdpa = all(getattr(c, "_supports_sdpa", False) for c in models)
        held = _EAGER[cls] = (own if callable(own) else eager_attention, sdpa)
    return held


def _additive_mask(module: Any, query: Any, key: Any, mask: Any, is_causal: Any) -> Any:
    """The mask as eager attention adds it: 0 where read, the dtype's min where not (as
    transformers' eager_mask makes it); a boolean mask (SDPA's, which register() installs)
    added as it is would add 1 to the read logits. No mask: the causal one SDPA would use
    (``is_causal``) for more than one query token."""
    import torch

    if mask is None:
        q_len, kv_len = query.shape[2], key.shape[2]
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        if q_len == 1 or not causal:
            return None
        mask = torch.ones((1, 1, q_len, kv_len), dtype=torch.bool, device=query.device).tril()
    if mask.dtype != torch.bool:
        return mask
    zero = torch.zeros((), dtype=query.dtype, device=mask.device)
    return torch.where(mask, zero, torch.finfo(query.dtype).min)


def eager_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    s_aux: Any = None,
    sinks: Any = None,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """Eager attention with a soft-cap and sinks, for a model whose module has no
    ``eager_attention_forward`` of its own (transformers has no generic one): Gemma 2's
    order (scale, cap, mask) and gpt-oss's sinks (one logit per query head in the
    softmax's denominator), the softmax in float32.

    Args:
        module: the attention layer (its ``training`` turns dropout on).
        query: ``[batch, n_heads, q_len, head_dim]``.
        key: ``[batch, n_kv_heads, kv_len, head_dim]``, ``n_heads`` a multiple of ``n_kv_heads``.
        value: as ``key``.
        attention_mask: additive, broadcast to ``[batch, n_heads, q_len, kv_len]``, or None.
        dropout: the probability of dropping a weight while training.
        scaling: the logits' scale (None: ``head_dim ** -0.5``).
        softcap: ``cap * tanh(logit / cap)`` before the mask, or None.
        s_aux: ``n_heads`` sink logits, or None (``sinks``: the same, by another name).

    Returns:
        ``(attn_output, weights)``: ``[batch, q_len, n_heads, head_dim]`` and
        ``[batch, n_heads, q_len, kv_len]``.
    """
    import torch

    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    logits = torch.matmul(query, key.transpose(2, 3)) * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if attention_mask is not None:
        logits = logits + attention_mask
    sink = s_aux if s_aux is not None else sinks
    if sink is not None:
        sink = sink.reshape(1, -1, 1, 1).to(logits.dtype).expand(*logits.shape[:-1], 1)
        logits = torch.cat([logits, sink], dim=-1)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if sink is not None:
        weights = weights[..., :-1]
    weights = weights.to(query.dtype)
    training = bool(getattr(module, "training", False))
    weights = torch.nn.functional.dropout(weights, p=dropout, training=training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


# A static cache's decode is planned once for its buffer, its launches remembered by the
# arrays it reads: the length (one int32 per device and stream, written before each
# decode on the decode's stream) and the sinks (one float32 copy per s_aux tensor, kept
# while its values stay: _float_sinks) keep their addresses from step to step.
_LENGTHS: dict[tuple[Any, int], Any] = {}
_SINKS: dict[int, tuple[Any, int, Any]] = {}


def _length_on(device: Any, stream: Any) -> Any:
    import torch

    key = (device, stream.cuda_stream)
    length = _LENGTHS.get(key)
    if length is None:
        length = _LENGTHS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return length


def _float_sinks(s_aux: Any) -> Any:
    """A layer's sinks as float32, one copy per s_aux tensor while its values stay (so a
    static cache's remembered decode reads the same array at every step)."""
    key = id(s_aux)
    held = _SINKS.get(key)
    if held is None or held[0] is not s_aux or held[1] != s_aux._version:
        held = _SINKS[key] = (s_aux, s_aux._version, s_aux.reshape(-1).float())
    return held[2]
