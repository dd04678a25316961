"""The outer sync of a round, end to end, against a gloo all-reduce of the same bytes.

::

    python -m bench.sync [--sizes 5m,50m] [--codecs fp32,int8] [--rounds 8] [--warm-up 3]
                         [--keep DIR]

For each model size (a residual Linear stack) and codec (raw float32 both ways, or int8 up and
down), a real ``coordinator serve`` and two ``siteclient start`` sites (one FSDP2 trainer each,
AdamW, site checkpoints every round) run a DiLoCo job on loopback over mutual TLS. A site's
*outer sync* is the time from the end of its last inner step of round r to theta_{r+1} loaded
into its model; the table gives the median over rounds and sites, the first ``--warm-up``
rounds left out (a job's steady state: from the fourth, each site checkpoint is written over
the files of one pruned before), next to a gloo all-reduce of
the same float32 bytes between two processes measured in the same run (about what torchft's
DiLoCo sync costs) and the floor of the transport: the same bytes up and down over mutual-TLS
gRPC with nothing else done to them (``bench.sync_floor``). Then where the time went: the
trainers' hand-off and load, the agents' push and fetch, and the coordinator's close (from the
event log). Then the fixed cost: the round
period of a 1 MiB model with the default timeouts (5 s heartbeats). Memory: the coordinator's
peak RSS above what a process importing it holds, over the fp32 model size. Last line::

    sync_vs_allreduce_50m=... sync_vs_allreduce_5m=... floor_vs_allreduce_50m=...
    floor_vs_allreduce_5m=... sync_vs_floor_50m=... sync_vs_floor_5m=... round_1mib_s=...
    coord_rss_over_model=...

(one line).
"""

from __future__ import annotations

import torch

SIZES = {"1m": (512, 1), "5m": (1024, 5), "50m": (2048, 12), "200m": (4096, 12)}


class ResidualStack(torch.nn.Module):
    """``x + relu(W_i x + b_i)`` for each layer: parameters ~ depth * width^2."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.relu(layer(x))
        return x


def residual_stack(width: int = 64, depth: int = 2) -> torch.nn.Module:
    return ResidualStack(width, depth)


if __name__ == "__main__":
    import sys

    from bench.sync_run import main

    sys.exit(main())
