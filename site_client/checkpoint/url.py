"""``--checkpoint-url``: checked before anything starts, without importing torch.

``s3://BUCKET[/PREFIX]`` keeps the site's checkpoints in object storage under
``PREFIX/SITE/`` (``site_client.checkpoint.s3_layout``); the endpoint and credentials come from the
usual AWS variables, as for the coordinator's ``[storage] url``. Every refusal is one line
naming the flag and what is wrong or missing.
"""

from __future__ import annotations

from site_client.checkpoint.s3_layout import SiteBucket, site_bucket


class CheckpointUrlError(ValueError):
    """The URL cannot hold this site's checkpoints; the message says why, in one line."""


def open_checkpoint_url(url: str, site: str) -> tuple[object, SiteBucket]:
    """A boto3 client and the site's folder under ``url``, once the bucket has answered."""
    from wire.config_table import ConfigError
    from wire.objstore.config import StorageConfig, check_storage, parse_url, s3_client

    where = f"--checkpoint-url {url}"
    parsed = parse_url(url)
    if parsed is None:
        raise CheckpointUrlError(f"{where}: expected s3://BUCKET[/PREFIX]")
    cfg = StorageConfig(url=url)
    try:
        check_storage(cfg, where=where)
    except ConfigError as exc:
        raise CheckpointUrlError(str(exc)) from None
    try:
        place = site_bucket(*parsed, site)
    except ValueError as exc:
        raise CheckpointUrlError(f"{where}: {exc}") from None
    client = s3_client(cfg)
    try:
        client.head_bucket(Bucket=place.bucket)
    except Exception as exc:  # botocore's errors: no such bucket, refused, unreachable
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointUrlError(f"{where}: bucket {place.bucket!r} not reachable: {why}") from None
    return client, place
