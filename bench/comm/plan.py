"""What ``python -m bench.comm_efficiency`` runs: scales (model, token budget, grid), the
``--grid`` syntax and the ``--dry-run`` printout."""

from __future__ import annotations

from dataclasses import dataclass

from bench.comm.links import CODEC_SPECS, FP32, NUM_SITES
from bench.comm.runs import Job, Setup
from bench.comm.streaming import plan_of, streaming_config
from examples.gpt_diloco.model import build_model
from wire.config_table import ConfigError

# Grid entries: (H, codec, outer lr, outer momentum) for blocking DiLoCo, with
# (P, tau, alpha) after them for streaming. The outer optimiser is tuned per H (the module
# docstring of bench.comm_efficiency gives the runs behind each choice).
BLOCKING = (
    (10, "int4+EF", 1.0, 0.0),
    (50, "int4+EF", 1.0, 0.6),
    (250, "int4+EF", 1.0, 0.6),
    (1000, "int4+EF", 1.0, 0.0),
    (250, "fp32", 1.0, 0.6),
    (250, "int8", 1.0, 0.6),
    (50, "topk1%+EF/int4", 1.0, 0.6),
)
# Each next to a blocking row at the same H and codec. The default model has 2 blocks, so
# P = 2 splits it in halves (strided: block 0 with the head, block 1 with the embeddings);
# P = 4 does not divide H 50 or 250.
STREAMING = (
    (50, "int4+EF", 0.8, 0.7, 2, 2, 0.0),
    (250, "int4+EF", 1.0, 0.6, 2, 5, 0.0),
    (250, "int4+EF", 1.0, 0.6, 2, 5, 0.5),
    (250, "fp32", 1.0, 0.6, 2, 5, 0.0),
)
# One H200: 114 M parameters (16 blocks, so P = 4 takes 4 blocks each), 20 k steps per site:
# 100 rounds at H 200, 200 at H 100; 328 M tokens per run. Learning rates are a first guess.
GPU_GRID = (
    (100, "int4+EF", 1.0, 0.6),
    (200, "int4+EF", 1.0, 0.6),
    (200, "fp32", 1.0, 0.6),
    (100, "int4+EF", 1.0, 0.6, 4, 5, 0.0),
    (200, "int4+EF", 1.0, 0.6, 4, 5, 0.0),
    (200, "int4+EF", 1.0, 0.6, 4, 5, 0.5),
    (200, "fp32", 1.0, 0.6, 4, 5, 0.0),
)


@dataclass(frozen=True)
class Scale:
    """A preset: ``model`` (``build_model`` kwargs), steps per site, rows per site per step,
    corpus cap, validation set, grid, learning rates and device."""

    model: dict
    steps: int
    batch: int
    corpus_bytes: int
    eval_batches: int
    eval_batch: int
    grid: tuple
    lr: float
    ddp_lrs: tuple[float, ...]
    device: str = "cpu"
    workers: int = 2


_SMALL = {"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 256, "seq_len": 32}
SCALES = {
    "default": Scale(
        _SMALL, 2000, 16, 8 << 20, 16, 32, BLOCKING + STREAMING, 6e-3, (3e-3, 6e-3, 1.2e-2)
    ),
    "quick": Scale(
        _SMALL,
        200,
        16,
        8 << 20,
        8,
        32,
        ((50, "int4+EF", 1.0, 0.6), (100, "int8", 1.0, 0.6), (50, "int4+EF", 1.0, 0.6, 2, 2, 0.0)),
        6e-3,
        (6e-3,),
    ),
    "gpu": Scale(
        {"d_model": 768, "n_layers": 16, "n_heads": 12, "d_ff": 3072, "seq_len": 256},
        20_000,
        16,
        256 << 20,  # the whole standard library (about 160 MB of sources)
        32,
        16,
        GPU_GRID,
        1e-3,
        (1e-3,),
        device="cuda",
        workers=1,
    ),
}


def setup_of(scale: Scale, steps: int, batch: int, device: str) -> Setup:
    return Setup(
        model=scale.model,
        steps=steps,
        batch=batch,
        warmup=max(1, steps // 20),
        final_lr_frac=0.1,
        weight_decay=0.01,
        corpus_bytes=scale.corpus_bytes,
        eval_batches=scale.eval_batches,
        eval_batch=scale.eval_batch,
        device=device,
    )


def parse_grid(items: list[str], outer_lr: float, momentum: float) -> list[tuple]:
    """``H:CODEC[:OUTER_LR:MOMENTUM][:P=..:tau=..:alpha=..]`` items as grid entries; any of
    ``P``, ``tau``, ``alpha`` makes it streaming (P defaults to 2, tau and alpha to 0)."""
    return [_grid_entry(item, outer_lr, momentum) for item in items]


def _grid_entry(item: str, outer_lr: float, momentum: float) -> tuple:
    parts = [p for p in item.split(":") if "=" not in p]
    options = dict(p.split("=", 1) for p in item.split(":") if "=" in p)
    try:
        if (
            len(parts) not in (2, 4)
            or parts[1] not in CODEC_SPECS
            or options.keys()
            - {
                "P",
                "tau",
                "alpha",
            }
        ):
            raise ValueError
        outer = (float(parts[2]), float(parts[3])) if len(parts) == 4 else (outer_lr, momentum)
        entry = (int(parts[0]), parts[1], *outer)
        if options:
            p, tau = int(options.get("P", 2)), int(options.get("tau", 0))
            entry += (p, tau, float(options.get("alpha", 0.0)))
        return entry
    except ValueError:
        raise SystemExit(
            f"--grid {item!r}: expected H:CODEC[:OUTER_LR:MOMENTUM][:P=N:tau=N:alpha=X], CODEC "
            f"one of {list(CODEC_SPECS)}"
        ) from None


def check_jobs(jobs: list[Job], steps: int) -> None:
    """Every H divides the steps; streaming jobs pass the service's own ``[streaming]``
    checks (H % P == 0, tau < H / P)."""
    bad = [j.h for j in jobs if j.h <= 0 or steps % j.h]
    if bad:
        raise SystemExit(f"every H must divide --steps {steps}; these do not: {bad}")
    for job in jobs:
        if job.streaming:
            try:
                streaming_config(job)
            except ConfigError as exc:
                raise SystemExit(f"{job.label}: {exc}") from None


def describe(setup: Setup, jobs: list[Job]) -> str:
    """The ``--dry-run`` plan: the model, and per DiLoCo job its rounds and, when streaming,
    its fragments (elements each, the largest as a fraction of the model)."""
    theta = build_model(**setup.model).state_dict()
    total = sum(t.numel() for t in theta.values())
    lines = [f"model {setup.model}: {total / 1e6:.2f} M parameters ({FP32 * total / 1e6:.0f} MB)"]
    for job in jobs:
        rounds = setup.steps // job.h * job.syncs_per_h
        line = f"  {job.label:<52} {rounds:>6} rounds"
        if job.streaming:
            plan = plan_of(theta, streaming_config(job))
            sizes = [sum(theta[n].numel() for n in f) for f in plan.fragments]
            line += f"  fragments {sizes}, largest {max(sizes) / total:.2f} of the model"
        lines.append(line)
    tokens = setup.steps * NUM_SITES * setup.batch * setup.model["seq_len"]
    lines.append(f"{tokens / 1e6:.1f} M tokens per run, {tokens / total:.1f} per parameter")
    return "\n".join(lines)
