"""The runs of the communication-efficiency benchmark: data parallel and DiLoCo.

Every run is a pure function of its ``Setup`` and ``Job`` (fixed seeds, batches addressed by
their coordinates), so runs can be spread over worker processes in any order.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial

import torch

from bench.comm.links import (
    CODEC_SPECS,
    FP32,
    NUM_SITES,
    SITES,
    Traffic,
    link_config,
    received,
)
from examples.gpt_diloco.data import Corpus, CorpusConfig, evaluate, load_corpus
from examples.gpt_diloco.model import build_model, count_parameters, lm_loss
from strategies import load_strategy
from strategies.base import SiteUpdate
from strategies.robust import RobustAggregator, close_round
from wire.codecs import CodecState
from wire.downlink import apply_delta, encode_delta
from wire.tensors import pack_encoded


@dataclass(frozen=True)
class Setup:
    """What every run shares: model, data, token budget and inner optimiser.

    Attributes
    ----------
    model
        Keyword arguments of ``build_model``.
    steps
        Inner steps per site (data parallel: optimiser steps), the token budget with ``batch``.
    batch
        Rows per site per step; data parallel's global batch is ``NUM_SITES * batch``.
    warmup, final_lr_frac
        Linear warm-up steps, then cosine decay to ``final_lr_frac * lr`` at the last step.
    weight_decay
        AdamW's (betas 0.9, 0.95).
    corpus_bytes
        Cap on the standard-library bytes read (``CorpusConfig.max_bytes``).
    eval_batches, eval_batch
        Size of the fixed validation set ``evaluate`` reads.
    device
        Where the sites train (``"cuda"`` for the GPU preset); the coordinator's theta, the
        codecs and the byte counts stay on the CPU, as the service keeps them.
    """

    model: dict
    steps: int
    batch: int
    warmup: int
    final_lr_frac: float
    weight_decay: float
    corpus_bytes: int
    eval_batches: int
    eval_batch: int
    device: str = "cpu"


@dataclass(frozen=True)
class Job:
    """One run: data parallel (``h is None``) or DiLoCo with H, codec and outer optimiser;
    streaming DiLoCo (``bench.comm.streaming``) with ``fragments`` P >= 1, ``tau`` and
    ``alpha`` (``[streaming] delay_steps`` and ``merge_alpha``), blocking with ``fragments`` 0.
    """

    lr: float
    h: int | None = None
    codec: str | None = None
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    fragments: int = 0
    tau: int = 0
    alpha: float = 0.0

    @property
    def streaming(self) -> bool:
        return self.fragments > 0

    @property
    def syncs_per_h(self) -> int:
        """Coordinator rounds per H inner steps: P when streaming, else 1."""
        return self.fragments if self.streaming else 1

    @property
    def name(self) -> str:
        """The run without streaming's P / tau / alpha (table columns show them)."""
        if self.h is None:
            return f"data parallel lr={self.lr:g}"
        kind = "Streaming" if self.streaming else "DiLoCo"
        return f"{kind} H={self.h} {self.codec} {self.outer_lr:g}/{self.outer_momentum:g}"

    @property
    def label(self) -> str:
        """``name``, and streaming's P / tau / alpha."""
        if self.streaming:
            return f"{self.name} P={self.fragments} tau={self.tau} a={self.alpha:g}"
        return self.name


@dataclass(frozen=True)
class Result:
    """A finished run: final validation loss, WAN bytes (all sites, both directions) and the
    largest single transfer (``Traffic.peak``; data parallel: one fp32 gradient)."""

    job: Job
    loss: float
    up_bytes: int
    down_bytes: int
    seconds: float
    peak_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return self.up_bytes + self.down_bytes


def lr_at(setup: Setup, peak: float, step: int) -> float:
    """Linear warm-up to ``peak``, then cosine decay to ``final_lr_frac * peak``."""
    if step < setup.warmup:
        return peak * (step + 1) / setup.warmup
    progress = (step - setup.warmup) / max(1, setup.steps - 1 - setup.warmup)
    floor = setup.final_lr_frac
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def corpus_for(setup: Setup) -> Corpus:
    """The standard-library corpus, windows of the model's ``seq_len``."""
    return load_corpus(CorpusConfig(max_bytes=setup.corpus_bytes, seq_len=setup.model["seq_len"]))


def site_batch(corpus: Corpus, setup: Setup, site: int, step: int):
    # Addressed as round 0, inner step = global step: every run reads the same tokens at the
    # same step whatever its H (a site's data stream does not restart with each round).
    x, y = corpus.site_batch(site, NUM_SITES, 0, step, 0, 1, setup.batch)
    return x.to(setup.device), y.to(setup.device)


def make_optimizer(model: torch.nn.Module, setup: Setup, lr: float) -> torch.optim.AdamW:
    """The inner optimiser, the same for data parallel and every DiLoCo site."""
    return torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=setup.weight_decay
    )


def inner_step(model, opt, x, y, lr: float) -> None:
    """One AdamW step on the mean next-token loss of ``(x, y)`` at learning rate ``lr``."""
    opt.zero_grad(set_to_none=True)
    lm_loss(model(x), y).backward()
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()


