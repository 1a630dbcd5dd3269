"""ferrox inside other frameworks (optional: each module imports its framework, nothing
else in ferrox_driver imports them)."""
