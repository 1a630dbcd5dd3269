"""Floor 3: planning and launching one decode: checks, the pure planner, records, entry points."""
