"""The isthmus site side: the agent, its CLI and the API a training script calls.

A training script needs three names, importable from here::

    from site_client import SiteSession, Round, SiteLoop

They load on first use, so the agent and the CLI start without importing the trainers' parts.
"""

from __future__ import annotations

import importlib

_PUBLIC = {
    "SiteSession": "site_client.trainer.session",
    "Round": "site_client.trainer.round",
    "SiteLoop": "site_client.trainer.loop",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'site_client' has no attribute {name!r}")
