"""The planner's driver half: a device's traits read from the driver (or modelled for an
architecture without one), the plans remembered per device, and the launches that make a
decode (the split kernel of a plan and its combine kernel, or the parity kernel)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..archs import ArchLimits, arch_limits, occupancy
from ..driver.compiler import KernelResources, Program
from ..driver.device import Device
from ..driver.memory import DeviceArray, empty
from ..driver.module_cache import get_program
from ..errors import CudaError, FerroxError
from ..kernels.abi import (
    CLUSTER_FEATURE_ROLES,
    COMBINE_FEATURE_ROLES,
    QKV,
    SEQ_SLOT,
    SPLIT_FEATURE_ROLES,
    FeatureArgs,
    Launch,
    Roles,
    roles_at,
)
from ..kernels.catalogue import kernel_source, split_kernel
from ..kernels.spec import (
    FOUR_BIT_FORMATS,
    NARROW_ROWS_HEAD_DIM,
    NVFP4_FORMAT,
    Q4_FORMAT,
    SPLIT_FILE,
    WIDE_ROWS_HEAD_DIM,
    KernelSpec,
    kernel_dtype,
)
from ..kernels.traits import (
    COMBINE_FEATURES,
    F_ALIBI,
    F_CAP,
    F_HND,
    F_LSE,
    F_SCALE,
    F_SINKS,
    F_WINDOW,
)
from . import plan as planner
from .plan import COMBINE_THREADS, DEFAULT_TUNING, TUNING, DeviceTraits, RowsPlan, SplitPlan

__all__ = [
    "allocate_scratch",
    "arch_traits",
    "device_traits",
    "parity_launches",
    "plan_rows",
    "plan_split",
    "rows_launches",
    "split_launches",
    "split_program",
    "verify_launches",
    "verify_workspace_floats",
]

# A verify's kernels' features (split_verify.cuh): the tail's, and its combine's
TAIL_FEATURES = F_WINDOW | F_CAP | F_ALIBI | F_SCALE | F_HND
VCOMBINE_FEATURES = F_WINDOW | F_SINKS | F_LSE | F_ALIBI
VERIFY_ROWS = 4  # FX_VERIFY_ROWS: rows per tail block


def device_traits(device: Device) -> DeviceTraits:
    """The traits of ``device`` (made once per context)."""
    traits = _traits.get(device.context_handle)
    if traits is None:
        traits = _traits[device.context_handle] = _read_traits(device)
    return traits


_traits: dict[int, DeviceTraits] = {}


def _read_traits(device: Device) -> DeviceTraits:
    blocks: dict[tuple[KernelSpec, int, int], int] = {}
    clusters: dict[tuple[KernelSpec, int, int, int], int] = {}

    def blocks_per_sm(kernel: KernelSpec, threads: int, shared: int) -> int:
        # (by launch too: one kernel's launches may reserve different shared memory)
        n = blocks.get((kernel, threads, shared))
        if n is None:
            found = split_kernel(kernel, device).max_active_blocks(threads, shared)
            n = blocks[kernel, threads, shared] = max(found, 1)
        return n

    def active_clusters(kernel: KernelSpec, cluster: int, threads: int, shared: int) -> int:
        n = clusters.get((kernel, cluster, threads, shared))
        if n is None:
            try:
                n = split_kernel(kernel, device).max_active_clusters(cluster, threads, shared)
            except CudaError:  # e.g. a cluster larger than this device (or MIG slice) holds
                n = 0
            clusters[kernel, cluster, threads, shared] = n
        return n

    return DeviceTraits(
        device.context_handle, device.arch, device.compute_capability,
        device.multiprocessor_count, blocks_per_sm, active_clusters,
        TUNING.get(device.arch, DEFAULT_TUNING), device.max_shared_per_block_optin,
    )  # fmt: skip


def split_program(specs: Sequence[KernelSpec], arch: str) -> Program:
    """The split kernels ``specs`` (with their ``_cluster`` twins) compiled for ``arch`` in
    one module, through the module cache (memory and disk); for one spec, the very module
    that ``split_kernel`` loads on a GPU of ``arch``. No GPU needed.

    Raises:
        ValueError: a bad ``arch``.
    """
    select = "\n".join(dict.fromkeys(spec.entry for spec in specs))
    source = f"#define FX_SELECTED 1\n{kernel_source(SPLIT_FILE)}\n{select}\n"
    return get_program(source, arch=arch, name=SPLIT_FILE)


def arch_traits(
    arch: str, resources: Callable[[str], KernelResources] | None = None
) -> DeviceTraits:
    """Hand-made traits of a GPU of ``arch`` (one of archs.ARCHS: its limits, its GPU's
    multiprocessors), for planning without one: a kernel's blocks per multiprocessor from
    the limits and its registers and static shared memory as ptxas reports them
    (``resources``: kernel name -> KernelResources; default: the kernel compiled for
    ``arch`` by ``split_program``), and resident clusters from a model of the GPCs (whole
    clusters within each; a real device's driver knows better).

    Raises:
        ValueError: ``arch`` is not in archs.ARCHS.
    """
    limits = arch_limits(arch)
    seen: dict[KernelSpec, KernelResources] = {}

    def kernel_resources(kernel: KernelSpec) -> KernelResources:
        found = seen.get(kernel)
        if found is None:
            found = seen[kernel] = (
                resources(kernel.name)
                if resources
                else split_program([kernel], arch).resources[kernel.name]
            )
        return found

    def blocks(kernel: KernelSpec, threads: int, shared: int) -> int:
        r = kernel_resources(kernel)
        return occupancy(limits, threads, shared, r.registers, r.shared_bytes)

    def blocks_per_sm(kernel: KernelSpec, threads: int, shared: int) -> int:
        return max(1, blocks(kernel, threads, shared))

    def active_clusters(kernel: KernelSpec, cluster: int, threads: int, shared: int) -> int:
        if not 0 < cluster <= limits.max_cluster:
            return 0
        gpcs = limits.multiprocessor_count // limits.gpc_sms
        return gpcs * (limits.gpc_sms * blocks(kernel, threads, shared) // cluster)

    return _limits_traits(limits, blocks_per_sm, active_clusters)


def _limits_traits(
    limits: ArchLimits,
    blocks_per_sm: Callable[[KernelSpec, int, int], int],
    active_clusters: Callable[[KernelSpec, int, int, int], int],
) -> DeviceTraits:
    return DeviceTraits(
        ("arch", limits.arch), limits.arch, limits.compute_capability,
        limits.multiprocessor_count, blocks_per_sm, active_clusters,
        TUNING.get(limits.arch, DEFAULT_TUNING), limits.shared_per_block,
    )  # fmt: skip


_plans: dict[tuple[Any, ...], SplitPlan] = {}
_MAX_PLANS = 4096  # distinct (shape, length) plans kept; eager decodes plan per length


def plan_split(
    device: Device,
    dtype: np.dtype,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    plan_seq: int,
    aligned: bool = True,
    features: int = 0,
    fp8: str = "",
    verify: bool = False,
) -> SplitPlan:
    """The split plan (``plan.plan``) for up to ``plan_seq`` tokens on ``device``, its
    kernel loaded (captures need it), memoised: every decode asks, once; ``OVERRIDES`` is
    part of the key."""
    overrides = planner.OVERRIDES
    key = (device.context_handle, np.dtype(dtype), n_heads, n_kv_heads, head_dim, plan_seq,
           aligned, overrides, features, fp8, verify)  # fmt: skip
    found = _plans.get(key)
    if found is None:
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        found = _plans[key] = planner.plan(
            device_traits(device), dtype, n_heads, n_kv_heads, head_dim, plan_seq, aligned,
            overrides, features, fp8, verify,
        )  # fmt: skip
    split_kernel(found.spec, device)  # loaded (after a first plan, a lookup)
    return found


_four_bit_plans: dict[tuple[Any, ...], SplitPlan | None] = {}


def plan_four_bit(
    device: Device, dtype: Any, n_heads: int, n_kv_heads: int, head_dim: int, plan_seq: int,
    aligned: bool, features: int, fmt: str, rotate: bool,
) -> SplitPlan | None:  # fmt: skip
    """A 4-bit cache's one-query split plan (``plan.four_bit_plan``) on ``device``, or None
    where its kernels do not take the call (the rows kernel does); its kernels loaded,
    memoised like ``plan_split``."""
    overrides = planner.OVERRIDES
    key = (device.context_handle, np.dtype(dtype), n_heads, n_kv_heads, head_dim, plan_seq,
           aligned, features, fmt, rotate, overrides)  # fmt: skip
    if key in _four_bit_plans:
        return _four_bit_plans[key]
    if len(_four_bit_plans) >= _MAX_PLANS:
        _four_bit_plans.clear()
    found = _four_bit_plans[key] = planner.four_bit_plan(
        device_traits(device), dtype, n_heads, n_kv_heads, head_dim, plan_seq, aligned,
        features, fmt, rotate, overrides,
    )  # fmt: skip
    if found is not None:
        split_kernel(found.spec, device)
        combine = found.combine_spec(dtype)
        if combine is not None:
            split_kernel(combine, device)
    return found


_rows_plans: dict[tuple[Any, ...], RowsPlan | None] = {}


def plan_rows(
    device: Device, dtype: Any, n_q: int, n_heads: int, n_kv_heads: int, head_dim: int,
    plan_seq: int, aligned: bool, features: int, fp8: str = "", rotate: bool = False,
) -> RowsPlan | None:  # fmt: skip
    """The rows kernel's plan (``plan.rows_plan``) for a verify on ``device``, or None where
    that kernel does not take it; its kernels loaded, memoised like ``plan_split``."""
    overrides = planner.OVERRIDES
    key = (device.context_handle, np.dtype(dtype), n_q, n_heads, n_kv_heads, head_dim, plan_seq,
           aligned, features, fp8, overrides, rotate)  # fmt: skip
    if key in _rows_plans:
        return _rows_plans[key]
    if len(_rows_plans) >= _MAX_PLANS:
        _rows_plans.clear()
    found = _rows_plans[key] = planner.rows_plan(
        device_traits(device), dtype, n_q, n_heads, n_kv_heads, head_dim, plan_seq, aligned,
        features, fp8, overrides, rotate,
    )  # fmt: skip
    if found is not None:
        split_kernel(found.spec, device)
        split_kernel(found.combine_spec(), device)
    return found


def rows_launches(
    plan: RowsPlan,
    q: DeviceArray,
    k: DeviceArray,
    v: DeviceArray,
    out: DeviceArray,
    workspace: DeviceArray,
    *,
    n_q: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    seq_len: int,
    seq_len_dev: DeviceArray | None,
    features: FeatureArgs,
    mask: DeviceArray | None = None,
    mask_mode: int = 0,
    kv_scales: DeviceArray | None = None,
    q4_scales: tuple[DeviceArray, DeviceArray] | None = None,
) -> list[Launch]:
    """The two launches of a verify of ``n_q`` queries on the rows kernel (split_rows.cuh):
    the rows kernel of ``plan`` over every token, each row under its own mask, window and
    ALiBi, its partials into ``workspace`` (``plan.workspace_floats``), then the combine
    merging them into ``out`` (n_q, n_heads, head_dim) with the sinks and the LSE, launched
    early. ``mask_mode`` as in `verify_launches`; ``kv_scales``: an fp8 cache's, an nvfp4
    cache's per KV head; ``q4_scales``: a 4-bit cache's K and V scales per block of its
    rows (q4: float16 per 32, nvfp4: e4m3 per 16; a cache of K and V in formats of their
    own, ``spec.v_fp8``: both, the fp8 side's unread, and ``kv_scales``).

    Raises:
        ValueError: a plan without the scales its cache has.
    """
    fmt = plan.spec.fp8
    four_bit = fmt in FOUR_BIT_FORMATS or plan.spec.v_fp8 in FOUR_BIT_FORMATS
    if four_bit and q4_scales is None:
        raise ValueError("q4_scales: a 4-bit plan reads the cache's block scales")
    if fmt and (fmt != Q4_FORMAT or plan.spec.v_fp8) and kv_scales is None:
        raise ValueError("kv_scales: an fp8 or nvfp4 plan reads the cache's scales")
    rows = n_q * n_heads
    n_partial = rows * plan.splits
    ws_ml = workspace.view((n_partial * 2,), np.float32, offset=n_partial * head_dim * 4)
    on_host = seq_len_dev is None
    splits, tile = np.int32(plan.splits), np.int32(plan.tile)
    scales: tuple[Any, ...] = (
        (*(q4_scales or (None, None)), kv_scales)  # K and V in formats of their own
        if plan.spec.v_fp8
        else (*(q4_scales or ()), *((kv_scales,) if fmt == NVFP4_FORMAT else ()))
        if four_bit
        else (kv_scales,)
        if fmt
        else ()
    )
    args = (
        q, k, v, workspace, ws_ml, np.int32(n_heads), np.int32(n_kv_heads), np.int32(n_q),
        np.int32(seq_len), seq_len_dev, splits, tile, mask, np.int32(mask_mode),
        np.float32(features.scale), np.float32(features.cap), np.int32(features.window),
        features.slopes, np.int64(features.head_stride),
        *scales,
    )  # fmt: skip
    roles: Roles = (*QKV, *(((8, "seq"),) if on_host else ()), (12, "mask"), (17, "slopes"),
                    (18, "heads"))  # fmt: skip
    shared = plan.shared_bytes(q.dtype.itemsize)
    combine_args = (
        out, workspace, ws_ml, np.int32(head_dim), np.int32(seq_len), seq_len_dev, splits, tile,
        np.int32(n_heads), np.int32(n_q), np.int32(features.window), features.sinks,
        features.lse,
    )  # fmt: skip
    combine_roles: Roles = (
        (0, "out"), *(((4, "seq"),) if on_host else ()), (11, "sinks"), (12, "lse"),
    )  # fmt: skip
    return [
        Launch(plan.spec, plan.grid(n_kv_heads), plan.threads, args, shared, roles=roles),
        Launch(plan.combine_spec(), (rows, -(-head_dim // 32), 1), COMBINE_THREADS,
               combine_args, early=planner.OVERRIDES.early_combine, roles=combine_roles),
    ]  # fmt: skip


def allocate_scratch(floats: int, device: Device, in_capture: str) -> DeviceArray:
    """``floats`` float32 of decode scratch.

    Raises:
        FerroxError: with the message ``in_capture`` when a stream capture is open
            (allocation is not capturable).
    """
    try:
        return empty((floats,), np.float32, device=device)
    except CudaError as exc:
        if exc.name == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED":
            raise FerroxError(in_capture) from exc
        raise


def split_launches(
    plan: SplitPlan,
    q: DeviceArray,
    k: DeviceArray,
    v: DeviceArray,
    out: DeviceArray,
    workspace: DeviceArray | None,
    *,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    seq_len: int,
    seq_len_dev: DeviceArray | None,
    features: FeatureArgs | None = None,
    kv_scales: DeviceArray | None = None,
    q4_scales: tuple[DeviceArray, DeviceArray] | None = None,
) -> list[Launch]:
    """The launches of a split decode in order: the split kernel of ``plan``, then (unless
    it is a cluster plan, whose split kernel writes ``out``) the kernel combining its
    chunks, launched early. A plan with features takes their values from ``features``.
    ``kv_scales``: an fp8 cache's, an nvfp4 cache's per KV head; ``q4_scales``: a 4-bit
    cache's K and V block scales.

    Raises:
        ValueError: a combine plan without ``workspace``, or with features and no
            ``features``; a plan without the scales its cache has.
    """
    if plan.features and features is None:
        raise ValueError("features: the plan has features compiled in; pass their values")
    four_bit = plan.fp8 in FOUR_BIT_FORMATS
    if four_bit and q4_scales is None:
        raise ValueError("q4_scales: a 4-bit plan reads the cache's block scales")
    if plan.fp8 and plan.fp8 != Q4_FORMAT and kv_scales is None:
        raise ValueError("kv_scales: an fp8 or nvfp4 plan reads the cache's scales")
    # the split kernel's last arguments: an fp8 plan's scales (a 4-bit plan's: the per head
    # ones, unread for q4, then the block scales), and with features (an fp8 plan's kernels
    # take every feature's value, its own or not) their values
    values = (features or FeatureArgs(scale=head_dim**-0.5)) if plan.features or plan.fp8 else None
    fp8_args: tuple[Any, ...] = (
        (kv_scales, *(q4_scales or ())) if four_bit else (kv_scales,) if plan.fp8 else ()
    )
    launch_kv = n_kv_heads // 2 if plan.paired else n_kv_heads  # paired: KV heads of 2 rows
    heads = (np.int32(n_heads), np.int32(launch_kv))
    splits, tile = np.int32(plan.splits), np.int32(plan.tile)
    args: tuple[Any, ...]
    shared = plan.shared_bytes(head_dim, q.dtype.itemsize)
    # seq_len (the launch's bound when the kernels read the length on the device) is a
    # role only when it is the length itself
    on_host = seq_len_dev is None
    if plan.cluster:
        args = (q, k, v, out, *heads, np.int32(seq_len), seq_len_dev, splits, tile, *fp8_args)
        roles: Roles = (*QKV, (3, "out"), *(((SEQ_SLOT["cluster"], "seq"),) if on_host else ()))
        if values is not None:
            roles += roles_at(len(args), CLUSTER_FEATURE_ROLES)
            args += values.cluster_args()
        grid = plan.grid(n_kv_heads)
        return [Launch(plan.spec, grid, plan.threads, args, shared, plan.cluster, roles=roles)]
    if workspace is None:
        raise ValueError("workspace: the combine kernel's plans need one (workspace_floats)")
    n_partial = n_heads * plan.splits
    ws_o = workspace
    ws_ml = workspace.view((n_partial * 2,), offset=n_partial * head_dim * 4)
    split_roles: Roles = ()
    if plan.tensor_cores:
        args = (q, k, v, ws_o, ws_ml, *heads, np.int32(seq_len), seq_len_dev, splits, tile)
        args += fp8_args
        if values is not None:
            split_roles = roles_at(len(args), SPLIT_FEATURE_ROLES)
            args += values.split_args()
        grid = plan.grid(n_kv_heads)  # tiles of 8 query heads
        at = SEQ_SLOT["tensor_cores"]
    else:  # head tiles of one chunk adjacent in launch order (see the kernel)
        lanes = np.int32(plan.lanes_per_token)
        args = (q, k, v, ws_o, ws_ml, *heads, np.int32(head_dim), np.int32(seq_len),
                seq_len_dev, splits, lanes, tile, *fp8_args)  # fmt: skip
        if values is not None:
            split_roles = roles_at(len(args), SPLIT_FEATURE_ROLES)
            args += values.split_args()
        grid = plan.grid(n_kv_heads)
        at = SEQ_SLOT["cuda_cores"]
    combine_args: tuple[Any, ...] = (out, ws_o, ws_ml, np.int32(head_dim), np.int32(seq_len),
                                     seq_len_dev, splits, tile)  # fmt: skip
    combine = plan.combine_spec(q.dtype)
    assert combine is not None
    combine_roles: Roles = ()
    if plan.features & COMBINE_FEATURES and values is not None:
        combine_roles = roles_at(len(combine_args), COMBINE_FEATURE_ROLES)
        combine_args += values.combine_args()
    return [
        Launch(
            plan.spec, grid, plan.threads, args, shared,
            roles=(*QKV, *(((at, "seq"),) if on_host else ()), *split_roles),
        ),
        Launch(
            combine,
            (n_heads, -(-head_dim // 32), 1),
            COMBINE_THREADS,
            combine_args,
            early=planner.OVERRIDES.early_combine,  # it waits for the split kernel itself
            roles=(
                (0, "out"), *(((SEQ_SLOT["combine"], "seq"),) if on_host else ()),
                *combine_roles,
            ),
        ),
    ]  # fmt: skip


def parity_launches(
    q: DeviceArray,
    k: DeviceArray,
    v: DeviceArray,
    out: DeviceArray,
    *,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    seq_len: int,
    seq_len_dev: DeviceArray | None,
) -> list[Launch]:
    """The one launch of the parity kernel (ferrox-cuda's algorithm, corrected)."""
    args = (q, k, v, out, np.int32(n_heads), np.int32(n_kv_heads), np.int32(head_dim),
            np.int32(seq_len), seq_len_dev)  # fmt: skip
    on_host = seq_len_dev is None
    roles = (*QKV, (3, "out"), *(((SEQ_SLOT["parity"], "seq"),) if on_host else ()))
    spec = KernelSpec.parity(kernel_dtype(q.dtype), head_dim)
    return [Launch(spec, (n_heads, 1, 1), 32, args, roles=roles)]


def _at4(floats: int) -> int:
    """``floats`` rounded up to whole 16-byte units."""
    return -(-floats // 4) * 4


def verify_workspace_floats(
    plan: SplitPlan, n_q: int, n_heads: int, head_dim: int, itemsize: int
) -> int:
    """Floats of scratch a verify of ``n_q`` queries needs (`verify_launches`): the split
    kernel's partials for its n_q x n_heads rows, the tail's partials, the rows' queries
    (q's dtype, ``itemsize`` bytes) and slopes, and the prefix's length."""
    rows = n_q * n_heads
    return (
        _at4(plan.workspace_floats(rows, head_dim)) + _at4(rows * (head_dim + 2))
        + _at4(-(-rows * head_dim * itemsize // 4)) + _at4(rows) + 4
    )  # fmt: skip


def verify_launches(
    plan: SplitPlan,
    q: DeviceArray,
    k: DeviceArray,
    v: DeviceArray,
    out: DeviceArray,
    workspace: DeviceArray,
    *,
    n_q: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    seq_len: int,
    seq_len_dev: DeviceArray | None,
    features: FeatureArgs,
    bits: int,
    mask: DeviceArray | None = None,
    mask_mode: int = 0,
    kv_scales: DeviceArray | None = None,
) -> list[Launch]:
    """The launches of a decode of ``n_q`` queries, the cache's last n_q tokens
    (split_verify.cuh): the tail kernel (the rows' queries in row order, the tokens only
    some queries see, the prefix's length), the split kernel of ``plan`` (planned for
    n_q x n_heads rows, ``verify``) over the tokens every query sees, and the combine
    merging both into ``out`` (n_q, n_heads, head_dim). ``bits``: the decode's features
    (F_*), their values in ``features`` (the window the queries', the LSE output of n_q x
    n_heads floats). ``mask_mode``: 0 causal, 1 a mask of bytes (n_q, n_q), 2 of bits (n_q,
    ceil(n_q / 8)) in ``mask``. Roles: the tail's q, k, v, seq, mask, slopes and head
    stride, the split kernel's k, v and head stride, the combine's out, sinks, LSE and
    slopes."""
    rows = n_q * n_heads
    dt = kernel_dtype(q.dtype)
    split_floats = _at4(plan.workspace_floats(rows, head_dim))
    tail_at = split_floats
    tail_ml_at = tail_at + rows * head_dim
    q_rows_at = tail_at + _at4(rows * (head_dim + 2))
    slopes_at = q_rows_at + _at4(-(-rows * head_dim * q.dtype.itemsize // 4))
    prefix_at = slopes_at + _at4(rows)
    tail_o = workspace.view((rows * head_dim,), np.float32, offset=tail_at * 4)
    tail_ml = workspace.view((rows * 2,), np.float32, offset=tail_ml_at * 4)
    q_rows = workspace.view((rows, head_dim), q.dtype, offset=q_rows_at * 4)
    slopes_rows = workspace.view((rows,), np.float32, offset=slopes_at * 4)
    prefix = workspace.view((1,), np.int32, offset=prefix_at * 4)
    window = features.window
    fp8 = plan.fp8
    # (head_dims past 256: the tail's _d512 twin, 16 elements a lane)
    wide_rows = WIDE_ROWS_HEAD_DIM if head_dim > NARROW_ROWS_HEAD_DIM else 0
    tail_spec = KernelSpec("verify", dt, wide_rows, fp8=fp8, features=bits & TAIL_FEATURES)
    tail_args = (
        q, k, v, tail_o, tail_ml, q_rows, slopes_rows, prefix, np.int32(n_heads),
        np.int32(n_kv_heads), np.int32(head_dim), np.int32(n_q), np.int32(seq_len), seq_len_dev,
        mask, np.int32(mask_mode), kv_scales, np.float32(features.scale),
        np.float32(features.cap), np.int32(window), features.slopes,
        np.int64(features.head_stride),
    )  # fmt: skip
    tail_roles: Roles = (
        *QKV, *(((12, "seq"),) if seq_len_dev is None else ()), (14, "mask"), (20, "slopes"),
        (21, "heads"),
    )  # fmt: skip
    group_rows = n_q * (n_heads // n_kv_heads)
    tail = Launch(tail_spec, (n_kv_heads, -(-group_rows // VERIFY_ROWS), 1), VERIFY_ROWS * 32,
                  tail_args, roles=tail_roles)  # fmt: skip
    # the split kernel: the window less the queries (its first token is the last query's)
    split_window = max(0, window - n_q) if bits & F_WINDOW else 0
    split_values = FeatureArgs(
        features.scale, features.cap, split_window, slopes_rows, head_stride=features.head_stride
    )
    split = split_launches(
        plan, q_rows, k, v, out, workspace.view((split_floats,), np.float32), n_heads=rows,
        n_kv_heads=n_kv_heads, head_dim=head_dim, seq_len=max(seq_len - n_q, 0),
        seq_len_dev=prefix, features=split_values, kv_scales=kv_scales,
    )[0]  # fmt: skip
    split_roles = tuple(pair for pair in split.roles if pair[1] in ("k", "v", "heads"))
    n_partial = rows * plan.splits
    ws_ml = workspace.view((n_partial * 2,), np.float32, offset=n_partial * head_dim * 4)
    combine_spec = KernelSpec("vcombine", dt, features=bits & VCOMBINE_FEATURES)
    combine_args = (
        out, workspace, ws_ml, tail_o, tail_ml, np.int32(head_dim), prefix,
        np.int32(plan.splits), np.int32(plan.tile), np.int32(n_heads), np.int32(n_kv_heads),
        np.int32(n_q), np.int32(split_window), features.sinks, features.lse, features.slopes,
    )  # fmt: skip
    combine = Launch(
        combine_spec, (rows, -(-head_dim // 32), 1), COMBINE_THREADS, combine_args,
        early=planner.OVERRIDES.early_combine,
        roles=((0, "out"), (13, "sinks"), (14, "lse"), (15, "slopes")),
    )  # fmt: skip
    # the split kernel launched early behind the tail (programmatic dependent launch): the
    # tensor-core kernels wait for the tail's writes in fx_tc_block
    early = planner.OVERRIDES.early_combine and split.spec.tensor_cores
    return [tail, Launch(split.spec, split.grid, split.block, split.args, split.shared_mem,
                         split.cluster, early, split_roles), combine]  # fmt: skip
