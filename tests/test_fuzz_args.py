"""A fuzz of the public entry points' argument checks, with no GPU: every call either runs
(gets past its checks to where it needs the device) or raises a TypeError/ValueError naming
an argument; never another exception, and never a refusal after touching the device.

There is no device here, and none is reached: every CUDA driver function raises
DeviceTouched (a BaseException, so no ``except Exception`` swallows it), except
cuPointerGetAttribute, which answers device 0 (the question array_ref asks of a CUDA array
interface object: a query, not device work). A call that raises DeviceTouched got past its
checks. Device arrays are fakes with no memory behind them (CUDA array interface or DLPack,
any shape, any strides, a cache of 2^31 tokens included); KVCaches are built over a fake
device and fake buffers, and any use of those raises DeviceTouched too.

Most tests draw a valid call and, half the time, one defect whose argument they know: a
valid call must run (reach the device, or return where it needs none), a defective one must
be refused, naming that argument (or one it conflicts with), before any device work. The
chaos tests throw anything at every argument: only the kind of outcome is checked.
"""

from __future__ import annotations

import math
import sys
import weakref
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import as_strided

import ferrox_driver as fd
from ferrox_driver.cache import appends, kv_cache, staging, state
from ferrox_driver.decode.checks import MAX_INT32, MAX_KV_HEADS, MAX_TOKENS
from ferrox_driver.driver import dlpack
from ferrox_driver.driver._bindings import cu
from ferrox_driver.driver.device import Device
from ferrox_driver.errors import KVCapacityError

SETTINGS = settings(
    max_examples=200, derandomize=True, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip
F32, F16, BF16 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
E4M3, E5M2 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)
FLOATS = (F32, F16, BF16)
BAD_DTYPES = (np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int8), np.dtype(np.bool_))
EDGE_TOKENS = (MAX_TOKENS + 1, 2**31 - 1, 2**31, 2**40)  # more than the kernels count
BASE = 0x7F00_0000_0000  # a fake device address


# ---- the device that is not there ---------------------------------------------------------
class DeviceTouched(BaseException):
    """A driver call, or a fake device's use: the call got past its checks."""


ARMED = [True]  # False while a KVCache is built over fakes


def _touch(*_args: Any, **_kw: Any) -> Any:
    raise DeviceTouched


def _missing(obj: Any, name: str) -> Any:
    """Any public attribute not set up is device work (private ones: not there)."""
    if name.startswith("_"):
        raise AttributeError(name)
    raise DeviceTouched(f"{type(obj).__name__}.{name}")


class _Fake:
    __getattr__ = _missing


class FakeBuffer(_Fake):
    """What a KVCache allocates: a pointer, no memory."""

    def __init__(self, shape: Any, dtype: Any) -> None:
        self.shape = tuple(shape) if isinstance(shape, tuple) else (shape,)
        self.dtype, self.ptr, self._base = np.dtype(dtype), BASE, None
        self.size = math.prod(self.shape)
        self.nbytes = self.size * self.dtype.itemsize

    def _work(self, *_args: Any, **_kw: Any) -> None:
        if ARMED[0]:
            raise DeviceTouched("buffer")

    fill_bytes = copy_from_host = synchronize = _work

    def close(self) -> None:
        pass


class FakeDevice(Device):
    """A Device no driver stands behind (compute capability 9.0)."""

    def __init__(self) -> None:
        self.ordinal, self._shared, self._ctx_int, self.name = 0, True, -1, "none"
        self._finalizer = weakref.finalize(self, int)
        self.compute_capability = (9, 0)

    def activate(self) -> None:
        if ARMED[0]:
            raise DeviceTouched("activate")

    __getattr__ = _missing


@pytest.fixture(scope="module", autouse=True)
def no_device():
    """Every driver function raises DeviceTouched (cuPointerGetAttribute answers 0), as do
    the aliases modules bound at import and the driver's initialisation, which remembers a
    failure (any module's ``init`` of the driver layer: another test may have reloaded it)."""
    with pytest.MonkeyPatch.context() as mp:
        for name in dir(cu):
            f = getattr(cu, name)
            if name.startswith("cu") and callable(f) and not isinstance(f, type):
                mp.setattr(cu, name, _touch)
        mp.setattr(cu, "cuPointerGetAttribute", lambda *_: (cu.CUresult.CUDA_SUCCESS, 0))
        for mod in [m for n, m in sys.modules.items() if n.startswith("ferrox_driver")]:
            for attr in ("init", "_memcpy_htod", "_graph_launch", "_stream_sync",
                         "_cuLaunchKernel", "_cuLaunchKernelEx"):  # fmt: skip
                value = getattr(mod, attr, None)
                driver_init = getattr(value, "__module__", "") == "ferrox_driver.driver._bindings"
                if callable(value) and (attr != "init" or driver_init):
                    mp.setattr(mod, attr, _touch)
        yield


def fake_world(count: Any = None) -> dict[str, Any]:
    """What a KVCache's constructor allocates and launches, faked (in the namespaces of
    the cache modules); ``count``, if given, is called at each use."""

    def counted(fake: Any) -> Any:
        def call(*args: Any, **kw: Any) -> Any:
            if count is not None:
                count()
            return fake(*args, **kw)

        return call

    fakes = {
        "resolve": lambda device=None: FAKE_DEVICE,
        "Stream": FakeStream,
        "stream_handle": lambda *a: 0,
        "empty": lambda shape, dtype=np.float32, device=None: FakeBuffer(shape, dtype),
        "pinned_empty": lambda shape, dtype=np.float32: np.zeros(shape, dtype),
        "Event": lambda *a, **k: FakeBuffer((1,), np.uint8),
        "quantize_kernel": lambda *a, **k: None,
        "PackedLaunch": lambda *a, **k: FakeBuffer((1,), np.uint8),
    }
    return {name: fake if name == "Stream" else counted(fake) for name, fake in fakes.items()}


def fake_cache(*args: Any, count: Any = None, **kw: Any) -> fd.KVCache:
    """A KVCache over the fake device, built by its own constructor with what it allocates
    and launches faked (``fake_world``); from then on any use of those is DeviceTouched."""
    ARMED[0] = False
    try:
        with pytest.MonkeyPatch.context() as mp:
            for name, fake in fake_world(count).items():
                for module in (kv_cache, staging, appends, state):  # (each allocates its own)
                    if hasattr(module, name):
                        mp.setattr(module, name, fake)
            return fd.KVCache(*args, **kw)
    finally:
        ARMED[0] = True


