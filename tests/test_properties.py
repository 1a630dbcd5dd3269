"""Property-based checks of argument validation: every input is either accepted or refused
with a ValueError/TypeError naming an argument; never another exception. No GPU needed
(refusals happen before device work); derandomized so CI is stable."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ferrox_driver as fd
from ferrox_driver.decode.checks import check_decode_args

SETTINGS = settings(
    max_examples=300,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
ARG_NAMES = ("q", "k_cache", "v_cache", "n_heads", "n_kv_heads", "head_dim")
DTYPES = [
    np.float32,
    np.float16,
    ml_dtypes.bfloat16,
    np.float64,
    np.int32,
    np.int8,
    np.bool_,
    object,
    np.complex64,
]
dims = st.one_of(
    st.integers(-3, 300),
    st.sampled_from([2**31, 2**63 - 1, -(2**40)]),
    st.floats(allow_nan=True),
    st.none(),
    st.just("8"),
    st.booleans(),
)


@st.composite
def arrays(draw):
    ndim = draw(st.integers(0, 4))
    shape = tuple(draw(st.integers(0, 6)) for _ in range(ndim))
    dtype = draw(st.sampled_from(DTYPES))
    arr = np.zeros(shape, dtype=dtype)
    if ndim and draw(st.booleans()) and shape[-1] > 1:
        arr = np.zeros((*shape[:-1], shape[-1] * 2), dtype=dtype)[..., ::2]  # strided
    return (
        draw(st.sampled_from([arr, arr.tolist(), "array", 3]))
        if draw(st.booleans()) and ndim == 0
        else arr
    )


@SETTINGS
@given(q=arrays(), k=arrays(), v=arrays(), h=dims, kv=dims, d=dims)
def test_decode_arguments_are_accepted_or_refused_by_name(q, k, v, h, kv, d):
    try:
        spec = check_decode_args(q, k, v, h, kv, d)
    except (ValueError, TypeError) as exc:
        assert any(
            str(exc).startswith(name + ":") or f"{name}:" in str(exc) for name in ARG_NAMES
        ), str(exc)
        return
    # Accepted: the spec is consistent with the arrays.
    assert spec.n_heads % spec.n_kv_heads == 0 and 1 <= spec.head_dim <= 256
    assert q.size == spec.n_heads * spec.head_dim
    assert k.size == v.size == spec.seq_len * spec.n_kv_heads * spec.head_dim


@SETTINGS
@given(q=arrays(), k=arrays(), v=arrays(), h=dims, kv=dims, d=dims)
def test_reference_is_correct_or_refuses_by_name(q, k, v, h, kv, d):
    try:
        out = fd.reference_gqa_decode(q, k, v, n_heads=h, n_kv_heads=kv, head_dim=d)
    except (ValueError, TypeError) as exc:  # (the reference's K and V are called k and v)
        names = ("q", "k", "v", "n_heads", "n_kv_heads", "head_dim")
        assert any(str(exc).startswith(f"{name}:") for name in names), str(exc)
        return
    assert out.shape == q.shape and out.dtype == np.float64


@SETTINGS
@given(n_kv=dims, d=dims, cap=dims, dtype=st.sampled_from(DTYPES))
def test_kv_cache_construction_is_refused_by_name_before_any_device_work(n_kv, d, cap, dtype):
    valid = (
        all(isinstance(x, int) and not isinstance(x, bool) for x in (n_kv, d, cap))
        and n_kv >= 1
        and 1 <= d <= 256
        and 1 <= cap < 2**31
        and np.dtype(dtype)
        in (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
    )
    if valid:
        return  # would allocate on the device: covered by the GPU tests
    with pytest.raises((ValueError, TypeError)) as info:
        fd.KVCache(n_kv, d, cap, dtype=dtype)
    assert any(f"{n}:" in str(info.value) for n in ("n_kv_heads", "head_dim", "capacity", "dtype"))


MUTATIONS = [
    "",
    "}",
    "{",
    "extern",
    '"',
    "\\",
    "/*",
    "#if 1",
    "float* p = nullptr; *p",
    "__global__",
    "template <",
    "asm(",
    "\x00",
]


@settings(max_examples=60, derandomize=True, deadline=None)
@given(cut=st.integers(0, 2000), junk=st.sampled_from(MUTATIONS))
def test_mutated_kernel_sources_give_compile_errors_not_crashes(cut, junk):
    from ferrox_driver.kernels.catalogue import kernel_source

    src = kernel_source("kv_cache.cu")
    cut = min(cut, len(src))
    mutated = src[:cut] + junk + src[cut:]
    try:
        program = fd.compile_source(mutated, arch="sm_90", name="mutated.cu")
    except fd.CompileError as exc:
        assert exc.log and "mutated.cu" in str(exc)
    else:
        assert program.cubin