def ring_allreduce_bytes(n_params: int, steps: int) -> int:
    """fp32 gradients all-reduced by a ring every step: each of the ``NUM_SITES`` workers sends
    ``2 (n - 1) / n`` model sizes per all-reduce."""
    return round(steps * NUM_SITES * 2 * (NUM_SITES - 1) / NUM_SITES * FP32 * n_params)


def run_ddp(corpus: Corpus, setup: Setup, job: Job) -> tuple[float, Traffic]:
    """Synchronous data parallel: one AdamW step per step on the mean of the sites' gradients.

    One backward over the 4 sites' batches laid end to end gives the mean of their gradients
    (equal batch sizes), which is what the all-reduce would leave on every worker.
    """
    model = build_model(**setup.model).to(setup.device)
    opt = make_optimizer(model, setup, job.lr)
    for step in range(setup.steps):
        xs, ys = zip(*(site_batch(corpus, setup, s, step) for s in range(NUM_SITES)), strict=True)
        inner_step(model, opt, torch.cat(xs), torch.cat(ys), lr_at(setup, job.lr, step))
    loss = evaluate(model, corpus, setup.eval_batches, setup.eval_batch)
    n = count_parameters(model)
    return loss, Traffic(ring_allreduce_bytes(n, setup.steps), 0, FP32 * n)


def cpu_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A site model's state on the CPU, where the wire layer encodes it (the very tensors on a
    CPU run)."""
    return {n: t.cpu() for n, t in model.state_dict().items()}


def start(setup: Setup, job: Job):
    """What every DiLoCo run starts from: the outer strategy and aggregator, theta_0 and its
    bytes, and per site a model, its AdamW and its uplink codec state."""
    strategy = load_strategy("diloco", {"lr": job.outer_lr, "momentum": job.outer_momentum})
    theta = {k: v.detach().clone() for k, v in build_model(**setup.model).state_dict().items()}
    traffic = Traffic()
    traffic.theta_0(theta)
    models = [build_model(**setup.model).to(setup.device) for _ in SITES]
    opts = [make_optimizer(m, setup, job.lr) for m in models]
    return strategy, RobustAggregator(), theta, traffic, models, opts, [CodecState() for _ in SITES]


def diloco_theta(corpus: Corpus, setup: Setup, job: Job) -> tuple[dict, Traffic]:
    """DiLoCo with the service's data path on both links; the final theta and its traffic.

    Sites: AdamW whose state persists across rounds (DiLoCo's Algorithm 1); the pseudo-gradient
    ``theta_r - theta_site`` goes through ``pack_encoded`` with the site's own codec state, as
    ``CoordinatorClient.push`` sends it. Coordinator: ``close_round`` (the weighted mean in
    site order, then the strategy's outer step), then ``encode_delta`` / ``apply_delta``, which
    define the official theta every site receives.
    """
    uplink, downlink = (link_config(spec) for spec in CODEC_SPECS[job.codec])
    strategy, aggregator, theta, traffic, models, opts, site_codecs = start(setup, job)
    down_codec = CodecState()
    for r in range(setup.steps // job.h):
        strategy.begin_round(r, theta)
        updates = []
        for i, site in enumerate(SITES):
            model, opt = models[i], opts[i]
            model.load_state_dict(theta)
            for k in range(job.h):
                step = r * job.h + k
                x, y = site_batch(corpus, setup, i, step)
                inner_step(model, opt, x, y, lr_at(setup, job.lr, step))
            local = cpu_state(model)
            delta = {n: theta[n] - local[n] for n in theta}
            manifest, payload = pack_encoded(delta, uplink, site_codecs[i])
            traffic.uplink(manifest, payload)
            weight = strategy.update_weight(site, float(job.h * setup.batch))
            updates.append(SiteUpdate(site, weight, partial(received, manifest, payload)))
        new_theta, _ = close_round(strategy, aggregator, theta, updates, r)
        manifest, payload = encode_delta(theta, new_theta, downlink, down_codec)
        theta = apply_delta(theta, manifest, payload)
        traffic.downlink(manifest, payload)
    return theta, traffic


def evaluate_theta(corpus: Corpus, setup: Setup, theta: dict[str, torch.Tensor]) -> float:
    """The final validation measurement every DiLoCo run ends with, on the global theta."""
    model = build_model(**setup.model)
    model.load_state_dict(theta)
    return evaluate(model.to(setup.device), corpus, setup.eval_batches, setup.eval_batch)


def execute(setup: Setup, job: Job, threads: int = 1) -> Result:
    """Run one job (in a worker process) and time it."""
    from bench.comm.streaming import streaming_theta

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    if setup.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    corpus = corpus_for(setup)
    began = time.perf_counter()
    if job.h is None:
        loss, traffic = run_ddp(corpus, setup, job)
    else:
        train = streaming_theta if job.streaming else diloco_theta
        theta, traffic = train(corpus, setup, job)
        loss = evaluate_theta(corpus, setup, theta)
    seconds = time.perf_counter() - began
    return Result(job, loss, traffic.up, traffic.down, seconds, traffic.peak)
