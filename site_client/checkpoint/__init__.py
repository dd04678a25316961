"""Site checkpoints with torch.distributed.checkpoint: local folder or object storage."""
