"""The site's health probe, run by every trainer rank together (``wire.health`` says when).

Three measures, each cheap next to a round:

* compute: an n x n matmul timed on each rank's device (bfloat16 on a GPU, float32 on a CPU),
  as GFLOP/s; the site reports the median over its ranks, so one slow rank shows without one
  fast rank hiding it;
* the site's own collective bandwidth: an all-reduce of ``allreduce_mib`` over the trainers'
  process group, as bus bandwidth (``2 (w - 1) / w`` bytes per byte reduced, as nccl-tests
  count it); nothing with one rank;
* on GPUs, the driver's uncorrected ECC error counts (``nvidia-smi``), where it is installed.

Rank 0 hands the result to the agent, which sends it in its heartbeats.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from wire.health import HealthConfig

# A CPU probe stays small: its trainers start often in tests, and a CPU's rate shows early.
CPU_MATMUL, GPU_MATMUL = 256, 4096
CPU_ALLREDUCE_MIB, GPU_ALLREDUCE_MIB = 1, 64
REPEATS = 4
SMI_QUERY = "index,ecc.errors.uncorrected.volatile.total"


@dataclass(frozen=True)
class ProbeResult:
    round: int
    matmul_gflops: float
    allreduce_gbps: float
    world_size: int
    device: str
    gpu_errors: tuple[str, ...] = ()

    def as_report(self) -> dict:
        return {**asdict(self), "gpu_errors": list(self.gpu_errors)}


def probe_sizes(cfg: HealthConfig, on_gpu: bool) -> tuple[int, int]:
    """The matmul's n and the all-reduce's bytes: the config's, or (0) what suits the device.
    A GPU needs a large matmul to reach its rate; a CPU does not, and is slow at it."""
    n = cfg.matmul_size or (GPU_MATMUL if on_gpu else CPU_MATMUL)
    mib = cfg.allreduce_mib or (GPU_ALLREDUCE_MIB if on_gpu else CPU_ALLREDUCE_MIB)
    return n, mib << 20


def matmul_gflops(n: int, device: torch.device, slower_s: float = 0.0) -> float:
    """GFLOP/s of ``REPEATS`` n x n matmuls on ``device`` (after one warm-up). ``slower_s``
    is added inside the timed part (fault injection: a throttled device)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=gen, dtype=torch.float32).to(device, dtype)
    b = torch.randn(n, n, generator=gen, dtype=torch.float32).to(device, dtype)
    _sync(device, a @ b)
    started = time.perf_counter()
    for _ in range(REPEATS):
        c = a @ b
    _sync(device, c)
    if slower_s > 0:
        time.sleep(slower_s)
    seconds = time.perf_counter() - started
    return 2 * n**3 * REPEATS / seconds / 1e9


def allreduce_gbps(nbytes: int, device: torch.device, world_size: int) -> float:
    """Bus bandwidth of an all-reduce over the default group (0.0 with one rank)."""
    if world_size < 2:
        return 0.0
    buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    dist.all_reduce(buf)  # warm-up: connections, buffers
    _sync(device, buf)
    started = time.perf_counter()
    for _ in range(2):
        dist.all_reduce(buf)
    _sync(device, buf)
    seconds = (time.perf_counter() - started) / 2
    return 2 * (world_size - 1) / world_size * buf.numel() * 4 / seconds / 1e9


def median_over_ranks(value: float, rank: int, world_size: int) -> float:
    """The median of every rank's ``value`` (a collective: every rank calls it)."""
    if world_size < 2:
        return value
    slots = torch.zeros(world_size, dtype=torch.float64)
    slots[rank] = value
    dist.all_reduce(slots)
    return float(slots.median())  # the lower middle one for an even count: conservative


def ecc_errors(smi_output: str) -> tuple[str, ...]:
    """GPUs with uncorrected ECC errors in ``nvidia-smi --query-gpu=<SMI_QUERY>`` CSV output
    (``[N/A]``: the GPU does not count them)."""
    found = []
    for line in smi_output.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 2 or not fields[1].isdigit():
            continue
        if int(fields[1]) > 0:
            found.append(f"GPU {fields[0]}: {int(fields[1])} uncorrected ECC errors")
    return tuple(found)


def gpu_errors(run: Callable[[list[str]], str] | None = None) -> tuple[str, ...]:
    """What the driver reports; () without a GPU, without ``nvidia-smi`` or when it fails."""
    if not torch.cuda.is_available() or (run is None and shutil.which("nvidia-smi") is None):
        return ()
    cmd = ["nvidia-smi", f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits"]
    try:
        out = run(cmd) if run is not None else _smi(cmd)
    except (OSError, subprocess.SubprocessError):
        return ()
    return ecc_errors(out)


def run_probe(
    cfg: HealthConfig,
    round_number: int,
    rank: int,
    world_size: int,
    collective_device: torch.device,
    slower_s: float = 0.0,
) -> ProbeResult:
    """Every rank together: the site's probe before ``round_number``."""
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    n, nbytes = probe_sizes(cfg, on_gpu)
    gflops = median_over_ranks(matmul_gflops(n, device, slower_s), rank, world_size)
    bandwidth = allreduce_gbps(nbytes, collective_device, world_size)
    name = f"cuda:{torch.cuda.get_device_name(device)}" if on_gpu else "cpu"
    errors = gpu_errors() if rank == 0 else ()
    return ProbeResult(round_number, gflops, bandwidth, world_size, name[:128], errors)


def _sync(device: torch.device, _result: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _smi(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout


class SiteProber:
    """When a site's trainers probe: once when they start, then before every
    ``every_rounds``-th round, each round at most once; ``before`` is a collective."""

    def __init__(
        self,
        cfg: HealthConfig,
        rank: int,
        world_size: int,
        slower_s: Callable[[int], float],
        send: Callable[[ProbeResult], None],
    ) -> None:
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.slower_s, self.send = slower_s, send  # fault injection; rank 0 -> the agent
        self.probed: int | None = None

    def due(self, round_number: int) -> bool:
        if not self.cfg.enabled or self.probed == round_number:
            return False
        return self.probed is None or self.cfg.due(round_number)

    def before(self, round_number: int) -> ProbeResult | None:
        if not self.due(round_number):
            return None
        self.probed = round_number
        # "nccl", or "cpu:gloo,cuda:nccl" for a group with a backend per device type.
        backend = dist.get_backend() if self.world_size > 1 else "gloo"
        collective = torch.device("cpu")
        if "nccl" in backend:
            collective = torch.device("cuda", torch.cuda.current_device())
        result = run_probe(
            self.cfg,
            round_number,
            self.rank,
            self.world_size,
            collective,
            self.slower_s(round_number),
        )
        if self.rank == 0:
            self.send(result)
        return result