class FakeStream(FakeBuffer):
    """A KVCache's stream (a class: the constructor asks isinstance of it)."""

    def __init__(self, *_args: Any, **_kw: Any) -> None:
        super().__init__((1,), np.uint8)
        self._closed = False


FAKE_DEVICE = FakeDevice()


# ---- arrays ---------------------------------------------------------------------------------
class CudaView:
    """A device array by the CUDA array interface: any shape and strides (in elements), no
    memory (float32/float16 and the integer and float64 dtypes: the interface has no bf16)."""

    def __init__(self, shape: tuple[int, ...], dtype: Any, strides: Any = None, ptr: int = BASE):
        dt = self.dtype = np.dtype(dtype)
        self.shape = tuple(shape)
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": dt.str, "data": (ptr, False), "version": 3,
            "strides": None if strides is None else tuple(s * dt.itemsize for s in strides),
        }  # fmt: skip

    def __repr__(self) -> str:
        cai = self.__cuda_array_interface__
        return f"CudaView({cai['shape']}, {cai['typestr']}, strides={cai['strides']})"


class DlpackView:
    """A C-contiguous device array by DLPack (any dtype DLPack names, bf16 and fp8 too)."""

    def __init__(self, shape: tuple[int, ...], dtype: Any, ptr: int = BASE):
        self.shape, self.dtype, self.ptr = tuple(shape), np.dtype(dtype), ptr

    def __dlpack__(self, *, max_version: Any = None, **_kw: Any) -> Any:
        return dlpack.export(self.ptr, self.shape, self.dtype, dlpack.CUDA, 0, self,
                             versioned=max_version is not None)  # fmt: skip

    def __dlpack_device__(self) -> tuple[int, int]:
        return (dlpack.CUDA, 0)

    def __repr__(self) -> str:
        return f"DlpackView({self.shape}, {self.dtype})"


def device_array(shape: tuple[int, ...], dtype: Any, strides: Any = None) -> Any:
    """A fake device array: by DLPack where the interface cannot say the dtype."""
    if strides is None and np.dtype(dtype) in (BF16, E4M3, E5M2):
        return DlpackView(shape, dtype)
    return CudaView(shape, dtype, strides)


