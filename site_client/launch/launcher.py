"""Starting the site's trainers with torch's own elastic launcher (the engine of torchrun).

The launch flags are torchrun's, parsed by torchrun's own parser, so ``--nproc-per-node``,
``--nnodes``, ``--node-rank``, ``--rdzv-backend``, ``--rdzv-endpoint``, ``--max-restarts``,
``--log-dir`` and the rest mean exactly what they mean there; a multi-node site uses its
rendezvous, and a crashed trainer restarts the worker group within the restart budget.

Two defaults differ from torchrun's, so that a failure can say its cause
(``site_client.launch.trainer_failure``): each rank's stderr is also copied to a file under the
site's
run folder (``--tee 2 --log-dir RUN_DIR/trainer_logs``, unless the flags say otherwise), and a
worker group that failed with a usage error (exit 2) is not restarted.
"""

from __future__ import annotations

import argparse
import os
import uuid
from pathlib import Path

import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, get_args_parser, parse_min_max_nnodes

from site_client.launch.trainer_failure import (
    block,
    failures_of,
    headline,
    last_attempt,
    restartable,
)

DEFAULT_MAX_RESTARTS = 3


class LaunchError(ValueError):
    """Launch flags that torchrun's parser refused."""


class TrainersFailed(RuntimeError):
    """The trainers failed for good; ``report`` is the block that says why, and the message
    its first line."""

    def __init__(self, message: str, report: str) -> None:
        super().__init__(message)
        self.report = report


class _SiteAgent(LocalElasticAgent):
    """torchrun's agent, except that a usage error is not restarted."""

    def _monitor_workers(self, worker_group):
        result = super()._monitor_workers(worker_group)
        codes = [f.exitcode for f in result.failures.values()]
        if result.is_failed() and not restartable(codes):
            self._remaining_restarts = 0
        return result


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


def node_count(args: argparse.Namespace) -> int:
    """How many hosts the site's trainers span at most (``--nnodes N`` or ``MIN:MAX``)."""
    return parse_min_max_nnodes(args.nnodes)[1]


def nproc_per_node(args: argparse.Namespace) -> int:
    value = str(args.nproc_per_node)
    return int(value) if value.isdigit() else 0


def run_trainers(args: argparse.Namespace, site: str, log_dir: Path) -> None:
    """Run the trainers to completion.

    Raises
    ------
    TrainersFailed
        The restart budget is spent, or a rank made a usage error; with the cause.
    """
    if args.log_dir is None:
        args.log_dir = str(log_dir)
    if args.tee == "0" and args.redirects == "0":
        args.tee = "2"  # stderr to the console and to a file the failure report reads
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    config, entrypoint, cmd_args = config_from_args(args)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # launch_agent builds the agent by this module-level name; there is no parameter for it.
    launcher_api.LocalElasticAgent = _SiteAgent
    try:
        elastic_launch(config, entrypoint)(*cmd_args)
    except ChildFailedError as exc:
        attempt, attempts = last_attempt(Path(args.log_dir), config.run_id)
        first, *others = failures_of(exc, attempt)
        report = block(site, first, others, attempts)
        raise TrainersFailed(headline(first), report) from exc
    finally:
        launcher_api.LocalElasticAgent = LocalElasticAgent
