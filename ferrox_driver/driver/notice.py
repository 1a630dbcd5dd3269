"""A notice on stderr for work that turns out slow (a first compile), silent for quick work."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator


@contextlib.contextmanager
def announce(message: str, after: float = 1.0) -> Iterator[None]:
    """Say ``message`` on stderr if the block is still running after ``after`` seconds,
    with a spinner and the elapsed time redrawn in place on a terminal, and how long it
    took once it ends. Quick blocks say nothing."""
    stream = sys.stderr
    done = threading.Event()
    shown = threading.Event()
    start = time.perf_counter()
    tty = hasattr(stream, "isatty") and stream.isatty()

    def watch() -> None:
        if done.wait(after):
            return
        shown.set()
        frames = "|/-\\"
        i = 0
        while True:
            elapsed = time.perf_counter() - start
            if tty:
                stream.write(f"\r{message} {frames[i % 4]} {elapsed:4.0f}s")
            elif i == 0:
                stream.write(f"{message}\n")
            stream.flush()
            i += 1
            if done.wait(0.25):
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        if shown.is_set():
            elapsed = time.perf_counter() - start
            stream.write(f"{chr(13) if tty else ''}{message} done in {elapsed:.1f}s\n")
            stream.flush()
