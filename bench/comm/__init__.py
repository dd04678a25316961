"""Pieces of ``python -m bench.comm_efficiency``: the training runs and their report."""