def lying(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A C-contiguous numpy view of ``shape`` over one element (as_strided does not check)."""
    dt = np.dtype(dtype)
    strides, step = [], dt.itemsize
    for d in reversed(shape):
        strides.insert(0, step)
        step *= d
    return as_strided(np.zeros(1, dt), shape=shape, strides=tuple(strides))


def host_array(shape: tuple[int, ...], dtype: Any, rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


# ---- outcomes -------------------------------------------------------------------------------
def outcome(call: Any) -> tuple[str, Any]:
    """('device', None), ('returned', result), ('refused', exc) or ('capacity', exc); any
    other exception propagates (and fails the test)."""
    try:
        result = call()
    except DeviceTouched:
        return "device", None
    except (TypeError, ValueError) as exc:
        return "refused", exc
    except KVCapacityError as exc:
        return "capacity", exc
    return "returned", result


def named(exc: BaseException) -> set[str]:
    """The arguments a refusal names: its message's leading ``name[, name...]:``."""
    head = str(exc).split(":", 1)[0]
    return {part.strip() for part in head.split(",")}


def expect(call: Any, defect: tuple[str, ...] | None, what: Any = None) -> None:
    """``call`` runs (``defect`` None) or is refused naming one of ``defect``."""
    kind, info = outcome(call)
    if defect is None:
        assert kind in ("device", "returned"), f"{what}: a valid call was refused: {info!r}"
    elif defect == ("capacity",):
        assert kind == "capacity", f"{what}: past the capacity, got {kind} {info!r}"
    else:
        assert kind == "refused", f"{what}: bad {defect}, but the call got {kind}"
        assert named(info) & set(defect), f"{what}: bad {defect}, refused with {info!r}"


def expect_any(call: Any, names: tuple[str, ...]) -> None:
    """Chaos: any outcome but an exception other than a refusal naming one of ``names``."""
    kind, info = outcome(call)
    if kind == "refused":
        assert named(info) & set(names), f"refused naming none of {names}: {info!r}"


# ---- gqa_decode and reference_gqa_decode --------------------------------------------------
class DecodeCall:
    """A valid decode's dims and arrays (``build`` makes them from the dims), features and
    other keywords; a defect changes some and says which argument it broke."""

    def __init__(self, draw: Any, *, device: bool, layouts: tuple[str, ...]) -> None:
        self.rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        self.kv = draw(st.sampled_from([1, 2, 4, 8]))
        self.h = self.kv * draw(st.sampled_from([1, 2, 3, 8, 16, 17]))
        self.hd = draw(st.sampled_from([1, 8, 16, 64, 72, 128, 256]))
        self.dt = draw(st.sampled_from(FLOATS))
        self.on_device = device and draw(st.booleans())
        self.layout = draw(st.sampled_from(layouts))
        self.seq = draw(st.sampled_from([0, 1, 2, 33] + [MAX_TOKENS] * self.on_device))
        self.flat_q, self.flat_k = draw(st.booleans()), draw(st.booleans())
        # a head-major device view of the first seq tokens of a larger cache (strided)
        self.spare = draw(st.sampled_from([0, 0, 5])) if self.dt != BF16 else 0
        self.kw: dict[str, Any] = {}
        self.build()

    def array(self, shape: tuple[int, ...], dtype: Any = None, strides: Any = None) -> Any:
        dt = self.dt if dtype is None else dtype
        if self.on_device:
            return device_array(shape, dt, strides)
        return host_array(shape, dt, self.rng)

    def build(self) -> None:
        h, kv, hd, seq = self.h, self.kv, self.hd, self.seq
        self.q = self.array((h * hd,) if self.flat_q else (h, hd))
        if self.layout == "NHD":
            shape = (seq * kv * hd,) if self.flat_k else (seq, kv, hd)
            self.k, self.v = self.array(shape), self.array(shape)
        elif self.on_device and self.spare:  # (1, kv, seq, hd) of a (1, kv, seq + spare, hd)
            cap = seq + self.spare
            strides = (kv * cap * hd, cap * hd, hd, 1)
            self.k = self.array((1, kv, seq, hd), strides=strides)
            self.v = self.array((1, kv, seq, hd), strides=strides)
        elif self.on_device:
            self.k, self.v = self.array((kv, seq, hd)), self.array((kv, seq, hd))
        else:  # numpy, any strides: a token-major array's transpose
            self.k = host_array((seq, kv, hd), self.dt, self.rng).transpose(1, 0, 2)
            self.v = host_array((seq, kv, hd), self.dt, self.rng).transpose(1, 0, 2)

    def args(self) -> dict[str, Any]:
        a = dict(q=self.q, k_cache=self.k, v_cache=self.v, n_heads=self.h,
                 n_kv_heads=self.kv, head_dim=self.hd)  # fmt: skip
        if self.layout == "HND":
            a["kv_layout"] = "HND"
        a.update(self.kw)
        return a

    def per_head(self, n: int, dtype: Any = np.float32) -> Any:
        if self.on_device:
            return device_array((n,), dtype)
        return self.rng.standard_normal(n).astype(dtype)


def draw_features(draw: Any, c: DecodeCall) -> None:
    """Valid features, each half the time."""
    for name, values in (
        ("sliding_window", st.sampled_from([1, 7, MAX_INT32])),
        ("logits_soft_cap", st.sampled_from([0.5, 30.0])),
        ("scale", st.sampled_from([0.0, -0.25, 1.5])),
        ("return_lse", st.sampled_from([True, False, np.bool_(True)])),
        ("sinks", st.just(None)),
        ("alibi_slopes", st.just(None)),
    ):  # fmt: skip
        if draw(st.booleans()):
            c.kw[name] = draw(values)
    for name in ("sinks", "alibi_slopes"):
        if name in c.kw:
            c.kw[name] = c.per_head(c.h)


def _rebuild(c: DecodeCall, **dims: Any) -> None:
    for name, value in dims.items():
        setattr(c, name, value)
    c.build()


JUNK_INT = [0, -1, 2**31, 2**63, 2.0, True, "8", np.float32(8)]


def decode_defect(draw: Any, c: DecodeCall, *, host_only: bool) -> tuple[str, ...]:
    """Break one thing of the call; return the arguments a refusal may name."""
    kinds = ["n_heads", "not_multiple", "n_kv_big", "n_kv_junk", "head_dim", "head_dim_junk",
             "q_dtype", "q_shape", "q_strided", "q_type", "k_shape", "v_shape", "v_dtype",
             "feature"]  # fmt: skip
    if not c.on_device:
        kinds += ["q_lying", "k_lying", "v_lying"]
    if c.on_device:
        kinds += ["k_tokens"]
    if c.on_device and c.layout == "HND" and c.dt != BF16:
        kinds += ["hnd_token_stride", "hnd_overlap", "hnd_negative", "hnd_huge", "hnd_v"]
    if c.layout == "NHD" and c.dt != BF16:
        kinds += ["k_strided"]
    if not host_only:
        kinds += ["mixed", "algorithm", "kv_layout", "stream", "out", "device"]
    kind = c.defect = draw(st.sampled_from(kinds))
    dims = ("n_heads", "n_kv_heads", "head_dim")
    if kind == "n_heads":
        c.kw["n_heads"] = draw(st.sampled_from(JUNK_INT))
        return ("n_heads", "q")
    if kind == "not_multiple":
        _rebuild(c, kv=max(c.kv, 2), h=max(c.kv, 2) * 3 + 1)
        return ("n_heads",)
    if kind == "n_kv_big":
        n = draw(st.sampled_from([MAX_KV_HEADS + 1, 65536]))
        _rebuild(c, kv=n, h=n, hd=1, seq=min(c.seq, 1))
        return ("n_kv_heads",)
    if kind == "n_kv_junk":
        c.kw["n_kv_heads"] = draw(st.sampled_from([0, -2, 2.5, True, "2"]))
        return ("n_kv_heads", "n_heads")
    if kind == "head_dim":
        _rebuild(c, hd=draw(st.sampled_from([513, 1024])), seq=min(c.seq, 2))
        return ("head_dim",)
    if kind == "head_dim_junk":
        c.kw["head_dim"] = draw(st.sampled_from([0, -1, 2**31, 8.0, True]))
        return dims
    if kind == "q_dtype":
        dt = draw(st.sampled_from([d for d in (*FLOATS, *BAD_DTYPES) if d != c.dt]))
        if c.on_device and dt == BF16 and not c.flat_q:
            dt = np.dtype(np.float64)
        c.q = c.array(c.q.shape if not c.on_device else (c.h * c.hd,), dt)
        return ("q", "k_cache", "v_cache")
    if kind == "q_shape":
        c.q = c.array(draw(st.sampled_from([(c.h * c.hd + 1,), (c.h, c.hd, 1), (c.h + 1, c.hd)])))
        return ("q", *dims)
    if kind == "q_strided":
        c.hd = max(c.hd, 2)
        c.build()
        if c.on_device:
            c.q = CudaView((c.h, c.hd), F32 if c.dt == BF16 else c.dt, (2 * c.hd, 2))
            return ("q", "k_cache", "v_cache")  # (a bf16 decode: the dtype, too)
        c.q = host_array((c.h, 2 * c.hd), c.dt, c.rng)[:, ::2]
        return ("q",)
    if kind == "q_type":
        c.q = draw(st.sampled_from([[0.0] * (c.h * c.hd), "q", 3, None, object()]))
        return ("q",)
    if kind == "q_lying":
        _rebuild(c, hd=max(c.hd, 2))
        c.q = lying((c.h, c.hd), c.dt)
        return ("q",)
    if kind in ("k_lying", "v_lying"):
        _rebuild(c, seq=max(c.seq, 2))
        shape = (c.seq, c.kv, c.hd) if c.layout == "NHD" else (c.kv, c.seq, c.hd)
        setattr(c, kind[0], lying(shape, c.dt))
        return ("k_cache",) if kind == "k_lying" else ("v_cache",)
    if kind == "k_shape":
        kv, hd, seq = c.kv, c.hd, c.seq
        if c.layout == "NHD":
            shapes = [(seq, kv + 1, hd), (seq, kv, hd + 1), (1, seq, kv, hd)]
            shapes += [(seq * kv * hd + 3,)] * (kv * hd > 1)  # (not a whole number of rows)
        else:
            shapes = [(kv + 1, seq, hd), (2, kv, seq, hd), (kv, seq)]
        shape = draw(st.sampled_from(shapes))
        c.k, c.v = c.array(shape), c.array(shape)
        return ("k_cache", "v_cache", *dims)
    if kind == "v_shape":
        shape = (c.seq + 1, c.kv, c.hd) if c.layout == "NHD" else (c.kv, c.seq + 1, c.hd)
        c.v = c.array(shape)
        return ("v_cache",)
    if kind == "v_dtype":
        dt = draw(st.sampled_from([d for d in (*FLOATS, np.dtype(np.float64)) if d != c.dt]))
        if c.on_device and dt == BF16:
            dt = np.dtype(np.float64)
        c.v = c.array(c.k.shape, dt)
        return ("v_cache",)
    if kind == "k_tokens":
        _rebuild(c, seq=draw(st.sampled_from(EDGE_TOKENS)), spare=0)
        return ("k_cache", "v_cache")
    if kind == "k_strided":
        _rebuild(c, hd=max(c.hd, 2), seq=max(c.seq, 1))
        shape = (c.seq, c.kv, c.hd)
        c.v = c.array(shape)
        if c.on_device:
            c.k = CudaView(shape, c.dt, (c.kv * 2 * c.hd, 2 * c.hd, 2))
        else:
            c.k = host_array((c.seq, c.kv, 2 * c.hd), c.dt, c.rng)[:, :, ::2]
        return ("k_cache",)
    if kind.startswith("hnd_"):
        _rebuild(c, kv=max(c.kv, 2), h=max(c.kv, 2) * (c.h // c.kv), seq=max(c.seq, 2))
        kv, seq, hd = c.kv, c.seq, c.hd
        strides = {
            "hnd_token_stride": (seq * (hd + 1), hd + 1, 1),
            "hnd_overlap": ((seq - 1) * hd, hd, 1),
            "hnd_negative": (-seq * hd, hd, 1),
            "hnd_huge": (2**62, hd, 1),  # (2^63 bytes on: past signed 64-bit offsets)
            "hnd_v": ((seq + 1) * hd, hd, 1),
        }[kind]
        view = CudaView((kv, seq, hd), c.dt, strides)
        if kind == "hnd_token_stride" and hd == 1:
            view = CudaView((kv, seq, 1), c.dt, (seq * 2, 2, 1))
        if kind == "hnd_v":
            c.k, c.v = CudaView((kv, seq, hd), c.dt), view
            return ("v_cache",)
        c.k = c.v = view
        return ("k_cache",)
    if kind == "feature":
        return feature_defect(draw, c)
    if kind == "mixed":
        on = c.on_device
        c.on_device = not on
        c.q = c.array(c.q.shape if not on else (c.h * c.hd,))
        c.on_device = on
        return ("q", "k_cache", "v_cache")
    if kind == "algorithm":
        bad = ["fast", 3, None]
        if c.layout == "HND" or c.kw:
            bad.append("parity")
        c.kw["algorithm"] = draw(st.sampled_from(bad))
        return ("algorithm",)
    if kind == "kv_layout":
        c.kw["kv_layout"] = draw(st.sampled_from(["hnd", "NHD ", None, 3]))
        return ("kv_layout",)
    if kind == "stream":
        c.kw["stream"] = draw(st.sampled_from([-1, "s", 1.5, object()]))
        return ("stream",)
    if kind == "out":
        if c.on_device:
            c.kw["out"] = device_array((c.h * c.hd + 1,), c.dt)
        else:
            c.kw["out"] = np.zeros((c.h, c.hd), c.dt)
        return ("out",)
    c.kw["device"] = draw(st.sampled_from(["gpu", 1.5, object()]))
    return ("device",)


def feature_defect(draw: Any, c: DecodeCall) -> tuple[str, ...]:
    name = draw(st.sampled_from(["sliding_window", "logits_soft_cap", "scale", "return_lse",
                                 "sinks", "alibi_slopes"]))  # fmt: skip
    nan, inf = float("nan"), float("inf")
    bad: list[Any] = {
        "sliding_window": [0, -1, 2**31, 2**40, 1.5, True, "3"],
        "logits_soft_cap": [0, -1.0, nan, inf, "x", True],
        "scale": [nan, inf, -inf, "x", True],
        "return_lse": [1, "yes", None, 0.0],
        "sinks": [], "alibi_slopes": [],
    }[name]  # fmt: skip
    if name in ("sinks", "alibi_slopes"):
        bad = [c.per_head(c.h + 1), [0.0] * c.h, "x"]
        if c.on_device:
            bad.append(c.per_head(c.h, np.float64))
        else:
            values = np.zeros(c.h, np.float32)
            values[0] = nan
            bad += [values, np.zeros(c.h, np.complex64), np.zeros((c.h, 2), np.float32)]
    value = draw(st.sampled_from(bad))
    if name in ("sinks", "alibi_slopes") and isinstance(value, np.ndarray):
        value = value.copy()
    c.kw[name] = value
    return (name,)


@st.composite
def decode_calls(draw: Any, *, host_only: bool = False) -> tuple[dict[str, Any], Any]:
    layouts = ("NHD",) if host_only else ("NHD", "HND")
    c = DecodeCall(draw, device=not host_only, layouts=layouts)
    if draw(st.booleans()):
        draw_features(draw, c)
    defect = decode_defect(draw, c, host_only=host_only) if draw(st.booleans()) else None
    if host_only and defect and c.defect in ("q_dtype", "v_dtype"):
        arrays = (c.q, c.v) if c.defect == "q_dtype" else (c.v,)
        if all(a.dtype.kind == "f" or a.dtype == BF16 for a in arrays):
            defect = None  # (the reference takes any float, float64 too, mixed)
    return c.args(), defect


@SETTINGS
@given(call=decode_calls())
def test_gqa_decode_runs_or_refuses_the_bad_argument_before_the_device(call):
    args, defect = call
    expect(lambda: fd.gqa_decode(**args), defect, args)


@SETTINGS
@given(call=decode_calls(host_only=True))
def test_reference_computes_or_refuses_the_bad_argument(call):
    args, defect = call
    args["k"], args["v"] = args.pop("k_cache"), args.pop("v_cache")
    defect = defect and tuple({"k_cache": "k", "v_cache": "v"}.get(n, n) for n in defect)
    if defect == ("head_dim",):  # 513 or 1024: past the kernels', within the reference's 1024
        defect = None
    results = []
    expect(lambda: results.append(fd.reference_gqa_decode(**args)), defect, args)
    if results:
        out = results[0][0] if isinstance(results[0], tuple) else results[0]
        assert out.shape == args["q"].shape and out.dtype == np.float64


# ---- KVCache ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def caches() -> dict[str, fd.KVCache]:
    """Caches over the fake device (2 KV heads of 16, 64 tokens): one per dtype."""
    return {dt.name: fake_cache(2, 16, 64, dtype=dt) for dt in (F32, F16, BF16, E4M3)}


def _row_defects(draw: Any, kv: fd.KVCache, rows: Any, name: str) -> Any:
    """A bad version of rows ``rows`` (named ``name``)."""
    if not isinstance(rows, np.ndarray):  # device rows: a mix, a size or dtype off
        dt = rows.dtype
        bad = np.dtype(np.float64)
        return draw(st.sampled_from([np.zeros(rows.shape, dt), device_array((33,), dt),
                                     device_array(rows.shape, bad), None]))  # fmt: skip
    bad_dtypes = [d for d in (*FLOATS, *BAD_DTYPES) if d != kv.dtype]
    if kv.fp8:
        bad_dtypes = [*BAD_DTYPES, E4M3]
    kind = draw(st.sampled_from(["dtype", "shape", "lying", "type"]))
    if kind == "dtype":
        return rows.astype(draw(st.sampled_from(bad_dtypes)))
    if kind == "shape":
        return np.zeros(draw(st.sampled_from([(rows.size + 1,), (3, 5, 7), ()])), rows.dtype)
    if kind == "lying":
        return lying(rows.shape if rows.size > 1 else (2, 16), rows.dtype)
    return draw(st.sampled_from([rows.tolist(), device_array(rows.shape, rows.dtype), None]))


@st.composite
def cache_appends(draw: Any) -> tuple[str, str, dict[str, Any], Any]:
    """(cache dtype, method, keywords, defect) of a KVCache append or extend."""
    dt = draw(st.sampled_from([F32, F16, BF16, E4M3]))
    method = draw(st.sampled_from(["append", "extend"]))
    row_dt = draw(st.sampled_from(FLOATS)) if dt == E4M3 else dt
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.sampled_from([0, 1, 3, 64, 65])) if method == "extend" else 1
    shape = draw(st.sampled_from([(2, 16), (32,)] if method == "append" else
                                 [(n, 2, 16), (n, 32), (n * 32,)]))  # fmt: skip
    rows = {name: host_array(shape, row_dt, rng) for name in ("k", "v")}
    if draw(st.booleans()):  # a view numpy made (strided): as good as any
        rows["k"] = np.repeat(rows["k"], 2, axis=-1)[..., ::2]
    elif draw(st.booleans()):  # device rows (both: a mix is refused)
        rows = {name: device_array(shape, row_dt) for name in ("k", "v")}
    names = ("k_tok", "v_tok") if method == "append" else ("k_rows", "v_rows")
    defect: Any = ("capacity",) if n > 64 else None
    return dt.name, method, {names[0]: rows["k"], names[1]: rows["v"]}, defect


@SETTINGS
@given(call=cache_appends(), data=st.data())
def test_kv_cache_appends_run_or_refuse_the_bad_rows_before_the_device(caches, call, data):
    dtype, method, kw, defect = call
    kv = caches[dtype]
    if defect is None and data.draw(st.booleans()):
        name = data.draw(st.sampled_from(sorted(kw)))
        kw[name] = _row_defects(data.draw, kv, kw[name], name)
        defect = (name,)
    elif defect is None and method == "extend" and data.draw(st.booleans()):
        name = sorted(kw)[1]  # (v_rows) a token more or less than k_rows
        kw[name] = np.zeros((kw[name].shape[0] + 1, 32), kw[name].dtype)
        defect = ("k_rows", "v_rows")
    expect(lambda: getattr(kv, method)(**kw), defect, (dtype, method, kw))
    assert kv.seq_len == 0  # nothing counted: every append refused or stopped at the device


@st.composite
def cache_decodes(draw: Any) -> tuple[str, dict[str, Any], Any]:
    """(cache dtype, keywords, defect) of a KVCache.decode."""
    dt = draw(st.sampled_from([F32, F16, BF16, E4M3]))
    q_dt = draw(st.sampled_from([F16, BF16])) if dt == E4M3 else dt
    group = draw(st.sampled_from([1, 3, 8]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shape = draw(st.sampled_from([(2 * group, 16), (2 * group * 16,)]))
    kw: dict[str, Any] = {"q": host_array(shape, q_dt, rng), "n_heads": 2 * group}
    if draw(st.booleans()):
        kw["algorithm"] = "auto"
    c = DecodeCall.__new__(DecodeCall)
    c.on_device, c.h, c.rng, c.kw = False, 2 * group, rng, {}
    if draw(st.booleans()):
        draw_features(draw, c)
        c.kw.pop("return_lse", None) if draw(st.booleans()) else None
    kw.update(c.kw)
    if not draw(st.booleans()):
        return dt.name, kw, None
    kind = draw(st.sampled_from(["q_dtype", "q_shape", "q_lying", "q_type", "n_heads",
                                 "algorithm", "feature"]))  # fmt: skip
    if kind == "q_dtype":
        kw["q"] = kw["q"].astype(draw(st.sampled_from(
            [d for d in (*FLOATS, *BAD_DTYPES) if d not in ((F16, BF16) if dt == E4M3 else (dt,))]
        )))  # fmt: skip
        return dt.name, kw, ("q",)
    if kind == "q_shape":
        kw["q"] = np.zeros(draw(st.sampled_from([(2 * group + 1, 16), (5,), (2 * group, 17)])),
                           q_dt)  # fmt: skip
        return dt.name, kw, ("q", "n_heads")
    if kind == "q_lying":
        kw["q"] = lying(kw["q"].shape, q_dt)
        return dt.name, kw, ("q",)
    if kind == "q_type":
        kw["q"] = draw(st.sampled_from([kw["q"].tolist(), "q", None]))
        return dt.name, kw, ("q",)
    if kind == "n_heads":
        kw["n_heads"] = draw(st.sampled_from([*JUNK_INT, 3]))
        return dt.name, kw, ("n_heads", "q")
    if kind == "algorithm":
        bad = ["fast", 7] + (["parity"] if dt == E4M3 or len(kw) > 3 else [])
        kw["algorithm"] = draw(st.sampled_from(bad))
        return dt.name, kw, ("algorithm",)
    defect = feature_defect(draw, c)
    kw.update(c.kw)
    return dt.name, kw, defect


@SETTINGS
@given(call=cache_decodes())
def test_kv_cache_decode_runs_or_refuses_the_bad_argument_before_the_device(caches, call):
    dtype, kw, defect = call
    expect(lambda: caches[dtype].decode(**kw), defect, (dtype, kw))


@st.composite
def cache_constructions(draw: Any) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """(positional, keywords, defect) of a KVCache construction (small rows: the fake
    world allocates the page-locked staging for real)."""
    fp8 = draw(st.booleans())
    dt = draw(st.sampled_from([E4M3, E5M2] if fp8 else [*FLOATS, "float16", np.float32]))
    n_kv = draw(st.sampled_from([1, 2, 8]))
    hd = draw(st.sampled_from([8, 64, 256] if fp8 else [1, 3, 64, 256]))
    capacity = draw(st.sampled_from([1, 5, MAX_TOKENS]))
    kw: dict[str, Any] = {"dtype": dt, "staging_slots": draw(st.sampled_from([1, 4]))}
    if fp8 and draw(st.booleans()):
        kw["k_scale"] = draw(st.sampled_from([0.5, np.float32(2), [1.0] * n_kv]))
    args = [n_kv, hd, capacity]
    if not draw(st.booleans()):
        return tuple(args), kw, None
    nan = float("nan")
    kind = draw(st.sampled_from(["n_kv_heads", "head_dim", "capacity", "dtype", "k_scale",
                                 "staging_slots", "stream"]))  # fmt: skip
    if kind in ("n_kv_heads", "head_dim", "capacity"):
        bad = {
            "n_kv_heads": [0, -1, MAX_KV_HEADS + 1, 2.0, True, None, "2"],
            "head_dim": [0, 513, 2**31, 8.0, True] + ([12] if fp8 else []),
            "capacity": [0, -1, *EDGE_TOKENS, 2**63, 1.0, True, None],
        }[kind]
        args[["n_kv_heads", "head_dim", "capacity"].index(kind)] = draw(st.sampled_from(bad))
    elif kind == "dtype":
        kw["dtype"] = draw(st.sampled_from([np.float64, np.int8, "nope", object, 3, None]))
    elif kind == "k_scale":
        kw["k_scale"] = draw(st.sampled_from(
            [0.0, -1.0, nan, float("inf"), 1e-40, [1.0] * (n_kv + 1), "x", True]
            if fp8 else [1.0, np.ones(n_kv)]
        ))  # fmt: skip
    elif kind == "staging_slots":
        kw["staging_slots"] = draw(st.sampled_from([0, -1, 1.5]))
    else:
        kw["stream"] = draw(st.sampled_from([3, "s", object()]))
    return tuple(args), kw, (kind,)


@SETTINGS
@given(call=cache_constructions())
def test_kv_cache_construction_is_refused_by_name_before_any_device_work(call):
    args, kw, defect = call
    asked = []
    kind, info = outcome(lambda: fake_cache(*args, count=lambda: asked.append(1), **kw))
    if defect is None:
        assert kind == "returned", f"{args} {kw}: a valid cache was refused: {info!r}"
    else:
        assert kind == "refused", f"{args} {kw}: bad {defect}, got {kind}"
        assert named(info) & set(defect), f"{args} {kw}: bad {defect}, refused with {info!r}"
        assert not asked, f"{args} {kw}: the device was asked before the refusal"


# ---- kv_append_async and gqa_decode_async ----------------------------------------------------
@st.composite
def async_appends(draw: Any) -> tuple[str, dict[str, Any], Any]:
    dt = draw(st.sampled_from([F32, F16, BF16, E4M3]))
    row_dt = draw(st.sampled_from(FLOATS)) if dt == E4M3 else dt
    shape = draw(st.sampled_from([(32,), (2, 16)]))
    kw: dict[str, Any] = {"k_dev": device_array(shape, row_dt),
                          "v_dev": device_array(shape, row_dt), "stream": None}  # fmt: skip
    if not draw(st.booleans()):
        return dt.name, kw, None
    kind = draw(st.sampled_from(["k_dev", "v_dev", "stream", "kv"]))
    if kind == "stream":
        kw["stream"] = draw(st.sampled_from([-1, "s", 1.5]))
    elif kind == "kv":
        kw["kv"] = draw(st.sampled_from([None, "cache", (kw["k_dev"], kw["v_dev"])]))
    else:
        bad_dt = np.dtype(np.float64) if dt != F32 else F16
        kw[kind] = draw(st.sampled_from([
            np.zeros(shape, row_dt), device_array((33,), row_dt), device_array(shape, bad_dt),
            CudaView((2, 16), F32, (32, 2)), [0.0] * 32, None,
        ]))  # fmt: skip
    return dt.name, kw, (kind,)


@SETTINGS
@given(call=async_appends())
def test_kv_append_async_runs_or_refuses_the_bad_argument_before_the_device(caches, call):
    dtype, kw, defect = call
    kv = kw.pop("kv", caches[dtype])
    expect(lambda: fd.kv_append_async(kv, **kw), defect, (dtype, kw))


@st.composite
def async_decodes(draw: Any) -> tuple[Any, dict[str, Any], Any]:
    """A gqa_decode_async against a KVCache (its dtype's name) or a (k, v) pair."""
    pair = draw(st.booleans())
    c = DecodeCall(draw, device=True, layouts=("NHD", "HND") if pair else ("NHD",))
    c.on_device = True
    dt = draw(st.sampled_from([F32, F16, BF16] + [E4M3] * (not pair)))
    if not pair:  # the fixture's caches: 2 KV heads of 16
        c.kv, c.hd, c.h = 2, 16, 2 * draw(st.sampled_from([1, 3, 8]))
    c.dt = draw(st.sampled_from([F16, BF16])) if dt == E4M3 else dt
    c.flat_k = False  # (a pair is shaped)
    c.spare = 0 if c.dt == BF16 else c.spare  # (strided: by the CUDA array interface)
    c.build()
    if draw(st.booleans()):
        draw_features(draw, c)
        if c.kw.pop("return_lse", False):
            c.kw["out_lse"] = device_array((c.h,), np.float32)
    kw: dict[str, Any] = {"q_dev": c.q, "out_dev": c.array(c.q.shape if c.dt != BF16
                          else (c.h * c.hd,)), "n_heads": c.h, "stream": None, **c.kw}  # fmt: skip
    if pair:
        kw["kv"] = (c.k, c.v)
        kw["seq_len"] = CudaView((1,), np.int32)
        if c.layout == "HND":
            kw["kv_layout"] = "HND"
    target = kw.pop("kv") if pair else dt.name
    if not draw(st.booleans()):
        return target, kw, None
    kinds = ["q_dev", "out_dev", "n_heads", "stream", "algorithm", "feature", "out_lse"]
    kinds += ["seq_len", "pair", "capacity"] if pair else ["seq_len_given"]
    kind = draw(st.sampled_from(kinds))
    if kind in ("q_dev", "out_dev"):
        kw[kind] = draw(
            st.sampled_from(
                [
                    np.zeros(c.h * c.hd, c.dt),
                    device_array((3,), c.dt),
                    device_array((c.h * c.hd,), np.float64),
                    None,
                ]
            )
        )
        return target, kw, (kind,)
    if kind == "n_heads":
        kw["n_heads"] = draw(st.sampled_from([*JUNK_INT[:-1], c.h + 1]))
        return target, kw, ("n_heads", "q_dev")
    if kind == "stream":
        kw["stream"] = draw(st.sampled_from([-1, "s"]))
        return target, kw, ("stream",)
    if kind == "algorithm":
        kw["algorithm"] = draw(st.sampled_from(["fast", 3] + ["parity"] * (pair or dt == E4M3)))
        return target, kw, ("algorithm",)
    if kind == "feature":
        defect = feature_defect(draw, c)
        if defect == ("return_lse",):
            return target, kw, None  # (no such keyword here: out_lse)
        kw.update({k: v for k, v in c.kw.items() if k != "return_lse"})
        return target, kw, defect
    if kind == "out_lse":
        kw["out_lse"] = draw(
            st.sampled_from(
                [device_array((c.h + 1,), np.float32), device_array((c.h,), F16), np.zeros(c.h)]
            )
        )
        return target, kw, ("out_lse",)
    if kind == "seq_len_given":
        kw["seq_len"] = CudaView((1,), np.int32)
        return target, kw, ("seq_len",)
    if kind == "seq_len":
        kw["seq_len"] = draw(
            st.sampled_from(
                [None, CudaView((2,), np.int32), CudaView((1,), np.int64), np.zeros(1, np.int32)]
            )
        )
        return target, kw, ("seq_len",)
    if kind == "capacity":
        n = draw(st.sampled_from(EDGE_TOKENS))
        shape = (n, c.kv, c.hd) if c.layout == "NHD" else (c.kv, n, c.hd)
        return (c.array(shape), c.array(shape)), kw, ("k_cache",)
    bad_pair = draw(
        st.sampled_from(
            [
                (c.k,),
                (c.k, c.v, c.v),
                (np.zeros(4), np.zeros(4)),
                (c.k, c.array((1, 1, 1), np.float64)),
            ]
        )
    )
    return bad_pair, kw, ("kv", "k_cache", "v_cache")


@SETTINGS
@given(call=async_decodes())
def test_gqa_decode_async_runs_or_refuses_the_bad_argument_before_the_device(caches, call):
    target, kw, defect = call
    kv = caches[target] if isinstance(target, str) else target
    expect(lambda: fd.gqa_decode_async(kw.pop("q_dev"), kv, kw.pop("out_dev"), **kw), defect,
           (target, kw))  # fmt: skip


# ---- merge_states ----------------------------------------------------------------------------
@st.composite
def merges(draw: Any) -> tuple[dict[str, Any], Any]:
    on_device = draw(st.booleans())
    parts, heads, hd = (draw(st.sampled_from(v)) for v in ([1, 2, 5], [1, 4], [1, 16]))
    dt = draw(st.sampled_from(FLOATS))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shape = draw(st.sampled_from([(parts, heads, hd), (parts, heads * hd)]))
    if on_device:
        kw: dict[str, Any] = {"outs": device_array(shape, dt),
                              "lses": device_array((parts, heads), np.float32)}  # fmt: skip
        if draw(st.booleans()):
            kw["out"] = device_array((heads, hd), dt)
    else:
        kw = {"outs": host_array(shape, dt, rng), "lses": rng.standard_normal((parts, heads))}
        kw["lses"][0, 0] = -np.inf  # an empty part
    if not draw(st.booleans()):
        return kw, None
    kind = draw(
        st.sampled_from(
            ["lses_shape", "outs_shape", "mixed", "out", "lses_dtype"]
            + (["lying", "nan"] if not on_device else ["outs_dtype"])
        )
    )
    if kind == "lses_shape":
        bad = draw(st.sampled_from([(0, heads), (parts, 0), (parts,), (parts, heads, 1), ()]))
        kw["lses"] = device_array(bad, np.float32) if on_device else np.zeros(bad)
        return kw, ("lses", "outs")
    if kind == "outs_shape":
        bad = draw(
            st.sampled_from(
                [
                    (parts + 1, heads, hd),
                    (parts,),
                    (),
                    (parts, heads + 1, hd),
                    (parts, heads, hd, 1),
                ]
            )
        )
        kw["outs"] = device_array(bad, dt) if on_device else np.zeros(bad, dt)
        return kw, ("outs",)
    if kind == "mixed":
        kw["lses"] = np.zeros((parts, heads)) if on_device else device_array((parts, heads), F32)
        return kw, ("outs", "lses")
    if kind == "out":
        kw["out"] = np.zeros((heads, hd), dt) if not on_device else device_array((heads + 1,), dt)
        return kw, ("out", "out_lse")
    if kind == "lses_dtype":
        kw["lses"] = (device_array((parts, heads), np.float64) if on_device
                      else np.zeros((parts, heads), np.int32))  # fmt: skip
        return kw, ("lses",)
    if kind == "outs_dtype":
        kw["outs"] = device_array(shape, np.float64)
        return kw, ("outs",)
    if kind == "nan":
        kw["lses"][-1, -1] = draw(st.sampled_from([np.nan, np.inf]))
        return kw, ("lses",)
    kw["outs"] = lying((parts, heads, max(hd, 2)), dt)
    return kw, ("outs",)


@SETTINGS
@given(call=merges())
def test_merge_states_runs_or_refuses_the_bad_argument_before_the_device(call):
    kw, defect = call
    expect(lambda: fd.merge_states(**kw), defect, kw)


# ---- chaos: anything in any argument ---------------------------------------------------------
def _junk_arrays() -> list[Any]:
    rng = np.random.default_rng(0)
    return [
        np.zeros(()), np.zeros((0,)), np.zeros((2, 3), np.complex64), np.zeros(3, object),
        np.zeros((4, 2, 8), np.float16)[:, :, ::2], rng.standard_normal((2, 2, 8)).astype(BF16),
        np.zeros(5, np.int64), np.array(["a", "b"]), lying((3, 2, 8), F32), lying((2**20,), F16),
        np.ones((8, 16), np.float32), np.ones((5, 2, 16), np.float32),
        CudaView((2, 2, 8), F16, (16, 8, 2)), CudaView((MAX_TOKENS + 1, 2, 16), F32),
        CudaView((2**40,), F16), CudaView((2, 8), np.float64), CudaView((), F32),
        CudaView((3, 4), F32, (-4, 1)), CudaView((2, 2, 4), F16, (3, 3, 1)),
        DlpackView((8, 16), BF16), DlpackView((5, 2, 16), E4M3), DlpackView((1,), np.int32),
        DlpackView((0, 2, 16), F32),
    ]  # fmt: skip


JUNK = st.one_of(
    st.none(), st.booleans(), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, 2, 16, -1, MAX_INT32, 2**31, 2**63, -(2**40), MAX_TOKENS + 1,
                     np.int32(8), np.int64(2**40), np.float32(2.5), np.bool_(True)]),
    st.text(max_size=4), st.sampled_from(["auto", "parity", "HND", "NHD", "cuda:0"]),
    st.sampled_from([[1.0, 2.0], (1, 2), {}, object(), b"x", 1j, slice(1)]),
    st.sampled_from(_junk_arrays()),
)  # fmt: skip


def _chaos(draw: Any, valid: dict[str, Any]) -> dict[str, Any]:
    """``valid`` with about a third of its values replaced by junk."""
    return {k: draw(JUNK) if draw(st.integers(0, 2)) == 0 else v for k, v in valid.items()}


FEATURE_NAMES = ("sliding_window", "logits_soft_cap", "sinks", "alibi_slopes", "scale",
                 "return_lse")  # fmt: skip


@SETTINGS
@given(data=st.data())
def test_gqa_decode_and_the_reference_take_anything_without_crashing(data):
    on_device = data.draw(st.booleans())
    make = (lambda s, d: device_array(s, d)) if on_device else (lambda s, d: np.ones(s, d))
    valid = dict(q=make((8, 16), F32), k_cache=make((5, 2, 16), F32),
                 v_cache=make((5, 2, 16), F32), n_heads=8, n_kv_heads=2, head_dim=16)  # fmt: skip
    extra = ("stream", "algorithm", "device", "out", "kv_layout", *FEATURE_NAMES)
    for name in data.draw(st.sets(st.sampled_from(extra), max_size=3)):
        valid[name] = None
    args = _chaos(data.draw, valid)
    expect_any(lambda: fd.gqa_decode(**args), tuple(args))
    if not set(args) - {"q", "k_cache", "v_cache", "n_heads", "n_kv_heads", "head_dim",
                        *FEATURE_NAMES}:  # fmt: skip
        ref = {
            ("k" if n == "k_cache" else "v" if n == "v_cache" else n): a for n, a in args.items()
        }
        expect_any(lambda: fd.reference_gqa_decode(**ref), tuple(ref))


@SETTINGS
@given(data=st.data())
def test_kv_cache_takes_anything_without_crashing(caches, data):
    ctor = _chaos(data.draw, dict(n_kv_heads=2, head_dim=16, capacity=8, dtype=F16))
    expect_any(lambda: fake_cache(**ctor), tuple(ctor))
    kv = caches[data.draw(st.sampled_from(sorted(caches)))]
    rows = np.ones((2, 16), F16 if kv.fp8 else kv.dtype)
    method = data.draw(st.sampled_from(["append", "extend", "decode"]))
    if method == "decode":
        q = np.ones((4, 16), F16 if kv.fp8 else kv.dtype)
        kw = _chaos(data.draw, dict(q=q, n_heads=4, algorithm="auto", **dict.fromkeys(
            data.draw(st.sets(st.sampled_from(FEATURE_NAMES), max_size=2)))))  # fmt: skip
    elif method == "append":
        kw = _chaos(data.draw, dict(k_tok=rows, v_tok=rows))
    else:
        kw = _chaos(data.draw, dict(k_rows=rows[None], v_rows=rows[None]))
    expect_any(lambda: getattr(kv, method)(**kw), tuple(kw))
    assert kv.seq_len == 0


@SETTINGS
@given(data=st.data())
def test_the_async_entry_points_and_merge_take_anything_without_crashing(caches, data):
    kv = caches[data.draw(st.sampled_from(sorted(caches)))]
    dt = F16 if kv.fp8 else kv.dtype
    row = device_array((32,), dt)
    kw = _chaos(data.draw, dict(kv=kv, k_dev=row, v_dev=row, stream=None))
    expect_any(lambda: fd.kv_append_async(**kw), tuple(kw))
    pair = (device_array((6, 2, 16), F16), device_array((6, 2, 16), F16))
    target = data.draw(st.sampled_from([kv, pair]))
    valid: dict[str, Any] = dict(
        q_dev=device_array((64,), dt),
        kv=target,
        out_dev=device_array((64,), dt),
        n_heads=4,
        stream=None,
    )
    if target is pair:
        valid.update(q_dev=device_array((64,), F16), out_dev=device_array((64,), F16),
                     seq_len=CudaView((1,), np.int32))  # fmt: skip
    for name in data.draw(
        st.sets(
            st.sampled_from(["algorithm", "out_lse", "kv_layout", *FEATURE_NAMES[:-1]]), max_size=3
        )
    ):
        valid[name] = None
    kw = _chaos(data.draw, valid)
    expect_any(lambda: fd.gqa_decode_async(**kw), (*kw, "k_cache", "v_cache"))  # (kv's pair)
    on_device = data.draw(st.booleans())
    make = (lambda s, d: device_array(s, d)) if on_device else (lambda s, d: np.zeros(s, d))
    kw = _chaos(data.draw, dict(outs=make((3, 4, 16), F32), lses=make((3, 4), F32)))
    for name in data.draw(st.sets(st.sampled_from(["out", "out_lse", "stream"]))):
        kw[name] = data.draw(JUNK)
    expect_any(lambda: fd.merge_states(**kw), tuple(kw))
