"""Collectives a site checkpoint's ranks agree through, working without a process group too.

Without ``torch.distributed`` initialised (a plain process loading a checkpoint) every helper
acts as the one rank of a world of one.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException


class SiteCheckpointError(RuntimeError):
    """A site checkpoint is missing, incomplete or corrupt, or could not be written."""


def describe(exc: BaseException) -> str:
    # CheckpointException derives from BaseException and renders every rank's traceback;
    # name the first failure instead.
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, (first, _) = next(iter(sorted(exc.failures.items())))
        return f"rank {rank}: {type(first).__name__}: {first}"
    return f"{type(exc).__name__}: {exc}"


@contextlib.contextmanager
def single_process_ok():
    # Without a process group DCP warns that it assumes one process, which is what we mean.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def world(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def device(group: dist.ProcessGroup | None = None) -> torch.device:
    # NCCL only reduces CUDA tensors; every other backend here takes CPU ones.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_ok(ok: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank when ``ok`` is true on every rank; doubles as a barrier."""
    if not dist.is_initialized():
        return ok
    flag = torch.tensor([1 if ok else 0], device=device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def run_on_rank0(fn, where: Path, group: dist.ProcessGroup | None = None) -> None:
    """Run ``fn`` on rank 0 and make every rank raise if it failed."""
    error = None
    if rank(group) == 0:
        try:
            fn()
        except Exception as exc:
            error = exc
    if not all_ok(error is None, group):
        why = describe(error) if error else "failed on rank 0"
        raise SiteCheckpointError(f"cannot write site checkpoint {where}: {why}") from error


def all_gather_json(obj, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's JSON value ``obj``, in rank order, on every rank (no pickle involved)."""
    if not dist.is_initialized():
        return [obj]
    data = json.dumps(obj).encode()
    dev = device(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(size) for _ in range(world(group))]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    buf = torch.zeros(max(lengths), dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.zeros_like(buf, device=dev) for _ in lengths]
    dist.all_gather(bufs, buf.to(dev), group=group)
    return [json.loads(bytes(b[:n].cpu().tolist())) for b, n in zip(bufs, lengths, strict=True)]
