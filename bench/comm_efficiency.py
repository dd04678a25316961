"""Validation loss against WAN bytes: synchronous data parallel vs DiLoCo with uplink codecs.

Run ``python -m bench.comm_efficiency [--quick]``. A small byte-level GPT
(``examples.gpt_diloco.model.build_model``, default d_model 64, 2 layers, 4 heads, d_ff 256,
seq_len 64, ~137 k parameters) is pretrained on the standard-library corpus
(``examples.gpt_diloco.data``) across 4 sites with a fixed token budget, once with synchronous
data parallelism and once per (H, codec) pair of a grid with DiLoCo; every run ends with the
same validation loss measurement (``evaluate``) of its final global model.

What is simulated
-----------------
- The 4 sites and the coordinator live in this one process, on one CPU thread by default: each
  site is a plain ``nn.Module`` with its own AdamW (no FSDP, no torchrun, no gRPC, no TLS, no
  spool files, no leases or deadlines; every site delivers every round).
- The WAN is not used: bytes are *counted*, never sent. Data parallel counts a ring all-reduce of
  fp32 gradients: per step each of the 4 workers sends ``2 (n - 1) / n`` model sizes, i.e.
  ``4 * 2 * 3/4 * 4 bytes * n_params`` per step. DiLoCo counts the encoded uplink of every site
  every round (codec data plus codec meta, as ``Encoded.nbytes`` gives them; the gRPC manifest,
  chunk framing and TLS overhead are left out) plus a full fp32 theta downlink to every site at
  the start (theta_0) and after every round: the compressed downlink is not built yet.
- Time: nothing here measures wall-clock time of a WAN; only bytes and loss are compared.

What is real
------------
- Model, corpus, batches and validation: the example's own ``build_model``, ``load_corpus``,
  ``Corpus.site_batch`` (disjoint shard per site, a pure function of its coordinates) and
  ``evaluate``. Site ``s`` at global inner step ``t`` reads ``site_batch(s, 4, 0, t, 0, 1, B)``
  in every run, so every run sees exactly the same tokens (same total steps, same batch).
- The outer step is the service's: pseudo-gradients ``theta_r - theta_site`` are encoded per
  tensor by ``CodecState.encode`` with the codec ``choose_codec`` picks from one rule (the same
  codec for every tensor, norms and biases included), with each site's error-feedback residuals
  kept across rounds; the coordinator side decodes them with ``decode_into`` into one fp32
  accumulator, ``w_i`` times each site in site-name order (``w_i`` from the strategy's
  ``update_weight``, 1 for DiLoCo), divides by the total weight, wraps the result in
  ``strategies.Aggregate`` and calls ``strategies.load_strategy("diloco", ...)``'s
  ``outer_step`` (Nesterov momentum, lr 0.7, momentum 0.9 unless ``--outer-lr`` says otherwise;
  not tuned per codec).
- Inner optimisation: AdamW per site whose state persists across rounds (DiLoCo's Algorithm 1),
  the same learning-rate schedule (linear warm-up, cosine decay, indexed by the global inner
  step) for the data-parallel optimiser and for every site.

Output: one line per run with its elapsed time, a table of final validation loss, WAN bytes and
``ddp_bytes / bytes``, the plot ``runs/comm_efficiency.png`` (loss against bytes, log x), and as
the last line ``ddp_bytes=N best_bytes_ratio=X loss_gap_pct=Y``: the largest
``ddp_bytes / bytes`` among DiLoCo runs whose validation loss is within 1 % of data parallel's,
and that run's gap in percent (``best_bytes_ratio=0`` and the smallest gap when none is).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from examples.gpt_diloco.data import Corpus, CorpusConfig, evaluate, load_corpus
from examples.gpt_diloco.model import build_model, count_parameters, lm_loss
from strategies import Aggregate, load_strategy
from wire.codecs import CodecRule, CodecState, choose_codec, decode_into, make_codec

NUM_SITES = 4
SITES = [f"site-{i}" for i in range(NUM_SITES)]
FP32 = 4
REPO = Path(__file__).resolve().parent.parent

# Uplink codecs: label -> (codec name, parameters). int4 and topk use error feedback by default.
CODEC_SPECS: dict[str, tuple[str, dict]] = {
    "fp32": ("none", {}),
    "int8": ("int8", {"block": 256}),
    "int4+EF": ("int4", {"block": 64}),
    "topk1%+EF": ("topk", {"fraction": 0.01}),
    "topk5%+EF": ("topk", {"fraction": 0.05}),
}
DEFAULT_CODECS = ("fp32", "int8", "int4+EF", "topk1%+EF")


@dataclass(frozen=True)
class Setup:
    model: dict
    steps: int
    batch: int
    lr: float
    warmup: int
    weight_decay: float
    outer_lr: float
    outer_momentum: float
    eval_batches: int
    eval_batch: int


@dataclass
class Result:
    label: str
    h: int | None
    codec: str | None
    loss: float
    nbytes: int
    seconds: float


def lr_at(setup: Setup, step: int) -> float:
    """Linear warm-up to ``lr``, then cosine decay to 10 % of it at the last step."""
    if step < setup.warmup:
        return setup.lr * (step + 1) / setup.warmup
    span = max(1, setup.steps - setup.warmup)
    progress = (step - setup.warmup) / span
    return setup.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, setup: Setup) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        model.parameters(), lr=setup.lr, betas=(0.9, 0.95), weight_decay=setup.weight_decay
    )


def batch(corpus: Corpus, site: int, step: int, setup: Setup):
    # round 0, inner step = global step: the same tokens in every run, whatever H.
    return corpus.site_batch(site, NUM_SITES, 0, step, 0, 1, setup.batch)


def run_ddp(corpus: Corpus, setup: Setup) -> tuple[float, int]:
    """Synchronous data parallel: the 4 sites' gradients averaged every step, one AdamW step."""
    torch.manual_seed(0)
    model = build_model(**setup.model)
    opt = make_optimizer(model, setup)
    params = list(model.parameters())
    for step in range(setup.steps):
        grads = [torch.zeros_like(p) for p in params]
        for site in range(NUM_SITES):
            x, y = batch(corpus, site, step, setup)
            model.zero_grad(set_to_none=True)
            lm_loss(model(x), y).backward()
            for g, p in zip(grads, params, strict=True):
                g.add_(p.grad)
        for g, p in zip(grads, params, strict=True):
            p.grad = g.div_(NUM_SITES)  # the fp32 all-reduce (mean)
        for group in opt.param_groups:
            group["lr"] = lr_at(setup, step)
        opt.step()
    n = count_parameters(model)
    ring = 2 * (NUM_SITES - 1) / NUM_SITES  # model sizes each worker sends per all-reduce
    ddp_bytes = round(setup.steps * NUM_SITES * ring * FP32 * n)
    return evaluate(model, corpus, setup.eval_batches, setup.eval_batch), ddp_bytes


