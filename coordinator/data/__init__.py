"""Data modes: federated (each site its own data) and shared (units with backup copies)."""
