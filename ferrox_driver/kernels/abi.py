"""The split and parity kernels' argument layouts, as the host packs them: the features'
run-time values (``FeatureArgs``), one launch of a decode (``Launch``: a kernel spec, its grid
and arguments) and the argument slots a launch record rewrites per call (``Roles``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..driver.device import Device
from ..driver.launch import Kernel, PackedLaunch
from ..driver.memory import DeviceArray
from .catalogue import split_kernel
from .spec import KernelSpec
from .traits import F_ALIBI, F_CAP, F_HND, F_LSE, F_SCALE, F_SINKS, F_WINDOW

__all__ = [
    "CLUSTER_FEATURE_ROLES",
    "COMBINE_FEATURE_ROLES",
    "F_HND",
    "QKV",
    "SPLIT_FEATURE_ROLES",
    "SEQ_SLOT",
    "FeatureArgs",
    "Launch",
    "Roles",
    "feature_args",
    "feature_bits",
    "feature_bits_of",
    "is_aligned",
    "roles_at",
]

Roles = tuple[tuple[int, str], ...]  # (argument index, role) pairs
QKV: Roles = ((0, "q"), (1, "k"), (2, "v"))
# Where each launch's host seq_len sits in its arguments (the role "seq" when the length is
# on the host): after q, k, v, the output or workspace and the head counts, as the kernels'
# signatures in cuda_src declare them (a CUDA-core kernel takes head_dim before it)
SEQ_SLOT = {"cluster": 6, "tensor_cores": 7, "cuda_cores": 8, "combine": 4, "parity": 7}


@dataclass(frozen=True)
class FeatureArgs:
    """The run-time values of a decode's features, as its kernels take them: the split
    kernel's (scale, cap, window, ALiBi slopes, a head-major cache's head stride) and the
    combine kernel's (window, sinks, the LSE output); device arrays of float32 per query
    head, or None."""

    scale: float
    cap: float = 1.0
    window: int = 0
    slopes: DeviceArray | None = None
    sinks: DeviceArray | None = None
    lse: DeviceArray | None = None
    head_stride: int = 0  # F_HND: elements from one KV head's rows to the next's

    def split_args(self) -> tuple[Any, ...]:
        return (np.float32(self.scale), np.float32(self.cap), np.int32(self.window), self.slopes,
                np.int64(self.head_stride))  # fmt: skip

    def combine_args(self) -> tuple[Any, ...]:
        return (np.int32(self.window), self.sinks, self.lse)

    def cluster_args(self) -> tuple[Any, ...]:  # a cluster plan's split kernel: all of them
        return (*self.split_args(), self.sinks, self.lse)


# The feature values a launch record may rewrite per call (the per-head arrays, the LSE
# output, a head-major cache's head stride), by offset into ``split_args``,
# ``combine_args`` and ``cluster_args``: roles a record takes where its calls change them
SPLIT_FEATURE_ROLES: Roles = ((3, "slopes"), (4, "heads"))
COMBINE_FEATURE_ROLES: Roles = ((1, "sinks"), (2, "lse"))
CLUSTER_FEATURE_ROLES: Roles = (*SPLIT_FEATURE_ROLES, (5, "sinks"), (6, "lse"))


def roles_at(start: int, roles: Roles) -> Roles:
    """``roles`` of values appended at argument ``start``."""
    return tuple((start + offset, role) for offset, role in roles)


def feature_bits(window: bool, cap: bool, alibi: bool, sinks: bool, lse: bool, scale: bool) -> int:
    """The F_* bits of a decode's features."""
    bits = (F_WINDOW, F_CAP, F_ALIBI, F_SINKS, F_LSE, F_SCALE)
    return sum(b for b, on in zip(bits, (window, cap, alibi, sinks, lse, scale), strict=True) if on)


def feature_bits_of(feats: Any) -> int:
    """The F_* bits of validated features (features.Features)."""
    return feature_bits(
        feats.sliding_window is not None, feats.logits_soft_cap is not None,
        feats.alibi_slopes is not None, feats.sinks is not None, feats.return_lse,
        feats.scale is not None,
    )  # fmt: skip


def feature_args(
    feats: Any, head_dim: int, *, slopes: DeviceArray | None = None,
    sinks: DeviceArray | None = None, lse: DeviceArray | None = None,
) -> tuple[int, FeatureArgs]:  # fmt: skip
    """The F_* bits and the kernels' values of validated features (features.Features) for
    ``head_dim``, with the per-head device arrays the kernels read (None: not used)."""
    values = FeatureArgs(
        scale=feats.score_scale(head_dim), cap=feats.logits_soft_cap or 1.0,
        window=feats.sliding_window or 0, slopes=slopes, sinks=sinks, lse=lse,
    )  # fmt: skip
    return feature_bits_of(feats), values


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a decode: the kernel (``spec``), its grid, block, arguments,
    dynamic shared memory, cluster size, whether it starts early (programmatic dependent
    launch), and which arguments are the call's q, k, v, out and seq_len (``roles``: a
    launch record rewrites those per call)."""

    spec: KernelSpec
    grid: tuple[int, int, int]
    block: int
    args: tuple[Any, ...]
    shared_mem: int = 0
    cluster: int = 0
    early: bool = False
    roles: Roles = ()

    @property
    def kernel(self) -> str:
        """The kernel's name (the symbol a module exports)."""
        return self.spec.name

    @property
    def file(self) -> str:
        return self.spec.file

    def kernel_for(self, device: Device) -> Kernel:
        """The kernel this launch names, loaded on ``device``."""
        return split_kernel(self.spec, device)

    def run(self, stream: Any, device: Device, kernel: Kernel | None = None) -> None:
        """Queue this launch on ``stream`` (``kernel``: a variant with the same parameters
        in place of the named one, for experiments)."""
        self.packed(stream, device, kernel)()

    def packed(self, stream: Any, device: Device, kernel: Kernel | None = None) -> PackedLaunch:
        """This launch packed once for ``stream`` (see ``PackedLaunch``)."""
        return PackedLaunch(
            kernel or self.kernel_for(device),
            self.grid,
            self.block,
            self.args,
            shared_mem=self.shared_mem,
            stream=stream,
            cluster=self.cluster,
            early=self.early,
        )


def is_aligned(*arrays: DeviceArray) -> bool:
    """True when every array starts on a 16-byte boundary (needed for vector loads)."""
    return all(a.ptr % 16 == 0 for a in arrays)
