"""The append-only event log, its segments, and the history read back from it."""
