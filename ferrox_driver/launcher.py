"""``python -m ferrox_driver.launcher -n N script.py``: the rank launcher's documented
command, kept at the top level; the launcher lives in `ferrox_driver.parallel.launcher`."""

from __future__ import annotations

import sys

from .parallel.launcher import main

if __name__ == "__main__":
    sys.exit(main())
