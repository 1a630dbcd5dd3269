"""A dependency-free progress bar for the command line (stderr, redrawn in place)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], total: int, label: str, width: int = 30) -> Iterator[T]:
    """Yield ``items`` while drawing ``label [#####.....] i/total elapsed`` on stderr."""
    start = last = time.perf_counter()
    stream = sys.stderr
    for i, item in enumerate(items):
        yield item
        done = i + 1
        now = time.perf_counter()
        if now - last < 0.25 and done < total:  # redraw at most 4 times a second
            continue
        last = now
        filled = width * done // max(total, 1)
        elapsed = now - start
        stream.write(
            f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {elapsed:5.1f}s"
        )
        stream.flush()
    stream.write("\n")
    stream.flush()
