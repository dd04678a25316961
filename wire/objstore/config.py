"""The ``[storage]`` table and the S3 client both sides build from it.

``url = "s3://BUCKET/PREFIX"`` names S3-compatible object storage (needs the ``s3`` extra,
``pip install 'isthmus[s3]'``); ``""`` is the local state folder::

    [storage]
    url = "s3://my-bucket/jobs/gpt"   # checkpoints under jobs/gpt/checkpoints/
    endpoint_url = ""                 # "": AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL / AWS config
    multipart_mib = 64                # objects above this go as multipart uploads (>= 5)

Credentials come from the usual AWS variables or files (``AWS_ACCESS_KEY_ID`` and
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ``~/.aws``); ``check_storage`` refuses a start
without them, in one line naming what is missing, before any state is touched. The coordinator
keeps its checkpoints there (``coordinator.persist.open_store``), a site its own
(``siteclient start --checkpoint-url``, ``site_client.checkpoint.url``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from wire.config_table import ConfigError, positive, setting

BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
MIN_PART_MIB = 5  # S3's smallest part (every part but the last); SeaweedFS enforces it too


def check_url(url: str) -> str | None:
    """``s3://BUCKET[/PREFIX]``, or ``""`` for the local state folder"""
    if url == "":
        return None
    if parse_url(url) is None:
        return "expected 's3://BUCKET[/PREFIX]' (or \"\": the local state folder)"
    return None


def check_part(mib: int) -> str | None:
    return None if mib >= MIN_PART_MIB else f"must be >= {MIN_PART_MIB} (S3's smallest part)"


check_part.__doc__ = f"must be >= {MIN_PART_MIB} (S3's smallest part)"


def parse_url(url: str) -> tuple[str, str] | None:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b")``; None if it is not such a URL."""
    if not url.startswith("s3://"):
        return None
    bucket, _, prefix = url[len("s3://") :].partition("/")
    prefix = prefix.strip("/")
    if not BUCKET_NAME.match(bucket) or ".." in bucket:
        return None
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        return None
    return bucket, prefix


@dataclass(frozen=True)
class StorageConfig:
    """The ``[storage]`` table (see the module docstring)."""

    url: str = setting(
        "",
        check=check_url,
        help="``s3://BUCKET[/PREFIX]``: the coordinator's checkpoints, start epoch and event log "
        'in S3-compatible object storage (the ``s3`` extra). ``""``: the state folder',
    )
    endpoint_url: str = setting(
        "",
        help='the S3 endpoint. ``""``: ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, the AWS '
        "config file, else AWS S3 in ``AWS_REGION``",
    )
    multipart_mib: int = setting(
        64,
        check=[positive, check_part],
        help="objects above this many MiB go as multipart uploads, in parts of this size",
    )

    @property
    def remote(self) -> bool:
        return self.url != ""


def endpoint_of(cfg: StorageConfig) -> str | None:
    """The endpoint named by the table or the environment; None: botocore's own resolution
    (an ``endpoint_url`` in the AWS config file, else AWS S3 for the region)."""
    for value in (
        cfg.endpoint_url,
        os.environ.get("AWS_ENDPOINT_URL_S3", ""),
        os.environ.get("AWS_ENDPOINT_URL", ""),
    ):
        if value:
            return value
    return None


def region_of(session) -> str | None:
    """The session's region (``AWS_DEFAULT_REGION``, the config file), else ``AWS_REGION``."""
    return session.region_name or os.environ.get("AWS_REGION") or None


def check_storage(cfg: StorageConfig, where: str | None = None) -> None:
    """Refuse an object store that cannot be reached for want of a setting (``ConfigError``,
    one line naming the variable or key, after ``where``: the setting that named the store);
    nothing for the local state folder."""
    if not cfg.remote:
        return
    where = where or f"storage.url = {cfg.url!r}"
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if bool(key) != bool(secret):
        missing = "AWS_SECRET_ACCESS_KEY" if key else "AWS_ACCESS_KEY_ID"
        raise ConfigError(f"{where}: {missing} is not set (the other half of the key is)")
    try:
        import boto3
    except ImportError:
        raise ConfigError(f"{where}: needs boto3: pip install 'isthmus[s3]'") from None
    session = boto3.session.Session()
    if session.get_credentials() is None:
        raise ConfigError(
            f"{where}: no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(or AWS_PROFILE with ~/.aws/credentials)"
        )
    scoped = session._session.get_scoped_config()
    if endpoint_of(cfg) is None and not scoped.get("endpoint_url") and not region_of(session):
        raise ConfigError(
            f"{where}: no endpoint: set AWS_ENDPOINT_URL (or storage.endpoint_url) for "
            "S3-compatible storage, or AWS_REGION for AWS S3 itself"
        )


def s3_client(cfg: StorageConfig):
    import boto3
    from botocore.config import Config

    endpoint = endpoint_of(cfg)
    config = Config(
        retries={"max_attempts": 5, "mode": "standard"},
        connect_timeout=10,
        read_timeout=120,
        s3={"addressing_style": "path"} if endpoint else {},
    )
    session = boto3.session.Session()
    return session.client(
        "s3", endpoint_url=endpoint, region_name=region_of(session), config=config
    )
