"""``python -m ferrox_driver info|demo|bench``."""

from .cli import main

raise SystemExit(main(prog="python -m ferrox_driver"))
