"""A site's trainer for ``python -m bench.sync``: the residual Linear stack, H cheap inner
steps per round, and the two moments the benchmark measures, per round, in
``run_dir/sync_times.jsonl``: when the inner steps ended and when theta_{r+1} was loaded."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file by the launcher: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from bench.sync import residual_stack
from site_client.trainer.session import SiteSession


def main() -> None:
    torch.set_num_threads(1)
    session = SiteSession(backend="gloo")
    kwargs = session.job_config.get("model", {}).get("kwargs", {})
    model = residual_stack(**kwargs)
    mesh = init_device_mesh("cpu", (session.world_size,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    width = kwargs.get("width", 64)
    out = session.run_dir / "sync_times.jsonl"
    for rnd in session.rounds(model, optimizer):
        loaded = time.time()
        for step in rnd.steps():
            g = torch.Generator().manual_seed(rnd.number * 1000 + step)
            x = torch.randn(2, width, generator=g)
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        ended = time.time()
        if session.rank == 0:
            record = {"round": rnd.number, "loaded_wall": loaded, "steps_end_wall": ended}
            with open(out, "a") as f:
                f.write(json.dumps(record) + "\n")
    if session.rank == 0:
        with open(out, "a") as f:
            f.write(json.dumps({"round": session.final.round, "loaded_wall": time.time()}) + "\n")
    session.close()


if __name__ == "__main__":
    main()
