"""ferrox as a Hugging Face transformers attention implementation, ``"ferrox"``.

    import ferrox_driver.integrations.transformers as fx_transformers

    fx_transformers.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="ferrox")
    model.generate(ids, max_new_tokens=64, cache_implementation="static")

Which attention computes each call:

- ferrox: single-token decode steps of a batch of one on CUDA, reading the cache's K and V
  in place (head-major, ``gqa_decode(..., kv_layout="HND")``), with the layer's scale,
  sliding window (from the attention mask), soft-cap (Gemma 2) and sinks (gpt-oss). Values
  of their own width (DeepSeek V2/V3: K 192, V 128 wide, V a ``torch.split`` view): decode
  steps of 1 to 16 query tokens (a verify's, causal, after earlier tokens), eager
  (``gqa_decode(..., head_dim_v=)`` over the first tokens the mask keeps); compiled, one
  query token's (the op over the whole buffers and a length on the device, as other
  models' compiled steps), more on SDPA.
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

from ..decode.checks import MAX_HEAD_DIM, layout_dims
from ..decode.values import VALUES_MAX_HEAD_DIM_V, VALUES_MAX_QUERIES
from ..kernels.spec import LATENT_MAX_HEAD_DIM

NAME = "ferrox"
logger = logging.getLogger(__name__)
_REGISTERED: Any = None  # ferrox_attention_forward as registered (not traced by torch.compile)

__all__ = ["NAME", "DecodeCall", "FP8Cache", "FourBitCache", "decode_call", "eager_attention",
           "ferrox_attention_forward", "register"]  # fmt: skip


def register(name: str = NAME) -> None:
    """Register ferrox's attention under ``name`` with transformers, with SDPA's boolean
    mask function (a decode step reads the mask for the tokens it attends to; a call that
    falls back to eager attention gets it as an additive mask). Idempotent."""
    from functools import partial

    import torch
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    import ferrox_driver.integrations.torch  # noqa: F401  (registers torch.ops.ferrox)

    global _REGISTERED
    if _REGISTERED is None:
        # generate() compiles a static cache's decode steps (torch.compile): the compiled
        # path traces ferrox's custom ops (torch.ops.ferrox) into the graph, the length and
        # the mask's check on the device, no graph break
        _REGISTERED = ferrox_attention_forward
    del torch
    AttentionInterface.register(name, _REGISTERED)
    # allow_is_causal_skip=False: a decode step's mask always says which tokens it reads
    AttentionMaskInterface.register(name, partial(sdpa_mask, allow_is_causal_skip=False))


@dataclass(frozen=True)
class DecodeCall:
    """How one attention call runs on ferrox: the first ``length`` tokens of the cache,
    the window (None: all of them) and the features; ``head_dim_v`` the values' width
    where it is not the keys' (None: equal)."""

    length: int
    sliding_window: int | None
    scale: float | None
    logits_soft_cap: float | None
    sinks: Any  # a float32 torch tensor of n_heads, or None
    head_dim_v: int | None = None


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
    read_mask: bool = True,
    **kwargs: Any,
) -> DecodeCall | str:
    """The ferrox decode of a transformers attention call, or why there is none (a
    sentence for the debug log). ``query`` is ``[batch, n_heads, q_len, head_dim]``, ``key``
    and ``value`` ``[batch, n_kv_heads, kv_len, head_dim]`` (a static cache's whole buffer,
    or a dynamic cache's tokens); the mask, where given, says which of kv_len are read.
    Reads the mask's last row on the host (one small copy). A ``value`` whose rows are
    not the keys' width (DeepSeek V2/V3) takes 1 to 16 query tokens, the last of a run
    that the mask's rows show causal after earlier tokens (``_rows_span``); compiled, one.
    ``require_cuda=False``: the plan of CPU tensors too (for tests). ``read_mask=False``
    (a compiled step): the mask is not read here; ``length`` is then the whole cache and
    the window the layer's ``sliding_window`` keyword, both checked against the mask on
    the device."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "query, key and value are not 4-D [batch, heads, tokens, head_dim]"
    batch, n_heads, q_len, head_dim = query.shape
    dv = int(value.shape[3]) if value.shape[3] != key.shape[3] else None  # (DeepSeek V2/V3)
    if batch != 1:
        return f"a batch of {batch} (ferrox decodes one sequence)"
    if q_len != 1 and dv is None:
        return f"{q_len} query tokens (prefill; ferrox decodes one token)"
    if q_len > VALUES_MAX_QUERIES:
        return (f"{q_len} query tokens (prefill; ferrox decodes 1 to {VALUES_MAX_QUERIES} "
                f"with values of their own width)")  # fmt: skip
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
    if (tuple(value.shape[:3]) != tuple(key.shape[:3]) or key.shape[3] != head_dim
            or key.shape[0] != 1):  # fmt: skip
        return f"key {tuple(key.shape)} and value {tuple(value.shape)} do not match the query"
    if dv is not None:
        why = _why_not_values(query, key, value, read_mask)
        if why:
            return why
    elif head_dim > MAX_HEAD_DIM or n_heads % n_kv:
        return f"{n_heads} query heads of {head_dim} over {n_kv} KV heads"
    elif key.stride(-1) != 1 or key.stride(-2) != head_dim or value.stride() != key.stride():
        return f"K/V rows not contiguous (strides {key.stride()}, {value.stride()})"
    if (
        key.device != query.device
        or value.device != query.device
        or (require_cuda and query.device.type != "cuda")
    ):
        return f"tensors on {query.device}, {key.device}, {value.device} (ferrox: one CUDA device)"
    length, window = kv_len, None
    if not read_mask:
        window = kwargs.get("sliding_window")
        window = None if window is None or window >= kv_len else int(window)
    elif attention_mask is not None:
        span = (_mask_span(attention_mask, kv_len) if q_len == 1
                else _rows_span(attention_mask, kv_len, q_len))  # fmt: skip
        if isinstance(span, str):
            return span
        first, length = span
        window = length - first if first else None
    if q_len > 1 and (attention_mask is None or length <= q_len):
        # (no earlier token: a prompt's; SDPA's is_causal, without a mask, aligns its
        # queries with the first keys, ferrox's with the last)
        return f"{q_len} query tokens with no earlier token to read (prefill)"
    sinks = None
    if s_aux is not None:  # (a compiled step hands s_aux to the op, which makes its copy)
        sinks = s_aux if not read_mask else _float32_copy(s_aux).reshape(-1)
    if sinks is not None and sinks.numel() != n_heads:
        return f"{sinks.numel()} sinks for {n_heads} query heads"
    cap = float(softcap) if softcap else None
    scale = None if scaling is None else float(scaling)
    return DecodeCall(length, window, scale, cap, sinks, dv)


def _why_not_values(query: Any, key: Any, value: Any, read_mask: bool) -> str | None:
    """Why ferrox does not decode values of their own width (``value``'s rows narrower
    or wider than ``key``'s) from these tensors, or None: the kernels' dtypes and widths
    (decode/values.py), rows contiguous and 16-byte aligned, and, compiled (no host read:
    the mask is checked on the device, as ``_device_span`` checks one query's row), one
    query token. Compiled, the pointers are not read here (a traced tensor has none): the
    op checks them when it runs, and refuses a view off 16 bytes by name."""
    d, dv, n_heads, n_kv = key.shape[3], value.shape[3], query.shape[1], key.shape[1]
    what = f"values {dv} wide against keys {d}"
    if not read_mask and query.shape[2] != 1:
        return (f"{what}, {query.shape[2]} query tokens compiled (ferrox checks one query's "
                f"mask on the device)")  # fmt: skip
    if str(query.dtype) not in _DTYPES[:2]:
        return f"{what} in {query.dtype} (ferrox's kernels for them: float16, bfloat16)"
    if d % 64 or d > LATENT_MAX_HEAD_DIM or dv % 128 or dv > VALUES_MAX_HEAD_DIM_V:
        return (f"{what} (ferrox: keys a multiple of 64 up to {LATENT_MAX_HEAD_DIM}, values "
                f"of 128 up to {VALUES_MAX_HEAD_DIM_V})")  # fmt: skip
    if n_heads % n_kv:
        return f"{n_heads} query heads over {n_kv} KV heads"
    size = key.element_size()
    for name, t, width in (("K", key, d), ("V", value, dv)):
        apart = [t.stride(1) if t.shape[1] > 1 else 0, t.stride(2) if t.shape[2] > 1 else width]
        if t.stride(3) != 1 or apart[1] < width or apart[0] < 0:
            return f"{name} rows not contiguous (strides {t.stride()})"
        if (read_mask and t.data_ptr() % 16) or any(a * size % 16 for a in apart):
            return f"{name} rows not 16-byte aligned (strides {t.stride()})"
    return None


# The last mask read on the host and its span: a step's layers share one mask, read once.
_SPAN: list[Any] = [None, -1, None]  # [mask, its _version, span]


def _mask_span(mask: Any, kv_len: int) -> tuple[int, int] | str:
    """The tokens [first, end) that a decode step's mask lets it read (a boolean mask, or
    an additive one of 0 and -inf), or why it is not one run of them. One host read per
    mask (the layers of a step share theirs)."""
    if mask.dim() != 4 or mask.shape[-1] != kv_len:
        return f"an attention mask of shape {tuple(mask.shape)}"
    if _SPAN[0] is mask and _SPAN[1] == mask._version:
        return _SPAN[2]
    span = _read_span(mask)
    _SPAN[:] = [mask, mask._version, span]
    return span


# The last mask of several rows read on the host and its span (as _SPAN).
_ROWS: list[Any] = [None, -1, None]


def _rows_span(mask: Any, kv_len: int, n_q: int) -> tuple[int, int] | str:
    """``_mask_span`` of a mask of ``n_q`` query rows, which ferrox reads as its causal
    queries: the last n_q tokens of a run ending at ``end``, query t's row keeping the
    tokens up to ``end - n_q + t`` from where the window (the last row's, None: token 0)
    starts. ``(first, end)`` of the last row, or why the mask is not that."""
    shape = tuple(mask.shape)
    if mask.dim() != 4 or shape[:2] != (1, 1) or shape[2:] != (n_q, kv_len):
        return f"an attention mask of shape {shape} for {n_q} query tokens"
    if _ROWS[0] is mask and _ROWS[1] == mask._version:
        return _ROWS[2]
    span = _read_rows(mask, n_q)
    _ROWS[:] = [mask, mask._version, span]
    return span


def _read_rows(mask: Any, n_q: int) -> tuple[int, int] | str:
    import torch

    rows = mask[0, 0]
    keep = (rows if rows.dtype == torch.bool else rows == 0).cpu()  # (one host copy)
    at = torch.arange(keep.shape[1])
    count = keep.sum(1)
    if bool((count == 0).any()):
        return "a mask that hides every token from a query"
    end = torch.where(keep, at + 1, 0).amax(1)
    first = torch.where(keep, at, keep.shape[1]).amin(1)
    if not torch.equal(end - first, count):
        return "a mask that is not one run of tokens for each query (padding)"
    n = int(end[-1])
    if not torch.equal(end, torch.arange(n - n_q + 1, n + 1)):
        return f"a mask whose {n_q} queries are not the last tokens it keeps, in order"
    window = n - int(first[-1]) if int(first[-1]) else None
    start = torch.zeros_like(end) if window is None else (end - window).clamp(min=0)
    if not torch.equal(first, start):
        return "a mask whose queries' windows differ"
    return int(first[-1]), n


def _read_span(mask: Any) -> tuple[int, int] | str:
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
    ``(attn_output [batch, q_len, n_heads, head_dim], weights or None)``.

    Eager, the mask's run of tokens is read on the host once per mask (a step's layers
    share it) and a mask that is not one run goes to SDPA or eager attention. Compiled
    (``torch.compile``), nothing is read on the host: the length and the mask's check are
    computed on the device, the decode is ``torch.ops.ferrox.gqa_decode``, and a step whose
    mask ferrox cannot read (not one run of tokens ending at the length, with the layer's
    window) gets NaN, never a wrong number."""
    import torch

    if str(key.dtype).startswith("torch.float8"):  # an FP8Cache's decode step
        return _fp8_forward(module, query, key, value, attention_mask, dropout, scaling,
                            **kwargs)  # fmt: skip
    if key.dtype == torch.uint8:  # a FourBitCache's decode step (its values' bytes)
        from .transformers_kv4 import four_bit_forward

        return four_bit_forward(module, query, key, value, attention_mask, dropout, scaling,
                                **kwargs)  # fmt: skip
    compiling = torch.compiler.is_compiling()
    call = decode_call(module, query, key, value, attention_mask, dropout=dropout,
                       scaling=scaling, read_mask=not compiling, **kwargs)  # fmt: skip
    if isinstance(call, str):
        return _fallback(call, module, query, key, value, attention_mask, dropout, scaling,
                         **kwargs)  # fmt: skip
    _, n_heads, _, head_dim = query.shape
    features: dict[str, Any] = dict(sliding_window=call.sliding_window, scale=call.scale,
                                    logits_soft_cap=call.logits_soft_cap)  # fmt: skip
    if compiling:  # (one query token; values of their own width too: the op reads V's)
        import ferrox_driver.integrations.torch as fxt

        seq_len, ok = _device_span(attention_mask, key.shape[2], call.sliding_window, query.device)
        out = fxt.gqa_decode(query.reshape(n_heads, head_dim), key, value, seq_len,
                             kv_layout="HND", sinks=kwargs.get("s_aux"), **features)  # fmt: skip
        width = head_dim if call.head_dim_v is None else call.head_dim_v
        out = torch.where(ok, out, torch.nan).reshape(1, 1, n_heads, width)
        return out, None
    if call.head_dim_v is not None:
        return _values_forward(call, query, key, value), None

    import ferrox_driver as fd
    from ferrox_driver.driver.stream import torch_stream

    n = call.length
    out = torch.empty((1, 1, n_heads, head_dim), dtype=query.dtype, device=query.device)
    stream = torch_stream(query.get_device())  # (PyTorch's current stream's handle)
    q = query.reshape(n_heads, head_dim)
    features["sinks"] = call.sinks
    if n < key.shape[2]:  # a static cache: its whole buffer, the length on the device
        length = _length_on(query.device, stream, attention_mask, n, key.shape[2])
        fd.gqa_decode_async(q, (key, value), out, n_heads=n_heads, stream=stream,
                            seq_len=length, kv_layout="HND", **features)  # fmt: skip
    else:  # (a dynamic cache: a new shape at every step)
        fd.gqa_decode(q, key, value, n_heads=n_heads, n_kv_heads=key.shape[1],
                      head_dim=head_dim, out=out, kv_layout="HND", stream=stream,
                      **features)  # fmt: skip
    return out, None


def _values_forward(call: DecodeCall, query: Any, key: Any, value: Any) -> Any:
    """A decode step whose values are ``call.head_dim_v`` wide (not the keys' width) on
    ferrox: ``gqa_decode(..., head_dim_v=)`` of the query tokens ``(q_len, n_heads,
    head_dim)`` over the first ``call.length`` tokens of K and V (views, read in place),
    into ``[1, q_len, n_heads, head_dim_v]``."""
    import torch

    import ferrox_driver as fd
    from ferrox_driver.driver.stream import torch_stream

    _, n_heads, q_len, head_dim = query.shape
    dv, n = call.head_dim_v, call.length
    assert dv is not None
    q = query[0].transpose(0, 1).contiguous()  # (q_len, n_heads, head_dim)
    q = q.clone() if q.data_ptr() % 16 else q  # (the kernels read 16-byte pieces)
    out = torch.empty((1, q_len, n_heads, dv), dtype=query.dtype, device=query.device)
    fd.gqa_decode(q, key[:, :, :n], value[:, :, :n], n_heads=n_heads, n_kv_heads=key.shape[1],
                  head_dim=head_dim, head_dim_v=dv, out=out.view(q_len, n_heads, dv),
                  kv_layout="HND", stream=torch_stream(query.get_device()),
                  sliding_window=call.sliding_window, scale=call.scale,
                  logits_soft_cap=call.logits_soft_cap, sinks=call.sinks)  # fmt: skip
    return out


def _fp8_forward(
    module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float,
    scaling: float | None, **kwargs: Any,
) -> tuple[Any, Any]:  # fmt: skip
    """A decode step over an `FP8Cache` layer (its update returned the fp8 buffers): read
    in place by ``torch.ops.ferrox.gqa_decode`` with the layer's scales and device length.
    What it cannot compute is refused with an error (eager) or NaN (compiled): there is no
    other attention over fp8 bytes to fall back on."""
    import ferrox_driver.integrations.torch as fxt

    layer = bound_layer(module, key, "ferrox_fp8_layer", "FP8Cache", "fp8")
    n_heads, head_dim, window = quantized_step("FP8Cache", "an fp8 cache", query, key, dropout,
                                               kwargs)  # fmt: skip
    softcap = kwargs.get("softcap")
    out = fxt.gqa_decode(query.reshape(n_heads, head_dim), key, value, layer.state[:1],
                         kv_layout="NHD", kv_scales=layer.kv_scales, sinks=kwargs.get("s_aux"),
                         scale=scaling, logits_soft_cap=float(softcap) if softcap else None,
                         sliding_window=window)  # fmt: skip
    out = masked_step(out, layer, attention_mask, window, query, "FP8Cache")
    return out.reshape(1, 1, n_heads, head_dim), None


def bound_layer(module: Any, key: Any, attr: str, cache: str, what: str) -> Any:
    """The cache layer bound to ``module`` as ``attr`` (by a ``cache`` of ``what`` keys),
    checked to be the one whose keys reached it (eager; compiled, the graph's guards)."""
    import torch

    layer = getattr(module, attr, None)
    if layer is None:
        raise ValueError(
            f"key: {what} keys reached {type(module).__name__}, which no {cache} is bound to: "
            f"make the cache with {cache}(model, max_cache_len) for this model"
        )
    if not torch.compiler.is_compiling() and key is not layer.keys:
        raise ValueError(
            f"key: these {what} keys are not those of the {cache} bound to "
            f"{type(module).__name__} (the one made last for this model): use that cache, or "
            f"make a new {cache}(model, ...) for this run"
        )
    return layer


def bind_layers(model: Any, layers: list[Any], attr: str, cache: str) -> None:
    """Bind a quantized cache's ``layers`` to ``model``'s attention modules (each module's
    ``attr`` its layer_idx's layer), where its decode steps find them.

    Raises:
        ValueError: naming ``model``, where it has no attention module with a layer_idx.
    """
    bound = 0
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and type(module).__name__.endswith("Attention"):
            setattr(module, attr, layers[idx])
            bound += 1
    if bound == 0:
        raise ValueError(f"model: no attention modules with a layer_idx in "
                         f"{type(model).__name__} to bind the {cache} to")  # fmt: skip


def quantized_step(
    cache: str, what: str, query: Any, key: Any, dropout: float, kwargs: dict[str, Any],
    kv_layout: str = "NHD",
) -> tuple[int, int, int | None]:  # fmt: skip
    """A decode step over a quantized cache's layer checked: (n_heads, head_dim, the
    window to read, None for the whole cache), or a ValueError naming what it has that
    ferrox's decode of ``what`` (there is no other attention over its bytes) lacks.
    ``kv_layout``: the layer's keys' ("NHD", capacity first; "HND", KV heads first)."""
    batch, n_heads, q_len, head_dim = query.shape
    why = None
    if batch != 1 or q_len != 1:
        why = f"a batch of {batch} with {q_len} query tokens"
    elif dropout:
        why = f"dropout {dropout}"
    elif kwargs.get("output_attentions"):
        why = "output_attentions"
    else:
        why = _unread(kwargs, ("softcap", "s_aux"))
    if why:
        raise ValueError(f"{cache}: ferrox decodes one query token of a batch of one over "
                         f"{what}, without other features; got {why}")  # fmt: skip
    cap = layout_dims(kv_layout, tuple(key.shape))[0]
    window = kwargs.get("sliding_window")
    return n_heads, head_dim, None if window is None or window >= cap else int(window)


def masked_step(
    out: Any, layer: Any, attention_mask: Any, window: int | None, query: Any, cache: str
) -> Any:
    """``out`` of a quantized cache's decode step, checked against the step's mask: the
    mask must keep the tokens ferrox read (the layer's device length, its window). Eager, a
    ValueError naming ``attention_mask``; compiled (nothing read on the host), NaN."""
    import torch

    if attention_mask is None:
        return out
    if torch.compiler.is_compiling():
        end, ok = _device_span(attention_mask, attention_mask.shape[-1], window, query.device)
        ok = ok & (end == layer.state[:1]).all()
        return torch.where(ok, out, torch.nan)
    span = _mask_span(attention_mask, attention_mask.shape[-1])
    n = int(layer.state[0])
    want = (0 if window is None else max(0, n - window), n)
    if span != want:
        raise ValueError(f"attention_mask: ferrox reads tokens {want} of the {cache}, "
                         f"the mask keeps {span}")  # fmt: skip
    return out


def _device_span(mask: Any, kv_len: int, window: int | None, device: Any) -> tuple[Any, Any]:
    """A compiled decode step's length and whether ferrox reads its mask right, on the
    device: ``(seq_len, ok)``, seq_len one int32 (the last token the mask keeps, plus
    one), ok a boolean scalar: the mask keeps one run of tokens that ends there and starts
    where the window (None: the first token) does."""
    import torch

    if mask is None:
        return torch.full((1,), kv_len, dtype=torch.int32, device=device), torch.tensor(True)
    row = mask[0, 0, -1]
    keep = row if row.dtype == torch.bool else row == 0
    at = torch.arange(kv_len, device=keep.device, dtype=torch.int32)
    end = torch.where(keep, at + 1, 0).amax()
    first = torch.where(keep, at, kv_len).amin()
    count = keep.sum(dtype=torch.int32)
    start = end * 0 if window is None else (end - window).clamp(min=0)
    ok = (count > 0) & (count == end - first) & (first == start)
    return end.reshape(1).to(torch.int32), ok


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
    """A call ferrox does not decode (``why``), on eager attention or SDPA; logged where
    not compiled (dynamo breaks the graph at a logger call: a compiled step's fallback,
    a compiled DeepSeek verify's say, is traced into the graph instead)."""
    import torch

    quiet = torch.compiler.is_compiling()
    feature = _why_eager(module, kwargs)
    if feature is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if not quiet:
            logger.debug("ferrox: %s: SDPA instead", why)
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)  # fmt: skip
    if not quiet:
        logger.debug("ferrox: %s: eager attention instead (%s)", why, feature)
    if attention_mask is not None and attention_mask.shape[-1] > key.shape[-2]:
        # (an FP8Cache's prefill: its mask covers the whole cache, its keys the tokens so far,
        # which are the mask's first columns; SDPA's attention slices it the same way)
        attention_mask = attention_mask[..., : key.shape[-2]]
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
# while its values stay: integrations.torch.float32_copy) keep their addresses from step
# to step.
_LENGTHS: dict[tuple[Any, int, int], tuple[Any, int, Any]] = {}


def _length_on(device: Any, stream: int, mask: Any, n: int, kv_len: int) -> Any:
    """The int32 device length ``n`` of a static cache's decode: one array per device,
    stream (its handle) and cache size (the layers of one size end their runs at one length
    in a step), so a layer's decode keeps its record from step to step; written once per
    mask (not per layer) before the decodes that read it, on their stream."""
    import torch

    key = (device, stream, kv_len)
    held = _LENGTHS.get(key)
    if held is not None and held[0] is mask and held[1] == n:
        return held[2]
    if held is None:
        if len(_LENGTHS) > 64:
            _LENGTHS.clear()
        length = torch.zeros(1, dtype=torch.int32, device=device)
    else:
        length = held[2]
    length.fill_(n)
    _LENGTHS[key] = (mask, n, length)
    return length


def _float32_copy(t: Any) -> Any:
    from ferrox_driver.integrations.torch import float32_copy

    return float32_copy(t)


FP8Cache: Any  # made on first use (module __getattr__)
FourBitCache: Any  # made on first use (module __getattr__; transformers_kv4.py)


def __getattr__(name: str) -> Any:
    if name == "FP8Cache":  # made on first use: it subclasses transformers' Cache
        global FP8Cache
        FP8Cache = _fp8_cache_class()
        return FP8Cache
    if name == "FourBitCache":
        from .transformers_kv4 import four_bit_cache_class

        global FourBitCache
        FourBitCache = four_bit_cache_class()
        return FourBitCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _fp8_cache_class() -> Any:
    import torch
    from transformers import cache_utils

    Cache: Any = cache_utils.Cache  # (Any: the layers hold attributes of their own)
    StaticLayer: Any = cache_utils.StaticLayer

    import ferrox_driver.integrations.torch as fxt

    fp8_max = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

    class FP8Layer(StaticLayer):
        """One layer of an `FP8Cache`: K and V token-major ``(max_cache_len, n_kv_heads,
        head_dim)`` in fp8, their scales ``kv_scales`` (float32 ``(2, n_kv_heads)``) and
        the length on the device (``state``)."""

        def __init__(self, max_cache_len: int, fp8_dtype: Any, k_scale: Any, v_scale: Any,
                     margin: float) -> None:  # fmt: skip
            super().__init__(max_cache_len=max_cache_len)
            self.fp8_dtype, self.margin = fp8_dtype, margin
            self.given_scales = (k_scale, v_scale)

        def lazy_initialization(self, key_states: Any, value_states: Any) -> None:
            self.dtype, self.device = key_states.dtype, key_states.device
            batch, n_kv, _, head_dim = key_states.shape
            if batch != 1:
                raise ValueError(f"FP8Cache: one sequence (a batch of 1), got {batch}")
            if head_dim % 8 or value_states.shape[-1] != head_dim:
                raise ValueError(
                    f"FP8Cache: head_dim {head_dim} (K) and "
                    f"{value_states.shape[-1]} (V): equal, a multiple of 8"
                )
            shape = (self.max_cache_len, n_kv, head_dim)
            self.keys = torch.zeros(shape, dtype=self.fp8_dtype, device=self.device)
            self.values = torch.zeros(shape, dtype=self.fp8_dtype, device=self.device)
            self.kv_scales = torch.ones((2, n_kv), dtype=torch.float32, device=self.device)
            self.state = torch.zeros(2, dtype=torch.int32, device=self.device)
            self.cumulative_length: Any = self.cumulative_length.to(self.device)
            self.batch_size, self.num_heads = 1, n_kv
            self.k_head_dim = self.v_head_dim = head_dim
            for i, given in enumerate(self.given_scales):
                if given is not None:
                    self.kv_scales[i] = torch.as_tensor(given, dtype=torch.float32)
            if not torch.compiler.is_compiling():
                for t in (self.keys, self.values, self.kv_scales, self.state,
                          self.cumulative_length):  # fmt: skip
                    torch._dynamo.mark_static_address(t)
            self.is_initialized = True

        def update(self, key_states: Any, value_states: Any, *args: Any,
                   **kwargs: Any) -> tuple[Any, Any]:  # fmt: skip
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = key_states.shape[-2]
            if n == 1:  # a decode step: quantized in, the fp8 buffers out (read in place)
                _, n_kv, _, head_dim = key_states.shape
                fxt.kv_append(self.keys, self.values, key_states.reshape(n_kv, head_dim),
                              value_states.reshape(n_kv, head_dim), self.state,
                              kv_scales=self.kv_scales)  # fmt: skip
                self.cumulative_length.add_(1)
                return self.keys, self.values
            past = int(self.state[0])  # (several tokens: a prefill, eager; one host read)
            if past + n > self.max_cache_len:
                raise ValueError(f"FP8Cache: {past} + {n} tokens pass max_cache_len "
                                 f"{self.max_cache_len}")  # fmt: skip
            if past == 0:
                self._calibrate(key_states, value_states)
            rows_k = key_states[0].transpose(0, 1).contiguous()
            rows_v = value_states[0].transpose(0, 1).contiguous()
            fxt.kv_append(self.keys, self.values, rows_k, rows_v, self.state,
                          kv_scales=self.kv_scales)  # fmt: skip
            self.cumulative_length.add_(n)
            if past == 0:
                return key_states, value_states
            # later tokens of several: the attention reads the cache so far, dequantized
            return (
                torch.cat((self._dequantized(self.keys, 0, past), key_states), dim=-2),
                torch.cat((self._dequantized(self.values, 1, past), value_states), dim=-2),
            )

        def _calibrate(self, key_states: Any, value_states: Any) -> None:
            """Scales from the first tokens: each KV head's largest magnitude over them,
            times ``margin``, at the format's largest value (given scales stay)."""
            top = fp8_max[self.fp8_dtype]
            for i, (x, given) in enumerate(zip((key_states, value_states), self.given_scales,
                                               strict=True)):  # fmt: skip
                if given is None:
                    amax = x[0].float().abs().amax(dim=(1, 2))
                    self.kv_scales[i] = (amax * self.margin / top).clamp(min=1e-8)

        def _dequantized(self, buf: Any, which: int, n: int) -> Any:
            scale = self.kv_scales[which].view(1, -1, 1)
            return (buf[:n].float() * scale).to(self.dtype).transpose(0, 1)[None]

        def reset(self) -> None:
            super().reset()
            if self.is_initialized:
                self.state.zero_()

    class FP8Cache(Cache):
        """A static KV cache for ``generate()`` whose K and V are fp8 (e4m3 by default),
        quantized on the device as each token arrives and read by ferrox's kernels in
        place: half the bytes of a bf16 StaticCache, decodes that read half as much.

            fx_transformers.register()
            model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="ferrox")
            cache = fx_transformers.FP8Cache(model, max_cache_len=131072)
            model.generate(ids, past_key_values=cache, max_new_tokens=64)

        Works eager and compiled (generate's default torch.compile). The scales (one per
        KV head, K and V apart) come from the prompt: each head's largest magnitude over it,
        times ``scale_margin``, at the format's largest value; or give ``k_scale``/``v_scale``
        (a scalar or one per KV head). Values past the range saturate. One sequence (a
        batch of 1); the prompt's attention runs on SDPA or eager attention in the model's
        dtype, every later token on ferrox. Sliding-window layers keep every token (the
        kernel reads the window). The cache binds itself to ``model``'s attention modules
        (their ``ferrox_fp8_layer``): one FP8Cache per model at a time.

        Args:
            model: the model (``attn_implementation="ferrox"``).
            max_cache_len: tokens the cache holds (prompt and new ones).
            fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
            k_scale, v_scale: fixed scales (default: from the prompt).
            scale_margin: headroom over the prompt's largest magnitude.
        """

        def __init__(self, model: Any, max_cache_len: int, *, fp8_dtype: Any = None,
                     k_scale: Any = None, v_scale: Any = None,
                     scale_margin: float = 2.0) -> None:  # fmt: skip
            fp8_dtype = torch.float8_e4m3fn if fp8_dtype is None else fp8_dtype
            if fp8_dtype not in fp8_max:
                raise TypeError(f"fp8_dtype: expected torch.float8_e4m3fn or float8_e5m2, "
                                f"got {fp8_dtype}")  # fmt: skip
            if not isinstance(max_cache_len, int) or max_cache_len < 1:
                raise ValueError(f"max_cache_len: expected a positive int, got {max_cache_len!r}")
            if not scale_margin > 0:
                raise ValueError(f"scale_margin: expected > 0, got {scale_margin}")
            config = model.config.get_text_config(decoder=True)
            layers = [FP8Layer(max_cache_len, fp8_dtype, k_scale, v_scale, scale_margin)
                      for _ in range(config.num_hidden_layers)]  # fmt: skip
            super().__init__(layers=layers)
            bind_layers(model, layers, "ferrox_fp8_layer", "FP8Cache")

        @property
        def nbytes(self) -> int:
            """Device bytes held: K, V, scales and lengths of every initialized layer."""
            return sum(
                t.nbytes
                for layer in self.layers
                if layer.is_initialized
                for t in (layer.keys, layer.values, layer.kv_scales, layer.state)
            )

    return FP8Cache
