"""What a training script calls inside a site: the session, its rounds, its shards.

``from site_client.trainer import SiteSession`` (the name scripts have always used) loads the
session on first use, like ``from site_client import SiteSession``.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name in ("SiteSession", "Round"):
        import site_client

        return getattr(site_client, name)
    raise AttributeError(f"module 'site_client.trainer' has no attribute {name!r}")
