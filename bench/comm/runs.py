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

from examples.gpt_diloco.data import Corpus, CorpusConfig, evaluate, load_corpus
from examples.gpt_diloco.model import build_model, count_parameters, lm_loss
from strategies import load_strategy
from strategies.base import SiteUpdate
from strategies.robust import RobustAggregator, close_round
from wire.codecs import CodecState, CompressionConfig, make_codec
from wire.downlink import apply_delta, encode_delta
from wire.tensors import Manifest, pack, pack_encoded, unpack

NUM_SITES = 4
SITES = [f"site-{i}" for i in range(NUM_SITES)]
FP32 = 4

# Codecs per run: label -> (uplink, downlink), each (codec name, parameters); a label with a
# slash names the uplink's codec, then the downlink's. int4 and top-k keep error feedback (their
# default), so what one round drops is sent in a later one.
_INT4 = ("int4", {"block": 64})
CODEC_SPECS: dict[str, tuple[tuple[str, dict], tuple[str, dict]]] = {
    "fp32": (("none", {}), ("none", {})),
    "int8": (("int8", {"block": 256}), ("int8", {"block": 256})),
    "int4+EF": (_INT4, _INT4),
    # On the downlink top-k leaves 99 % of every outer step to error feedback, which needs far
    # more rounds than these runs have (it diverged at H 50), so the grid pairs it with int4.
    "topk1%+EF/int4": (("topk", {"fraction": 0.01}), _INT4),
    "topk1%+EF": (("topk", {"fraction": 0.01}), ("topk", {"fraction": 0.01})),
}


def link_config(spec: tuple[str, dict]) -> CompressionConfig:
    """One codec for every tensor of a link (norms and biases included)."""
    name, params = spec
    return CompressionConfig(default=make_codec(name, **params))


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


@dataclass(frozen=True)
class Job:
    """One run: data parallel (``h is None``) or DiLoCo with H, codec and outer optimiser."""

    lr: float
    h: int | None = None
    codec: str | None = None
    outer_lr: float = 0.7
    outer_momentum: float = 0.9

    @property
    def label(self) -> str:
        if self.h is None:
            return f"data parallel lr={self.lr:g}"
        return f"DiLoCo H={self.h} {self.codec} {self.outer_lr:g}/{self.outer_momentum:g}"


@dataclass(frozen=True)
class Result:
    """A finished run: final validation loss and WAN bytes (all sites, both directions)."""

    job: Job
    loss: float
    up_bytes: int
    down_bytes: int
    seconds: float

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
    return corpus.site_batch(site, NUM_SITES, 0, step, 0, 1, setup.batch)


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


def wire_bytes(manifest: Manifest, payload: memoryview) -> int:
    """Bytes one transfer puts on the WAN: the payload plus its serialised manifest (names,
    shapes, codec meta); gRPC framing and TLS are left out."""
    return len(payload) + manifest.to_proto().ByteSize()


def ring_allreduce_bytes(n_params: int, steps: int) -> int:
    """fp32 gradients all-reduced by a ring every step: each of the ``NUM_SITES`` workers sends
    ``2 (n - 1) / n`` model sizes per all-reduce."""
    return round(steps * NUM_SITES * 2 * (NUM_SITES - 1) / NUM_SITES * FP32 * n_params)


def run_ddp(corpus: Corpus, setup: Setup, job: Job) -> tuple[float, int, int]:
    """Synchronous data parallel: one AdamW step per step on the mean of the sites' gradients.

    One backward over the 4 sites' batches laid end to end gives the mean of their gradients
    (equal batch sizes), which is what the all-reduce would leave on every worker.
    """
    model = build_model(**setup.model)
    opt = make_optimizer(model, setup, job.lr)
    for step in range(setup.steps):
        xs, ys = zip(*(site_batch(corpus, setup, s, step) for s in range(NUM_SITES)), strict=True)
        inner_step(model, opt, torch.cat(xs), torch.cat(ys), lr_at(setup, job.lr, step))
    loss = evaluate(model, corpus, setup.eval_batches, setup.eval_batch)
    return loss, ring_allreduce_bytes(count_parameters(model), setup.steps), 0


def _received(manifest: Manifest, payload: memoryview):
    # What the coordinator reads back from its spool: the manifest as the peer sent it (proto),
    # validated, and every tensor decoded (and so checked) by the wire layer.
    return unpack(Manifest.from_proto(manifest.to_proto()), payload).items()


def run_diloco(corpus: Corpus, setup: Setup, job: Job) -> tuple[float, int, int]:
    """DiLoCo with the service's data path on both links.

    Sites: AdamW whose state persists across rounds (DiLoCo's Algorithm 1); the pseudo-gradient
    ``theta_r - theta_site`` goes through ``pack_encoded`` with the site's own codec state, as
    ``CoordinatorClient.push`` sends it. Coordinator: ``close_round`` (the weighted mean in
    site order, then the strategy's outer step), then ``encode_delta`` / ``apply_delta``, which
    define the official theta every site receives.
    """
    uplink, downlink = (link_config(spec) for spec in CODEC_SPECS[job.codec])
    strategy = load_strategy("diloco", {"lr": job.outer_lr, "momentum": job.outer_momentum})
    aggregator = RobustAggregator()
    global_model = build_model(**setup.model)
    theta = {k: v.detach().clone() for k, v in global_model.state_dict().items()}
    manifest, payload = pack(theta)
    down = NUM_SITES * wire_bytes(manifest, payload)  # theta_0, uncompressed, to every site
    up = 0
    models = [build_model(**setup.model) for _ in SITES]
    opts = [make_optimizer(m, setup, job.lr) for m in models]
    site_codecs = [CodecState() for _ in SITES]
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
            local = model.state_dict()
            delta = {n: theta[n] - local[n] for n in theta}
            manifest, payload = pack_encoded(delta, uplink, site_codecs[i])
            up += wire_bytes(manifest, payload)
            weight = strategy.update_weight(site, float(job.h * setup.batch))
            updates.append(SiteUpdate(site, weight, partial(_received, manifest, payload)))
        new_theta, _ = close_round(strategy, aggregator, theta, updates, r)
        manifest, payload = encode_delta(theta, new_theta, downlink, down_codec)
        theta = apply_delta(theta, manifest, payload)
        down += NUM_SITES * wire_bytes(manifest, payload)
    global_model.load_state_dict(theta)
    return evaluate(global_model, corpus, setup.eval_batches, setup.eval_batch), up, down


def execute(setup: Setup, job: Job, threads: int = 1) -> Result:
    """Run one job (in a worker process) and time it."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    corpus = corpus_for(setup)
    start = time.perf_counter()
    run = run_ddp if job.h is None else run_diloco
    loss, up, down = run(corpus, setup, job)
    return Result(job, loss, up, down, time.perf_counter() - start)
