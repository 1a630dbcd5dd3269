"""`FourBitCache`: a transformers static cache of 4-bit K and V (int4 or nvfp4), the
sibling of `FP8Cache` (transformers.py), made on first use by that module's __getattr__.

Each layer holds a 4-bit ``KVCache``'s storage as tensors (``torch_kv4``), in a
KVCache's default layout (``LAYOUT``, ``cache.four_bit.DEFAULT_LAYOUT``: head-major,
``"HND"``, a KV head's rows in one run, or token-major, ``"NHD"``): K's and V's values,
uint8 ``(max_cache_len, n_kv_heads, head_dim // 2)`` (head-major: ``(n_kv_heads,
max_cache_len, ...)``), their block scales alike, nvfp4's scales per KV head
(``kv_scales``) and the length on the device. Rows are quantized on the GPU by
``torch.ops.ferrox.kv_append_4bit``; a decode step's attention reads the bytes in place
with ``torch.ops.ferrox.gqa_decode`` (eager and compiled: no graph break); the prompt
attends in the model's dtype, as an FP8Cache's does.
"""

from __future__ import annotations

from typing import Any

from ..cache.four_bit import DEFAULT_LAYOUT
from ..decode.checks import layout_shape
from .transformers import bind_layers, bound_layer, masked_step, quantized_step

__all__ = ["four_bit_cache_class", "four_bit_forward"]

_E2M1_MAX, _E4M3_MAX = 6.0, 448.0  # nvfp4's largest value: 6 times a block scale of 448
LAYOUT = DEFAULT_LAYOUT  # the layers' storage, "NHD" or "HND"


def four_bit_forward(
    module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float,
    scaling: float | None, **kwargs: Any,
) -> tuple[Any, Any]:  # fmt: skip
    """A decode step over a `FourBitCache` layer (its update returned the values' bytes):
    read in place by ``torch.ops.ferrox.gqa_decode`` with the layer's block scales,
    rotation and device length. What it cannot compute is refused with an error (eager) or
    NaN (compiled): there is no other attention over 4-bit bytes to fall back on."""
    import ferrox_driver.integrations.torch as fxt

    layer = bound_layer(module, key, "ferrox_kv4_layer", "FourBitCache", "4-bit")
    n_heads, head_dim, window = quantized_step("FourBitCache", "a 4-bit cache", query, key,
                                               dropout, kwargs, kv_layout=LAYOUT)  # fmt: skip
    softcap = kwargs.get("softcap")
    out = fxt.gqa_decode(query.reshape(n_heads, head_dim), key, value, layer.state[:1],
                         kv_layout=LAYOUT, kv_scales=layer.kv_scales, sinks=kwargs.get("s_aux"),
                         scale=scaling, logits_soft_cap=float(softcap) if softcap else None,
                         sliding_window=window, kv_format=layer.kv_format,
                         k_block_scales=layer.k_block_scales,
                         v_block_scales=layer.v_block_scales, rotate_k=layer.rotate)  # fmt: skip
    out = masked_step(out, layer, attention_mask, window, query, "FourBitCache")
    return out.reshape(1, 1, n_heads, head_dim), None


