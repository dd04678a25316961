"""One site's trainer for the example GPT: FSDP2 over the site's ranks, DiLoCo inner loop.

Run it under the site agent, which starts one copy per rank::

    siteclient start --coordinator HOST:PORT --site site-0 --nproc-per-node 2 \\
        -- examples/gpt_diloco/train.py

The model's shape comes from the job config (``[model] kwargs``), so it always matches theta.
Each round it reports the validation loss of the global theta_r it starts from, trains H inner
steps with AdamW and hands the pseudo-gradient to the agent. It reads its own shard of the
corpus in federated mode (shard ``rnd.site_index`` of ``rnd.num_sites``: the site's place among
the round's participants, unless ``--site-index``/``--num-sites`` fix it), and in shared-data
mode (``[data] mode = "shared"``) the unit of the shared stream the coordinator assigned,
backup copies of other sites' units included; a unit committed elsewhere first is abandoned
mid-way.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a file by the launcher: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from examples.gpt_diloco.data import Corpus, CorpusConfig, evaluate, load_corpus
from examples.gpt_diloco.model import build_model, lm_loss, transformer_blocks
from site_client.trainer.round import Round
from site_client.trainer.session import SiteSession


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--site-index", type=int, help="fixed corpus shard (default: the session's)")
    p.add_argument("--num-sites", type=int, help="fixed shard count (default: the session's)")
    p.add_argument("--batch-size", type=int, default=8, help="rows per site per inner step")
    p.add_argument("--lr", type=float, default=2e-3, help="inner AdamW learning rate")
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--corpus-bytes", type=int, default=4 << 20)
    p.add_argument("--checkpoint-every", type=int, default=0, help="inner steps; 0 = per round")
    p.add_argument(
        "--slowdown",
        type=float,
        default=1.0,
        help="benchmarks: make each inner step this many times as long, as on a slower "
        "accelerator (the step sleeps (F - 1) x its measured compute, inside the step)",
    )
    args = p.parse_args(argv)
    if (args.site_index is None) != (args.num_sites is None):
        p.error("give both --site-index and --num-sites, or neither")
    if args.num_sites is not None and not 0 <= args.site_index < args.num_sites:
        p.error(f"--site-index must be in [0, {args.num_sites}), got {args.site_index}")
    if not args.slowdown >= 1.0:
        p.error(f"--slowdown must be >= 1, got {args.slowdown}")
    return args


@dataclass(frozen=True)
class Setup:
    """What both forms of the loop train with (this file's, and ``train_loop.py``'s)."""

    args: argparse.Namespace
    session: SiteSession
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    corpus: Corpus


def setup(argv=None) -> Setup:
    """The session, the FSDP2-sharded model shaped by the job's ``[model] kwargs``, AdamW, and
    the corpus."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    session = SiteSession(backend="gloo", checkpoint_every=args.checkpoint_every)
    model_kwargs = session.job_config.get("model", {}).get("kwargs", {})
    model = build_model(**model_kwargs)
    mesh = init_device_mesh("cpu", (session.world_size,))
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    seq_len = model.config.seq_len
    corpus = load_corpus(CorpusConfig(max_bytes=args.corpus_bytes, seq_len=seq_len))
    if session.rank == 0:  # what the losses depend on besides the job: see the README
        print(
            f"[{session.site}] corpus {corpus.fingerprint} ({len(corpus.train)} + "
            f"{len(corpus.val)} bytes of {corpus.root}); torch {torch.__version__}, "
            f"CPU kernels {torch.backends.cpu.get_cpu_capability()}",
            file=sys.stderr,
        )
    return Setup(args, session, model, optimizer, corpus)


def batch(s: Setup, rnd: Round, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch for ``step`` of ``rnd``: the site's shard of the corpus (federated),
    or the unit's slice of the shared stream (shared-data mode)."""
    args, session = s.args, s.session
    if rnd.data_unit_index is not None:
        return s.corpus.unit_batch(
            rnd.data_unit_index,
            step,
            rnd.inner_steps,
            session.rank,
            session.world_size,
            args.batch_size,
        )
    fixed = args.num_sites is not None
    return s.corpus.site_batch(
        args.site_index if fixed else rnd.site_index,
        args.num_sites if fixed else rnd.num_sites,
        rnd.number,
        step,
        session.rank,
        session.world_size,
        args.batch_size,
    )


class ValLoss:
    """Reports the validation loss of theta_r as a round starts: once per round (not per
    unit of it, nor again after a restart mid-round). Not with streaming outer steps, where a
    round starts from the site's own model, not theta_r (the coordinator's ``[evaluation]``
    measures the global model there)."""

    def __init__(self, s: Setup) -> None:
        self.s, self.last = s, -1

    def __call__(self, rnd: Round) -> None:
        if self.s.session.streaming is not None:
            return
        if rnd.start_step == 0 and rnd.number != self.last:
            s = self.s
            rnd.report(val_loss=evaluate(s.model, s.corpus, s.args.eval_batches, s.args.batch_size))
            self.last = rnd.number


def finish(s: Setup) -> None:
    final = evaluate(s.model, s.corpus, s.args.eval_batches, s.args.batch_size)
    s.session.report(round=s.session.final.round, val_loss=final, final=1)
    s.session.close()


def main(argv=None) -> None:
    s = setup(argv)
    model, optimizer, val_loss = s.model, s.optimizer, ValLoss(s)
    for rnd in s.session.rounds(model, optimizer):
        val_loss(rnd)
        losses = []
        for step in rnd.steps():
            started = time.perf_counter()
            inputs, targets = batch(s, rnd, step)
            loss = lm_loss(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            rnd.loss = loss.item()
            losses.append(rnd.loss)
            if s.args.slowdown > 1.0:  # a slower accelerator, for benchmarks
                time.sleep((s.args.slowdown - 1.0) * (time.perf_counter() - started))
        if losses and not rnd.cancelled:
            rnd.report(train_loss=sum(losses) / len(losses))
    finish(s)


if __name__ == "__main__":
    main()
