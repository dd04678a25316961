"""Per-shard hand-off (site_client/trainer/shards.py, site_client/agent/update_payload.py) in real
gloo ranks:
no rank materialises the whole model, for FSDP2 and for FSDP2 with tensor parallelism on a
2-D mesh, and what the ranks hand over is exactly theta_r - theta_local."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from coordinator.intake.spool import UpdateSpool
from coordinator.intake.uploads import check_update_manifest
from coordinator.round.accumulate import fold_into
from site_client.agent.update_payload import build_payload
from wire.codecs import CodecState
from wire.digest import state_digest
from wire.safetensors_io import write_tensors

pytestmark = pytest.mark.e2e
WIDTH = 512  # two 512x512 layers: about 2 MiB of parameters


def build(width: int = WIDTH) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)
    )


def theta_r() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {k: torch.randn(v.shape, generator=g) for k, v in build().state_dict().items()}


def local_step(model: torch.nn.Module, rank: int) -> None:
    """Stand-in for inner steps: every rank moves its own shards by a rank-dependent amount."""
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(0.01 * (rank + 1)) if hasattr(p, "to_local") else p.add_(0.01)


class AllocationCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of every new storage torch ops create while it is active (an upper bound of what
    is held at once)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":  # meta: no memory
                continue
            if t.untyped_storage().data_ptr() not in seen:
                self.bytes += t.untyped_storage().nbytes()
                seen.add(t.untyped_storage().data_ptr())
        return out


def _worker(rank: int, world: int, port: int, folder: str, tp: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from site_client.trainer.shards import load_pieces, local_pieces, write_update
    from wire.safetensors_io import map_tensors

    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = build()
    if tp:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    else:
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    theta = map_tensors(Path(folder) / "theta.safetensors")
    pieces = local_pieces(model, rank)
    counter = AllocationCounter()
    with counter:
        wrong = load_pieces(pieces, theta)
    full = {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()
    }
    loaded_hash = state_digest(full).hex()
    local_step(model, rank)
    full_after = {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()
    }
    with counter:
        write_update(pieces, theta, Path(folder) / f"update-rank{rank}.safetensors")
    if rank == 0:
        torch.save({k: v.clone() for k, v in full_after.items()}, Path(folder) / "after.pt")
    report = {"wrong": wrong, "allocated": counter.bytes, "loaded_hash": loaded_hash}
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("world", "tp"), [(2, False), (4, True)], ids=["fsdp2", "fsdp2+tp"])
def test_each_rank_moves_only_its_own_shards(tmp_path, world, tp):
    theta = theta_r()
    write_tensors(tmp_path / "theta.safetensors", theta)
    mp.start_processes(
        _worker, args=(world, free_port(), str(tmp_path), tp), nprocs=world, start_method="spawn"
    )
    model_bytes = sum(t.numel() * t.element_size() for t in theta.values())
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r in reports:
        assert r["wrong"] == []  # every rank's shards hold theta's bits
        assert r["loaded_hash"] == state_digest(theta).hex()
        # Loading theta and handing the update back allocated (far) less than the model.
        assert r["allocated"] < 0.05 * model_bytes, r["allocated"]
    files = [tmp_path / f"update-rank{r}.safetensors" for r in range(world)]
    shares = [f.stat().st_size for f in files]
    assert max(shares) < 0.7 * model_bytes and sum(shares) >= model_bytes  # each its own part

    # The agent streams the pieces; the coordinator accepts them and sums exactly theta - local.
    payload = build_payload(files, None, CodecState())
    trainable = sorted(k for k, v in theta.items() if v.is_floating_point())
    check_update_manifest(payload.manifest, theta, trainable)
    data = b"".join(bytes(c) for _, c in payload.chunks(0, 1 << 20))
    spool = UpdateSpool(tmp_path / "spool")
    with spool.open_part(0, "site-0", "u1") as f:
        f.write(data)
    update = spool.commit(0, "site-0", "u1", payload.manifest, 1.0)
    acc = {k: torch.zeros_like(v) for k, v in theta.items()}
    fold_into(acc, update, 1.0)
    after = torch.load(tmp_path / "after.pt")
    for k in theta:
        assert torch.equal(acc[k], theta[k] - after[k]), k


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
