"""Length buckets (decode/records.length_bound): a record planned for its bucket's last
length serves every length of the bucket, so a growing cache plans once per bucket. The
buckets are checked against the planner itself (sm_90's traits, no GPU): the plan for the
bound is the length's own, or the same kernel and tile with a few more chunks."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from ferrox_driver.decode import launches
from ferrox_driver.decode import plan as planner
from ferrox_driver.decode.checks import MAX_TOKENS
from ferrox_driver.decode.records import length_bound

# every length to 4096, then every 61st (a stride prime to the buckets' widths, each
# standing for 61 lengths), and each power of two with its neighbours (where the planner's
# thresholds sit), up to 131072: length -> how many lengths of 1..131072 it stands for
TOP = 131072
STRIDE = 61
LENGTHS = {n: 1 for n in range(1, 4097)} | {n: STRIDE for n in range(4097, TOP + 1, STRIDE)}
LENGTHS |= {p + d: 1 for e in range(3, 18) for p in (2**e,) for d in (-1, 0, 1) if p + d > 4096}


def test_a_bound_is_at_least_the_length_and_at_most_a_sixteenth_more():
    for n in range(0, 70_000):
        bound = length_bound(n)
        assert n <= bound <= n + max(7, n // 16), n


def test_every_length_of_a_bucket_has_the_same_bound_and_buckets_do_not_interleave():
    bounds = [length_bound(n) for n in range(0, 1 << 17)]
    assert bounds == sorted(bounds)  # monotone: each bucket is a run of lengths
    for n in range(0, 1 << 17):
        assert length_bound(bounds[n]) == bounds[n], n  # a bound is its own bucket's last


def test_below_256_the_buckets_are_8_tokens_then_16_per_octave():
    assert [length_bound(n) for n in (0, 1, 7, 8, 9, 255)] == [7, 7, 7, 15, 15, 255]
    assert [length_bound(n) for n in (256, 271, 272, 4096, 4351, 4352)] == [
        271, 271, 287, 4351, 4351, 4607,
    ]  # fmt: skip
    for lo, count in ((0, 32), (256, 16), (4096, 16), (1 << 20, 16)):
        hi = max(256, 2 * lo)
        assert len({length_bound(n) for n in range(lo, hi)}) == count, lo


@pytest.mark.parametrize("top", [8192, 131072, 1 << 20])
def test_the_records_up_to_a_length_are_logarithmically_few(top):
    octaves = int(math.log2(top)) - 8  # above 256
    assert len({length_bound(n) for n in range(top)}) == 32 + 16 * octaves


def test_a_bound_never_passes_what_the_kernels_count():
    for n in (MAX_TOKENS - 1, MAX_TOKENS, MAX_TOKENS + 1, 2**31 - 1, 2**31, 2**40):
        bound = length_bound(n)
        assert bound >= n
        assert bound <= MAX_TOKENS or bound == n  # past it: the length itself (refused later)
    assert all(length_bound(n) <= MAX_TOKENS for n in range(MAX_TOKENS - 2**27, MAX_TOKENS, 9973))


@pytest.fixture(scope="module")
def traits():
    return launches.arch_traits("sm_90")  # (compiles the split kernels' resources: NVRTC)


SHAPES = [
    ("bf16", 32, 8, 128),  # Llama-3-8B: tensor cores, clusters, wide from 1024
    ("bf16", 28, 4, 128),  # groups of 7: wide from 16384
    ("bf16", 32, 8, 96),  # paired from 32768
    ("f32", 32, 8, 128),  # split-TF32 tensor cores
    ("f32", 8, 8, 72),  # CUDA cores, 16-token tiles, chunks grow to 115
]
DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}


@pytest.mark.parametrize("dtype,n_heads,n_kv,head_dim", SHAPES)
def test_the_plan_for_a_bound_is_the_lengths_own_or_a_chunk_or_two_more(
    traits, dtype, n_heads, n_kv, head_dim
):
    """Where the plans differ, the bound's has the same kernel and tile and only as many
    more chunks as the bucket's extra tokens fill (an idle block or two: the chunks are
    cut from the actual length); the lengths where they differ are at most 1% of
    1..131072."""
    plans: dict[int, planner.SplitPlan] = {}

    def plan(n: int) -> planner.SplitPlan:
        if n not in plans:
            plans[n] = planner.plan(traits, DTYPES[dtype], n_heads, n_kv, head_dim, n)
        return plans[n]

    differ = []
    for n in LENGTHS:
        own, bound = plan(n), length_bound(n)
        at_bound = plan(bound)
        if at_bound == own:
            continue
        differ.append(n)
        assert at_bound.spec.but(cluster=own.spec.cluster) == own.spec, n
        assert at_bound.tile == own.tile, n
        extra = -(-(bound - n + 1) // own.tile)  # tiles the bucket's extra tokens can start
        assert own.splits < at_bound.splits <= own.splits + extra, (n, own, at_bound)
    assert sum(LENGTHS[n] for n in differ) <= 0.01 * TOP, (len(differ), differ[:10])
    if dtype != "f32":  # the tensor-core kernels: only lengths that are whole 64-token tiles
        assert all(n % 64 == 0 for n in differ), differ


# -- the cached calls, without a GPU: fakes stand in for CUDA tensors (never dereferenced)
# and for the device steps (a record that keeps what each run writes, a pool of addresses)

torch = pytest.importorskip("torch")

H, KV, D = 8, 2, 16
Q_AT, K_AT, V_AT, OUT_AT = 1 << 20, 1 << 24, 1 << 28, 1 << 32


class FakeTensor:
    """What ferrox reads of a PyTorch CUDA tensor, strides included."""

    __module__ = "torch"

    def __init__(self, shape, ptr, strides=None, dtype=None) -> None:
        self.shape = torch.Size(shape)
        self.dtype = torch.bfloat16 if dtype is None else dtype
        self._ptr, self._strides = ptr, strides

    def data_ptr(self) -> int:
        return self._ptr

    def get_device(self) -> int:
        return 0

    def is_contiguous(self) -> bool:
        return self._strides is None

    def stride(self) -> tuple[int, ...]:
        if self._strides is not None:
            return self._strides
        out, step = [], 1
        for d in reversed(self.shape):
            out.append(step)
            step *= d
        return tuple(reversed(out))


class FakeRecord:
    def __init__(self, plan_seq: int) -> None:
        self.plan_seq, self.runs, self.captured = plan_seq, [], False

    def run(self, values: tuple[int, ...]) -> None:
        self.runs.append(values)


class FakeDevice:
    ordinal = 0

    def activate(self) -> None:
        pass


class FakePool:
    def __init__(self) -> None:
        self.next = 1 << 36

    def take(self, shape, dtype, *, keep=True):
        from ferrox_driver.driver.memory import DeviceArray

        self.next += 4096
        return DeviceArray._wrap(self.next, shape, np.dtype(dtype), FakeDevice(), None)


@pytest.fixture
def made(monkeypatch):
    """The records the calls make (plan_seq, run values), with every device step faked."""
    from ferrox_driver.decode import eager, records

    made: list[FakeRecord] = []

    def record(*args, plan_seq, **kw):
        made.append(FakeRecord(plan_seq))
        return made[-1]

    monkeypatch.setattr(eager, "_calls", records.Kept(eager.MAX_CALLS))
    monkeypatch.setattr(eager, "_families", records.Kept(eager.MAX_CALLS))
    monkeypatch.setattr(eager, "decode_record", record)
    monkeypatch.setattr(records, "feature_record", record)
    monkeypatch.setattr(eager, "device_for", lambda ordinal: FakeDevice())
    monkeypatch.setattr(eager, "output_pool", lambda *a: FakePool())
    # a plan per bucket (its bound: no two share one) unless a test says otherwise
    monkeypatch.setattr(eager, "plan_split", lambda *a, **kw: ("plan", a[5]))
    return made


def _q():
    return FakeTensor((H, D), Q_AT)


def test_a_growing_token_major_cache_makes_one_record_per_bucket_and_writes_each_length(made):
    import ferrox_driver as fd

    lengths = range(250, 600)
    for n in lengths:
        k, v = FakeTensor((n, KV, D), K_AT), FakeTensor((n, KV, D), V_AT)
        fd.gqa_decode(_q(), k, v, stream=0)
    bounds = sorted({length_bound(n) for n in lengths})
    assert [r.plan_seq for r in made] == bounds  # [255, 271, 287, ...]: one per bucket
    runs = [values for r in made for values in r.runs]
    assert [values[4] for values in runs] == list(lengths)  # the call's own length
    assert {values[:3] for values in runs} == {(Q_AT, K_AT, V_AT)}


def test_a_flat_cache_is_keyed_by_its_exact_length(made):
    import ferrox_driver as fd

    for n in (300, 301, 300):
        k = FakeTensor((n * KV * D,), K_AT)
        fd.gqa_decode(_q(), k, k, n_kv_heads=KV, stream=0)
    assert [r.plan_seq for r in made] == [300, 301]
    runs = [[(*values[:3], values[4]) for values in r.runs] for r in made]
    assert runs == [[(Q_AT, K_AT, K_AT, 300)] * 2, [(Q_AT, K_AT, K_AT, 301)]]


def test_a_v_unlike_k_is_refused_after_the_bucket_was_seen(made):
    import ferrox_driver as fd

    fd.gqa_decode(_q(), FakeTensor((300, KV, D), K_AT), FakeTensor((300, KV, D), V_AT), stream=0)
    k, v = FakeTensor((301, KV, D), K_AT), FakeTensor((302, KV, D), V_AT)
    with pytest.raises(ValueError, match="v_cache: expected k_cache's shape"):
        fd.gqa_decode(_q(), k, v, stream=0)
    with pytest.raises(ValueError, match="v_cache: expected k_cache's shape"):
        fd.gqa_decode(_q(), k, v, stream=0, sliding_window=8)
    assert len(made) == 1 and len(made[0].runs) == 1


def test_head_major_views_write_their_length_and_head_stride_at_each_call(made):
    import ferrox_driver as fd

    cap = 700
    sinks = [FakeTensor((H,), 1 << 40, dtype=torch.float32),
             FakeTensor((H,), 1 << 41, dtype=torch.float32)]  # fmt: skip
    for n in range(400, 420):
        view = {"shape": (KV, n, D), "strides": (cap * D, D, 1)}
        k, v = FakeTensor(**view, ptr=K_AT), FakeTensor(**view, ptr=V_AT)
        out, lse = fd.gqa_decode(_q(), k, v, kv_layout="HND", sinks=sinks[n % 2],
                                 return_lse=True, stream=0)  # fmt: skip
        values = made[-1].runs[-1]
        assert values == (Q_AT, K_AT, V_AT, out.ptr, n, 0, sinks[n % 2]._ptr, lse.ptr, cap * D)
    for n in range(400, 420):  # contiguous (KV, n, D): heads n rows apart
        k, v = FakeTensor((KV, n, D), K_AT), FakeTensor((KV, n, D), V_AT)
        fd.gqa_decode(_q(), k, v, kv_layout="HND", stream=0)
        assert made[-1].runs[-1][4:] == (n, 0, 0, 0, n * D)
    assert [r.plan_seq for r in made] == [415, 431, 415, 431]  # views, arrays: 400-415, 416-431


def test_a_window_plans_for_at_most_the_window(made):
    import ferrox_driver as fd

    for n in (100, 5000, 5001, 9000):
        k = FakeTensor((n, KV, D), K_AT)
        fd.gqa_decode(_q(), k, k, sliding_window=1000, stream=0)
    # (5000 and 5001: one bucket; 9000's bucket plans for the window too: the same plan)
    assert [r.plan_seq for r in made] == [103, 1000]
    assert [v[4] for r in made for v in r.runs] == [100, 5000, 5001, 9000]


def test_a_view_whose_heads_would_overlap_at_a_longer_length_of_its_bucket_is_refused(made):
    import ferrox_driver as fd

    strides = (402 * D, D, 1)  # heads 402 tokens apart: 400 and 402 fit, 403 overlaps
    for n in (400, 402):
        k = FakeTensor((KV, n, D), K_AT, strides)
        fd.gqa_decode(_q(), k, k, kv_layout="HND", stream=0)
    k = FakeTensor((KV, 403, D), K_AT, strides)
    with pytest.raises(ValueError, match="k_cache: KV heads 6432 elements apart overlap"):
        fd.gqa_decode(_q(), k, k, kv_layout="HND", stream=0)
    assert len(made) == 1 and [v[4] for v in made[0].runs] == [400, 402]


def test_a_feature_value_of_another_type_is_checked_again(made):
    import ferrox_driver as fd

    k = FakeTensor((300, KV, D), K_AT)
    fd.gqa_decode(_q(), k, k, sliding_window=64, stream=0)
    with pytest.raises(TypeError, match="sliding_window: expected an int"):
        fd.gqa_decode(_q(), k, k, sliding_window=64.0, stream=0)
    with pytest.raises(TypeError, match="return_lse: expected True or False"):
        fd.gqa_decode(_q(), k, k, sliding_window=64, return_lse=1, stream=0)
    assert len(made) == 1


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_buckets_of_one_plan_take_the_call_made_for_the_first(made, monkeypatch, layout):
    """Where the planner gives the buckets from 512 up one plan, the first of them makes the
    call (its checks, its record) and the later ones take it, each call still writing its
    own length; a length past what the kernels count is still refused by the checks."""
    import ferrox_driver as fd
    from ferrox_driver.decode import eager

    monkeypatch.setattr(eager, "plan_split", lambda *a, **kw: ("plan", min(a[5], 512)))
    lengths = range(480, 700)
    for n in lengths:
        shape = (n, KV, D) if layout == "NHD" else (KV, n, D)
        fd.gqa_decode(_q(), FakeTensor(shape, K_AT), FakeTensor(shape, V_AT), stream=0,
                      kv_layout=layout)  # fmt: skip
    bounds = sorted({length_bound(n) for n in lengths if n < 512})
    assert [r.plan_seq for r in made] == [*bounds, length_bound(512)]
    assert [values[4] for r in made for values in r.runs] == list(lengths)
    assert len({id(c) for c in eager._calls.values()}) == len(made)
    if layout == "NHD":
        big = 2**31  # past MAX_TOKENS: the sibling is not asked, the checks refuse it
        with pytest.raises(ValueError, match="k_cache"):
            fd.gqa_decode(_q(), FakeTensor((big, KV, D), K_AT), FakeTensor((big, KV, D), V_AT),
                          stream=0)  # fmt: skip


@pytest.mark.parametrize(
    "shape, strides",
    [
        ((KV, 400, D), None),  # contiguous: heads n rows apart
        ((KV, 400, D), (700 * D, D, 1)),  # the first 400 tokens of a 700-token cache
        ((1, KV, 400, D), (KV * 700 * D, 700 * D, D, 1)),  # SDPA's 4-d view
        ((1, 400, D), (700 * D, D, 1)),  # one KV head
    ],
)
def test_a_plain_head_major_signature_is_the_general_ones(shape, strides):
    """The fast signature of a featureless head-major call is `_feature_signature`'s, key
    and values, so what one remembers the other finds."""
    from ferrox_driver.decode import eager

    k, v = FakeTensor(shape, K_AT, strides), FakeTensor(shape, V_AT, strides)
    q, out = _q(), FakeTensor((H, D), OUT_AT)
    for o in (None, out):
        dims = (None, KV if shape[-3] == KV else None, D, "auto", None)
        general = eager._feature_signature(q, k, v, o, dims, 0, eager._PLAIN, "HND")
        fast = eager._plain_head_major_signature(q, k, v, o, dims, 0)
        assert general is not None and fast == general


def test_views_the_plain_head_major_signature_leaves_to_the_general_one():
    from ferrox_driver.decode import eager

    dims = (None, None, D, "auto", None)
    overlap = FakeTensor((KV, 403, D), K_AT, (402 * D, D, 1))
    flat = FakeTensor((KV * 400 * D,), K_AT)
    v_other = FakeTensor((KV, 400, D), V_AT, (701 * D, D, 1))
    k = FakeTensor((KV, 400, D), K_AT, (700 * D, D, 1))
    assert eager._plain_head_major_signature(_q(), overlap, overlap, None, dims, 0) is None
    assert eager._plain_head_major_signature(_q(), flat, flat, None, dims, 0) is None
    assert eager._plain_head_major_signature(_q(), k, v_other, None, dims, 0) is None