def run_diloco(corpus: Corpus, setup: Setup, h: int, codec_label: str) -> tuple[float, int]:
    """DiLoCo with H inner steps per round and the given uplink codec, through the service's
    strategy and codec code paths (see the module docstring)."""
    torch.manual_seed(0)
    codec_name, params = CODEC_SPECS[codec_label]
    rules = [CodecRule(make_codec(codec_name, **params))]
    strategy = load_strategy("diloco", {"lr": setup.outer_lr, "momentum": setup.outer_momentum})
    global_model = build_model(**setup.model)
    theta = {k: v.detach().clone() for k, v in global_model.state_dict().items()}
    theta_bytes = sum(t.numel() * FP32 for t in theta.values())
    models = [build_model(**setup.model) for _ in SITES]
    opts = [make_optimizer(m, setup) for m in models]
    codec_states = [CodecState() for _ in SITES]
    nbytes = NUM_SITES * theta_bytes  # theta_0 to every site
    rounds = setup.steps // h
    for r in range(rounds):
        strategy.begin_round(r, theta)
        uploads: dict[str, list] = {}
        for i, site in enumerate(SITES):
            model, opt = models[i], opts[i]
            model.load_state_dict(theta)  # the fetched theta_r; AdamW state stays
            for k in range(h):
                step = r * h + k
                x, y = batch(corpus, i, step, setup)
                opt.zero_grad(set_to_none=True)
                lm_loss(model(x), y).backward()
                for group in opt.param_groups:
                    group["lr"] = lr_at(setup, step)
                opt.step()
            local = model.state_dict()
            encoded = []
            for name in theta:
                delta = theta[name] - local[name]
                codec = choose_codec(name, delta, rules)
                enc = codec_states[i].encode(name, delta, codec)
                nbytes += enc.nbytes
                encoded.append((name, enc))
            uploads[site] = encoded
        # Coordinator: sum w_i * decoded_i in site-name order, divide by the total weight.
        acc = {name: torch.zeros(t.shape, dtype=torch.float32) for name, t in theta.items()}
        weights: dict[str, float] = {}
        for site in sorted(uploads):
            w = float(strategy.update_weight(site, float(h * setup.batch)))
            for name, enc in uploads[site]:
                decode_into(acc[name], enc.data, enc.meta, w, codec=enc.codec, name=name)
            weights[site] = w
        total = sum(weights.values())
        for t in acc.values():
            t.div_(total)
        aggregate = Aggregate(mean_delta=acc, total_weight=total, weights=weights, round=r)
        theta = strategy.outer_step(theta, aggregate)
        nbytes += NUM_SITES * theta_bytes  # theta_{r+1} to every site, fp32
    global_model.load_state_dict(theta)
    return evaluate(global_model, corpus, setup.eval_batches, setup.eval_batch), nbytes


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.1f} TB"


