"""The benchmark harness and its reports (`python -m ferrox_driver bench`)."""
