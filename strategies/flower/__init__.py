"""Adapters that run Flower strategies (classic and Message API) as the outer step."""