def four_bit_cache_class() -> Any:
    import torch
    from transformers import cache_utils

    Cache: Any = cache_utils.Cache  # (Any: the layers hold attributes of their own)
    StaticLayer: Any = cache_utils.StaticLayer

    import ferrox_driver.integrations.torch as fxt

    group = {"int4": 32, "nvfp4": 16}
    default_rotate = {"int4": True, "nvfp4": False}  # KVCache(rotate=None)'s

    class FourBitLayer(StaticLayer):
        """One layer of a `FourBitCache`: K and V values in ``LAYOUT``, uint8
        ``(max_cache_len, n_kv_heads, head_dim // 2)`` (head-major: ``(n_kv_heads,
        max_cache_len, ...)``), their block scales alike (``head_dim // 32`` of them a row
        for int4, ``// 16`` for nvfp4), nvfp4's scales per KV head (``kv_scales``,
        float32 ``(2, n_kv_heads)``; None for int4) and the length on the device
        (``state``)."""

        def __init__(self, max_cache_len: int, fmt: str, rotate: bool, k_scale: Any,
                     v_scale: Any, margin: float) -> None:  # fmt: skip
            super().__init__(max_cache_len=max_cache_len)
            self.kv_format, self.rotate, self.margin = fmt, rotate, margin
            self.given_scales = (k_scale, v_scale)
            self.kv_scales: Any = None

        def lazy_initialization(self, key_states: Any, value_states: Any) -> None:
            self.dtype, self.device = key_states.dtype, key_states.device
            batch, n_kv, _, head_dim = key_states.shape
            if batch != 1:
                raise ValueError(f"FourBitCache: one sequence (a batch of 1), got {batch}")
            if head_dim not in (64, 128, 256) or value_states.shape[-1] != head_dim:
                raise ValueError(
                    f"FourBitCache: head_dim {head_dim} (K) and {value_states.shape[-1]} (V): "
                    "equal, and 64, 128 or 256 (the 4-bit kernels' widths)"
                )
            if self.dtype not in (torch.float16, torch.bfloat16):
                raise ValueError(f"FourBitCache: a model in {self.dtype}: ferrox reads 4-bit "
                                 "caches with float16 or bfloat16 queries")  # fmt: skip
            cap, dev = self.max_cache_len, self.device
            # values and block scales in LAYOUT
            self.keys = torch.zeros(layout_shape(LAYOUT, cap, n_kv, head_dim // 2),
                                    dtype=torch.uint8, device=dev)  # fmt: skip
            self.values = torch.zeros_like(self.keys)
            per = layout_shape(LAYOUT, cap, n_kv, head_dim // group[self.kv_format])
            sdt = torch.float16 if self.kv_format == "int4" else torch.uint8
            self.k_block_scales = torch.zeros(per, dtype=sdt, device=dev)
            self.v_block_scales = torch.zeros(per, dtype=sdt, device=dev)
            if self.kv_format == "nvfp4":
                self.kv_scales = torch.ones((2, n_kv), dtype=torch.float32, device=dev)
                for i, given in enumerate(self.given_scales):
                    if given is not None:
                        self.kv_scales[i] = torch.as_tensor(given, dtype=torch.float32)
            self.state = torch.zeros(2, dtype=torch.int32, device=dev)
            self.cumulative_length: Any = self.cumulative_length.to(dev)
            self.batch_size, self.num_heads = 1, n_kv
            self.k_head_dim = self.v_head_dim = head_dim
            if not torch.compiler.is_compiling():
                for t in (*self._tensors(), self.cumulative_length):
                    torch._dynamo.mark_static_address(t)
            self.is_initialized = True

        def _tensors(self) -> tuple[Any, ...]:
            held = (self.keys, self.values, self.k_block_scales, self.v_block_scales,
                    self.state)  # fmt: skip
            return held if self.kv_scales is None else (*held, self.kv_scales)

        def _append(self, k: Any, v: Any) -> None:
            fxt.kv_append(self.keys, self.values, k, v, self.state, kv_scales=self.kv_scales,
                          kv_format=self.kv_format, k_block_scales=self.k_block_scales,
                          v_block_scales=self.v_block_scales, rotate_k=self.rotate,
                          kv_layout=LAYOUT)  # fmt: skip

        def update(self, key_states: Any, value_states: Any, *args: Any,
                   **kwargs: Any) -> tuple[Any, Any]:  # fmt: skip
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = key_states.shape[-2]
            if n == 1:  # a decode step: quantized in, the 4-bit buffers out (read in place)
                _, n_kv, _, head_dim = key_states.shape
                self._append(key_states.reshape(n_kv, head_dim),
                             value_states.reshape(n_kv, head_dim))  # fmt: skip
                self.cumulative_length.add_(1)
                return self.keys, self.values
            past = int(self.state[0])  # (several tokens: a prefill, eager; one host read)
            if past + n > self.max_cache_len:
                raise ValueError(f"FourBitCache: {past} + {n} tokens pass max_cache_len "
                                 f"{self.max_cache_len}")  # fmt: skip
            rows_k = key_states[0].transpose(0, 1).contiguous()
            rows_v = value_states[0].transpose(0, 1).contiguous()
            if past == 0 and self.kv_scales is not None:
                self._calibrate(rows_k, rows_v)
            self._append(rows_k, rows_v)
            self.cumulative_length.add_(n)
            if past == 0:
                return key_states, value_states
            # later tokens of several: the attention reads the cache so far, dequantized
            return (torch.cat((self._dequantized(0, past), key_states), dim=-2),
                    torch.cat((self._dequantized(1, past), value_states), dim=-2))  # fmt: skip

        def _calibrate(self, rows_k: Any, rows_v: Any) -> None:
            """nvfp4's scales per KV head from the first tokens: each head's largest
            magnitude over them (K's as stored: rotated where K is), times ``margin``, at
            the format's largest value, 6 x 448 (given scales stay)."""
            k = fxt.hadamard(rows_k) if self.rotate else rows_k
            for i, (x, given) in enumerate(zip((k, rows_v), self.given_scales, strict=True)):
                if given is None:
                    amax = x.float().abs().amax(dim=(0, 2))
                    top = _E2M1_MAX * _E4M3_MAX
                    self.kv_scales[i] = (amax * self.margin / top).clamp(min=1e-12)

        def _dequantized(self, which: int, n: int) -> Any:
            """K (0) or V (1) of the first ``n`` tokens in the model's dtype, ``[1,
            n_kv_heads, n, head_dim]``: the bytes decoded, K's rotation undone."""
            hnd = LAYOUT == "HND"  # (head-major: each head's first n rows)
            values = (self.keys, self.values)[which]
            scales = (self.k_block_scales, self.v_block_scales)[which]
            values, scales = (values[:, :n], scales[:, :n]) if hnd else (values[:n], scales[:n])
            g = None if self.kv_scales is None else self.kv_scales[which]
            x = fxt.dequantize_4bit(values, scales, self.kv_format, global_scale=g,
                                    rotated=which == 0 and self.rotate,
                                    kv_layout=LAYOUT)  # fmt: skip
            return (x if hnd else x.transpose(0, 1)).to(self.dtype)[None]

        def reset(self) -> None:
            super().reset()
            if self.is_initialized:
                for t in (self.k_block_scales, self.v_block_scales, self.state):
                    t.zero_()
                if self.kv_scales is not None:
                    self.kv_scales.fill_(1.0)
                    for i, given in enumerate(self.given_scales):
                        if given is not None:
                            self.kv_scales[i] = torch.as_tensor(given, dtype=torch.float32)

    class FourBitCache(Cache):
        """A static KV cache for ``generate()`` whose K and V are 4-bit (int4 or nvfp4),
        quantized on the device as each token arrives and read by ferrox's kernels in place:
        about 0.28x the bytes of a bf16 StaticCache at head_dim 128 (4.5 bits an element).

            fx_transformers.register()
            model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="ferrox")
            cache = fx_transformers.FourBitCache(model, max_cache_len=131072, fmt="int4")
            model.generate(ids, past_key_values=cache, max_new_tokens=64)

        Works eager and compiled (generate's default torch.compile). The formats are a
        4-bit ``KVCache``'s, bit for bit: int4, a float16 scale per 32 elements; nvfp4, an
        e4m3 scale per 16 and a float32 scale per KV head, K and V apart, from the prompt
        (each head's largest magnitude over it times ``scale_margin``, at nvfp4's largest
        value, 6 x 448) unless ``k_scale``/``v_scale`` fix them. ``rotate``: K
        Hadamard-rotated before it is quantized (q alike in the decode; None: the format's
        measured default, on for int4, off for nvfp4). One sequence (a batch of 1), head_dim
        64, 128 or 256; the prompt's attention runs on SDPA or eager attention in the
        model's dtype, every later token on ferrox. Sliding-window layers keep every token
        (the kernel reads the window). The cache binds itself to ``model``'s attention
        modules (their ``ferrox_kv4_layer``): one FourBitCache per model at a time.

        Args:
            model: the model (``attn_implementation="ferrox"``).
            max_cache_len: tokens the cache holds (prompt and new ones).
            fmt: ``"int4"`` or ``"nvfp4"``.
            rotate: rotate K (None: the format's default).
            k_scale, v_scale: nvfp4's fixed scales per KV head (a scalar or one per head;
                default: from the prompt).
            scale_margin: nvfp4's headroom over the prompt's largest magnitude.

        Raises:
            ValueError, TypeError: naming the argument (the model's dtype, head_dim and
                batch, and the GPU's compute capability, 8.0 or newer for int4 and 8.9 for
                nvfp4: at the first update).
        """

        def __init__(self, model: Any, max_cache_len: int, fmt: str = "int4", *,
                     rotate: bool | None = None, k_scale: Any = None, v_scale: Any = None,
                     scale_margin: float = 2.0) -> None:  # fmt: skip
            if fmt not in group:
                raise ValueError(f"fmt: expected 'int4' or 'nvfp4', got {fmt!r}")
            if rotate is not None and not isinstance(rotate, bool):
                raise TypeError(f"rotate: expected None, True or False, got "
                                f"{type(rotate).__name__}")  # fmt: skip
            if not isinstance(max_cache_len, int) or max_cache_len < 1:
                raise ValueError(f"max_cache_len: expected a positive int, got {max_cache_len!r}")
            if fmt == "int4" and (k_scale is not None or v_scale is not None):
                raise ValueError("k_scale: an int4 cache scales each group of 32 itself; only "
                                 "nvfp4 takes k_scale and v_scale")  # fmt: skip
            if not scale_margin > 0:
                raise ValueError(f"scale_margin: expected > 0, got {scale_margin}")
            rotated = default_rotate[fmt] if rotate is None else rotate
            config = model.config.get_text_config(decoder=True)
            layers = [FourBitLayer(max_cache_len, fmt, rotated, k_scale, v_scale, scale_margin)
                      for _ in range(config.num_hidden_layers)]  # fmt: skip
            super().__init__(layers=layers)
            self.fmt, self.rotate = fmt, rotated
            bind_layers(model, layers, "ferrox_kv4_layer", "FourBitCache")

        @property
        def nbytes(self) -> int:
            """Device bytes held: values, block scales, scales and lengths of every
            initialized layer."""
            return sum(
                t.nbytes for layer in self.layers if layer.is_initialized for t in layer._tensors()
            )

    return FourBitCache
