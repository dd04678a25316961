"""``python -m bench.dataplane`` (see the package docstring)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench.dataplane.floor import pass_floor, tls_floor
from bench.dataplane.report import Figures, plot, print_table
from bench.dataplane.run import run_job
from bench.dataplane.sampler import Sampler
from bench.progress import steps
from bench.sync import SIZES
from bench.sync_run import shed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dataplane")
    p.add_argument("--size", default="50m", choices=sorted(SIZES))
    p.add_argument("--sites", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument(
        "--warm-up",
        type=int,
        default=5,
        help="rounds left out (a job's steady state: the coordinator's files go over a pruned "
        "checkpoint's from the fifth round, the sites' from the third)",
    )
    p.add_argument("--codec", default="fp32", choices=["fp32", "int8"])
    p.add_argument("--out", type=Path, help="where the figure and the job's logs go")
    p.add_argument("--keep", action="store_true", help="keep the job's state and checkpoints")
    args = p.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="isthmus-dataplane-"))
    width, depth = SIZES[args.size]
    sampler = Sampler()
    sampler.start()
    try:
        for step in steps(["job", "tls floor", "passes"], lambda s: s):
            if step == "job":
                job = run_job(
                    out / "job",
                    width,
                    depth,
                    args.sites,
                    args.rounds,
                    args.codec,
                    sampler,
                    args.warm_up,
                )
            elif step == "tls floor":
                tls = tls_floor(out / "job", job.model_bytes, args.sites, sampler)
            else:
                passes = pass_floor(job.model_bytes)
    finally:
        sampler.stop()
        if not args.keep:
            shed(out / "job")
    figures = Figures.of(job, tls, passes)
    print_table(job, figures, args)
    plot(job, figures, out / "dataplane.png")
    print(f"figure: {out / 'dataplane.png'}")
    print(figures.last_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