def plot(results: list[Result], ddp: Result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ax.scatter([ddp.nbytes], [ddp.loss], marker="*", s=180, color="black", label="data parallel")
    ax.axhline(ddp.loss * 1.01, color="grey", ls=":", lw=1, label="data parallel + 1 %")
    for codec in dict.fromkeys(r.codec for r in results):
        pts = sorted((r.nbytes, r.loss, r.h) for r in results if r.codec == codec)
        xs, ys, hs = zip(*pts, strict=True)
        ax.plot(xs, ys, marker="o", label=f"DiLoCo {codec}")
        for x, y, h in pts:
            ax.annotate(f"H={h}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("WAN bytes, all sites (DiLoCo downlink counted as fp32 theta)")
    ax.set_ylabel("final validation loss")
    ax.set_title("Validation loss vs WAN bytes at a fixed token budget (4 sites)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.comm_efficiency", description=__doc__)
    p.add_argument("--quick", action="store_true", help="~1-minute smoke version")
    p.add_argument("--steps", type=int, help="inner steps per site (default 500; quick 60)")
    p.add_argument("--hs", type=int, nargs="+", help="H grid (default 10 25 50; quick 15 30)")
    p.add_argument(
        "--codecs", nargs="+", choices=sorted(CODEC_SPECS), help="uplink codecs to compare"
    )
    p.add_argument("--batch", type=int, default=16, help="rows per site per inner step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak inner (and DDP) AdamW lr")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--png", default=str(REPO / "runs" / "comm_efficiency.png"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    steps = args.steps or (60 if args.quick else 500)
    hs = args.hs or ([15, 30] if args.quick else [10, 25, 50])
    codecs = args.codecs or list(DEFAULT_CODECS)
    bad = [h for h in hs if h <= 0 or steps % h]
    if bad:
        raise SystemExit(f"every H must divide --steps {steps}; these do not: {bad}")
    model = {"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 256, "seq_len": 64}
    setup = Setup(
        model=model,
        steps=steps,
        batch=args.batch,
        lr=args.lr,
        warmup=max(1, steps // 20),
        weight_decay=0.01,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        eval_batches=8 if args.quick else 16,
        eval_batch=32,
    )
    corpus = load_corpus(CorpusConfig(seq_len=model["seq_len"]))
    n_params = count_parameters(build_model(**model))
    tokens = steps * NUM_SITES * args.batch * model["seq_len"]
    print(
        f"model {n_params} params; {NUM_SITES} sites x {steps} inner steps x batch {args.batch} "
        f"x seq {model['seq_len']} = {tokens / 1e6:.2f} M training tokens per run; "
        f"H {hs}; codecs {codecs}; threads {args.threads}",
        flush=True,
    )
    start = time.perf_counter()
    t0 = time.perf_counter()
    ddp_loss, ddp_bytes = run_ddp(corpus, setup)
    ddp = Result("data parallel", None, None, ddp_loss, ddp_bytes, time.perf_counter() - t0)
    print(
        f"[{time.perf_counter() - start:6.1f}s] {ddp.label:<24} val {ddp.loss:.4f}  "
        f"{fmt_bytes(ddp.nbytes):>10}  ({ddp.seconds:.1f}s)",
        flush=True,
    )
    results: list[Result] = []
    for codec in codecs:
        for h in hs:
            t0 = time.perf_counter()
            loss, nbytes = run_diloco(corpus, setup, h, codec)
            res = Result(f"DiLoCo H={h} {codec}", h, codec, loss, nbytes, time.perf_counter() - t0)
            results.append(res)
            print(
                f"[{time.perf_counter() - start:6.1f}s] {res.label:<24} val {res.loss:.4f}  "
                f"{fmt_bytes(res.nbytes):>10}  ({res.seconds:.1f}s)",
                flush=True,
            )

    def gap(r: Result) -> float:
        return 100 * (r.loss - ddp.loss) / ddp.loss

    print()
    print(
        "WAN bytes: DDP = ring all-reduce of fp32 grads every step; DiLoCo = encoded uplink "
        "(data+meta)\n  + fp32 full-theta downlink to every site (initial + after every round; "
        "compressed downlink not built yet)"
    )
    header = f"{'run':<26}{'val loss':>10}{'gap %':>9}{'WAN bytes':>14}{'ddp/bytes':>11}"
    print(header)
    print("-" * len(header))
    print(f"{ddp.label:<26}{ddp.loss:>10.4f}{0.0:>9.2f}{fmt_bytes(ddp.nbytes):>14}{1.0:>11.1f}")
    for r in results:
        print(
            f"{r.label:<26}{r.loss:>10.4f}{gap(r):>9.2f}{fmt_bytes(r.nbytes):>14}"
            f"{ddp.nbytes / r.nbytes:>11.1f}"
        )
    png = Path(args.png)
    plot(results, ddp, png)
    print(f"\nplot: {png}; total {time.perf_counter() - start:.1f}s")
    within = [r for r in results if gap(r) <= 1.0]
    if within:
        best = max(within, key=lambda r: ddp.nbytes / r.nbytes)
        ratio, best_gap = ddp.nbytes / best.nbytes, gap(best)
    else:
        ratio, best_gap = 0.0, min(gap(r) for r in results)
    print(f"ddp_bytes={ddp.nbytes} best_bytes_ratio={ratio:.2f} loss_gap_pct={best_gap:.3f}")


if __name__ == "__main__":
    main()
