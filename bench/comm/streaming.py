"""Streaming DiLoCo runs of the communication-efficiency benchmark (Douillard et al. 2025).

The product's schedule (``wire.fragments``, ``site_client.trainer.streaming_rounds``,
``coordinator.round.round_tensors``), simulated in one process like the blocking runs: the trainable
tensors are split by ``fragment_plan`` into P fragments; coordinator round r lasts H/P inner
steps and syncs fragment ``r % P`` only, so every fragment syncs once per H steps and the
token budget is the blocking run's. At the end of round r each site hands over
``theta_r[frag] - theta_local[frag]`` for that fragment (``pack_encoded``, its own codec
state) and trains on; the coordinator closes the round on the fragment alone
(``close_round`` on theta's fragment, the DiLoCo strategy's momentum being per tensor name)
and encodes only the fragment down (``encode_delta(..., names=fragment)``, ``apply_delta`` on
the partial manifest). Before step tau of round r+1 every site merges it,
``local <- alpha * local + (1 - alpha) * theta_{r+1}`` on that fragment (``alpha = 0``: an
exact copy, as ``site_client.trainer.shards.merge_pieces`` does); the other fragments train on
unmerged. theta_0 is loaded whole at the start; the final global theta is evaluated.

Sites run one after another within a round, which changes nothing: a site's merge in round
r+1 needs theta_{r+1}, closed once every site has finished round r.
"""

from __future__ import annotations

from functools import partial

import torch

from bench.comm.links import CODEC_SPECS, SITES, Traffic, link_config, received
from bench.comm.runs import Job, Setup, cpu_state, inner_step, lr_at, site_batch, start
from examples.gpt_diloco.data import Corpus
from strategies.base import SiteUpdate
from strategies.robust import close_round
from wire.codecs import CodecState
from wire.downlink import apply_delta, encode_delta
from wire.fragments import FragmentPlan, StreamingConfig, fragment_plan
from wire.tensors import pack_encoded

Tensors = dict[str, torch.Tensor]


def streaming_config(job: Job, pattern: str = "strided") -> StreamingConfig:
    """The ``[streaming]`` table of ``job``, checked against its H as the service checks it."""
    cfg = StreamingConfig(
        fragments=job.fragments, pattern=pattern, delay_steps=job.tau, merge_alpha=job.alpha
    )
    cfg.check_steps(job.h)
    return cfg


def plan_of(theta: Tensors, cfg: StreamingConfig) -> FragmentPlan:
    """The fragments of theta's trainable (floating-point) tensors, as coordinator and sites
    compute them."""
    shapes = {n: tuple(t.shape) for n, t in theta.items() if t.is_floating_point()}
    return fragment_plan(shapes, cfg)


@torch.no_grad()
def merge(model: torch.nn.Module, theta: Tensors, names: tuple[str, ...], alpha: float) -> None:
    """``local <- alpha * local + (1 - alpha) * theta`` on ``names``, in float32; alpha 0 is
    an exact copy."""
    local = model.state_dict()
    for name in names:
        source = theta[name].to(local[name].device)
        if alpha == 0.0:
            local[name].copy_(source)
        else:
            local[name].copy_(local[name].float() * alpha + source.float() * (1 - alpha))


def train_span(corpus: Corpus, setup: Setup, job: Job, site: int, model, opt, r: int, merge_at):
    """Site ``site``'s H/P inner steps of round ``r``; ``merge_at()`` runs before step tau."""
    span = job.h // job.fragments
    for k in range(span):
        if k == job.tau and merge_at is not None:
            merge_at()
        step = r * span + k
        x, y = site_batch(corpus, setup, site, step)
        inner_step(model, opt, x, y, lr_at(setup, job.lr, step))


def streaming_theta(
    corpus: Corpus, setup: Setup, job: Job, trace: list | None = None
) -> tuple[Tensors, Traffic]:
    """Streaming DiLoCo (see the module docstring); the final theta and its traffic.

    ``trace``, when given, gets ``(round, "up" | "down", tensor names)`` for every transfer.
    """
    uplink, downlink = (link_config(spec) for spec in CODEC_SPECS[job.codec])
    strategy, aggregator, theta, traffic, models, opts, site_codecs = start(setup, job)
    plan = plan_of(theta, streaming_config(job))
    for model in models:
        model.load_state_dict(theta)  # theta_0, whole
    down_codec = CodecState()
    last: tuple[Tensors, tuple[str, ...]] | None = None  # theta_r and the fragment to merge
    for r in range(setup.steps * job.fragments // job.h):
        names = plan.names(r)
        chosen = {n: theta[n] for n in theta if n in names}  # theta's order, as blocking sends
        strategy.begin_round(r, theta)
        updates = []
        for i, site in enumerate(SITES):
            model, opt = models[i], opts[i]
            merge_at = None if last is None else partial(merge, model, *last, job.alpha)
            train_span(corpus, setup, job, i, model, opt, r, merge_at)
            local = cpu_state(model)
            delta = {n: t - local[n] for n, t in chosen.items()}
            manifest, payload = pack_encoded(delta, uplink, site_codecs[i])
            traffic.uplink(manifest, payload)
            _note(trace, r, "up", manifest)
            weight = strategy.update_weight(site, float(job.h // job.fragments * setup.batch))
            updates.append(SiteUpdate(site, weight, partial(received, manifest, payload)))
        fragment, _ = close_round(strategy, aggregator, chosen, updates, r)
        manifest, payload = encode_delta(theta, {**theta, **fragment}, downlink, down_codec, names)
        theta = apply_delta(theta, manifest, payload)
        traffic.downlink(manifest, payload)
        _note(trace, r, "down", manifest)
        last = (theta, names)
    return theta, traffic


def _note(trace: list | None, r: int, direction: str, manifest) -> None:
    if trace is not None:
        trace.append((r, direction, tuple(sorted(manifest.by_name()))))
