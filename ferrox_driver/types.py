"""Names for the kinds of argument ferrox takes. Each is checked at run time, with an error
naming the argument; a type checker lets anything through them, since the libraries they
cover (PyTorch, CuPy, JAX...) are optional."""

from __future__ import annotations

from typing import Any, TypeAlias

__all__ = [
    "ArrayLike",
    "DTypeLike",
    "DeviceArrayLike",
    "DeviceLike",
    "HostArrayLike",
    "KernelArg",
    "StreamLike",
]

DeviceArrayLike: TypeAlias = Any
"""A ferrox `DeviceArray`, a PyTorch tensor or CuPy array on the GPU, or any object with
`__dlpack__` or `__cuda_array_interface__`; C-contiguous."""

HostArrayLike: TypeAlias = Any
"""A numpy array (or anything `numpy.asarray` takes) in host memory."""

ArrayLike: TypeAlias = Any
"""A `HostArrayLike` or a `DeviceArrayLike`."""

StreamLike: TypeAlias = Any
"""A ferrox `Stream`, any object with `__cuda_stream__` (cuda.core, PyTorch, CuPy), a
PyTorch or CuPy stream, an int handle, or None (the legacy default stream; with PyTorch
tensors among the arrays, PyTorch's current stream on their device)."""

DeviceLike: TypeAlias = Any
"""A ferrox `Device`, an int ordinal, a `torch.device("cuda", i)`, a string `"cuda:i"`, or
None (the default: device 0). `"cuda"` with no index is PyTorch's current device."""

DTypeLike: TypeAlias = Any
"""A numpy dtype or scalar type, `ml_dtypes.bfloat16`, a name such as `"bf16"`, `"f16"`,
`"float32"`, or a torch dtype."""

KernelArg: TypeAlias = Any
"""A kernel argument: a `DeviceArrayLike` (its pointer), a numpy scalar such as
`numpy.int32(n)` (its C value), or None (a null pointer)."""
