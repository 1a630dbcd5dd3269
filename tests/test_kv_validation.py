"""KV cache and resident-decode arguments are rejected before any device work (no GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import ferrox_driver as fd


@pytest.mark.parametrize(
    "args,kwargs,exc,pattern",
    [
        ((0, 128, 16), {}, ValueError, "n_kv_heads"),
        ((8, 0, 16), {}, ValueError, "head_dim"),
        ((8, 300, 16), {}, ValueError, r"head_dim: expected 1\.\.256"),
        ((8, 128, 0), {}, ValueError, "capacity"),
        ((8, 128, 16.0), {}, TypeError, "capacity"),
        ((8, 128, 16), {"dtype": np.float64}, TypeError, "dtype"),
        ((8, 128, 16), {"dtype": np.int8}, TypeError, "dtype"),
        ((8, 128, 16), {"stream": 5}, TypeError, "stream"),
    ],
)
def test_kv_cache_bad_construction_names_the_argument(args, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fd.KVCache(*args, **kwargs)


def test_layer_cache_bad_layer_count_is_rejected():
    with pytest.raises(ValueError, match="n_layers"):
        fd.LayerKVCache(0, 8, 128, 16)


def test_ensure_layer_kv_validates_before_building():
    with pytest.raises(ValueError, match="head_dim"):
        fd.ensure_layer_kv(2, 8, 512, 16)


@pytest.mark.parametrize(
    "over,exc,pattern",
    [
        (dict(host_seq=5), ValueError, "k_cache: holds 4 tokens, fewer than host_seq=5"),
        (dict(host_seq=-1), ValueError, "host_seq"),
        (dict(n_heads=6, n_kv_heads=4), ValueError, "n_heads: must be a multiple"),
        (dict(q=[0.0] * 64), TypeError, "q: expected a numpy array"),
    ],
)
def test_resident_decode_bad_arguments_are_rejected(over, exc, pattern):
    args = dict(
        layer=0,
        q=np.zeros(64, np.float32),
        k_cache=np.zeros(4 * 2 * 16, np.float32),
        v_cache=np.zeros(4 * 2 * 16, np.float32),
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        host_seq=4,
    )
    args.update(over)
    with pytest.raises(exc, match=pattern):
        fd.gqa_decode_resident(**args)


def test_async_ops_need_a_kv_cache():
    with pytest.raises(TypeError, match="kv"):
        fd.kv_append_async(object(), None, None, stream=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="kv"):
        fd.gqa_decode_async(None, object(), None, n_heads=8, stream=None)  # type: ignore[arg-type]
