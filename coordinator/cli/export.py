"""``coordinator export``: a kept checkpoint's model as a standalone safetensors file.

Only the standard library loads before the command runs (torch comes with the checkpoint).
"""

from __future__ import annotations

from pathlib import Path

from wire.config_table import ConfigError


class ExportError(Exception):
    """The checkpoint cannot be read; the message says why (printed as one line, exit 2)."""


def add_export_parser(sub) -> None:
    export = sub.add_parser(
        "export", help="write a kept checkpoint's model as a standalone safetensors file"
    )
    export.add_argument("--state-dir", required=True, metavar="DIR", help="the job's state folder")
    export.add_argument("--round", type=int, metavar="N", help="the checkpoint (default: newest)")
    export.add_argument("--out", required=True, metavar="FILE", help="NAME.safetensors to write")
    export.add_argument(
        "--storage-url",
        default="",
        metavar="s3://BUCKET/PREFIX",
        help="read the checkpoints from this object store (the job's [storage] url; endpoint "
        "and credentials from the AWS variables) instead of the state folder",
    )


def run_export(args) -> int:
    from coordinator.persist.export import export_model
    from coordinator.persist.local_store import StoreError
    from coordinator.persist.open_store import open_store
    from wire.objstore.config import StorageConfig, check_url

    if problem := check_url(args.storage_url):
        raise ConfigError(f"--storage-url {args.storage_url}: {problem}")
    try:
        store = None
        if args.storage_url:
            store = open_store(Path(args.state_dir), StorageConfig(args.storage_url), True)
        done = export_model(Path(args.state_dir), Path(args.out), args.round, store)
    except StoreError as exc:
        raise ExportError(str(exc)) from exc
    print(
        f"model of round {done.card.round} (theta {done.card.theta_digest[:12]}) written to "
        f"{done.path}; its [model] table in {done.card_path}"
    )
    return 0
