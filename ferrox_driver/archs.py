"""The GPU architectures ferrox_driver supports: the minimum compute capability, and each
checked architecture's limits as a planner and an occupancy calculator need them.

A real device's numbers come from its driver (``decode.launches.device_traits``); this table is
for planning without one (``decode.launches.arch_traits``: the CPU demo, and the CPU test that
plans the benchmark shapes for every architecture here and compiles what the plans pick,
tests/driver/test_arch_support.py). Per-architecture limits as the CUDA programming guide's
"Technical Specifications per Compute Capability" table and CCCL's ``cuda::arch_traits``
give them; multiprocessor counts and L2 sizes of the GPU named.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ARCHS",
    "MIN_COMPUTE_CAPABILITY",
    "ArchLimits",
    "arch_limits",
    "occupancy",
    "supported_archs",
]

# Turing (sm_75: T4, RTX 20xx) and newer. sm_75 has no cp.async and no bf16 or TF32 mma, so
# it runs the CUDA-core kernels only (the planner never picks a tensor-core kernel there);
# older GPUs are refused when a Device opens (CUDA 13 dropped them as well).
MIN_COMPUTE_CAPABILITY = (7, 5)
TENSOR_CORES_FROM = (8, 0)  # cp.async and the bf16/TF32 mma the tensor-core kernels use
FP8_FROM = (8, 9)  # cvt between fp8 and fp16/fp32


@dataclass(frozen=True)
class ArchLimits:
    """One architecture's limits (per multiprocessor unless said) and the GPU whose
    multiprocessor count and L2 size stand for it.

    Attributes:
        arch: the NVRTC target, e.g. ``"sm_86"``.
        gpu: the GPU the counts are of, with others of the architecture.
        compute_capability: (major, minor).
        multiprocessor_count: SMs of ``gpu``.
        shared_per_block: the most shared memory one block may have (static + dynamic,
            opted in), bytes.
        shared_per_sm: shared memory of a multiprocessor, bytes.
        reserved_per_block: shared memory the driver reserves per resident block.
        threads_per_sm, blocks_per_sm: the most resident threads and blocks.
        registers_per_sm: 32-bit registers of a multiprocessor (also the most per block).
        l2_bytes: L2 cache of ``gpu`` (not used by the planner; for the record).
        max_cluster: the largest thread block cluster the planner may ask for (0: none).
        gpc_sms: multiprocessors per GPC, for a model of how many clusters are resident at
            once (a real device answers with cuOccupancyMaxActiveClusters).
    """

    arch: str
    gpu: str
    compute_capability: tuple[int, int]
    multiprocessor_count: int
    shared_per_block: int
    shared_per_sm: int
    reserved_per_block: int
    threads_per_sm: int
    blocks_per_sm: int
    l2_bytes: int
    max_cluster: int = 0
    gpc_sms: int = 0
    registers_per_sm: int = 65536

    @property
    def tensor_cores(self) -> bool:
        """Whether the tensor-core kernels run here (cp.async, bf16 and TF32 mma)."""
        return self.compute_capability >= TENSOR_CORES_FROM

    @property
    def fp8(self) -> bool:
        """Whether fp8 caches can be used here."""
        return self.compute_capability >= FP8_FROM


KiB, MiB = 1024, 1024 * 1024


def _arch(
    arch: str, gpu: str, cc: tuple[int, int], sms: int, shared_sm_kib: int, threads: int,
    blocks: int, l2_mib: int, cluster: int = 0, gpc: int = 0,
) -> ArchLimits:  # fmt: skip
    reserved = KiB if cc >= (8, 0) else 0
    shared_sm = shared_sm_kib * KiB
    return ArchLimits(
        arch, gpu, cc, sms, shared_sm - reserved, shared_sm, reserved, threads, blocks,
        l2_mib * MiB, cluster, gpc,
    )  # fmt: skip


ARCHS: dict[str, ArchLimits] = {
    a.arch: a
    for a in (
        _arch("sm_75", "Tesla T4 (RTX 20xx, Quadro RTX)", (7, 5), 40, 64, 1024, 16, 4),
        _arch("sm_80", "A100 (A30, A800)", (8, 0), 108, 164, 2048, 32, 40),
        _arch("sm_86", "RTX 3090 (RTX 30xx, A40, A10, RTX A6000)", (8, 6), 82, 100, 1536, 16, 6),
        _arch("sm_89", "RTX 4090 (RTX 40xx, L40S: 142 SMs, L4)", (8, 9), 128, 100, 1536, 24, 72),
        _arch("sm_90", "H200 (H100, GH200)", (9, 0), 132, 228, 2048, 32, 60, 16, 17),
        _arch("sm_100", "B200 (GB200)", (10, 0), 148, 228, 2048, 32, 126, 16, 18),
        # clusters of up to 8 (the portable size; larger ones not checked)
        _arch("sm_120", "RTX 5090 (RTX 50xx, RTX PRO)", (12, 0), 170, 100, 1536, 24, 96, 8, 16),
    )
}


def supported_archs() -> tuple[str, ...]:
    """The architectures of ARCHS (checked by tests/driver/test_arch_support.py), oldest first."""
    return tuple(ARCHS)


def arch_limits(arch: str) -> ArchLimits:
    """The limits of ``arch`` (one of ``supported_archs()``).

    Raises:
        ValueError: another architecture.
    """
    found = ARCHS.get(arch)
    if found is None:
        raise ValueError(
            f"arch: expected one of {', '.join(ARCHS)} (the architectures ferrox_driver plans "
            f"for without a GPU), got {arch!r}"
        )
    return found


def occupancy(
    limits: ArchLimits, threads: int, dynamic_shared: int, registers: int, static_shared: int
) -> int:
    """Blocks of ``threads`` threads, each with ``registers`` registers a thread and
    ``static_shared`` + ``dynamic_shared`` bytes of shared memory, resident at once on one
    multiprocessor of ``limits`` (as cuOccupancyMaxActiveBlocksPerMultiprocessor counts,
    registers allocated per warp in units of 256); 0 where one block does not fit."""
    shared = static_shared + dynamic_shared
    warps = -(-threads // 32)
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    if shared > limits.shared_per_block or warps * per_warp > limits.registers_per_sm:
        return 0
    per_block = shared + limits.reserved_per_block
    by_shared = limits.shared_per_sm // per_block if per_block else limits.blocks_per_sm
    by_registers = limits.registers_per_sm // (warps * per_warp)
    by_threads = limits.threads_per_sm // (warps * 32)
    return max(0, min(by_shared, by_registers, by_threads, limits.blocks_per_sm))
