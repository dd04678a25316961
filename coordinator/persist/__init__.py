"""Durable state: checkpoints (local folder or object storage), theta files, the disk."""
