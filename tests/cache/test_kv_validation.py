"""KV cache and resident-decode arguments are rejected before any device work (no GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import ferrox_driver as fd

E4M3 = "float8_e4m3fn"  # (ml_dtypes' name: np.dtype reads it once ml_dtypes is imported)


@pytest.mark.parametrize(
    "args,kwargs,exc,pattern",
    [
        ((0, 128, 16), {}, ValueError, "n_kv_heads"),
        ((8, 0, 16), {}, ValueError, "head_dim"),
        ((8, 513, 16), {}, ValueError, r"head_dim: expected 1\.\.512"),
        ((8, 128, 0), {}, ValueError, "capacity"),
        ((8, 128, 16.0), {}, TypeError, "capacity"),
        ((8, 128, 16), {"dtype": np.float64}, TypeError, "dtype"),
        ((8, 128, 16), {"dtype": np.int8}, TypeError, "dtype"),
        ((8, 128, 16), {"stream": 5}, TypeError, "stream"),
        ((8, 96, 16), {"dtype": "int4"}, ValueError, "head_dim: int4 caches take head_dim 64"),
        ((8, 128, 16), {"dtype": "int4", "kv_layout": "hnd"}, ValueError, "kv_layout: expected"),
        (
            (8, 128, 16),
            {"dtype": np.float16, "kv_layout": "HND"},
            ValueError,
            "kv_layout: a KVCache stores head-major",
        ),
        (
            (8, 128, 16),
            {"dtype": E4M3, "v_dtype": "int4", "kv_layout": "HND"},
            ValueError,
            "kv_layout: a KVCache stores head-major",
        ),
        ((8, 80, 16), {"dtype": "nvfp4"}, ValueError, "head_dim: nvfp4 caches take"),
        ((8, 128, 16), {"dtype": "int4", "k_scale": 2.0}, ValueError, "k_scale: an int4 cache"),
        (
            (8, 128, 16),
            {"dtype": np.float16, "v_dtype": "int4"},
            ValueError,
            "v_dtype: K and V in formats of their own are both quantized",
        ),
        ((8, 128, 16), {"dtype": "int4", "v_dtype": np.float16}, ValueError, "v_dtype: K and V"),
        (
            (8, 96, 16),
            {"dtype": E4M3, "v_dtype": "int4"},
            ValueError,
            "head_dim: K and V in formats of their own take head_dim 64, 128 or 256",
        ),
        (
            (8, 128, 16),
            {"dtype": E4M3, "v_dtype": "int4", "rotate": True},
            ValueError,
            "rotate: only a 4-bit K is rotated, K here is float8_e4m3fn",
        ),
        ((8, 128, 16), {"dtype": "int4", "v_dtype": E4M3, "rotate": 1}, TypeError, "rotate"),
        (
            (8, 128, 16),
            {"dtype": E4M3, "v_dtype": "int4", "v_scale": 2.0},
            ValueError,
            "v_scale: V in int4 scales each group of 32 itself",
        ),
        (
            (8, 128, 16),
            {"dtype": "int4", "v_dtype": "nvfp4", "k_scale": 2.0},
            ValueError,
            "k_scale: K in int4",
        ),
        ((8, 128, 16), {"dtype": E4M3, "v_dtype": np.int8}, ValueError, "v_dtype"),
        ((8, 128, 16), {"dtype": "int4", "rotate": 1}, TypeError, "rotate: expected None"),
        ((8, 128, 16), {"dtype": np.float16, "v_dtype": np.float32}, ValueError, "v_dtype"),
        ((8, 128, 16), {"rotate": True}, ValueError, "rotate: only the 4-bit caches"),
    ],
)
def test_kv_cache_bad_construction_names_the_argument(args, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fd.KVCache(*args, **kwargs)


@pytest.mark.parametrize("dtype", ["int4", "nvfp4"])
def test_caches_that_do_not_hold_4_bit_formats_say_so(dtype):
    with pytest.raises(ValueError, match="dtype: ShardedKVCache does not hold 4-bit caches"):
        fd.ShardedKVCache(8, 128, 16, group=None, dtype=dtype)


@pytest.mark.parametrize(
    "kwargs,exc,pattern",
    [
        ({"dtype": np.float16, "v_dtype": "nvfp4"}, ValueError, "v_dtype: K and V"),
        ({"dtype": E4M3, "v_dtype": "int4", "rotate": True}, ValueError, "rotate: only a 4-bit K"),
        ({"dtype": E4M3, "v_dtype": "int4", "v_scale": 0.5}, ValueError, "v_scale: V in int4"),
        ({"dtype": np.int8}, TypeError, "dtype"),
    ],
)
def test_a_layer_cache_checks_the_formats_it_passes_on_before_any_device_work(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fd.LayerKVCache(2, 8, 128, 16, **kwargs)


def test_mixed_formats_name_both_sides_for_the_kernels():
    from ferrox_driver.kernels.spec import kv_formats, mixed_format

    assert mixed_format("e4m3", "q4") == "e4m3+q4"
    assert mixed_format("q4", "q4") == "q4"
    assert kv_formats("e4m3+q4") == ("e4m3", "q4")
    assert kv_formats("nvfp4") == ("nvfp4", "nvfp4")
    assert kv_formats("") == ("", "")


def test_layer_cache_bad_layer_count_is_rejected():
    with pytest.raises(ValueError, match="n_layers"):
        fd.LayerKVCache(0, 8, 128, 16)


def test_ensure_layer_kv_validates_before_building():
    with pytest.raises(ValueError, match="head_dim"):
        fd.ensure_layer_kv(2, 8, 513, 16)


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


class FakeDevice:
    """A device array as the CUDA array interface describes one, at address 0 (its shape,
    dtype and strides are all a pair's checks read: no driver call)."""

    def __init__(self, shape, dtype=np.float16, strides=None):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": np.dtype(dtype).str, "data": (0, False),
            "version": 3, "strides": strides,
        }  # fmt: skip


