"""The round engine: open, count, decide, fold, step, publish, recover.

The pure rules live in ``rules``; ``driver`` applies them on each tick; ``close`` is the
pipeline a decided round runs top to bottom; ``recovery`` rebuilds a round in flight at start."""
