"""ferrox as a Hugging Face transformers attention implementation, ``"ferrox"``.

    import ferrox_driver.integrations.transformers as fx_transformers

    fx_transformers.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="ferrox")
    model.generate(ids, max_new_tokens=64, cache_implementation="static")

Single-token decode steps of a batch of one run on ferrox, reading the cache's K and V in
place (head-major, ``gqa_decode(..., kv_layout="HND")``), with the layer's scale, sliding
window (from the attention mask), soft-cap (Gemma 2) and sinks (gpt-oss). Everything else
(prefill, batches, padding, dropout, CPU tensors) runs on transformers' SDPA attention with
SDPA's masks, and says why in a debug log line of logger ``ferrox_driver.integrations.
transformers``: never silently wrong.

Needs transformers (5.x) and PyTorch; ferrox itself imports neither.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

NAME = "ferrox"
logger = logging.getLogger(__name__)
_REGISTERED: Any = None  # ferrox_attention_forward as registered (not traced by torch.compile)

__all__ = ["NAME", "DecodeCall", "decode_call", "ferrox_attention_forward", "register"]


def register(name: str = NAME) -> None:
    """Register ferrox's attention under ``name`` with transformers, with SDPA's mask
    function (prefill and fallbacks run on SDPA; a decode step reads the mask for the
    tokens it attends to). Idempotent."""
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
) -> tuple[Any, None]:
    """transformers' attention function for ``attn_implementation="ferrox"``: a decode
    step on ferrox (see ``decode_call``), anything else on SDPA. Returns
    ``(attn_output [batch, q_len, n_heads, head_dim], None)``."""
    call = decode_call(module, query, key, value, attention_mask, dropout=dropout,
                       scaling=scaling, **kwargs)  # fmt: skip
    if isinstance(call, str):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        logger.debug("ferrox: %s: SDPA instead", call)
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)  # fmt: skip
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
