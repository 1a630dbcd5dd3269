"""``python -m ferrox_driver info|demo|bench|cache``."""

from .apps.cli import main

raise SystemExit(main(prog="python -m ferrox_driver"))
