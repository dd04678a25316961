"""Coordinator shards: processes (or hosts) that each own some of the model's tensors.

A shard receives its part of every update, keeps it durable, and steps its tensors when the
lead tells it which parts a closed round folds and in which order; it never decides anything.
See docs/design/sharded-coordinator.md.
"""
