"""A researcher's own outer-loop strategy, named in the job config and run unchanged."""
