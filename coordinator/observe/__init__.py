"""What an operator sees: status, the status page, metrics, server-side evaluation."""
