"""numpy dtypes by name, ml_dtypes' (bfloat16, float8) made on first use.

ml_dtypes' extension takes most of a second to initialise, which was most of
``import ferrox_driver``; a process that never meets a bf16 or fp8 array should not pay it.
No dtype of ml_dtypes can exist before ml_dtypes is imported, so a table can answer "is this
dtype one of mine?" from its plain numpy dtypes until then, and build its full self once
ml_dtypes is loaded (by the caller, or by a lookup that has to make a dtype).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Generic, TypeVar, overload

import numpy as np

__all__ = ["ML_DTYPE_NAMES", "DTypeTable", "DTypes", "named"]

ML_DTYPE_NAMES = frozenset(("bfloat16", "float8_e4m3fn", "float8_e5m2"))

V = TypeVar("V")


@functools.cache
def named(name: str) -> np.dtype:
    """The numpy dtype called ``name`` (``"float32"``, ``"bfloat16"``, ``"float8_e4m3fn"``...);
    importing ml_dtypes for its own names."""
    if name in ML_DTYPE_NAMES:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def _loaded() -> bool:
    return "ml_dtypes" in sys.modules


class DTypeTable(Mapping[np.dtype, V], Generic[V]):
    """A dict keyed by numpy dtypes, given by name. Lookups do not import ml_dtypes;
    iterating does (it has to make the keys)."""

    def __init__(self, by_name: Mapping[str, V]) -> None:
        self._by_name = dict(by_name)
        self._plain = {named(n): v for n, v in self._by_name.items() if n not in ML_DTYPE_NAMES}
        self._full: dict[np.dtype, V] | None = None

    def _table(self) -> dict[np.dtype, V]:
        if self._full is not None:
            return self._full
        if not _loaded():
            return self._plain  # no dtype of ml_dtypes exists yet
        self._full = {named(n): v for n, v in self._by_name.items()}
        return self._full

    def __getitem__(self, dtype: np.dtype) -> V:
        return self._table()[dtype]

    def __contains__(self, dtype: object) -> bool:
        return dtype in self._table()

    def __iter__(self) -> Iterator[np.dtype]:
        return iter([named(n) for n in self._by_name])

    def __len__(self) -> int:
        return len(self._by_name)

    def __repr__(self) -> str:
        return f"DTypeTable({self._by_name!r})"


class DTypes(Sequence[np.dtype]):
    """A tuple of numpy dtypes, given by name. ``in`` does not import ml_dtypes; an item
    of ml_dtypes does when it is read."""

    def __init__(self, *names: str) -> None:
        self.names = names
        self._plain = tuple(named(n) for n in names if n not in ML_DTYPE_NAMES)
        self._full: tuple[np.dtype, ...] | None = None

    def _all(self) -> tuple[np.dtype, ...]:
        if self._full is None:
            self._full = tuple(named(n) for n in self.names)
        return self._full

    def __contains__(self, dtype: object) -> bool:  # (on an fp8 cache's append path)
        full = self._full
        if full is not None:
            return dtype in full
        return dtype in (self._all() if _loaded() else self._plain)

    @overload
    def __getitem__(self, index: int) -> np.dtype: ...
    @overload
    def __getitem__(self, index: slice) -> DTypes: ...
    def __getitem__(self, index: int | slice) -> np.dtype | DTypes:
        if isinstance(index, slice):
            return DTypes(*self.names[index])
        return named(self.names[index])

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"DTypes{self.names!r}"
