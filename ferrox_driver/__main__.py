"""``python -m ferrox_driver info|demo|bench|cache``."""

from .cli import main

raise SystemExit(main(prog="python -m ferrox_driver"))
