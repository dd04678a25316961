"""Validation loss against WAN bytes: synchronous data parallel vs DiLoCo with compressed links.

Run ``python -m bench.comm_efficiency [--quick | --scale gpu] [--dry-run]``. A small byte-level GPT
(``examples.gpt_diloco.model.build_model``: d_model 64, 2 layers, 4 heads, d_ff 256, seq_len 32,
about 135 k parameters) is pretrained from scratch on the standard-library corpus
(``examples.gpt_diloco.data``) by 4 sites with a fixed token budget: 2000 steps x 4 sites x 16
rows x 32 tokens = 4.1 M tokens per run, about 30 tokens per parameter (past the
compute-optimal ~20). Every run ends with the same validation measurement (``evaluate``, 16 x 32
windows) of its final global model.

Runs
----
- Data parallel: per step, one AdamW step on the mean of the 4 sites' gradients, for each peak
  lr of ``--ddp-lrs``; the best of this sweep is the baseline every gap and ratio refers to.
- DiLoCo over a grid of (H, codec, outer lr, outer momentum): each site runs H AdamW steps per
  round from the global theta, with the same batch, AdamW settings (betas 0.9 / 0.95, weight
  decay 0.01) and learning-rate schedule as data parallel (linear warm-up over 5 % of the steps,
  cosine decay to 10 %, indexed by the global step), peak ``--lr``; the outer step is the DiLoCo
  strategy's Nesterov SGD.
- Streaming DiLoCo (``bench.comm.streaming``; Douillard et al. 2025) next to blocking rows at the
  same H and codec: the trainable tensors split by ``wire.fragments.fragment_plan`` into P
  fragments (pattern strided); coordinator round r lasts H/P steps and syncs fragment ``r % P``
  only, so each fragment syncs every H steps on the same token budget. Each site sends that
  fragment's ``theta_r - theta_local`` and trains on; before step tau of the next round it
  merges the new global fragment, ``local <- alpha * local + (1 - alpha) * global``; the other
  fragments train on unmerged. The outer momentum is per tensor, so per fragment.

Tuning (same token budget, same data; each setting one run, final validation loss):

- peak lr, data parallel: 3e-3 -> 1.583, 6e-3 -> 1.533, 1.2e-2 -> 1.551 (the sweep is rerun
  here, so the table shows it); DiLoCo (fp32, H 250, outer 1.0 / 0.6): 1.778, 1.776, 1.965. Both
  use 6e-3, the best of the same sweep for each.
- outer lr / momentum at H 250 (fp32): the paper's 0.7 / 0.9 -> 1.864, 0.8 / 0.8 -> 1.807,
  1.0 / 0.6 -> 1.776, plain averaging 1.0 / 0 -> 1.820; at H 50 (int4+EF): 1.0 / 0.6 -> 1.659,
  1.0 / 0 -> 1.696; at H 10: 1.0 / 0.6 -> 1.752, 1.0 / 0 -> 1.618; at H 1000: 1.0 / 0.6 ->
  2.616, 0.7 / 0 -> 2.259, 1.0 / 0 -> 2.111. Each H in the grid runs with its best. Momentum
  compounds over rounds (steady-state step ``lr / (1 - mu)`` times the pseudo-gradient): too
  much for the 200 short rounds of H 10, and with 2 rounds (H 1000) it only re-applies the
  first round's update, taken from the random initialisation.
- top-k 1 %: on both links it diverged at H 50 (loss 8.9); with an int4+EF downlink it reached
  3.91 at H 250 and 2.39 at H 50. With rounds this few, error feedback cannot deliver the 99 %
  of each update that a round leaves unsent, so top-k uplinks pair with the int4+EF downlink.

Where the gap comes from (runs made alongside this bench, same setup unless said): not the
codecs (fp32, int8 and int4+EF end within 0.2 % of each other at H 250) but the few rounds that
2000 steps leave at large H. The first round from the random initialisation costs the most:
the sites' models are not yet in one basin, so their average is worse than each of them (at
H 250: sites 2.60 to 2.82 after round 0, their average 2.87, after the outer step 3.63; from
round 1 on the average beats every site). Starting DiLoCo from a data-parallel checkpoint (not
counted) at step 250 or 1000 cuts the H 250 gap to 10.5 % or 4.8 %. More rounds amortise it:
with 4x the steps (``--steps 8000 --grid 250:int4+EF``, 32 rounds, 16 M tokens per run, both
lrs swept over the same three values) the gap at H 250 falls from 15.7 % to 4.4 % (data
parallel 1.4025 at lr 1.2e-2, DiLoCo 1.4649 at 6e-3) at 1214x fewer bytes. The per-site batch
(512 tokens) is also far below the gradient noise scale measured along the data-parallel run
(1.6 k tokens at step 250, 25 k at the end), where data parallel's 4x batch buys the most.

Streaming (``--grid`` with blocking H 50 / 250 int4+EF and H 250 fp32 at 1.0 / 0.6, data
parallel 6e-3; P = 2, the most that the 2 blocks of this model split evenly and that divides
H 50 and 250; fragments of 68.4 k and 66.5 k parameters). Gap to blocking DiLoCo at equal H and
codec, and peak bytes in flight (the largest single uplink or downlink, theta_0 aside) over
blocking's:

- H 250 fp32, tau 5, alpha 0: 1.7823 vs 1.7760, +0.35 %, peak 274 KB vs 541 KB (0.51);
- H 250 int4+EF, tau 5, alpha 0: 1.7857 vs 1.7730, +0.72 %, peak 37.9 KB vs 74.9 KB (0.51);
- H 250 int4+EF, tau 5, alpha 0.5: 1.9088, +7.7 % (mixing half the stale local fragment back
  in undoes half of every outer step);
- H 250: only the blocking rows' 1.0 / 0.6 was run for streaming;
- H 50 int4+EF, tau 2, alpha 0: at the blocking rows' 1.0 / 0.6, 1.6802 vs 1.6590, +1.28 %
  (a miss; likely as with H/P = 25-step rounds the tau steps of local progress that a merge
  overwrites are 8 % of a fragment's steps since its last send, 4 % at H 250); 1.0 / 0 -> 1.7061;
  0.8 / 0.7 -> 1.6504, -0.52 % against blocking's best (blocking at 0.8 / 0.7: 1.6602), so the
  grid runs it at 0.8 / 0.7. Peak 37.9 KB vs 74.9 KB (0.51).

Total bytes are the blocking run's (every tensor still crosses once per H steps); what streaming
buys is the peak, halved at P 2, and (not measured here) a sync that overlaps tau steps of
compute.

What is simulated
-----------------
- The 4 sites and the coordinator live in one process; runs are spread over ``--workers``
  processes of one thread each. No gRPC, TLS, spool files, leases or deadlines: every site
  delivers every round.
- The WAN is not used: bytes are counted, never sent. Data parallel counts a ring all-reduce of
  fp32 gradients: per step each of the 4 workers sends ``2 (n - 1) / n`` model sizes. DiLoCo
  counts, per transfer, the payload plus its serialised manifest (names, shapes, codec meta):
  theta_0 uncompressed (``pack``) to every site, then per round every site's uplink and the
  downlink to every site (the last round's included). gRPC framing and TLS are left out on both
  sides.

What is real (the service's own code paths)
-------------------------------------------
- Model, corpus, batches and validation: the example's ``build_model``, ``load_corpus``,
  ``Corpus.site_batch`` (a disjoint shard per site; site ``s`` at step ``t`` reads
  ``site_batch(s, 4, 0, t, 0, 1, 16)`` in every run, so every run sees the same tokens at the
  same step) and ``evaluate``.
- Uplink: ``pack_encoded(theta_r - theta_site, config, site_codec_state)`` as
  ``CoordinatorClient.push`` sends it, error-feedback residuals kept per site across rounds.
- Coordinator: the manifest goes through its proto and ``unpack`` (validated, decoded), then
  ``strategies.robust.close_round`` (the weighted mean in site order, then the DiLoCo strategy's
  ``outer_step``).
- Downlink: ``wire.downlink.encode_delta(theta_r, theta_{r+1}, config, coordinator_state)``; the
  official theta_{r+1} is ``apply_delta(theta_r, manifest, payload)``, what every site computes
  from the same bytes (the two calls ``coordinator.round.downlink.Downlink.step`` makes).
- Codecs: one codec for every tensor of a link (norms and biases included); a run uses one
  codec family on both links, except where its label names two (uplink/downlink).
- Streaming: the fragment plan and the ``[streaming]`` checks are ``wire.fragments``'; uplinks
  carry the fragment only, ``close_round`` runs on theta's fragment (as the coordinator
  restricts its ``like``), the downlink is ``encode_delta(..., names=fragment)`` and
  ``apply_delta`` on that partial manifest; alpha 0 merges by exact copy
  (``merge_pieces``). With P 1, tau 0, alpha 0 the run is blocking DiLoCo bit for bit (tested).

Scales
------
``--quick`` (``--scale quick``): 200 steps, two blocking rows and one streaming row, one
data-parallel lr; about a minute. ``--scale gpu``: sized for one H200, not run here (only its
``--dry-run`` plan): ``d_model 768, 16 layers, 12 heads, d_ff 3072, seq_len 256`` (114 M
parameters, 16 blocks, so P 4 gives four fragments of 0.25 each), 20 k steps x 16 rows per site
(328 M tokens per run, the whole standard library about twice), H 100 and 200 (200 and 100
rounds) blocking and streaming (P 4, tau 5, alpha 0 and 0.5), int4+EF and fp32, inner lr 1e-3
for both methods (a first guess, untuned), sites on cuda (TF32 matmuls) with one worker. By
FLOPs (6 N per token) a run is about 2.2e17, so of the order of half an hour per run on an
H200 and a few hours for the grid. ``--dry-run`` prints every run's rounds and fragment sizes.

Output: one line per finished run with the elapsed time, the table (P, tau, alpha, loss, gap to
the baseline and, streaming, to blocking DiLoCo at the same H and codec, bytes per direction,
``ddp_bytes / bytes``, peak bytes in flight and its ratio to blocking), one
``streaming ... gap_vs_blocking_pct=G peak_ratio=R`` line per streaming row, the plot
``docs/comm_efficiency.png`` (loss against bytes, log x), and as the last line
``ddp_bytes=N best_bytes_ratio=X loss_gap_pct=Y``: the largest ``ddp_bytes / bytes`` among
DiLoCo runs within 1 % of the baseline's validation loss and that run's gap in percent
(``best_bytes_ratio=0.00`` and the smallest gap when none is).
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from bench.comm.links import CODEC_SPECS, NUM_SITES
from bench.comm.plan import SCALES, check_jobs, describe, parse_grid, setup_of
from bench.comm.report import best_within, fmt_bytes, plot, streaming_lines, table
from bench.comm.runs import Job, Result, execute

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.comm_efficiency",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="~1-minute smoke version (--scale quick)")
    p.add_argument("--scale", choices=sorted(SCALES), help="preset (default: default)")
    p.add_argument("--dry-run", action="store_true", help="print the plan, train nothing")
    p.add_argument("--steps", type=int, help="inner steps per site (default: the scale's)")
    p.add_argument(
        "--grid",
        nargs="+",
        metavar="H:CODEC[:OUTER_LR:MOMENTUM][:P=N:tau=N:alpha=X]",
        help="DiLoCo runs, e.g. 250:int8, 10:int4+EF:1:0 or 250:fp32:1:0.6:P=2:tau=5 "
        f"(streaming); codecs: {', '.join(CODEC_SPECS)}".replace("%", "%%"),  # argparse's %
    )
    p.add_argument("--batch", type=int, help="rows per site per step (default: the scale's)")
    p.add_argument("--lr", type=float, help="DiLoCo's peak inner AdamW lr (default: the scale's)")
    p.add_argument("--ddp-lrs", type=float, nargs="+", help="data-parallel lr sweep")
    p.add_argument("--outer-lr", type=float, default=1.0, help="for --grid items without one")
    p.add_argument("--outer-momentum", type=float, default=0.6, help="likewise")
    p.add_argument(
        "--device",
        help="where the sites train (default: the scale's; cuda -> cpu when no GPU is there)",
    )
    p.add_argument("--workers", type=int, help="runs in parallel (default: the scale's)")
    p.add_argument("--png", default=str(REPO / "docs" / "comm_efficiency.png"))
    return p.parse_args(argv)


def progress(start: float, r: Result) -> str:
    """The line printed when a run finishes: elapsed time, run, loss, bytes, its own time."""
    return (
        f"[{time.perf_counter() - start:6.1f}s] {r.job.label:<52} val {r.loss:.4f}  "
        f"{fmt_bytes(r.nbytes):>9}  ({r.seconds:.0f}s)"
    )


def pick_device(wanted: str) -> str:
    import torch

    if wanted.startswith("cuda") and not torch.cuda.is_available():
        print(f"note: no GPU here; {wanted} -> cpu")
        return "cpu"
    return wanted


def run_all(setup, jobs: list[Job], workers: int) -> dict[Job, Result]:
    """Every job in ``workers`` processes (spawned, so CUDA starts afresh in each)."""
    start = time.perf_counter()
    done: dict[Job, Result] = {}
    context = multiprocessing.get_context("spawn" if setup.device != "cpu" else None)
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        futures = [pool.submit(execute, setup, job) for job in jobs]
        for future in as_completed(futures):
            result = future.result()
            done[result.job] = result
            print(progress(start, result), flush=True)
    return done


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    scale = SCALES[args.scale or ("quick" if args.quick else "default")]
    steps, batch = args.steps or scale.steps, args.batch or scale.batch
    lr = args.lr or scale.lr
    if args.grid:
        grid = parse_grid(args.grid, args.outer_lr, args.outer_momentum)
    else:
        grid = list(scale.grid)
    ddp_lrs = args.ddp_lrs or list(scale.ddp_lrs)
    diloco_jobs = [Job(lr, *entry) for entry in grid]
    check_jobs(diloco_jobs, steps)
    device = args.device or scale.device
    setup = setup_of(scale, steps, batch, device if args.dry_run else pick_device(device))
    tokens = steps * NUM_SITES * batch * scale.model["seq_len"]
    workers = args.workers or scale.workers
    print(
        f"{NUM_SITES} sites x {steps} steps x {batch} rows x {scale.model['seq_len']} tokens = "
        f"{tokens / 1e6:.2f} M tokens per run; data-parallel lrs {ddp_lrs}; DiLoCo inner lr "
        f"{lr:g}; {len(grid)} DiLoCo runs; {workers} worker(s) on {setup.device}",
        flush=True,
    )
    if args.dry_run:
        print(describe(setup, diloco_jobs))
        return
    ddp_jobs = [Job(lr=x) for x in ddp_lrs]
    start = time.perf_counter()
    # DiLoCo runs are the slower ones (4 small batches per step against one large one), so
    # they go first and the data-parallel runs fill the gaps at the end.
    done = run_all(setup, diloco_jobs + ddp_jobs, workers)
    report(args, [done[j] for j in ddp_jobs], [done[j] for j in diloco_jobs], lr, steps, start)


def report(args, ddp_runs: list[Result], results: list[Result], lr, steps, start) -> None:
    baseline = min(ddp_runs, key=lambda r: r.loss)
    if baseline.job.lr != lr:
        print(f"note: data parallel did best at lr {baseline.job.lr:g}, DiLoCo ran at {lr:g}")
    print(
        "\nWAN bytes: all sites, both directions. Data parallel: fp32 ring all-reduce every step. "
        "DiLoCo: theta_0\n(fp32), then per round every uplink and the downlink to every site, "
        "payload + manifest. DiLoCo runs:\nH, codec (uplink/downlink where they differ, else on "
        "both links), outer lr/momentum; streaming: P\nfragments, merged tau steps late with "
        "alpha. gap % and ddp/bytes against the best data-parallel\nrun; vs blk %: against "
        "blocking DiLoCo at the same H and codec; syncs: all-reduces or rounds; peak:\nthe "
        "largest single transfer (data parallel: one fp32 gradient), peak/blk: against blocking.\n"
    )
    print(table(ddp_runs, results, baseline, steps))
    for line in streaming_lines(results):
        print(line)
    png = Path(args.png)
    plot(ddp_runs, results, baseline, png)
    print(f"\nplot: {png}; total {time.perf_counter() - start:.1f}s")
    ratio, gap = best_within(results, baseline)
    print(f"ddp_bytes={baseline.nbytes} best_bytes_ratio={ratio:.2f} loss_gap_pct={gap:.3f}")


if __name__ == "__main__":
    main()
