"""4-bit KV formats and the Hadamard rotation on the CPU (decode/kv4.py): the rotation against
dense Sylvester matrices, the q4 and nvfp4 codes against brute-force nearest-grid rounding
over tables built here from the formats' bit definitions, the byte layout unpacked by hand,
the checks, and what the formats and the rotation cost an attention output."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import ferrox_driver as fd
from ferrox_driver.decode import kv4

E4M3 = ml_dtypes.float8_e4m3fn
HEAD_DIMS = (64, 80, 96, 128, 256)


@pytest.fixture
def rng():
    return np.random.default_rng()


# -- independent definitions --------------------------------------------------------------


def sylvester(n: int) -> np.ndarray:
    """The n x n Hadamard matrix by Sylvester's construction, float64, not normalised."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.kron(h, np.array([[1.0, 1.0], [1.0, -1.0]]))
    return h


def block_hadamard(n: int, block: int) -> np.ndarray:
    """The orthonormal block-diagonal rotation for n elements in blocks of ``block``."""
    return np.kron(np.eye(n // block), sylvester(block)) / np.sqrt(block)


def largest_power_of_two_dividing(n: int) -> int:
    p = 1
    while n % (2 * p) == 0:
        p *= 2
    return p


def e2m1_magnitudes() -> np.ndarray:
    """Codes 0..7 of e2m1 from its bits: 2 exponent bits (bias 1), 1 mantissa bit."""
    out = []
    for b in range(8):
        e, m = b >> 1, b & 1
        out.append(m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))
    return np.array(out)


def e4m3_magnitudes() -> np.ndarray:
    """Codes 0..126 of e4m3fn from its bits (bias 7, subnormals; 127 is NaN)."""
    out = []
    for b in range(127):
        e, m = b >> 3, b & 7
        out.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(out)


def nearest_code(mag: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index of the grid value nearest each magnitude, a tie to the even index (for these
    grids: mantissa bit 0), by brute force."""
    mag = np.asarray(mag, np.float64).reshape(-1)
    dist = np.abs(mag[:, None] - grid[None, :])
    tied = dist == dist.min(axis=1, keepdims=True)
    even = tied & (np.arange(grid.size) % 2 == 0)
    return np.where(even.any(axis=1), even.argmax(axis=1), tied.argmax(axis=1))


def e2m1_codes(y: np.ndarray) -> np.ndarray:
    """Sign bit 3 (negative zero kept), then the nearest magnitude, saturated at 6."""
    idx = nearest_code(np.minimum(np.abs(y), 6.0), e2m1_magnitudes()).reshape(y.shape)
    return (idx + 8 * np.signbit(y)).astype(np.uint8)


def e4m3_round(s: np.ndarray) -> np.ndarray:
    """Non-negative float32 values (<= 448) rounded to nearest-even e4m3, as float64."""
    grid = e4m3_magnitudes()
    return grid[nearest_code(s, grid)].reshape(s.shape)


def unpack_by_hand(packed: np.ndarray) -> np.ndarray:
    """Nibbles of each row, element 2i from byte i's low four bits, 2i+1 from its high four."""
    rows = packed.reshape(-1, packed.shape[-1])
    out = np.zeros((rows.shape[0], 2 * rows.shape[1]), np.uint8)
    for r, row in enumerate(rows):
        for i, byte in enumerate(row.tolist()):
            out[r, 2 * i], out[r, 2 * i + 1] = byte % 16, byte // 16
    return out.reshape(*packed.shape[:-1], -1)


def q4_expected(x: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """(nibbles, float16 scales) by the definition: scale = fp16(amax / 7) saturated,
    code = the nearest of -7..7 to float32(x / scale), a tie to the even code."""
    groups = x.reshape(*x.shape[:-1], -1, g).astype(np.float32)
    amax = np.abs(groups).max(axis=-1)
    scales = np.float16(np.minimum(amax / np.float32(7), 65504))
    s = scales.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(s > 0, groups / s, 0).astype(np.float32)
    grid = np.arange(-7, 8, dtype=np.float64)
    dist = np.abs(y.reshape(-1)[:, None] - grid[None, :])
    tied = dist == dist.min(axis=1, keepdims=True)
    even = tied & (grid % 2 == 0)
    idx = np.where(even.any(axis=1), even.argmax(axis=1), tied.argmax(axis=1))
    codes = grid[idx].astype(np.int64) + 8
    return codes.reshape(x.shape).astype(np.uint8), scales


# -- the rotation -------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
def test_hadamard_is_the_normalised_sylvester_matrix_for_powers_of_two(rng, n):
    x = rng.standard_normal((3, 5, n)).astype(np.float32)
    want = x.astype(np.float64) @ (sylvester(n) / np.sqrt(n)).T
    got = kv4.hadamard(x)
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.sqrt(np.log2(2 * n)) * 4)


@pytest.mark.parametrize(
    "n, block", [(80, 16), (96, 32), (112, 16), (160, 32), (192, 64), (72, 8), (40, 8)]
)
def test_other_sizes_rotate_by_blocks_of_the_largest_power_of_two_dividing_them(rng, n, block):
    assert kv4.hadamard_block(n) == block == largest_power_of_two_dividing(n)
    x = rng.standard_normal((7, n)).astype(np.float32)
    want = x.astype(np.float64) @ block_hadamard(n, block).T
    np.testing.assert_allclose(kv4.hadamard(x), want, rtol=0, atol=1e-5)


def test_hadamard_rotates_the_axis_it_is_given(rng):
    x = rng.standard_normal((4, 96, 3)).astype(np.float32)
    want = np.einsum("ij,ajb->aib", block_hadamard(96, 32), x.astype(np.float64))
    np.testing.assert_allclose(kv4.hadamard(x, axis=1), want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(kv4.hadamard(x, axis=-2), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("n", HEAD_DIMS)
def test_hadamard_is_its_own_inverse_and_keeps_norms(rng, n):
    x = rng.standard_normal((16, n)).astype(np.float32)
    np.testing.assert_allclose(kv4.hadamard(kv4.hadamard(x)), x, rtol=0, atol=2e-6)
    np.testing.assert_allclose(
        np.linalg.norm(kv4.hadamard(x), axis=-1), np.linalg.norm(x, axis=-1), rtol=2e-6
    )


@pytest.mark.parametrize("n", HEAD_DIMS)
def test_rotating_q_and_k_together_keeps_every_score(rng, n):
    q = rng.standard_normal((8, n)).astype(np.float32)
    k = rng.standard_normal((300, n)).astype(np.float32)
    want = k.astype(np.float64) @ q.astype(np.float64).T
    got = kv4.hadamard(k).astype(np.float64) @ kv4.hadamard(q).astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_hadamard_takes_the_documented_float32_order_bit_for_bit(rng):
    # butterflies (a + b, a - b) on pairs i, i + h for h = 1, 2, 4..., then one multiply
    n = 128
    x = rng.standard_normal((3, n)).astype(np.float32)
    want = x.copy()
    for row in want:
        h = 1
        while h < n:
            for start in range(0, n, 2 * h):
                for i in range(start, start + h):
                    a, b = row[i], row[i + h]
                    row[i], row[i + h] = a + b, a - b
            h *= 2
    want *= np.float32(1 / np.sqrt(n))
    assert (kv4.hadamard(x).view(np.uint32) == want.view(np.uint32)).all()


def test_hadamard_reads_half_precision_and_returns_float32(rng):
    x = rng.standard_normal((2, 64)).astype(ml_dtypes.bfloat16)
    want = x.astype(np.float64) @ (sylvester(64) / 8).T
    got = kv4.hadamard(x)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


# -- q4 -----------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [16, 32, 64])
def test_q4_codes_and_scales_are_the_nearest_on_each_groups_grid(rng, group):
    x = (rng.standard_normal((33, 2, 128)) * rng.uniform(0.01, 100, (33, 2, 1))).astype(np.float32)
    values, scales = kv4.quantize_q4(x, group)
    nibbles, want_scales = q4_expected(x, group)
    assert values.dtype == np.uint8 and values.shape == (33, 2, 64)
    assert scales.dtype == np.float16 and scales.shape == (33, 2, 128 // group)
    assert (scales.view(np.uint16) == want_scales.view(np.uint16)).all()
    assert (unpack_by_hand(values) == nibbles).all()
    codes = nibbles.astype(np.float64) - 8  # decoding (code * scale) is exact in float32
    exact = codes.reshape(33, 2, -1, group) * want_scales.astype(np.float64)[..., None]
    assert (kv4.dequantize_q4(values, scales) == exact.reshape(x.shape)).all()


@pytest.mark.parametrize("group", [16, 32, 64])
def test_q4_round_trip_is_within_half_a_step(rng, group):
    x = rng.standard_normal((50, 4, 128)).astype(np.float32) * 3
    values, scales = kv4.quantize_q4(x, group)
    back = kv4.dequantize_q4(values, scales)
    assert back.dtype == np.float32 and back.shape == x.shape
    amax = np.abs(x.reshape(50, 4, -1, group)).max(axis=-1, keepdims=True)
    half_step = amax / 7 / 2 * (1 + 2.0**-10)  # the float16 scale within 2^-11 of amax / 7
    err = np.abs(back - x).reshape(50, 4, -1, group)
    assert (err <= half_step).all()


def test_q4_hand_picked_values():
    # group 0: amax 7 -> scale 1, ties to even; group 1: zeros; group 2: tiny (scale
    # underflows float16 to 0); group 3: a subnormal float16 scale; group 4: beyond float16
    g0 = [7, -7, 2.5, 3.5, -2.5, -3.5, 0.5, 1.5, 0, -0.0, 6.49, -6.51, 0.4999, 1, -1, 4.5]
    g3 = [1e-6] + [0.0] * 15
    g4 = [1e6, -1e6, 458528, 65504 * 3.5] + [0.0] * 12
    x = np.array([g0, [0.0] * 16, [1e-8, -2e-7] + [0.0] * 14, g3, g4], np.float32)
    values, scales = kv4.quantize_q4(x.reshape(-1), 16)
    codes = unpack_by_hand(values).reshape(5, 16).astype(int) - 8
    want0 = [7, -7, 2, 4, -2, -4, 0, 2, 0, 0, 6, -7, 0, 1, -1, 4]
    assert codes[0].tolist() == want0 and float(scales[0]) == 1.0
    assert codes[1].tolist() == [0] * 16 and float(scales[1]) == 0.0
    assert codes[2].tolist() == [0] * 16 and float(scales[2]) == 0.0
    assert float(scales[3]) == float(np.float16(np.float32(1e-6) / np.float32(7)))
    assert codes[3][0] == 7  # the subnormal scale still maps the group's max to 7
    assert float(scales[4]) == 65504.0  # saturated: the largest values clip at 7 steps
    assert codes[4][:4].tolist() == [7, -7, 7, 4]
    assert (codes >= -7).all()  # nibble 0 (code -8) is never written


def test_q4_dequantizes_every_nibble_offset_binary():
    nibbles = np.arange(16, dtype=np.uint8)
    values = (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8)
    back = kv4.dequantize_q4(values, np.array([0.5], np.float16))
    assert back.tolist() == [(n - 8) * 0.5 for n in range(16)]


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_q4_shapes_over_a_cache(rng, head_dim):
    group = 16 if head_dim == 80 else 32
    x = rng.standard_normal((9, 4, head_dim)).astype(np.float16)
    values, scales = kv4.quantize_q4(x, group)
    assert values.shape == (9, 4, head_dim // 2) and scales.shape == (9, 4, head_dim // group)
    nibbles, want_scales = q4_expected(x.astype(np.float32), group)
    assert (unpack_by_hand(values) == nibbles).all() and (scales == want_scales).all()
    assert kv4.dequantize_q4(values, scales).shape == x.shape


# -- nvfp4 --------------------------------------------------------------------------------


def test_e2m1_rounding_matches_the_table_on_ties_and_a_dense_range():
    grid = e2m1_magnitudes()
    mids = (grid[1:] + grid[:-1]) / 2
    y = np.concatenate([grid, -grid, mids, -mids, np.linspace(-6, 6, 4801), [6.0, -6.0]])
    y = y.astype(np.float32)
    want = e2m1_codes(y)
    assert (kv4._e2m1_codes(y) == want).all()
    assert (kv4._e2m1_codes_table(y) == want).all()  # without ml_dtypes' float4
    assert kv4.E2M1_VALUES[want].tolist() == [
        float(np.copysign(grid[c & 7], -1.0 if c & 8 else 1.0)) for c in want.tolist()
    ]


def test_nvfp4_codes_and_scales_are_the_nearest_on_the_grids(rng):
    x = (rng.standard_normal((21, 3, 128)) * rng.uniform(0.001, 10, (21, 3, 8, 1)).repeat(
        16, axis=-1).reshape(21, 3, 128)).astype(np.float32)  # fmt: skip
    values, block_scales, g = kv4.quantize_nvfp4(x)
    assert values.shape == (21, 3, 64) and block_scales.shape == (21, 3, 8)
    assert block_scales.dtype == np.dtype(E4M3) and g.dtype == np.float32 and g.shape == (3,)
    amax_head = np.abs(x).max(axis=(0, 2))
    assert (g == amax_head / np.float32(2688)).all()
    blocks = x.reshape(21, 3, 8, 16)
    s = np.abs(blocks).max(axis=-1) / np.float32(6) / g[:, None]
    want_s = e4m3_round(np.minimum(s, np.float32(448)))
    assert (block_scales.astype(np.float64) == want_s).all()
    assert (want_s.max(axis=(0, 2)) == 448).all()  # each head's largest block fills e4m3
    denom = want_s.astype(np.float32)[..., None] * g[:, None, None]
    want = e2m1_codes((blocks / denom).astype(np.float32)).reshape(x.shape)
    assert (unpack_by_hand(values) == want).all()
    # decoding rounds once: value * block scale is exact, then one product with global
    signs = np.where(want >= 8, -1.0, 1.0)
    exact = (signs * e2m1_magnitudes()[want & 7]).reshape(21, 3, 8, 16) * want_s[..., None]
    exact = (exact * g.astype(np.float64)[:, None, None]).astype(np.float32).reshape(x.shape)
    back = kv4.dequantize_nvfp4(values, block_scales, g)
    assert (back.view(np.uint32) == exact.view(np.uint32)).all()


def test_nvfp4_hand_picked_values():
    # global 1: block 0 has amax 6 (scale 1), ties to even; block 1 zeros; block 2 tiny
    # (its scale rounds to e4m3 zero); block 3 beyond 6 * 448 (scale saturates at 448)
    b0 = [6, -6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -5, -0.1, 0, 5.9, 0.5, -1.5, 3]
    b3 = [6 * 448 * 2, -6 * 448, 448 * 4.9] + [0.0] * 13
    x = np.array([[b0, [0.0] * 16, [1e-4] + [0.0] * 15, b3]], np.float32).reshape(1, 64)
    values, scales, g = kv4.quantize_nvfp4(x, global_scale=1.0)
    codes = unpack_by_hand(values).reshape(4, 16)
    want0 = [7, 15, 0, 2, 2, 4, 4, 6, 6, 14, 8, 0, 7, 1, 11, 5]
    assert codes[0].tolist() == want0 and g.tolist() == [1.0]
    assert scales.astype(float).reshape(4).tolist() == [1.0, 0.0, 0.0, 448.0]
    assert codes[1].tolist() == codes[2].tolist() == [0] * 16
    assert codes[3][:3].tolist() == [7, 15, 6]  # saturated at 6; -6 * 448 / 448 = -6
    back = kv4.dequantize_nvfp4(values, scales, g).reshape(4, 16)
    assert back[0].tolist() == [6, -6, 0, 1, 1, 2, 2, 4, 4, -4, 0, 0, 6, 0.5, -1.5, 3]
    assert back[3][:3].tolist() == [6 * 448, -6 * 448, 4 * 448]


def test_nvfp4_round_trip_is_within_half_a_step(rng):
    x = (rng.standard_normal((40, 2, 128)) * np.array([[1.0], [30.0]])).astype(np.float32)
    values, block_scales, g = kv4.quantize_nvfp4(x)
    back = kv4.dequantize_nvfp4(values, block_scales, g)
    assert back.dtype == np.float32 and back.shape == x.shape
    unit = (block_scales.astype(np.float64) * g[:, None])[..., None]  # one e2m1 unit
    y = np.abs(x.reshape(40, 2, 8, 16)) / unit
    half_step = np.where(y <= 2, 0.25, np.where(y <= 4, 0.5, 1.0)) * unit
    assert (np.abs(back - x).reshape(40, 2, 8, 16) <= half_step * (1 + 1e-6)).all()


def test_nvfp4_takes_a_global_scale_per_kv_head(rng):
    x = rng.standard_normal((5, 2, 32)).astype(np.float32)
    gs = np.array([0.01, 0.002], np.float32)
    values, block_scales, g = kv4.quantize_nvfp4(x, global_scale=gs)
    assert (g == gs).all()
    s = np.abs(x.reshape(5, 2, 2, 16)).max(axis=-1) / np.float32(6) / gs[:, None]
    assert (block_scales.astype(np.float64) == e4m3_round(np.minimum(s, 448))).all()
    np.testing.assert_allclose(kv4.dequantize_nvfp4(values, block_scales, g), x, atol=0.5)


def test_nvfp4_reads_a_head_major_cache_through_a_swapped_view(rng):
    hnd = rng.standard_normal((3, 10, 64)).astype(np.float32)  # (n_kv_heads, seq, head_dim)
    values, block_scales, g = kv4.quantize_nvfp4(hnd.swapaxes(0, 1))
    want = kv4.quantize_nvfp4(np.ascontiguousarray(hnd.swapaxes(0, 1)))
    assert (g == np.abs(hnd).max(axis=(1, 2)) / np.float32(2688)).all()
    assert (values == want[0]).all() and (block_scales == want[1]).all()
    assert values.flags.c_contiguous and values.shape == (10, 3, 32)


def test_nvfp4_all_zero_head_gets_global_scale_one():
    values, scales, g = kv4.quantize_nvfp4(np.zeros((3, 2, 16), np.float32))
    assert g.tolist() == [1.0, 1.0] and (values == 0).all()
    assert (scales.astype(float) == 0).all()


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_nvfp4_shapes_over_a_cache(rng, head_dim):
    x = rng.standard_normal((9, 4, head_dim)).astype(ml_dtypes.bfloat16)
    values, block_scales, g = kv4.quantize_nvfp4(x)
    assert values.shape == (9, 4, head_dim // 2)
    assert block_scales.shape == (9, 4, head_dim // 16) and g.shape == (4,)
    back = kv4.dequantize_nvfp4(values, block_scales, g)
    assert back.shape == x.shape
    assert np.abs(back - x.astype(np.float32)).max() <= np.abs(x.astype(np.float32)).max() / 3


# -- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: kv4.quantize_q4(np.zeros((2, 80), np.float32)), ValueError,
         "head_dim: the q4 format with group_size 32 takes head_dims that are multiples "
         "of 32, got 80"),
        (lambda: kv4.quantize_q4(np.zeros(64, np.float32), 48), ValueError,
         r"group_size: expected one of \(16, 32, 64\), got 48"),
        (lambda: kv4.quantize_q4(np.zeros(64, np.float32), True), TypeError, "group_size"),
        (lambda: kv4.quantize_q4(np.zeros(64, np.float32), 32.0), TypeError, "group_size"),
        (lambda: kv4.quantize_q4(np.zeros(64, np.int32)), TypeError,
         "x: expected floating-point values"),
        (lambda: kv4.quantize_q4(np.float32(1.0)), ValueError, r"x: expected \(..., head_dim\)"),
        (lambda: kv4.quantize_q4(np.array([np.nan] * 32, np.float32)), ValueError,
         "x: expected finite values"),
        (lambda: kv4.quantize_q4(np.array([1e39] * 32)), ValueError, "x: expected finite"),
        (lambda: kv4.quantize_nvfp4(np.zeros((2, 72), np.float32)), ValueError,
         "head_dim: the nvfp4 format takes head_dims that are multiples of 16, got 72"),
        (lambda: kv4.quantize_nvfp4(np.zeros(64, np.float32)), ValueError,
         r"x: expected \(..., n_kv_heads, head_dim\)"),
        (lambda: kv4.quantize_nvfp4(np.zeros((2, 64), np.float32), global_scale=0.0),
         ValueError, "global_scale: expected positive finite"),
        (lambda: kv4.quantize_nvfp4(np.zeros((2, 64), np.float32), global_scale=[1, 2, 3]),
         ValueError, "global_scale: expected a scalar or 2 values"),
        (lambda: kv4.quantize_nvfp4(np.full((2, 16), np.inf, np.float32)), ValueError,
         "x: expected finite values"),
        (lambda: kv4.dequantize_q4(np.zeros(32, np.int8), np.zeros(2, np.float16)), TypeError,
         "values: expected uint8"),
        (lambda: kv4.dequantize_q4(np.zeros(32, np.uint8), np.zeros(2, np.float32)), TypeError,
         "scales: expected float16"),
        (lambda: kv4.dequantize_q4(np.zeros(32, np.uint8), np.zeros(3, np.float16)), ValueError,
         "scales: expected shape"),
        (lambda: kv4.dequantize_q4(np.zeros((2, 32), np.uint8), np.zeros((3, 2), np.float16)),
         ValueError, "scales: expected shape"),
        (lambda: kv4.dequantize_nvfp4(np.zeros((2, 32), np.uint8),
                                      np.zeros((2, 4), np.float16), 1.0),
         TypeError, "block_scales: expected ml_dtypes.float8_e4m3fn"),
        (lambda: kv4.dequantize_nvfp4(np.zeros((2, 32), np.uint8),
                                      np.zeros((2, 2), E4M3), 1.0),
         ValueError, "block_scales: expected shape"),
        (lambda: kv4.dequantize_nvfp4(np.zeros((2, 32), np.uint8),
                                      np.zeros((2, 4), E4M3), [1.0]),
         ValueError, "global_scale: expected a scalar or 2 values"),
        (lambda: kv4.hadamard(np.zeros((2, 64), np.int64)), TypeError, "x: expected floating"),
        (lambda: kv4.hadamard(np.zeros((2, 64), np.float32), axis=2), ValueError,
         "axis: expected -2 <= axis < 2"),
        (lambda: kv4.hadamard(np.zeros((2, 64), np.float32), axis=1.0), TypeError, "axis"),
        (lambda: kv4.hadamard(np.zeros((2, 0), np.float32)), ValueError, "x: expected at least"),
        (lambda: kv4.hadamard_block(0), ValueError, "n: expected a positive size"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


# -- what the formats cost an attention output --------------------------------------------


def _relative_error(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, fmt: str, rotate: bool, n_heads: int
) -> float:
    """||out - ref|| / ||ref|| for attention over K/V stored in ``fmt`` (the float64
    reference on the dequantized cache) against the reference on the originals; with
    ``rotate``, q, K and V rotated before storing and the output rotated back."""
    ref = fd.reference_gqa_decode(q, k, v, n_heads=n_heads)
    turn = kv4.hadamard if rotate else (lambda a: a)

    def stored(a: np.ndarray) -> np.ndarray:
        if fmt == "q4":
            return kv4.dequantize_q4(*kv4.quantize_q4(turn(a)))
        return kv4.dequantize_nvfp4(*kv4.quantize_nvfp4(turn(a)))

    out = fd.reference_gqa_decode(turn(q), stored(k), stored(v), n_heads=n_heads)
    out = turn(out.astype(np.float32)).astype(np.float64) if rotate else out
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def test_attention_over_4bit_caches_stays_close_with_and_without_rotation(rng):
    # Gaussian q, K and V; K with four outlier channels 10-50x the rest, as real models'
    # K have (with a Gaussian q their scores spread widely and the softmax is peaked, so
    # the output's error there is large and varies from draw to draw: a loose bound)
    n_heads, n_kv, d, seq = 8, 2, 128, 1024
    q = rng.standard_normal((n_heads, d)).astype(np.float32)
    k = rng.standard_normal((seq, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((seq, n_kv, d)).astype(np.float32)
    k_outliers = k.copy()
    k_outliers[..., rng.choice(d, 4, replace=False)] *= rng.uniform(10, 50, 4)
    errors = {}
    for data, kk in (("gaussian", k), ("outlier K", k_outliers)):
        for fmt in ("q4", "nvfp4"):
            for rotate in (False, True):
                errors[data, fmt, rotate] = _relative_error(q, kk, v, fmt, rotate, n_heads)
    for key, err in errors.items():
        print(f"{key[0]:>10} {key[1]:>6} rotate={key[2]!s:<5} relative error {err:.4f}")
    for (data, _, _), err in errors.items():
        assert 0 < err < (0.2 if data == "gaussian" else 1.0)


def test_rotation_spreads_outlier_channels_and_shrinks_the_q4_error(rng):
    k = rng.standard_normal((256, 2, 128)).astype(np.float32)
    k[..., rng.choice(128, 4, replace=False)] *= rng.uniform(10, 50, 4)
    plain = kv4.dequantize_q4(*kv4.quantize_q4(k)) - k
    turned = kv4.hadamard(k)
    rotated = kv4.dequantize_q4(*kv4.quantize_q4(turned)) - turned
    # the same error in either basis (orthonormal): measured 1.7-4x smaller rotated
    assert np.square(rotated).sum() < np.square(plain).sum() / 1.3
