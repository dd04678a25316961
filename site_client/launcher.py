"""Starting the site's trainers with torch's own elastic launcher (the engine of torchrun).

The launch flags are torchrun's, parsed by torchrun's own parser, so ``--nproc-per-node``,
``--nnodes``, ``--node-rank``, ``--rdzv-backend``, ``--rdzv-endpoint``, ``--max-restarts``,
``--log-dir`` and the rest mean exactly what they mean there; a multi-node site uses its
rendezvous, and a crashed trainer restarts the worker group within the restart budget.
"""

from __future__ import annotations

import argparse
import os
import uuid

from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, get_args_parser, parse_min_max_nnodes

DEFAULT_MAX_RESTARTS = 3


class LaunchError(ValueError):
    """Launch flags that torchrun's parser refused."""


def parse_launch_args(flags: list[str], script: str, script_args: list[str]) -> argparse.Namespace:
    parser = get_args_parser()

    def error(message: str):  # one line, raised instead of argparse's exit
        raise LaunchError(message)

    parser.error = error  # type: ignore[method-assign]
    args = parser.parse_args([*flags, script, *script_args])
    if not any(f.startswith(("--max-restarts", "--max_restarts")) for f in flags):
        args.max_restarts = DEFAULT_MAX_RESTARTS
    _, max_nodes = parse_min_max_nnodes(args.nnodes)
    if args.standalone or (max_nodes == 1 and not args.rdzv_endpoint):
        # One node: a private c10d store on a free local port, as torchrun --standalone does.
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    return args


def nproc_per_node(args: argparse.Namespace) -> int:
    value = str(args.nproc_per_node)
    return int(value) if value.isdigit() else 0


def run_trainers(args: argparse.Namespace) -> None:
    """Run the trainers to completion; raises ChildFailedError when the budget is spent."""
    config, entrypoint, cmd_args = config_from_args(args)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    elastic_launch(config, entrypoint)(*cmd_args)
