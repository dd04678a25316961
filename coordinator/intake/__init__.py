"""Receiving updates: uploads checked chunk by chunk, verified, spooled durably."""
