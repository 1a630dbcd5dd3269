"""Compile a kernel with NVRTC, read its resource report, and (with a GPU) launch and time it.

Runs without a GPU too: compiling needs only NVRTC. Exits non-zero when a check fails.
"""

import sys

import numpy as np

import ferrox_driver as fd

SOURCE = r"""
extern "C" __global__ void scale(float a, const float* x, float* y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i];
}
"""

program = fd.compile_source(SOURCE, arch="sm_90", name="scale.cu")
print(f"compiled for {program.arch}: {len(program.cubin)} bytes of cubin")
report = program.resources.get("scale")  # from ptxas's report in the NVRTC log
if report is None:  # (seen under compute-sanitizer: NVRTC's log came back empty)
    print("scale: NVRTC gave no resource report")
else:
    print(
        f"scale: {report.registers} registers, {report.stack_bytes} bytes stack, "
        f"{report.spill_stores + report.spill_loads} bytes spilled"
    )
    if report.stack_bytes or report.spill_stores:
        sys.exit("unexpected local memory use")

if not fd.cuda_available():
    print("no GPU here: compiled only")
    sys.exit(0)

module = fd.ensure_module_loaded(SOURCE, "scale.cu", "scale")  # compiled once, cached
kernel = module.get_function("scale")
n = 1 << 20
x = np.random.default_rng().standard_normal(n).astype(np.float32)
with fd.Stream() as stream, fd.Event() as start, fd.Event() as end:
    dx = fd.to_device(x, stream)
    dy = fd.empty(n, np.float32)
    start.record(stream)
    kernel.launch((n + 255) // 256, 256, (np.float32(3.0), dx, dy, np.int64(n)), stream=stream)
    end.record(stream)
    y = dy.to_host(stream)
    print(f"launch took {start.elapsed_ms(end) * 1e3:.1f} us")
if not np.allclose(y, 3.0 * x):
    sys.exit("wrong result")
print("result checked against numpy: ok")