HND = (1, 8, 64, 128)
Q = FakeDevice((32, 128))
SEQ = FakeDevice((1,), np.int32)


def _pair(shape=HND, dtype=np.float16, v_shape=None, strides=None):
    return (FakeDevice(shape, dtype, strides), FakeDevice(v_shape or shape, dtype, strides))


@pytest.mark.parametrize(
    "kv,kwargs,exc,pattern",
    [
        (_pair(), {"kv_layout": "NCHW"}, ValueError, "kv_layout: expected 'NHD'"),
        ((Q, Q, Q), {}, TypeError, "a pair .* got 3 items"),
        ((np.zeros(HND, np.float16),) * 2, {}, TypeError, "k_cache, v_cache: expected device"),
        (_pair((8, 128)), {}, ValueError, "k_cache: expected a head-major array"),
        (_pair((2, 8, 64, 128)), {}, ValueError, "k_cache: expected a head-major array"),
        (_pair(v_shape=(1, 8, 63, 128)), {}, ValueError, "v_cache: expected k_cache's shape"),
        (_pair(dtype=np.float64), {}, TypeError, "k_cache: expected float32, float16"),
        (_pair((64, 8, 128), strides=(4096, 256, 2)), {"kv_layout": "NHD"}, ValueError,
         "k_cache: expected a C-contiguous token-major"),
        (_pair((1, 8, 64, 600)), {}, ValueError, "head_dim"),
        (_pair(), {"seq_len": None}, TypeError, "seq_len: a .* pair needs its length"),
        (_pair(), {"seq_len": FakeDevice((1,), np.int64)}, TypeError, "seq_len: expected dtype"),
        (_pair(), {"seq_len": FakeDevice((2,), np.int32)}, ValueError, "seq_len: expected 1"),
        (_pair(), {"q": FakeDevice((31, 128))}, ValueError, "q_dev: expected 4096"),
        (_pair(), {"algorithm": "parity"}, ValueError, "algorithm: a .* pair needs the split"),
        (_pair(), {"n_heads": 12}, ValueError, "n_heads"),
    ],
)  # fmt: skip
def test_a_bad_cache_pair_is_refused_naming_the_argument(kv, kwargs, exc, pattern):
    kwargs = {"n_heads": 32, "kv_layout": "HND", "seq_len": SEQ, **kwargs}
    q = kwargs.pop("q", Q)
    with pytest.raises(exc, match=pattern):
        fd.gqa_decode_async(q, kv, Q, stream=None, **kwargs)


def test_seq_len_and_kv_layout_are_a_pairs_alone():
    for kwargs in ({"seq_len": SEQ}, {"kv_layout": "HND"}):
        with pytest.raises(ValueError, match="only with a \\(k_cache, v_cache\\) pair"):
            fd.gqa_decode_async(Q, object(), Q, n_heads=8, stream=None, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "q,out,n_queries,exc,pattern",
    [
        (FakeDevice((4 * 32 * 128,)), FakeDevice((4 * 32 * 128,)), 0, ValueError,
         "n_queries: expected at least 1"),
        (FakeDevice((4 * 32 * 128,)), FakeDevice((4 * 32 * 128,)), 2.0, TypeError,
         "n_queries: expected an int"),
        (FakeDevice((4, 32, 128)), FakeDevice((4, 32, 128)), 3, ValueError,
         "n_queries: 3, but q_dev of shape \\(4, 32, 128\\) holds 4"),
        (FakeDevice((3 * 32 * 128 + 128,)), FakeDevice((4 * 32 * 128,)), 3, ValueError,
         "q_dev: expected a C-contiguous buffer of n_queries \\(3\\)"),
        (FakeDevice((1, 32, 4, 128)), FakeDevice((4, 32, 128)), 4, ValueError,
         "q_dev: shape \\(1, 32, 4, 128\\) holds its queries head by head"),
        (FakeDevice((4 * 32, 128)), FakeDevice((4 * 32, 128), strides=(512, 2)), 4, ValueError,
         "out_dev: expected a C-contiguous"),
        (FakeDevice((4 * 16, 128)), FakeDevice((4 * 16, 128)), 4, ValueError,
         "n_heads: 32, but q_dev holds 16 heads"),
    ],
)  # fmt: skip
def test_n_queries_reads_a_buffer_of_several_queries_or_names_what_is_wrong(
    q, out, n_queries, exc, pattern
):
    with pytest.raises(exc, match=pattern):
        fd.gqa_decode_async(q, _pair(), out, n_heads=32, kv_layout="HND", seq_len=SEQ,
                            stream=None, n_queries=n_queries)  # fmt: skip
